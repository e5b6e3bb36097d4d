"""``BackupAndRestore``: backs a ``fit`` up as it goes, so that an interrupted one resumes exactly."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid

import torch

from .. import checkpoint, sharded_checkpoint
from ..preemption import preemption_signals
from ._periodic import _Periodic


class BackupAndRestore(_Periodic):
    """Resumes an interrupted ``fit`` exactly where its last backup left it.

    A backup holds the model, the optimizer (slots, iterations), the metric
    accumulators, the history so far, the RNG state, the global batch size and the data
    position: the epoch, the shuffle order (its seed and pass) and the number of global
    batches already consumed.
    Run the same ``fit`` again after a crash, a kill or an exception and it continues
    with exactly the batches the uninterrupted run would have seen.

    Args:
      backup_dir: where ``backup.pt`` lives (written atomically; ``backup.sharded``, a sharded checkpoint
        directory, under a strategy that shards parameters).
      save_freq: ``"epoch"`` or a number of steps.
      delete_checkpoint: delete the backup once ``fit`` finishes normally.
      save_before_preemption: ``True``: a SIGTERM (to any worker, or to the ``--workers`` launcher,
        which passes it on) makes every worker stop at the next step boundary they agree on, the
        chief write the backup, and ``fit`` raise ``Preempted`` (a ``SystemExit`` with status 75:
        uncaught, the process exits quietly with it). A signal or a list of signals (``"SIGUSR1"``
        for SLURM's ``--signal=USR1@90``, ``["SIGTERM", "SIGUSR1"]``) instead of SIGTERM. Running
        the same ``fit`` again resumes and trains no step twice. Where every worker stops, and what
        it costs: ``replicafit.trainer.preemption``. ``False`` (TensorFlow's default): a signal has
        its usual effect.
      save_on_peer_failure: across workers, when another worker dies or stops arriving, a surviving
        worker writes the backup of the last step every worker finished (where the state is whole on
        every worker: ``MultiWorkerMirroredStrategy`` without sharding), so the restarted run repeats
        no step; then ``fit`` raises ``WorkerFailedError`` saying what was written. On by default: the
        backup it writes is the one the next periodic save would write, only sooner, and nothing is
        done until a worker fails (each step keeps a reference to the random streams it began with).
        Which survivor writes, and what the dead worker took with it: ``replicafit.trainer.peer_failure``.
        ``False``: the last periodic backup stands (TensorFlow's behaviour).

    Arrays and datasets with ``batch_size`` shuffle from the backup's seed and pass and start at the
    saved batch without reading those before it. A source that draws its order as a pass begins (a
    ``DataLoader(shuffle=True)``, from torch's generator or its own ``generator=``) begins the
    interrupted pass again from the random state that pass began with, so it has the same order;
    other iterables skip the consumed batches of a fresh pass, in their own order.

    It saves at the end of a step or an epoch after every other callback (a learning-rate scheduler has
    stepped), wherever it stands in the list of callbacks (Keras' saves in its place).

    Across workers (``MultiWorkerMirroredStrategy``) the chief writes the backup, with every
    worker's RNG state and every replica's metric accumulators, and decides whether to resume;
    every worker then reads the file, so ``backup_dir`` must be storage every worker sees (one
    machine's disk for ``--workers N``; a shared file system across machines).

    A backup resumes under any strategy, on any number of workers or replicas, with the same
    *global* batch size (another one is a ``CheckpointError``: the data position is counted in
    global batches, and the optimizer's steps assume them). The run goes on with the same global
    batches (from a source of global batches: arrays, a dataset with ``batch_size``, a
    ``DataLoader``; a source each worker reads apart, a ``DistributedSampler``'s, makes other
    global batches on another number of workers); what belongs to replicas carries over by rule
    (``docs/guides/resume.md``): an open accumulation window's sums go, added together, to global replica
    0 (the others start at zero);
    metric accumulators are shared equally among the replicas; replicas the saver had keep their
    random streams (by global replica id), and a replica that did not exist before (every replica
    after the default strategy) starts a stream seeded from (seed, its global id, epoch, step). A
    model without per-replica state therefore ends as the uninterrupted run up to float rounding,
    and bit for bit on the same number of workers and replicas (per-replica BatchNorm statistics
    included). Dropout masks and plain BatchNorm's per-replica statistics depend on the split: on
    another number of replicas such a run is deterministic but not the uninterrupted one
    (``nn.SyncBatchNorm`` is, up to rounding).

    Example::

        backup = BackupAndRestore("runs/backup", save_freq=200, save_before_preemption=True)
        trainer.fit(model, data, epochs=50, callbacks=[backup])   # rerun after a kill or a preemption
    """

    leaves_variables_alone = _Periodic.leaves_variables_alone  # saves within epochs only with a step save_freq

    _decides_from_logs = True
    _saves_training_state = True  # saves after the other callbacks (callback_list.py)

    def __init__(
        self,
        backup_dir,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool | str | list[str] = False,
        save_on_peer_failure: bool = True,
    ):
        super().__init__(save_freq)
        if not isinstance(save_on_peer_failure, bool):
            raise ValueError(f"save_on_peer_failure must be True or False, got {save_on_peer_failure!r}.")
        self.save_on_peer_failure = save_on_peer_failure
        #: The running fit's name for the folder where survivors meet after a failure (the chief's, on every worker).
        self.peer_failure_token = None
        self.backup_dir = os.fspath(backup_dir)
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self.preemption_signals = preemption_signals(save_before_preemption)
        self.watch = None  # the running fit's PreemptionWatch (set by fit)
        self._saved_at = None  # (epoch, step) of the last backup this fit wrote

    def preempt(self, signum=None) -> None:
        """Asks the running ``fit`` to stop as on a preemption signal (thread-safe): for a ``fit`` that runs
        outside the main thread, from a handler of your own. Nothing happens outside a ``fit``, or without
        ``save_before_preemption``.

        Example::

            signal.signal(signal.SIGTERM, lambda signum, frame: backup.preempt(signum))
        """
        import signal

        if self.watch is not None:
            self.watch.request(signum if signum is not None else signal.SIGTERM)

    @property
    def path(self) -> str:
        """Where this fit writes its backup.

        The file ``backup_dir/backup.pt``; under a strategy that writes sharded checkpoints (``FullyShardedStrategy``)
        the directory ``backup_dir/backup.sharded`` instead, every worker writing its shards
        (``trainer.sharded_checkpoint``)."""
        return self._path_of(self._sharded())

    def _path_of(self, sharded: bool) -> str:
        return os.path.join(self.backup_dir, "backup.sharded" if sharded else "backup.pt")

    def _sharded(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.strategy.extended.capabilities.sharded_checkpoints

    def _newest(self):
        """The newest backup in ``backup_dir`` (either kind: a run may resume under another strategy), or None."""
        found = [p for p in (self._path_of(False), self._path_of(True)) if sharded_checkpoint.exists(p)]
        if not found:
            return None
        return max(found, key=lambda p: os.path.getmtime(p if os.path.isfile(p) else os.path.join(p, "state.pt")))

    def on_train_begin(self, logs=None):
        """Resumes from the newest backup in ``backup_dir`` where there is one (as the chief sees it, for every
        worker; a file or a sharded directory, whatever strategy wrote it): the model, the optimizer, the
        history, the RNG and the data position are restored, and ``fit`` goes on from the saved epoch and step;
        the other callbacks' saved states follow once every ``on_train_begin`` ran. Raises ``CheckpointError``
        for a backup that does not fit (another global batch size, say)."""
        self._steps = 0
        self._saved_at = None
        # The chief decides whether to resume, for every worker (file systems may disagree on exists()).
        cluster = self.trainer.strategy.cluster
        mine = (self._newest(), uuid.uuid4().hex[:16]) if cluster.is_chief else None
        found, self.peer_failure_token = cluster.broadcast(mine, "finding the backup")
        if cluster.is_chief:  # the survivors' notes of an earlier failure are spent
            self._remove_failure_notes()
        if found is not None:
            self.trainer.restore_training_state(self.trainer.read_checkpoint(found, kind="backup"), found)

    def _on_step(self, epoch, batch, logs):
        self._save(self.trainer.training_state(epoch, batch + 1))

    def _on_epoch(self, epoch, logs):
        self._save(self.trainer.training_state(epoch + 1, 0, (epoch, dict(logs))))

    def _save(self, state) -> None:
        sharded = self._sharded()
        self.trainer.write_checkpoint(state, self._path_of(sharded), sharded=sharded)
        if self.trainer.strategy.extended.should_checkpoint:  # a backup of the other kind is older now
            sharded_checkpoint.remove(self._path_of(not sharded))
        self._saved_at = (state["epoch"], state["step"])

    @property
    def saved_at(self):
        """``(epoch, step)`` of the last backup this fit wrote (every worker took part), else None."""
        return self._saved_at

    def save_for_preemption(self, epoch: int, step: int, epoch_logs=None) -> str:
        """Writes the backup of ``step`` steps of ``epoch`` done (``training_state``'s arguments), unless the
        last backup is that one already; returns its path. Called by ``fit`` on every worker alike."""
        if self._saved_at != (epoch, step):
            self._save(self.trainer.training_state(epoch, step, epoch_logs))
        return self.path

    def save_after_peer_failure(self, epoch: int, step: int, epoch_logs=None, chief_only=()) -> str:
        """Writes the backup of ``step`` steps of ``epoch`` done (``training_state``'s arguments) from this worker
        alone, after another worker's failure (``FitLoop.after_peer_failure``, within ``cluster.alone()``: this
        worker may not be the chief); returns its path. Atomic: a failure meanwhile leaves the last backup whole.
        ``chief_only``: the keys of the callbacks whose state only the chief keeps (``CSVLogger``'s rows, a
        tracker's run); written by another worker, their states are those of the last backup (the chief's), or
        none.

        Example::

            with cluster.alone():
                path = backup.save_after_peer_failure(epoch, step)
        """
        state = self.trainer.training_state(epoch, step, epoch_logs)
        path = self._path_of(False)
        if chief_only and not self.trainer.strategy.extended.should_checkpoint:
            saved = {}
            if os.path.isfile(path):
                with contextlib.suppress(Exception):  # (an unreadable backup: none of them)
                    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("callbacks") or {}
            callbacks = dict(state.get("callbacks") or {})
            for key in chief_only:
                callbacks.pop(key, None)
                if isinstance(saved.get(key), dict):
                    callbacks[key] = saved[key]
            state = dict(state, callbacks=callbacks)
        path = checkpoint.save(state, path)
        self._saved_at = (epoch, step)
        return path

    def _remove_failure_notes(self) -> None:
        if not os.path.isdir(self.backup_dir):
            return
        for name in os.listdir(self.backup_dir):
            if name.startswith(".peer-failure-"):
                shutil.rmtree(os.path.join(self.backup_dir, name), ignore_errors=True)

    def on_train_end(self, logs=None):
        """Deletes the backup (on the chief) with ``delete_checkpoint``: ``fit`` completed, so a rerun starts
        afresh. A ``fit`` that raises, or exits with ``Preempted``, keeps it."""
        if self.delete_checkpoint:
            self._saved_at = None  # (gone, or going: a save after a peer's failure from here on writes one again)
            self.trainer.write_on_chief("BackupAndRestore (delete)", self._delete)

    def _delete(self) -> None:
        for path in (self._path_of(False), self._path_of(True)):
            sharded_checkpoint.remove(path)
