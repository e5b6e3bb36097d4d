"""``CSVLogger``: the epoch logs as rows of a CSV file."""

from __future__ import annotations

import csv
import os

from .callback import Callback


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
