"""``_Periodic``: a callback that acts at each epoch's end, or every ``save_freq`` training steps
(``ModelCheckpoint`` and ``BackupAndRestore``).
"""

from __future__ import annotations

from .callback import Callback


class _Periodic(Callback):
    """A callback that acts at each epoch's end, or every ``save_freq`` training steps (``kwargs`` go to the
    next base: ``MonitorCallback``'s ``monitor`` for ``ModelCheckpoint``)."""

    def __init__(self, save_freq, **kwargs):
        super().__init__(**kwargs)
        if save_freq != "epoch" and (not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}.")
        self.save_freq = save_freq
        self._steps = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    @property
    def leaves_variables_alone(self) -> bool:
        """Saving at epochs' ends only, its batch hooks touch nothing (``Callback.leaves_variables_alone``)."""
        return self.save_freq == "epoch"

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
