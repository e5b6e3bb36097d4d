"""``ReduceLROnPlateau``: lowers the learning rate when the monitored value stops improving."""

from __future__ import annotations

import numpy as np

from .callback import _AttributeState
from .monitor_callback import MonitorCallback


class ReduceLROnPlateau(_AttributeState, MonitorCallback):
    """Multiplies the learning rate by ``factor`` when ``monitor`` stops improving (Keras 3's rules).

    Logs ``learning_rate`` at each epoch's end. A ``monitor`` missing from the logs is a ``UserWarning``
    once per fit (as ``EarlyStopping``'s), and the learning rate is left alone while it is missing.
    Checkpoints and backups keep its state (epochs without improvement, cooldown, best value).
    """

    _STATE = ("wait", "cooldown_counter", "best")
    _decides_from_logs = True
    logs_learning_rate = "before_monitor"
    _monitor_owner = "ReduceLROnPlateau"
    _without_monitor = "The learning rate is left alone while it is missing."

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
        super().__init__(monitor)
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support a factor >= 1.0, got {factor}.")
        self.factor, self.patience, self.verbose = factor, patience, verbose
        self.mode = self._resolve_mode(mode)
        self.min_delta, self.cooldown, self.min_lr = min_delta, cooldown, min_lr

    def on_train_begin(self, logs=None):
        """Resets the count of epochs without improvement, the cooldown and the best value (a checkpoint's or
        backup's state is loaded over them afterwards) and the once-per-fit missing-monitor warning."""
        super().on_train_begin(logs)
        self.wait = 0
        self.cooldown_counter = 0
        self.best = self._worst()

    def _better(self, current, best) -> bool:  # Keras' rule here: min_delta moves the best, not the value
        return current < best - self.min_delta if self.mode == "min" else current > best + self.min_delta

    def on_epoch_end(self, epoch, logs=None):
        """Logs the epoch's rate as ``learning_rate`` (before reading ``monitor``, which may name it), then,
        after ``patience`` epochs without an improvement of ``logs[monitor]`` by ``min_delta`` outside the
        cooldown, multiplies the rate by ``factor`` (not below ``min_lr``) for the epochs to come."""
        logs = logs if logs is not None else {}
        optimizer = self.trainer.optimizer
        logs["learning_rate"] = float(optimizer.learning_rate)
        current = self._monitor_value(logs)
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
