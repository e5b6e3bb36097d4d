"""``BackupAndRestore``: backs a ``fit`` up as it goes, so that an interrupted one resumes exactly."""

from __future__ import annotations

import os

from .. import checkpoint
from ._periodic import _Periodic


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

    It saves at the end of a step or an epoch after every other callback (a learning-rate scheduler has
    stepped), wherever it stands in the list of callbacks (Keras' saves in its place).

    Across workers (``MultiWorkerMirroredStrategy``) the chief writes the backup, with every
    worker's RNG state and every replica's metric accumulators, and decides whether to resume;
    every worker then reads the file, so ``backup_dir`` must be storage every worker sees (one
    machine's disk for ``--workers N``; a shared file system across machines). Resuming with
    another number of workers restores model, optimizer and position, not bit for bit.
    """

    _decides_from_logs = True
    _saves_training_state = True  # saves after the other callbacks (callback_list.py)

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
            self.trainer.restore_training_state(checkpoint.load(self.path, kind="backup"), self.path)

    def _on_step(self, epoch, batch, logs):
        self._save(self.trainer.training_state(epoch, batch + 1))

    def _on_epoch(self, epoch, logs):
        self._save(self.trainer.training_state(epoch + 1, 0, (epoch, dict(logs))))

    def _save(self, state) -> None:
        self.trainer.write_on_chief("BackupAndRestore", lambda: checkpoint.save(state, self.path))

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            self.trainer.write_on_chief("BackupAndRestore (delete)", self._delete)

    def _delete(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
