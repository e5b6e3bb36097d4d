"""``History``: the epoch logs of a ``fit``, which ``fit`` returns."""

from __future__ import annotations

from .callback import Callback


class History(Callback):
    """Records the epoch logs: ``history.history["loss"]`` etc., ``history.epoch``. ``fit`` returns it."""

    _decides_from_logs = True

    def __init__(self):
        super().__init__()
        self.history: dict = {}
        self.epoch: list = []

    def on_epoch_end(self, epoch, logs=None):
        """Appends ``epoch`` to ``self.epoch`` and each log value to ``self.history[key]`` (a key that first
        appears in a later epoch gets a shorter list)."""
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)
