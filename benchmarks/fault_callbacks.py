"""Callbacks the fault scripts put into a recipe (``{type: 'fault_callbacks:StepLog', ...}``, with this folder on
``PYTHONPATH``): a log of what a run did and when, and signals sent from inside a phase.

``StepLog`` (the chief) appends one line per event to ``path``, across the runs of one trial:
``step EPOCH STEP TIME`` (with ``every_worker``, the other workers' steps in ``path.R``),
``val-begin TIME`` / ``val-end TIME``, ``backup-begin TIME`` / ``backup-end TIME`` (``TimedBackup``),
``fit-begin TIME``; each worker writes its pid to ``pid_dir/rank{R}``.
"""

from __future__ import annotations

import os
import random
import signal
import time

from replicafit.trainer import BackupAndRestore, Callback


def _log(path: str, line: str) -> None:
    with open(path, "a") as file:
        file.write(f"{line} {time.time():.6f}\n")


def _target(to: str) -> int:
    return os.getppid() if to == "launcher" else os.getpid()


class StepLog(Callback):
    """The events of a run (module docstring); with ``signal_in: validation``, a SIGTERM to ``to`` (``self``
    or ``launcher``) from inside a validation step chosen at random by ``seed``, once per trial.
    ``step_seconds``: each training and validation step takes that much longer (a heavier model's
    compute), so that random moments spread over the phases as they would."""

    def __init__(self, path, pid_dir, signal_in=None, to="self", seed=0, step_seconds=0.0, every_worker=False):
        super().__init__()
        self.every_worker = every_worker  # the other workers log their steps too, to ``path.R`` (worker R)
        self.path, self.pid_dir, self.signal_in, self.to = path, pid_dir, signal_in, to
        self.step_seconds = step_seconds
        self.rng = random.Random(seed)
        self.epoch = None

    @property
    def chief(self) -> bool:
        return self.trainer.strategy.cluster.is_chief

    def on_train_begin(self, logs=None):
        os.makedirs(self.pid_dir, exist_ok=True)
        with open(os.path.join(self.pid_dir, f"rank{self.trainer.strategy.cluster.worker_index}"), "w") as file:
            file.write(str(os.getpid()))
        if self.chief:
            _log(self.path, "fit-begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.step_seconds)
        if self.chief:
            _log(self.path, f"step {self.epoch} {batch}")
        elif self.every_worker:
            _log(f"{self.path}.{self.trainer.strategy.cluster.worker_index}", f"step {self.epoch} {batch}")

    def on_test_begin(self, logs=None):
        if self.chief:
            _log(self.path, "val-begin")

    def on_test_batch_end(self, batch, logs=None):
        time.sleep(self.step_seconds)
        fired = os.path.join(self.pid_dir, "fired")
        if self.signal_in == "validation" and self.chief and not os.path.exists(fired) and self.rng.random() < 0.3:
            open(fired, "w").close()
            _log(self.path, "signal")
            os.kill(_target(self.to), signal.SIGTERM)

    def on_test_end(self, logs=None):
        if self.chief:
            _log(self.path, "val-end")


class TimedBackup(BackupAndRestore):
    """``BackupAndRestore`` that logs each write's begin and end to ``log`` (the chief); with
    ``signal_in_write: true``, a SIGTERM to ``to`` from inside one write chosen at random by ``seed``."""

    def __init__(self, backup_dir, log, pid_dir, signal_in_write=False, to="self", seed=0, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self.log, self.pid_dir, self.signal_in_write, self.to = log, pid_dir, signal_in_write, to
        self.rng = random.Random(seed)

    def _save(self, state) -> None:
        chief = self.trainer.strategy.cluster.is_chief
        if chief:
            _log(self.log, "backup-begin")
        fired = os.path.join(self.pid_dir, "fired")
        if self.signal_in_write and chief and not os.path.exists(fired) and self.rng.random() < 0.3:
            open(fired, "w").close()
            _log(self.log, "signal")
            os.kill(_target(self.to), signal.SIGTERM)
        super()._save(state)
        if chief:
            _log(self.log, "backup-end")
