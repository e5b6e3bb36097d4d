"""The per-step path reads nothing back to the host: on a GPU each such read (``float(t)``,
``t.item()``, ``bool(t)``, ``nonzero``) is a device synchronisation that stalls the step.

On the CPU the same reads are caught by a dispatch mode (``HostReads``); on a GPU the battery
checks it with ``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu/test_cuda_sync.py).
"""

from __future__ import annotations

import io
import time
import traceback
import types

import pytest
import torch
from conftest import make_strategy
from torch.utils._python_dispatch import TorchDispatchMode

from replicafit import optimizers
from replicafit.trainer import Callback, ProgbarLogger, Trainer
from replicafit.trainer.callbacks import progbar_logger
from replicafit.trainer.compile_metrics import CompileMetrics


class HostReads(TorchDispatchMode):
    """Records (or, with ``strict``, refuses) the operations that read a tensor's values back to
    Python: what synchronises a GPU with the host."""

    OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2"})

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict, self.reads = strict, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.OPS:
            where = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if "/torch/" not in f.filename]
            if self.strict:
                raise AssertionError(f"a host read in the per-step path: {func} at {where[-4:]}")
            self.reads.append((str(func), where))
        return func(*args, **(kwargs or {}))


class Window(Callback):
    """Watches steps ``first`` .. ``first + count - 1`` of the first epoch with ``mode`` (only
    ``on_train_batch_begin``, so the trainer reads no per-step logs for it)."""

    def __init__(self, mode, first=4, count=20):
        super().__init__()
        self.mode, self.first, self.count, self.active = mode, first, count, False

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.first:
            self.mode.__enter__()
            self.active = True
        elif batch == self.first + self.count and self.active:
            self.close()

    def close(self):
        if self.active:
            self.active = False
            self.mode.__exit__(None, None, None)


def _fit(strategy, mode, precision="32", optimizer="adam", trainer_class=Trainer, **fit_kwargs):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    trainer = trainer_class(
        strategy=make_strategy(strategy), optimizer=optimizer, metrics=["accuracy"], precision=precision, seed=0
    )
    window = Window(mode)
    try:
        trainer.fit(model, (x, y), batch_size=8, epochs=1, verbose=0, callbacks=[window], **fit_kwargs)
    finally:
        window.close()
    return trainer


@pytest.mark.parametrize("strategy", ["default", "one_device", "mirrored2", "central_storage2"])
def test_twenty_steady_steps_read_nothing_back(strategy):
    _fit(strategy, HostReads())


def _adamw_with_everything():
    schedule = optimizers.schedules.CosineDecay(1e-2, decay_steps=100)
    return optimizers.AdamW(schedule, global_clipnorm=1.0, gradient_accumulation_steps=2, use_ema=True)


@pytest.mark.parametrize(
    "precision, optimizer",
    [("bf16-mixed", lambda: "sgd"), ("32", lambda: "rmsprop"), ("32", _adamw_with_everything)],
    ids=["bf16_sgd", "rmsprop", "adamw_schedule_clipping_accumulation_ema"],
)
def test_precision_and_optimizers_read_nothing_back(precision, optimizer):
    _fit("one_device", HostReads(), precision=precision, optimizer=optimizer())


class _LeakyTrainer(Trainer):
    def train_step(self, data):
        super().train_step(data)
        float(data[0].sum())  # a read of one's own: what the check must catch


@pytest.mark.parametrize("strategy", ["one_device", "mirrored2"])
def test_the_check_catches_a_read_in_the_step(strategy):
    with pytest.raises(AssertionError, match="host read"):
        _fit(strategy, HostReads(), trainer_class=_LeakyTrainer)


def test_sixteen_mixed_reads_once_per_step_in_its_finite_check():
    """The documented exception: float16 loss scaling decides on the host whether to apply or skip
    the update, one read per update."""
    reads = HostReads(strict=False)
    _fit("one_device", reads, precision="16-mixed")
    assert len(reads.reads) == 20
    assert all(any("loss_scale.py" in frame for frame in where) for _, where in reads.reads)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("clock", [5.0, 1e6], ids=["fresh-machine", "machine-up-for-days"])
@pytest.mark.parametrize("redraw_seconds, reads_per_epoch", [(3600.0, 3), (0.0, 16 + 1)])
def test_the_progress_bar_reads_the_logs_only_when_it_redraws(monkeypatch, clock, redraw_seconds, reads_per_epoch):
    """16 steps an epoch: a bar that is never due reads the logs at each epoch's first and last steps
    (plus the epoch's own read), whatever the clock's origin; one always due reads them every step."""
    frozen = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    frozen.perf_counter = lambda: clock  # the system-wide clock's origin is the machine's boot
    monkeypatch.setattr(progbar_logger, "time", frozen)
    reads = []
    original = CompileMetrics.result  # the logs: every read of the metrics

    def counting(self):
        reads.append(self)
        return original(self)

    monkeypatch.setattr(CompileMetrics, "result", counting)
    bar = ProgbarLogger(1, stream=_Terminal())
    bar._REDRAW_SECONDS = redraw_seconds
    x, y = torch.randn(128, 4), torch.randint(0, 2, (128,))
    Trainer(optimizer="sgd").fit(torch.nn.Linear(4, 2), (x, y), batch_size=8, epochs=2, verbose=0, callbacks=[bar])
    assert len(reads) == 2 * reads_per_epoch
    text = bar.stream.getvalue()
    assert "16/16" in text and "loss:" in text
