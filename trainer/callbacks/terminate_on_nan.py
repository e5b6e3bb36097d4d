"""``TerminateOnNaN``: stops training at the first batch whose loss is not finite."""

from __future__ import annotations

import math

from .callback import Callback


class TerminateOnNaN(Callback):
    """Stops training as soon as a batch's loss is NaN or infinite."""

    leaves_variables_alone = True  # its batch hooks read the logs (and set rates), not variables

    _decides_from_logs = True

    def on_train_batch_end(self, batch, logs=None):
        """Sets ``trainer.stop_training`` when the batch logs' ``loss`` (the epoch's mean so far) is NaN or
        infinite. It makes the trainer read the logs at every step."""
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            self._print(f"Batch {batch}: invalid loss {loss}, terminating training")
            self.trainer.stop_training = True
