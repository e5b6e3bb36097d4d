"""No host synchronisation per step on the GPU: 20 steady-state steps of ``fit(verbose=0)`` under
``torch.cuda.set_sync_debug_mode("error")`` raise nothing, except what the docs list
(``docs/guides/distribution.md``, "A step never waits for the GPU"):

* ``"16-mixed"``: the finite check of each update (loss scaling decides on the host whether to
  apply the update or skip it, as ``torch.amp.GradScaler.step`` does);
* ``CentralStorageStrategy`` with its variables on the host and compute on a GPU: the gradients
  come to the host and the variables go back every step, by its nature;
* callbacks that read the logs every step (``TerminateOnNaN``, a callback of one's own with
  ``on_train_batch_end``); the progress bar reads them only when it redraws.

The same property on the CPU, without a GPU: tests/trainer/test_host_reads.py.
"""

from __future__ import annotations

import io

import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    cuda_determinism,  # noqa: F401 - autouse
    cuda_only,
    digits,
    logical_gpus,
    mlp,
)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Callback, ProgbarLogger, Trainer
from replicafit.trainer.compile_metrics import CompileMetrics

pytestmark = [*GPU_TESTS, cuda_only]


class SyncErrors(Callback):
    """``set_sync_debug_mode("error")`` over steps ``first`` .. ``first + 19`` of the first epoch
    (``on_train_batch_begin`` only: the trainer reads no per-step logs for it)."""

    def __init__(self, first=4, count=20):
        super().__init__()
        self.first, self.count = first, count

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.first:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        elif batch == self.first + self.count:
            torch.cuda.set_sync_debug_mode(0)

    def on_epoch_end(self, epoch, logs=None):
        torch.cuda.set_sync_debug_mode(0)


def _fit(strategy, precision="32", optimizer="adam", callbacks=(), trainer_class=Trainer):
    x, y = digits(480)
    model = mlp(dropout=0.1)
    trainer = trainer_class(strategy=strategy, optimizer=optimizer, metrics=["accuracy"], precision=precision, seed=0)
    try:
        trainer.fit(model, (x, y), batch_size=16, epochs=1, verbose=0, callbacks=[SyncErrors(), *callbacks])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return trainer


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd", "rmsprop"])
def test_steady_steps_on_one_gpu_never_wait_for_it(precision, optimizer):
    _fit(ds.OneDeviceStrategy(GPU), precision=precision, optimizer=optimizer)


def test_steady_steps_on_two_logical_gpus_never_wait_for_it():
    with logical_gpus(2) as devices:
        _fit(ds.MirroredStrategy(devices))


def test_a_schedule_clipping_and_accumulation_never_wait_for_it():
    schedule = optimizers.schedules.CosineDecay(1e-2, decay_steps=100)
    optimizer = optimizers.AdamW(schedule, global_clipnorm=1.0, gradient_accumulation_steps=2, use_ema=True)
    _fit(ds.OneDeviceStrategy(GPU), optimizer=optimizer)


def test_the_check_catches_a_sync_in_the_step():
    class Leaky(Trainer):
        def train_step(self, data):
            super().train_step(data)
            float(data[0].sum())

    with pytest.raises(RuntimeError, match="synchroniz"):
        _fit(ds.OneDeviceStrategy(GPU), trainer_class=Leaky)


def test_sixteen_mixed_synchronises_only_in_its_finite_check(monkeypatch):
    with pytest.raises(RuntimeError, match="synchroniz") as info:
        _fit(ds.OneDeviceStrategy(GPU), precision="16-mixed")
    assert any("loss_scale.py" in str(entry.path) for entry in info.traceback)
    original = optimizers.loss_scale.DynamicLossScale.__call__  # the loss scaler's stage

    def allowed(self, grads, layout):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(self, grads, layout)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    monkeypatch.setattr(optimizers.loss_scale.DynamicLossScale, "__call__", allowed)
    _fit(ds.OneDeviceStrategy(GPU), precision="16-mixed")  # nothing else synchronises


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_reads_values_only_when_it_redraws(monkeypatch):
    """With the bar on, the only synchronisations are its reads of the logs, at its redraws."""
    reads = []
    original = CompileMetrics.result  # the logs: every read of the metrics

    def logs(self):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            reads.append(self)
            return original(self)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    monkeypatch.setattr(CompileMetrics, "result", logs)
    bar = ProgbarLogger(1, stream=_Terminal())
    bar._REDRAW_SECONDS = 3600.0  # never due but at the epoch's last step
    _fit(ds.OneDeviceStrategy(GPU), callbacks=[bar])
    assert len(reads) == 2  # the last step's redraw and the epoch's logs
