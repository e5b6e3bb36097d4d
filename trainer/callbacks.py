"""Callbacks with Keras' hooks: progress, history, checkpoints, early stopping, resuming.

Every decision a callback takes (stop, change the learning rate, write a checkpoint)
reads ``logs``, which the trainer computes once from aggregated metric values, so every
replica (and, later, every worker) agrees.

Example::

    history = trainer.fit(model, (x, y), epochs=50, validation_split=0.2, callbacks=[
        EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
        ModelCheckpoint("ckpt/epoch{epoch:02d}-{val_loss:.3f}.pt", save_best_only=True),
        BackupAndRestore("backup/"),
    ])
"""

from __future__ import annotations

import copy
import csv
import math
import os
import sys
import time

import numpy as np

from replicafit.strategies import context

from . import checkpoint

__all__ = [
    "Callback",
    "CallbackList",
    "History",
    "ProgbarLogger",
    "ModelCheckpoint",
    "EarlyStopping",
    "LearningRateScheduler",
    "ReduceLROnPlateau",
    "CSVLogger",
    "TerminateOnNaN",
    "LambdaCallback",
    "BackupAndRestore",
    "SwapEMAWeights",
]

_BATCH_HOOKS = (
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


class Callback:
    """Base class: override the hooks you need (Keras' names and arguments).

    ``self.trainer`` is the running ``Trainer``, ``self.model`` the user's module and
    ``self.params`` ``{"epochs", "steps", "verbose"}``. Setting
    ``self.trainer.stop_training = True`` ends training after the current step.

    Example::

        class PrintLoss(Callback):
            def on_epoch_end(self, epoch, logs=None):
                print(epoch, logs["loss"])
    """

    def __init__(self):
        self.trainer = None
        self.model = None
        self.params: dict = {}

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    # Set on callbacks that act on the (global) logs alone, so decide alike on every worker.
    _decides_from_logs = False

    def _wants_logs(self, hook: str) -> bool:
        """Whether this callback reads the logs of the per-batch ``hook`` (only then are metrics read every step)."""
        return _overrides(self, hook) or hook in vars(self)

    @property
    def _is_chief(self) -> bool:
        """Whether this process writes files and prints (worker 0 of a multi-worker run; always in one process)."""
        trainer = self.trainer
        return trainer is None or trainer.strategy.extended.should_checkpoint

    def _print(self, message: str) -> None:
        if self._is_chief:
            print(message, flush=True)

    def on_train_begin(self, logs=None): ...
    def on_train_end(self, logs=None): ...
    def on_epoch_begin(self, epoch, logs=None): ...
    def on_epoch_end(self, epoch, logs=None): ...
    def on_train_batch_begin(self, batch, logs=None): ...
    def on_train_batch_end(self, batch, logs=None): ...
    def on_test_begin(self, logs=None): ...
    def on_test_end(self, logs=None): ...
    def on_test_batch_begin(self, batch, logs=None): ...
    def on_test_batch_end(self, batch, logs=None): ...
    def on_predict_begin(self, logs=None): ...
    def on_predict_end(self, logs=None): ...
    def on_predict_batch_begin(self, batch, logs=None): ...
    def on_predict_batch_end(self, batch, logs=None): ...


class CallbackList:
    """Calls every callback's hook in order. ``wants_batch_logs`` tells the trainer whether
    any callback reads per-batch logs (only then are metrics read every step)."""

    def __init__(self, callbacks=(), trainer=None, model=None, params=None):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be Callback instances, got {type(cb).__name__}.")
            cb.set_trainer(trainer)
            cb.set_model(model)
            cb.set_params(params or {})
        self.wants_batch_logs = {hook: any(cb._wants_logs(hook) for cb in self.callbacks) for hook in _BATCH_HOOKS}

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)


def may_stop_training_alone(callbacks) -> bool:
    """Whether a callback might set ``stop_training`` on one worker only: any callback that is not
    one of the built-ins acting on the (global) logs alone. A subclass of a built-in counts as the
    user's (it may decide otherwise), unless it sets ``_decides_from_logs = True`` itself."""
    return any(not type(cb).__dict__.get("_decides_from_logs", False) for cb in callbacks)


def _overrides(callback: Callback, hook: str) -> bool:
    method = getattr(type(callback), hook, None)
    return method is not None and method is not getattr(Callback, hook)


class History(Callback):
    """Records the epoch logs: ``history.history["loss"]`` etc., ``history.epoch``. ``fit`` returns it."""

    _decides_from_logs = True

    def __init__(self):
        super().__init__()
        self.history: dict = {}
        self.epoch: list = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


def _format_logs(logs: dict) -> str:
    return " - ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in logs.items())


class ProgbarLogger(Callback):
    """Keras-like progress: a tqdm bar per epoch with loss and metrics (``verbose=1``), one
    line per epoch (``verbose=2``), nothing (``0``); ``"auto"``: 1 on a terminal, else 2."""

    _decides_from_logs = True

    def __init__(self, verbose=1, stream=None):
        super().__init__()
        self.verbose = resolve_verbose(verbose)
        self.stream = stream
        self._bar = None
        self._start = 0.0

    def _stream(self):
        return self.stream or sys.stdout

    def _wants_logs(self, hook: str) -> bool:
        return self.verbose == 1 and super()._wants_logs(hook)  # only the bar shows per-batch values

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        epochs = self.params.get("epochs")
        if self.verbose == 1 and self._is_chief:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.params.get("steps"),
                desc=f"Epoch {epoch + 1}/{epochs}",
                unit="step",
                file=self._stream(),
                leave=True,
                dynamic_ncols=True,
            )

    def on_train_batch_end(self, batch, logs=None):
        if self._bar is not None:
            self._bar.update(1)
            if logs:
                self._bar.set_postfix({k: f"{v:.4f}" for k, v in logs.items() if isinstance(v, float)}, refresh=False)

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self._start
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in (logs or {}).items() if isinstance(v, float)})
            self._bar.close()
            self._bar = None
        elif self.verbose == 2 and self._is_chief:
            print(
                f"Epoch {epoch + 1}/{self.params.get('epochs')} - {elapsed:.1f}s - {_format_logs(logs or {})}",
                file=self._stream(),
                flush=True,
            )

    def on_train_end(self, logs=None):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def resolve_verbose(verbose) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}.")
    return verbose


class _Periodic(Callback):
    """A callback that acts at each epoch's end, or every ``save_freq`` training steps."""

    def __init__(self, save_freq):
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}.")
        self.save_freq = save_freq
        self._steps = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq != "epoch":
            self._steps += 1
            if self._steps % self.save_freq == 0:
                self._on_step(self._epoch, batch, logs or {})

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._on_epoch(epoch, logs or {})

    def _on_step(self, epoch: int, batch: int, logs: dict) -> None:
        raise NotImplementedError

    def _on_epoch(self, epoch: int, logs: dict) -> None:
        raise NotImplementedError


def _monitor_mode(monitor: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}.")
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    return "max" if any(k in name for k in ("acc", "auc", "precision", "recall")) else "min"


class ModelCheckpoint(_Periodic):
    """Saves a checkpoint after every epoch (or every ``save_freq`` steps).

    ``filepath`` may name ``{epoch}`` and any log key (``"ckpt-{epoch:02d}-{val_loss:.3f}.pt"``).
    ``save_best_only`` keeps only improvements of ``monitor`` (``mode`` min/max/auto).
    ``save_weights_only`` writes the model's state dict alone; otherwise a full trainer
    checkpoint (model, optimizer, epoch, RNG). Files are written atomically.
    """

    _decides_from_logs = True

    def __init__(
        self,
        filepath,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold=None,
    ):
        super().__init__(save_freq)
        self.filepath = os.fspath(filepath)
        self.monitor, self.verbose = monitor, verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.mode = _monitor_mode(monitor, mode)
        self.best = initial_value_threshold

    def _on_step(self, epoch, batch, logs):
        self._save(epoch, logs, batch=batch)

    def _on_epoch(self, epoch, logs):
        self._save(epoch, logs)

    def _save(self, epoch, logs, batch=None):
        path = self.filepath.format(epoch=epoch + 1, batch=(batch or 0) + 1, **logs)
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                return
            better = self.best is None or (current < self.best if self.mode == "min" else current > self.best)
            if not better:
                return
            self.best = current
        if self.save_weights_only:
            state = self.trainer.model_state_dict()  # every worker takes part; the chief writes
            self.trainer._chief_write("ModelCheckpoint", lambda: checkpoint.save(state, path))
        else:
            self.trainer.save_checkpoint(path)
        if self.verbose:
            self._print(f"Epoch {epoch + 1}: saved {path}")


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Keras 3's rules: ``mode`` min/max/auto, ``baseline``, ``start_from_epoch``, and
    ``restore_best_weights`` (the best epoch's weights are put back at the end).
    """

    _decides_from_logs = True

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline=None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ):
        super().__init__()
        self.monitor, self.patience, self.verbose = monitor, patience, verbose
        self.mode = _monitor_mode(monitor, mode)
        self.min_delta = abs(min_delta) if self.mode == "max" else -abs(min_delta)
        self.baseline, self.restore_best_weights, self.start_from_epoch = (
            baseline,
            restore_best_weights,
            start_from_epoch,
        )

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_weights = None
        self.best_epoch = 0

    def _improved(self, value, reference) -> bool:
        if reference is None:
            return True
        return value - self.min_delta > reference if self.mode == "max" else value - self.min_delta < reference

    def on_epoch_end(self, epoch, logs=None):
        current = (logs or {}).get(self.monitor)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = copy.deepcopy(self.trainer.model_state_dict())
        self.wait += 1
        if self._improved(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = copy.deepcopy(self.trainer.model_state_dict())
            if self.baseline is None or self._improved(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 and self.verbose:
            self._print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose:
                self._print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.trainer.load_model_state_dict(self.best_weights)


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of each epoch to ``schedule(epoch, lr)`` (or ``schedule(epoch)``)."""

    _decides_from_logs = True

    def __init__(self, schedule, verbose: int = 0):
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch, logs=None):
        optimizer = self.trainer.optimizer
        try:
            rate = self.schedule(epoch, float(optimizer.learning_rate))
        except TypeError:
            rate = self.schedule(epoch)
        if not isinstance(rate, (float, int, np.floating, np.integer)):
            raise ValueError(f"The schedule must return a number, got {rate!r}.")
        optimizer.learning_rate = float(rate)
        if self.verbose:
            self._print(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {rate}.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(self.trainer.optimizer.learning_rate)


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by ``factor`` when ``monitor`` stops improving (Keras 3's rules)."""

    _decides_from_logs = True

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
    ):
        super().__init__()
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support a factor >= 1.0, got {factor}.")
        self.monitor, self.factor, self.patience, self.verbose = monitor, factor, patience, verbose
        self.mode = _monitor_mode(monitor, mode)
        self.min_delta, self.cooldown, self.min_lr = min_delta, cooldown, min_lr

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.cooldown_counter = 0
        self.best = math.inf if self.mode == "min" else -math.inf

    def _better(self, current, best) -> bool:
        return current < best - self.min_delta if self.mode == "min" else current > best + self.min_delta

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        optimizer = self.trainer.optimizer
        logs["learning_rate"] = float(optimizer.learning_rate)
        current = logs.get(self.monitor)
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._better(current, self.best):
            self.best = current
            self.wait = 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                old = float(optimizer.learning_rate)
                if old > np.float32(self.min_lr):
                    optimizer.learning_rate = max(old * self.factor, self.min_lr)
                    if self.verbose:
                        self._print(
                            f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {optimizer.learning_rate}."
                        )
                    self.cooldown_counter = self.cooldown
                    self.wait = 0


class CSVLogger(Callback):
    """Writes one CSV row per epoch: ``epoch`` and every log value."""

    _decides_from_logs = True

    def __init__(self, filename, separator: str = ",", append: bool = False):
        super().__init__()
        self.filename, self.separator, self.append = os.fspath(filename), separator, append
        self._keys = None

    def on_train_begin(self, logs=None):
        self._keys = None
        if self._is_chief and not self.append and os.path.exists(self.filename):
            os.unlink(self.filename)

    def on_epoch_end(self, epoch, logs=None):
        if not self._is_chief:  # one file, written by the chief (the logs are global)
            return
        logs = logs or {}
        exists = os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        if self._keys is None:
            self._keys = sorted(logs)
        with open(self.filename, "a", newline="") as file:
            writer = csv.DictWriter(
                file, fieldnames=["epoch"] + self._keys, delimiter=self.separator, extrasaction="ignore"
            )
            if not exists:
                writer.writeheader()
            writer.writerow({"epoch": epoch, **{k: logs.get(k, "NA") for k in self._keys}})


class TerminateOnNaN(Callback):
    """Stops training as soon as a batch's loss is NaN or infinite."""

    _decides_from_logs = True

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            self._print(f"Batch {batch}: invalid loss {loss}, terminating training")
            self.trainer.stop_training = True


class LambdaCallback(Callback):
    """A callback from plain functions: ``LambdaCallback(on_epoch_end=lambda epoch, logs: ...)``."""

    def __init__(self, **hooks):
        super().__init__()
        known = {name for name in dir(Callback) if name.startswith("on_")}
        unknown = sorted(set(hooks) - known)
        if unknown:
            raise ValueError(f"Unknown callback hook(s) {unknown}; known: {sorted(known)}.")
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)


class BackupAndRestore(_Periodic):
    """Resumes an interrupted ``fit`` exactly where its last backup left it.

    A backup holds the model, the optimizer (slots, iterations), the metric
    accumulators, the history so far, the RNG state and the data position: the epoch,
    the shuffle order (its seed and pass) and the number of batches already consumed.
    Run the same ``fit`` again after a crash, a kill or an exception and it continues
    with exactly the batches the uninterrupted run would have seen.

    Args:
      backup_dir: where ``backup.pt`` lives (written atomically).
      save_freq: ``"epoch"`` or a number of steps.
      delete_checkpoint: delete the backup once ``fit`` finishes normally.

    Data sources that are not this package's batched arrays/datasets (e.g. a
    ``DataLoader``) are resumed by skipping the consumed batches of a fresh pass; their
    shuffle order is their own.

    Across workers (``MultiWorkerMirroredStrategy``) the chief writes the backup, with every
    worker's RNG state and every replica's metric accumulators, and decides whether to resume;
    every worker then reads the file, so ``backup_dir`` must be storage every worker sees (one
    machine's disk for ``--workers N``; a shared file system across machines). Resuming with
    another number of workers restores model, optimizer and position, not bit for bit.
    """

    _decides_from_logs = True

    def __init__(self, backup_dir, save_freq: str | int = "epoch", delete_checkpoint: bool = True):
        super().__init__(save_freq)
        self.backup_dir = os.fspath(backup_dir)
        self.delete_checkpoint = delete_checkpoint

    @property
    def path(self) -> str:
        return os.path.join(self.backup_dir, "backup.pt")

    def on_train_begin(self, logs=None):
        self._steps = 0
        # The chief decides whether to resume, for every worker (file systems may disagree on exists()).
        if self.trainer.strategy.extended._broadcast_object(os.path.exists(self.path)):
            self.trainer._restore_training_state(checkpoint.load(self.path, kind="backup"), self.path)

    def _on_step(self, epoch, batch, logs):
        self._save(self.trainer._training_state(epoch, batch + 1))

    def _on_epoch(self, epoch, logs):
        self._save(self.trainer._training_state(epoch + 1, 0, (epoch, dict(logs))))

    def _save(self, state) -> None:
        self.trainer._chief_write("BackupAndRestore", lambda: checkpoint.save(state, self.path))

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            self.trainer._chief_write("BackupAndRestore (delete)", self._delete)

    def _delete(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


class SwapEMAWeights(Callback):
    """Evaluates (and, with ``swap_on_epoch``, checkpoints) with the optimizer's moving averages (Keras 3's).

    Needs an optimizer with ``use_ema=True``. Validation inside ``fit`` and ``evaluate``
    (with this callback) run with the averages swapped into the model, and the trained
    values come back after. With ``swap_on_epoch=True`` the averages are also in the model
    from the end of each epoch to the start of the next, so the callbacks after this one
    (``ModelCheckpoint``, ``EarlyStopping(restore_best_weights=True)``) see and keep the
    averaged weights: put it first in the list. Training itself always continues from the
    trained values, and ``BackupAndRestore`` backs those up, so a resumed run equals the
    uninterrupted one.

    Unlike Keras 3, the swap keeps the averages where they are (it saves the trained values
    aside instead of exchanging them), so stopping early with ``swap_on_epoch`` still ends
    with the averages in the model.

    Example::

        trainer = Trainer(optimizer=optimizers.Adam(1e-3, use_ema=True), ...)
        trainer.fit(model, data, validation_split=0.2, callbacks=[
            SwapEMAWeights(swap_on_epoch=True),
            ModelCheckpoint("best.pt", monitor="val_accuracy", save_best_only=True),
        ])

    Without a callback: ``with optimizer.averaged_weights(): trainer.evaluate(model, data)``.
    """

    def __init__(self, swap_on_epoch: bool = False):
        super().__init__()
        if not isinstance(swap_on_epoch, bool):
            raise TypeError(f"`swap_on_epoch` must be True or False, got {swap_on_epoch!r}.")
        self.swap_on_epoch = swap_on_epoch
        self._mine = None  # "test" or "epoch": why this callback swapped the averages in

    def _optimizer(self):
        optimizer = self.trainer.optimizer
        if not getattr(optimizer, "use_ema", False):
            raise ValueError(
                "SwapEMAWeights needs an optimizer with use_ema=True (e.g. optimizers.Adam(1e-3, use_ema=True)); "
                f"the trainer's {type(optimizer).__name__} keeps no moving averages."
            )
        return optimizer

    def _swap_in(self, why: str) -> None:
        optimizer = self._optimizer()
        if optimizer._swapped is None:
            with _in_strategy(self.trainer):
                optimizer._swap_in_averages(None, "SwapEMAWeights")
            self._mine = why

    def _swap_out(self, why: str) -> None:
        if self._mine == why:
            self._mine = None
            with _in_strategy(self.trainer):
                self._optimizer()._swap_out_averages()

    def on_train_begin(self, logs=None):
        self._optimizer()  # a missing use_ema is an error before the first epoch, not after it

    def on_epoch_begin(self, epoch, logs=None):
        self._swap_out("epoch")

    def on_epoch_end(self, epoch, logs=None):
        if self.swap_on_epoch:
            self._swap_in("epoch")

    def on_test_begin(self, logs=None):
        self._swap_in("test")

    def on_test_end(self, logs=None):
        self._swap_out("test")

    def on_predict_begin(self, logs=None):
        self._swap_in("test")

    def on_predict_end(self, logs=None):
        self._swap_out("test")

    def on_train_end(self, logs=None):
        if self._mine == "epoch":  # fit has written the averages into the model: they stay
            self._mine = None
            self.trainer.optimizer._keep_averages()


def _in_strategy(trainer):
    return context.enter_or_assert_strategy(trainer.strategy)
