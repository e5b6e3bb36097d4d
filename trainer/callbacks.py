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
import inspect
import math
import os
import shutil
import sys
import time
import warnings

import numpy as np
import torch

from replicafit.strategies import context

from . import checkpoint
from .registry import did_you_mean

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
    "TorchLRScheduler",
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

    def _wants_logs_now(self, hook: str) -> bool:
        """Whether it reads them at the batch about to end (a display that redraws now and then says
        so only when it will redraw; reading the metrics is a device synchronisation on a GPU)."""
        return self._wants_logs(hook)

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
        self.refresh()

    def refresh(self) -> None:
        """Asks the callbacks again which per-batch logs they read (``fit`` does after ``on_train_begin``,
        when a callback may know more, e.g. which scheduler it built)."""
        self.wants_batch_logs = {hook: any(cb._wants_logs(hook) for cb in self.callbacks) for hook in _BATCH_HOOKS}

    def wants_logs_now(self, hook: str) -> bool:
        """Whether any callback reads the logs of the batch about to end (``wants_batch_logs`` says
        whether any ever does)."""
        return self.wants_batch_logs[hook] and any(cb._wants_logs_now(hook) for cb in self.callbacks)

    def stateful(self) -> dict:
        """``{key: callback}`` of the callbacks that keep state in checkpoints and backups (``state_dict``/
        ``load_state_dict``), keyed by class name and rank among callbacks of that class."""
        found, seen = {}, {}
        for cb in self.callbacks:
            if getattr(cb, "_keeps_state", False):
                name = type(cb).__name__
                found[f"{name}_{seen.get(name, 0)}"] = cb
                seen[name] = seen.get(name, 0) + 1
        return found

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


def _format_value(value) -> str:
    """Keras' rule: 4 decimals, or 4 significant digits in scientific notation below 1e-3 (a learning
    rate of 3e-5 stays readable)."""
    if isinstance(value, float):
        return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 or not math.isfinite(value) else f"{value:.4e}"
    return str(value)


def _format_logs(logs: dict) -> str:
    return " - ".join(f"{k}: {_format_value(v)}" for k, v in logs.items())


def _log_items(logs) -> list:
    return [f"{k}: {_format_value(v)}" for k, v in (logs or {}).items() if isinstance(v, (float, int))]


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
    if seconds >= 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{seconds:.0f}s"


def _per_step(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.1f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


class ProgbarLogger(Callback):
    """Keras' progress display: ``verbose=1`` draws a tqdm bar per epoch on a terminal, ``verbose=2``
    prints one complete line per epoch, ``0`` nothing; ``"auto"``: 1 on a terminal, else 2.

    The bar line is laid out as Keras' (``12/23 ━━━━━━━━━━━━━━━━━━━━ 1s 3ms/step - loss: 0.2053 -
    accuracy: 0.9475``) to the terminal's width: the bar gives up columns first (down to 10), then the
    values that do not fit are left out of the line being redrawn, never cut. The epoch's last line
    shows every value, the validation ones included, carrying on over further lines where one line
    is too narrow. On a stream that is not a terminal (a file, a pipe), ``verbose=1`` prints the
    epoch's final lines only. Values have 4 decimals, or 4 significant digits below 1e-3.

    Example::

        trainer.fit(model, data, epochs=3, callbacks=[ProgbarLogger(2, stream=open("log.txt", "w"))], verbose=0)
    """

    _decides_from_logs = True
    _REDRAW_SECONDS = 0.1
    _BAR = 20  # Keras' bar width, and the narrowest it gets
    _MIN_BAR = 10

    def __init__(self, verbose=1, stream=None):
        super().__init__()
        self.verbose = resolve_verbose(verbose)
        self.stream = stream
        self._bar = None
        self._start = 0.0
        self._seen = 0
        self._drawn = float("-inf")

    def _stream(self):
        return self.stream or sys.stdout

    def _columns(self) -> int:
        """The terminal's width (``COLUMNS``, else 80, where the stream is no terminal)."""
        try:
            return os.get_terminal_size(self._stream().fileno()).columns
        except (AttributeError, OSError, ValueError):
            return shutil.get_terminal_size((80, 24)).columns

    def _wants_logs(self, hook: str) -> bool:
        return self.verbose == 1 and super()._wants_logs(hook)  # only the bar shows per-batch values

    def _wants_logs_now(self, hook: str) -> bool:
        # The bar is redrawn at most every 0.1 s and at the epoch's last step: the values are read
        # then only, not at every step.
        bar = self._bar
        if hook != "on_train_batch_end" or bar is None:
            return False
        return self._redraw_due(self._seen + 1, bar.total)

    def _redraw_due(self, seen: int, total) -> bool:
        return time.perf_counter() - self._drawn >= self._REDRAW_SECONDS or seen == total

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._seen = 0
        self._drawn = float("-inf")  # each epoch's bar is drawn at its first step, as Keras' Progbar is
        if self.verbose == 1 and self._is_chief:
            stream = self._stream()
            print(f"Epoch {epoch + 1}/{self.params.get('epochs')}", file=stream, flush=True)
            if getattr(stream, "isatty", lambda: False)():
                from tqdm.auto import tqdm

                self._bar = tqdm(
                    total=self.params.get("steps"),
                    file=stream,
                    leave=True,
                    ncols=None,
                    dynamic_ncols=False,
                    mininterval=float("inf"),  # redrawn by on_train_batch_end, at most every 0.1 s
                    ascii=" ━",
                    bar_format="{n_fmt}/{total_fmt} {bar:20}{desc}",
                )

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        bar = self._bar
        if bar is None:
            return
        bar.n = self._seen
        if logs and self._redraw_due(self._seen, bar.total):  # logs are read only when a redraw is due
            self._drawn = time.perf_counter()
            self._draw(_log_items(logs), final=False)

    def _timing(self, final: bool) -> str:
        elapsed = time.perf_counter() - self._start
        per_step = elapsed / max(self._seen, 1)
        steps = self.params.get("steps")
        left = 0.0 if final or steps is None else per_step * max(steps - self._seen, 0)
        return f"{_duration(elapsed if final else left)} {_per_step(per_step)}"

    def _counter(self) -> str:
        steps = self.params.get("steps")
        return f"{self._seen}/{steps if steps is not None else '?'}"

    def _layout(self, items: list, timing: str, final: bool) -> tuple:
        """``(bar width, the items on the bar's line, the further lines)`` for this terminal."""
        counter = len(self._counter())
        limit = self._columns() - 1  # a line filling the last column would wrap in some terminals
        room = limit - (counter + 1) - len(" " + timing) - self._MIN_BAR
        first = []
        for item in items:
            if len(" - " + item) > room:
                break
            first.append(item)
            room -= len(" - " + item)
        bar = max(self._MIN_BAR, min(self._BAR, self._MIN_BAR + room))
        rest = items[len(first) :] if final else []
        lines, line, indent = [], "", " " * (counter + 1)
        for item in rest:  # the values that did not fit, over further lines, never cut
            if line and len(line + " - " + item) > limit:
                lines.append(line)
                line = ""
            line = (line + " - " + item) if line else (indent + "- " + item)
        if line:
            lines.append(line)
        return bar, first, lines

    def _draw(self, items: list, final: bool) -> list:
        """Redraws the bar's line; returns the further lines of a final draw."""
        timing = self._timing(final)
        width, first, further = self._layout(items, timing, final)
        text = " " + timing + "".join(" - " + item for item in first)
        bar = self._bar
        if bar is not None:
            bar.n = self._seen
            bar.bar_format = f"{{n_fmt}}/{{total_fmt}} {{bar:{width}}}{{desc}}"
            bar.set_description_str(text, refresh=False)
            bar.refresh()
        else:  # not a terminal: the final line only, the bar full
            utf = (getattr(self._stream(), "encoding", None) or "utf-8").lower().replace("-", "").startswith("utf")
            print(f"{self._counter()} {('━' if utf else '=') * width}{text}", file=self._stream())
        return further

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self._start
        if self.verbose == 1 and self._is_chief:
            further = self._draw(_log_items(logs), final=True)
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            for line in further:
                print(line, file=self._stream())
            self._stream().flush()
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


def _missing_monitor_message(who: str, monitor: str, available, consequence: str, per_step: str = "") -> str:
    """What a callback says when the logs it reads lack ``monitor``: the names they have, a close one, and why a
    ``val_`` name is missing (no validation, or the logs of a step; ``per_step``: the setting that reads the
    epoch's logs instead, e.g. ``"interval='epoch'"``)."""
    names = [str(name) for name in available]
    hint = did_you_mean(monitor, names)
    if monitor.startswith("val_") and not any(name.startswith("val_") for name in names):
        training = monitor.removeprefix("val_")
        instead = f", or monitor {training!r}" if training in names else ""
        hint = (
            f" (a step's logs have no val_ values, validation runs at each epoch's end: set {per_step}{instead})"
            if per_step
            else f" (no validation ran: pass validation_data or validation_split to fit{instead})"
        )
    return (
        f"{who} monitors {monitor!r}, which is not in the logs{hint}; available: {', '.join(names) or 'none'}. "
        f"{consequence}"
    )


def _warn_missing_monitor(callback: Callback, who: str, logs, consequence: str, per_step: str = "") -> None:
    """Warns once per ``fit`` (on the chief of a multi-worker run) that ``callback.monitor`` is not in ``logs``,
    as Keras' callbacks do; the callback then leaves that epoch (or step) alone, as before."""
    if callback._monitor_warned:
        return
    callback._monitor_warned = True
    if callback._is_chief:
        message = _missing_monitor_message(who, callback.monitor, logs or {}, consequence, per_step)
        warnings.warn(message, UserWarning, stacklevel=2)  # the callback's line


class ModelCheckpoint(_Periodic):
    """Saves a checkpoint after every epoch (or every ``save_freq`` steps).

    ``filepath`` may name ``{epoch}`` and any log key (``"ckpt-{epoch:02d}-{val_loss:.3f}.pt"``).
    ``save_best_only`` keeps only improvements of ``monitor`` (``mode`` min/max/auto).
    ``save_weights_only`` writes the model's state dict alone; otherwise a full trainer
    checkpoint (model, optimizer, epoch, RNG). Files are written atomically. With ``save_best_only``, a
    ``monitor`` missing from the logs is a ``UserWarning`` once per fit (the logged names and a close one,
    as Keras warns), and nothing is saved while it is missing.
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
        self._monitor_warned = False  # a missing monitor is said once per fit

    def on_train_begin(self, logs=None):
        self._monitor_warned = False

    def _on_step(self, epoch, batch, logs):
        self._save(epoch, logs, batch=batch)

    def _on_epoch(self, epoch, logs):
        self._save(epoch, logs)

    def _save(self, epoch, logs, batch=None):
        path = self.filepath.format(epoch=epoch + 1, batch=(batch or 0) + 1, **logs)
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                _warn_missing_monitor(
                    self,
                    "ModelCheckpoint(save_best_only=True)",
                    logs,
                    "No checkpoint is saved while it is missing.",
                    per_step="save_freq='epoch'" if batch is not None else "",
                )
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
    ``restore_best_weights`` (the best epoch's weights are put back at the end). A ``monitor`` missing
    from the logs is a ``UserWarning`` once per fit, at the end of the first epoch without it (Keras warns
    every epoch), naming the logged values and a close one (``val_acc``: did you mean ``val_accuracy``?).
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
        self._monitor_warned = False  # a missing monitor is said once per fit

    def on_train_begin(self, logs=None):
        self._monitor_warned = False
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
        if current is None:
            _warn_missing_monitor(self, "EarlyStopping", logs, "Training does not stop early while it is missing.")
            return
        if epoch < self.start_from_epoch:
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
    """Multiplies the learning rate by ``factor`` when ``monitor`` stops improving (Keras 3's rules).

    Logs ``learning_rate`` at each epoch's end. A ``monitor`` missing from the logs is a ``UserWarning``
    once per fit (as ``EarlyStopping``'s), and the learning rate is left alone while it is missing.
    """

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
        self._monitor_warned = False  # a missing monitor is said once per fit

    def on_train_begin(self, logs=None):
        self._monitor_warned = False
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
            _warn_missing_monitor(
                self, "ReduceLROnPlateau", logs, "The learning rate is left alone while it is missing."
            )
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
        if self.trainer.strategy.cluster.broadcast(os.path.exists(self.path)):
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


def _updates(optimizer) -> int:
    """The optimizer's update count, from its host copy where it keeps one (no read from the device)."""
    count = getattr(optimizer, "_updates_so_far", None)
    return count() if count is not None else int(optimizer.iterations)


class TorchLRScheduler(Callback):
    """Drives the learning rate with any ``torch.optim.lr_scheduler`` scheduler, per step or per epoch.

    Args:
      factory: a callable taking a ``torch.optim.Optimizer`` and returning a scheduler
        (``functools.partial(OneCycleLR, max_lr=0.01, total_steps=1000)``, a lambda building a
        ``SequentialLR`` warm-up chain, ...), or the name of a class in
        ``torch.optim.lr_scheduler`` (``"OneCycleLR"``), whose arguments then come as keyword
        arguments (the recipe form: ``{type: torch_lr_scheduler, factory: OneCycleLR, max_lr: 0.01}``;
        ``OneCycleLR``'s ``total_steps`` defaults to the run's number of updates there).
      interval: ``"step"`` (after every update, Lightning's ``interval: step``) or ``"epoch"``
        (after every epoch, the default).
      monitor: the log ``ReduceLROnPlateau`` reads (``"val_loss"`` by default; per step, a batch
        log such as ``"loss"``). Other schedulers ignore it. Missing from the logs, it is a
        ``UserWarning`` once per fit (as ``EarlyStopping``'s) and the rate is left alone.

    The optimizer the factory receives stands for the trainer's optimizer, ours or
    ``from_torch``'s: one param group whose ``lr`` (and ``momentum`` or ``betas``, which
    ``OneCycleLR`` cycles) is the optimizer's. It is created at the start of ``fit``, so its
    first learning rate is the scheduler's, exactly as in a plain torch loop; after every
    scheduler step the values are written back, one learning rate for every replica and worker.
    ``learning_rate`` is logged at each epoch's end (the last step's). The scheduler's state is
    kept in checkpoints and ``BackupAndRestore`` backups (a resumed run continues the schedule
    exactly). With ``gradient_accumulation_steps`` the ``"step"`` interval counts updates.

    Example::

        from functools import partial
        from torch.optim.lr_scheduler import OneCycleLR
        trainer.fit(model, data, epochs=5, batch_size=64, callbacks=[
            TorchLRScheduler(partial(OneCycleLR, max_lr=0.01, total_steps=5 * steps), interval="step")])
    """

    _decides_from_logs = True

    def __init__(self, factory, interval: str = "epoch", monitor: str = "val_loss", **scheduler_kwargs):
        super().__init__()
        if interval not in ("step", "epoch"):
            raise ValueError(f"`interval` must be 'step' or 'epoch', got {interval!r}.")
        if isinstance(factory, str):
            cls = getattr(torch.optim.lr_scheduler, factory.rsplit(".", 1)[-1], None)
            if not (isinstance(cls, type) and issubclass(cls, (_LRScheduler, _Plateau))):
                known = sorted(n for n, c in vars(torch.optim.lr_scheduler).items() if _is_scheduler_class(c))
                raise ValueError(f"{factory!r} is not a scheduler of torch.optim.lr_scheduler; known: {known}.")
            try:  # unknown or missing arguments now, not when fit starts
                inspect.signature(cls).bind(None, **scheduler_kwargs)
            except TypeError as error:
                raise TypeError(f"{cls.__name__}: {error}") from None
            factory = (cls, scheduler_kwargs)
        elif scheduler_kwargs:
            raise TypeError(
                f"TorchLRScheduler got scheduler arguments {sorted(scheduler_kwargs)} with a callable factory: bind "
                "them in the factory (functools.partial), or name the class as a string."
            )
        elif not callable(factory):
            raise TypeError(f"`factory` must be a callable (optimizer -> scheduler) or a class name, got {factory!r}.")
        self.factory, self.interval, self.monitor = factory, interval, monitor
        self.scheduler = None
        self._view = None
        self._pending = None  # a restored state that waits for the scheduler
        self._updates = None  # the optimizer's updates at the last step (with gradient accumulation)
        self._used = None  # the learning rate of the last step
        self._monitor_warned = False  # a missing monitor is said once per fit

    # --- the scheduler and the optimizer it stands for -------------------------------------------
    def _optimizer(self):
        optimizer = self.trainer.optimizer
        return getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's inner one

    def _make(self) -> None:
        optimizer = self._optimizer()
        if callable(optimizer._learning_rate):
            raise ValueError(
                "TorchLRScheduler sets the learning rate, but the optimizer's learning_rate is a schedule already: "
                "give the optimizer a number."
            )
        self._view = _OptimizerView(optimizer)
        if isinstance(self.factory, tuple):
            cls, kwargs = self.factory
            kwargs = dict(kwargs)
            if cls is torch.optim.lr_scheduler.OneCycleLR and not {"total_steps", "epochs"} & set(kwargs):
                kwargs["total_steps"] = self._total_updates()
            scheduler = cls(self._view, **kwargs)
        else:
            scheduler = self.factory(self._view)
        if not isinstance(scheduler, (_LRScheduler, _Plateau)):
            raise TypeError(
                f"The factory of TorchLRScheduler must return a torch.optim.lr_scheduler scheduler, got "
                f"{type(scheduler).__name__}."
            )
        self.scheduler = scheduler
        self._view.write_back(optimizer)

    def _total_updates(self) -> int:
        epochs, steps = self.params.get("epochs"), self.params.get("steps")
        if self.interval == "epoch":
            return int(epochs)
        if steps is None:
            raise ValueError(
                "OneCycleLR needs total_steps: the training data has no length, so pass total_steps yourself."
            )
        window = getattr(self._optimizer(), "gradient_accumulation_steps", None) or 1
        return int(epochs) * -(-int(steps) // window)

    def _step(self, logs) -> None:
        optimizer = self._optimizer()
        self._view.read(optimizer)  # another callback may have set the rate
        self._view.step()  # torch checks that optimizer.step() came before scheduler.step()
        if isinstance(self.scheduler, _Plateau):
            current = (logs or {}).get(self.monitor)
            if current is None:
                _warn_missing_monitor(
                    self,
                    "TorchLRScheduler(ReduceLROnPlateau)",
                    logs,
                    "The learning rate is left alone while it is missing.",
                    per_step="interval='epoch'" if self.interval == "step" else "",
                )
                return
            self.scheduler.step(float(current))
        else:
            self.scheduler.step()
        self._view.write_back(optimizer)

    # --- hooks -------------------------------------------------------------------------------
    _keeps_state = True
    _open_kwargs = True  # recipes: the keyword arguments are the scheduler's

    def _wants_logs(self, hook: str) -> bool:
        # Per-step logs (a read of every metric) only where a per-step ReduceLROnPlateau needs them; which
        # scheduler a callable factory makes is known once fit has started (then asked again).
        if hook != "on_train_batch_end" or self.interval != "step":
            return False
        if self.scheduler is not None:
            return isinstance(self.scheduler, _Plateau)
        return isinstance(self.factory, tuple) and issubclass(self.factory[0], _Plateau)

    def on_train_begin(self, logs=None):
        self._make()
        self._updates = None
        self._monitor_warned = False
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._load(state)

    def _accumulating(self) -> bool:
        return self.interval == "step" and bool(getattr(self._optimizer(), "gradient_accumulation_steps", None))

    def on_train_batch_begin(self, batch, logs=None):
        if self._accumulating():  # only a step that completes a window is an update
            self._updates = _updates(self._optimizer())

    def on_train_batch_end(self, batch, logs=None):
        if self.interval != "step":
            return
        optimizer = self._optimizer()
        self._used = float(optimizer.learning_rate)
        if self._accumulating():
            updates = _updates(optimizer)
            if updates == self._updates:
                return
            self._updates = updates
        self._step(logs)

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer()
        if self.interval == "epoch":
            self._used = float(optimizer.learning_rate)
            self._step(logs)
        elif self._accumulating() and self._updates is not None and _updates(optimizer) != self._updates:
            self._updates = _updates(optimizer)  # the epoch's partial window was one more update
            self._step(logs)
        if logs is not None and self._used is not None:
            logs["learning_rate"] = self._used

    # --- state (checkpoints and backups) -------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"scheduler": its state_dict(), "group": lr and momentum/betas, "used": the last step's rate}``."""
        if self.scheduler is None:
            return dict(self._pending) if self._pending is not None else {}
        return {"scheduler": self.scheduler.state_dict(), "group": self._view.hyper(), "used": self._used}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output now, or when ``fit`` creates the scheduler."""
        if not state:
            return
        if self.scheduler is None:
            self._pending = dict(state)
        else:
            self._load(state)

    def _load(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._view.param_groups[0].update(state["group"])
        self._used = state.get("used")  # the last step's rate, logged at the end of its epoch
        self._view.write_back(self._optimizer())


_LRScheduler = torch.optim.lr_scheduler.LRScheduler
_Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


def _is_scheduler_class(value) -> bool:
    return isinstance(value, type) and issubclass(value, (_LRScheduler, _Plateau)) and value is not _LRScheduler


class _OptimizerView(torch.optim.Optimizer):
    """A torch optimizer standing for one of ours: one param group holding its learning rate and, where it
    has them, its momentum (SGD, RMSprop) or betas (Adam), which schedulers read and change."""

    def __init__(self, optimizer):
        defaults = {"lr": float(optimizer.learning_rate)} | _hyper_parameters(optimizer)
        super().__init__([torch.zeros((), requires_grad=True)], defaults)

    def step(self, closure=None):
        return None

    def hyper(self) -> dict:
        group = self.param_groups[0]
        return {k: group[k] for k in ("lr", "momentum", "betas") if k in group}

    def read(self, optimizer) -> None:
        self.param_groups[0]["lr"] = float(optimizer.learning_rate)

    def write_back(self, optimizer) -> None:
        group = self.param_groups[0]
        optimizer.learning_rate = float(group["lr"])
        torch_optimizers = getattr(optimizer, "_torch_optimizers", None)
        if torch_optimizers is not None:  # from_torch: torch's own param groups, and the copies built later
            changed = {k: group[k] for k in ("momentum", "betas") if k in group}
            optimizer._torch_kwargs.update(changed)
            for copy in torch_optimizers:
                for torch_group in copy.param_groups:
                    torch_group.update(changed)
        elif "betas" in group:
            optimizer.beta_1, optimizer.beta_2 = (float(b) for b in group["betas"])
        elif "momentum" in group:
            optimizer.momentum = float(group["momentum"])


def _hyper_parameters(optimizer) -> dict:
    """The momentum or betas of ``optimizer`` a scheduler may cycle (only those it really uses)."""
    if hasattr(optimizer, "_torch_class"):
        defaults = optimizer._torch_class([torch.zeros(1, requires_grad=True)], **optimizer._torch_kwargs).defaults
        return {k: defaults[k] for k in ("momentum", "betas") if k in defaults}
    if hasattr(optimizer, "beta_1") and hasattr(optimizer, "beta_2"):
        return {"betas": (optimizer.beta_1, optimizer.beta_2)}
    if getattr(optimizer, "momentum", 0.0):  # SGD or RMSprop with momentum slots
        return {"momentum": optimizer.momentum}
    return {}


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
        optimizer = self._optimizer()  # a missing use_ema is an error before the first epoch, not after it
        if optimizer._swapped is not None:  # left swapped in by a fit that failed between epochs
            with _in_strategy(self.trainer):
                optimizer._swap_out_averages()
        self._mine = None

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
