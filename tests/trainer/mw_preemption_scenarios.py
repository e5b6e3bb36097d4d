"""``save_before_preemption`` across workers, run in worker processes by test_multi_worker_preemption.py."""

from __future__ import annotations

import os
import signal
import sys

from replicafit import optimizers
from replicafit.trainer import Preempted, callbacks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path in the worker processes
from mw_fit_scenarios import fit_run, strategy_for  # noqa: E402


class SignalOn(callbacks.Callback):
    """SIGTERM to this process on worker ``worker`` at the end of training step ``step`` (counted over the
    fit from 0) or of validation step ``val_step`` of epoch ``val_epoch``; records the steps trained."""

    def __init__(self, worker, step=None, val_epoch=None, val_step=None):
        super().__init__()
        self.worker, self.step, self.val_epoch, self.val_step = worker, step, val_epoch, val_step
        self.seen, self.epoch, self.trained = 0, None, []

    def _mine(self) -> bool:
        return self.trainer.strategy.cluster.worker_index == self.worker

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.trained.append((self.epoch, batch))
        if self.seen == self.step and self._mine():
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1

    def on_test_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.val_epoch, self.val_step) and self._mine():
            os.kill(os.getpid(), signal.SIGTERM)


def _run(strategy, outdir, signal_on, accumulate, validation_split):
    optimizer = optimizers.Adam(0.01, gradient_accumulation_steps=accumulate)
    backup = callbacks.BackupAndRestore(os.path.join(outdir, "backup"), save_before_preemption=True)
    return fit_run(
        strategy,
        init_seed=0,
        seed=1,
        extra_callbacks=[signal_on, backup],
        optimizer=optimizer,
        batch_size=8,
        validation_split=validation_split,
    )


def preempt_and_resume(
    rank,
    num_workers,
    port,
    outdir,
    worker,
    step=None,
    val_epoch=None,
    val_step=None,
    accumulate=None,
    validation_split=0.2,
    max_stride=None,
    check_seconds=None,
):
    """The uninterrupted run, the run a SIGTERM to ``worker`` preempts, and its rerun, on one strategy.
    ``max_stride``: validation agrees on the flags at least every that many steps (1: every step);
    ``check_seconds``: the time between two agreements the chief aims at."""
    from replicafit.trainer import preemption

    if max_stride is not None:
        preemption.MAX_STRIDE = max_stride
    if check_seconds is not None:
        preemption.CHECK_SECONDS = check_seconds
    strategy = strategy_for(rank, num_workers, port)
    reference_steps = SignalOn(None)
    reference = _run(strategy, os.path.join(outdir, "reference"), reference_steps, accumulate, validation_split)
    signal_on = SignalOn(worker, step, val_epoch, val_step)
    try:
        _run(strategy, outdir, signal_on, accumulate, validation_split)
        stop = None
    except Preempted as error:
        stop = {"code": error.code, "epoch": error.epoch, "step": error.step, "signal": error.signal_name}
    backup_written = os.path.exists(os.path.join(outdir, "backup", "backup.pt"))
    rerun_steps = SignalOn(None)
    resumed = _run(strategy, outdir, rerun_steps, accumulate, validation_split)
    return {
        "reference": reference,
        "resumed": resumed,
        "stop": stop,
        "backup_written": backup_written,
        "trained": signal_on.trained + rerun_steps.trained,
        "reference_trained": reference_steps.trained,
    }


class SignalAtIteration(callbacks.Callback):
    """For recipes (``{type: 'mw_preemption_scenarios:SignalAtIteration', ...}``): SIGTERM once the optimizer
    reaches ``iteration``, on worker ``worker``, to this process (``to: self``) or to the ``--workers``
    launcher (``to: launcher``). A resumed run starts past it, so the same command resumes."""

    def __init__(self, iteration, worker=0, to="self"):
        super().__init__()
        self.iteration, self.worker, self.to = iteration, worker, to

    def on_train_batch_end(self, batch, logs=None):
        trainer = self.trainer
        if trainer.strategy.cluster.worker_index == self.worker and int(trainer.optimizer.iterations) == self.iteration:
            os.kill(os.getppid() if self.to == "launcher" else os.getpid(), signal.SIGTERM)


def disagreeing(rank, num_workers, port, outdir):
    """Worker 0 saves before preemption and worker 1 does not: the error each gets (at once, not at a timeout)."""
    strategy = strategy_for(rank, num_workers, port)
    backup = callbacks.BackupAndRestore(os.path.join(outdir, "b"), save_before_preemption=rank == 0)
    try:
        fit_run(strategy, init_seed=0, seed=1, extra_callbacks=[backup])
    except ValueError as error:
        return str(error)
    return "trained"


def element_level_resume(rank, num_workers, port, outdir):
    """A token tagger with an element-level loss (ignore_index), preempted on worker 1 after step 5 and rerun,
    against the uninterrupted run: the loss's prescale must be the same after the restore."""
    import torch
    from element_scenarios import TokenModel, token_data

    from replicafit.trainer import Trainer

    strategy = strategy_for(rank, num_workers, port)

    def run(folder, *extra):
        torch.manual_seed(0)
        model = TokenModel(False)
        trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(0.01), loss=torch.nn.CrossEntropyLoss(), seed=2)
        backup = callbacks.BackupAndRestore(os.path.join(outdir, folder), save_before_preemption=True)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*token_data()), batch_size=8)
        trainer.fit(model, loader, epochs=3, verbose=0, callbacks=[*extra, backup])  # each worker reads its rows
        return {k: v.clone() for k, v in model.state_dict().items()}

    reference = run("reference")
    try:
        run("backup", SignalOn(1, step=5))
    except Preempted:
        pass
    return {"reference": reference, "resumed": run("backup")}
