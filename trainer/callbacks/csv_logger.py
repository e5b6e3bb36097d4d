"""``CSVLogger``: the epoch logs as rows of a CSV file."""

from __future__ import annotations

import csv
import os

from .callback import Callback


class CSVLogger(Callback):
    """Writes one CSV row per epoch: ``epoch`` and every log value.

    Checkpoints and backups keep the rows this fit wrote: a run resumed from a backup rewrites the file
    with them (dropping any row written after the backup) and goes on, so the file equals the
    uninterrupted run's.
    """

    _decides_from_logs = True
    _keeps_state = True
    _state_on_chief = True  # (the rows and the file's offset: the chief's, which writes the file)

    def __init__(self, filename, separator: str = ",", append: bool = False):
        super().__init__()
        self.filename, self.separator, self.append = os.fspath(filename), separator, append
        self._keys = None
        self._rows: list = []  # this fit's rows so far
        self._offset = 0  # the file's size where this fit began

    def on_train_begin(self, logs=None):
        """Starts this fit's rows: the chief deletes an existing file unless ``append`` (then it notes the
        file's size, where a resumed run cuts it back to)."""
        self._keys, self._rows, self._offset = None, [], 0
        if self._is_chief and not self.append and os.path.exists(self.filename):
            os.unlink(self.filename)
        if self._is_chief and os.path.exists(self.filename):
            self._offset = os.path.getsize(self.filename)  # (append: what earlier runs wrote stays)

    def state_dict(self) -> dict:
        """``{"keys", "rows", "offset"}``: the columns, the rows this fit wrote so far and the file's size where
        this fit began (what ``load_state_dict`` rewrites the file from)."""
        return {"keys": self._keys, "rows": [dict(row) for row in self._rows], "offset": self._offset}

    def load_state_dict(self, state: dict) -> None:
        """This fit's rows up to the backup: the file is cut back to where this fit began and written
        again with them."""
        self._keys, self._rows = state.get("keys"), [dict(row) for row in state.get("rows", [])]
        self._offset = state.get("offset", 0)
        if not self._is_chief:
            return
        if os.path.exists(self.filename):
            with open(self.filename, "r+b") as file:
                file.truncate(min(self._offset, os.path.getsize(self.filename)))
        for row in self._rows:
            self._write(row)

    def on_epoch_end(self, epoch, logs=None):
        """Appends the row ``epoch`` (from 0, as Keras writes it) and the epoch's logs (the chief writes the
        file). The columns are the first epoch's log keys, sorted (Keras' rule): a key missing later is
        written ``NA``, a key that appears later is left out."""
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
        row = {"epoch": epoch, **{k: logs.get(k, "NA") for k in self._keys}}
        self._rows.append(row)
        if self._is_chief:  # one file, written by the chief (the logs are global)
            self._write(row)

    def _write(self, row: dict) -> None:
        exists = os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        with open(self.filename, "a", newline="") as file:
            writer = csv.DictWriter(
                file, fieldnames=["epoch"] + self._keys, delimiter=self.separator, extrasaction="ignore"
            )
            if not exists:
                writer.writeheader()
            writer.writerow(row)
