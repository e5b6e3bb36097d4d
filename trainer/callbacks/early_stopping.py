"""``EarlyStopping``: stops training when the monitored value stops improving."""

from __future__ import annotations

import copy
import math

from .callback import Callback
from .monitor_callback import _monitor_mode, _warn_missing_monitor


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
