"""``LearningRateScheduler``: sets the learning rate at each epoch's start from a function of the epoch."""

from __future__ import annotations

import numpy as np

from .callback import Callback


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of each epoch to ``schedule(epoch, lr)`` (or ``schedule(epoch)``)."""

    _decides_from_logs = True
    logs_learning_rate = "after_step"

    def __init__(self, schedule, verbose: int = 0):
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch, logs=None):
        """Sets the optimizer's learning rate to ``schedule(epoch, current rate)``, or ``schedule(epoch)`` where
        that call raises ``TypeError``; ``epoch`` counts from 0. A result that is not a number is a
        ``ValueError``."""
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
        """Adds the epoch's learning rate to the logs as ``learning_rate`` (as Keras 3 does)."""
        if logs is not None:
            logs["learning_rate"] = float(self.trainer.optimizer.learning_rate)
