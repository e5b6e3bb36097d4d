"""``EarlyStopping``: stops training when the monitored value stops improving."""

from __future__ import annotations

import copy

from .callback import _AttributeState
from .monitor_callback import MonitorCallback


class EarlyStopping(_AttributeState, MonitorCallback):
    """Stops training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Keras 3's rules: ``mode`` min/max/auto, ``baseline``, ``start_from_epoch``, and
    ``restore_best_weights`` (the best epoch's weights are put back at the end). A ``monitor`` missing
    from the logs is a ``UserWarning`` once per fit, at the end of the first epoch without it (Keras warns
    every epoch), naming the logged values and a close one (``val_acc``: did you mean ``val_accuracy``?).
    Checkpoints and backups keep its state (a resumed run stops where the uninterrupted one does).
    """

    _decides_from_logs = True
    _monitor_owner = "EarlyStopping"
    _without_monitor = "Training does not stop early while it is missing."

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
        super().__init__(monitor)
        self.patience, self.verbose = patience, verbose
        self.mode = self._resolve_mode(mode)
        self.min_delta = abs(min_delta) if self.mode == "max" else -abs(min_delta)
        self.baseline, self.restore_best_weights, self.start_from_epoch = (
            baseline,
            restore_best_weights,
            start_from_epoch,
        )

    def on_train_begin(self, logs=None):
        """Resets the count of epochs without improvement, the best value, epoch and weights (a checkpoint's
        or backup's state is loaded over them afterwards) and the once-per-fit missing-monitor warning."""
        super().on_train_begin(logs)
        self.wait = 0
        self.stopped_epoch = 0
        self.best = self._worst()
        self.best_weights = None
        self.best_epoch = 0

    def on_epoch_end(self, epoch, logs=None):
        """Compares ``logs[monitor]`` with the best value (from ``start_from_epoch`` on; nothing while it is
        missing) and sets ``trainer.stop_training`` once ``patience`` epochs passed without an improvement
        by ``min_delta`` (or without beating ``baseline``), never at epoch 0. With
        ``restore_best_weights`` it keeps a copy of the best epoch's model state."""
        current = self._monitor_value(logs)
        if current is None:
            return
        if epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = copy.deepcopy(self.trainer.model_state_dict())
        self.wait += 1
        if self._is_improvement(current, self.best, self.min_delta):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = copy.deepcopy(self.trainer.model_state_dict())
            if self.baseline is None or self._is_improvement(current, self.baseline, self.min_delta):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True

    # its state: the count of epochs without improvement, the best value and epoch (and weights)
    _STATE = ("wait", "stopped_epoch", "best", "best_epoch", "best_weights")

    def on_train_end(self, logs=None):
        """Says at which epoch training stopped (``verbose``), and with ``restore_best_weights`` loads the best
        epoch's weights into the model, whether or not training stopped early (as Keras 3 does)."""
        if self.stopped_epoch > 0 and self.verbose:
            self._print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose:
                self._print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.trainer.load_model_state_dict(self.best_weights)
