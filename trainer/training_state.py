"""``TrainingState``: the training state that checkpoints and backups keep, saved and restored: the model
(with the trained values where moving averages are swapped in), the optimizer's state (an open
accumulation window's sums of every worker), the metrics' accumulators (aggregated and per replica), the
history, the random streams of torch, of every worker and of every replica, the stateful callbacks'
states and where the data stands; and where training stands (epoch, step, the data seed, the running
fit's cursor and callbacks).

``Trainer`` makes one and keeps it for its life: its ``save_checkpoint``/``load_checkpoint``,
``training_state``/``restore_training_state`` (``BackupAndRestore``) and ``write_on_chief`` ask it. The
fit's setup seeds through it and begins the callbacks with it (``begin_training``), and ``FitLoop`` moves
``epoch`` and ``step`` on. Only the chief writes files (``write_on_chief``); across workers saving is a
collective: every worker saves, in the same order.

Example::

    trainer.save_checkpoint("ckpt.pt")  # model, optimizer, epoch/step, random streams, callbacks
    trainer.load_checkpoint("ckpt.pt", model)
    state = trainer.training_state(epoch, step)  # during a fit: what a backup holds
"""

from __future__ import annotations

import contextlib
import os
import random

import torch

from replicafit.strategies import context
from replicafit.strategies.parameter_shards import consolidate, load_target, sharded_state_dict
from replicafit.strategies.rng import replica_seed
from replicafit.strategies.variables import SyncOnReadVariable, VariableAggregation

from . import checkpoint, sharded_checkpoint
from .replica_states import gather_replica_states, restore_replica_states

__all__ = ["TrainingState"]

_FORMAT = checkpoint.FORMAT  # the tag of checkpoints and backups (checked by checkpoint.load)


class TrainingState:
    """Where training stands, and what checkpoints and backups of a ``Trainer`` hold, saved and restored.

    Args:
      trainer: the ``Trainer`` whose public parts are saved and restored (``strategy``, ``optimizer``,
        ``history``, ``model_state_dict``).
      compiled_metrics: its ``CompileMetrics`` (the accumulators a backup keeps).
      compiled_loss: its ``CompileLoss`` (an open accumulation window's count of real elements).

    Attributes:
      epoch, step: where training stands (the running fit moves them on; a checkpoint restores them).
      data_seed: the seed of the running (or last) fit's shuffles, alike on every worker.
      cursor: the running (or last) fit's ``inputs.Cursor``: where its data stands.
      callbacks: the running (or last) fit's ``CallbackList`` (the stateful callbacks' states are saved).

    Example::

        state = TrainingState(trainer, compiled_metrics, compiled_loss)
        backup = state.backup(epoch=2, step=0, model=trainer.model)  # during a fit, on every worker
    """

    def __init__(self, trainer, compiled_metrics, compiled_loss):
        self._trainer = trainer
        self._compiled_metrics = compiled_metrics
        self._compiled_loss = compiled_loss
        self.epoch = 0
        self.step = 0
        self.data_seed = trainer.seed
        self.cursor = None
        self.callbacks = None
        self._resume = None  # where a backup restored in on_train_begin left off, for the fit that restored it
        self._loaded_callback_states = None  # callback states of a checkpoint loaded before a fit
        self._replica_rng_loaded = False  # a checkpoint loaded before a fit gave the replicas' streams

    @property
    def strategy(self):
        """The trainer's strategy."""
        return self._trainer.strategy

    @property
    def optimizer(self):
        """The trainer's optimizer (read at each use: ``Trainer.optimizer`` may be replaced between fits)."""
        return self._trainer.optimizer

    # --- a fit's beginning ------------------------------------------------------------------------------
    def seed_fit(self, seed) -> None:
        """Seeds a fit alike on every worker: torch's generator (with ``seed``), the data's shuffles
        (``data_seed``: ``seed``, else drawn by the chief) and each replica's own random stream (dropout...).

        Example::

            state.seed_fit(trainer.seed)
        """
        if seed is not None:
            torch.manual_seed(seed)
        self.data_seed = seed if seed is not None else random.randrange(2**31)
        # Every worker must shuffle alike: a seed drawn per process would train on other rows.
        cluster = self.strategy.cluster
        self.data_seed = cluster.broadcast(self.data_seed)
        if seed is None and cluster.num_workers > 1:
            # torch's generator too (a DataLoader's shuffle draws from it): the chief's on every
            # worker, as a seed would make it.
            torch.set_rng_state(cluster.broadcast(torch.get_rng_state()))
        # Each replica's own random stream (dropout...), from (seed, global replica id); after a checkpoint
        # loaded before a seedless fit, from the seed of the streams it held (as it keeps torch's generator).
        streams = self.strategy.extended.replica_streams
        if streams is not None and (seed is not None or not self._replica_rng_loaded):
            streams.seed(self.data_seed)
        elif streams is not None:  # fit keys the streams per step (ReplicaStreams.key) from their seed: from the
            # loaded one and this fit's data seed, so that the fit repeats none of the saver's draws
            streams.seed(replica_seed(streams.base_seed, 0, self.data_seed))
        self._replica_rng_loaded = False

    def begin_training(self, callback_list):
        """Makes ``callback_list`` the running fit's and calls ``on_train_begin``, where ``BackupAndRestore``
        may restore a backup (``restore_backup``); then the callbacks' saved states (the backup's, else those
        of a checkpoint loaded before this fit) are restored, after every callback's ``on_train_begin`` has
        reset its own (whatever their order). Returns where the restored backup left off (``{"epoch",
        "step", "cursor", "metrics", "metric_replicas"}``), or None.

        Example::

            resume = state.begin_training(callback_list)
            first_epoch = initial_epoch if resume is None else resume["epoch"]
        """
        self._resume = None
        self.callbacks = callback_list
        callback_list.call("on_train_begin", {})
        states, self._loaded_callback_states = self._loaded_callback_states, None
        if states:
            self._restore_callback_states(states)
        callback_list.refresh()
        return self._resume

    # --- writing files ----------------------------------------------------------------------------------
    def write_on_chief(self, what: str, write, default=None):
        """``write()`` on the chief only, then a barrier named ``what``: ``Trainer.write_on_chief``.

        Example::

            state.write_on_chief("my weights", lambda: checkpoint.save(weights, "weights.pt"))
        """
        result = write() if self.strategy.extended.should_checkpoint else default
        self.strategy.cluster.barrier(what)
        return result

    # --- checkpoints ------------------------------------------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        """Whether the strategy writes sharded checkpoints (sharded parameters or optimizer states): its states are
        read sharded (``sharded_state_dict``)."""
        return self.strategy.extended.capabilities.sharded_checkpoints

    def sharded_reads(self, snapshot: bool = True):
        """A context in which state dicts keep sharded parameters and slots sharded (nothing gathered), where the
        strategy shards parameters; nothing otherwise. ``snapshot=False``: views of the live shards, for a state
        written at once."""
        return sharded_state_dict(snapshot) if self.shards_parameters else contextlib.nullcontext()

    def save_checkpoint(self, path, sharded: bool = False) -> str:
        """Writes a checkpoint (``Trainer.save_checkpoint``) atomically; returns its path. ``sharded``: a sharded
        checkpoint directory (``sharded_checkpoint``: every worker writes its shards); else one file, whose
        sharded tensors are gathered one at a time onto the chief alone.

        Example::

            state.save_checkpoint("ckpt.pt")
        """
        with self.sharded_reads(snapshot=False):  # written at once: the live shards, not copies
            state = {
                "format": _FORMAT,
                "model": self._trainer.model_state_dict(),  # every worker takes part (SyncOnRead reads are collectives)
                "optimizer": self._optimizer_state(),
                "epoch": self.epoch,
                "step": self.step,
                "rng": torch.get_rng_state(),
                **self._replica_rng_states(),
                "callbacks": self._callback_states(),
            }
        return self.write(state, path, sharded, "save_checkpoint")

    def write(self, state: dict, path, sharded: bool, what: str) -> str:
        """*Collective.* Writes a state built under ``sharded_reads``: a sharded checkpoint directory at ``path``
        (``sharded``), else one file written by the chief, whose sharded tensors are gathered one at a time (no
        worker but the chief holds more than one whole tensor). Either replaces what was at ``path``."""
        cluster = self.strategy.cluster
        if sharded:
            return sharded_checkpoint.save(state, path, cluster)
        if self.shards_parameters:
            state = consolidate(state, keep=self.strategy.extended.should_checkpoint)

        def write_file():
            if not os.path.isdir(path):
                return checkpoint.save(state, path)
            # A sharded checkpoint there: set aside (a crash now leaves it for sharded_checkpoint.exists to put back),
            # then the file, then the old one removed.
            aside = sharded_checkpoint.set_aside(path)
            written = checkpoint.save(state, path)
            sharded_checkpoint.remove(aside)
            return written

        return self.write_on_chief(what, write_file, os.fspath(path))

    def read(self, path, kind: str, model) -> dict:
        """*Collective.* The checkpoint at ``path`` (a file, or a sharded directory read into ``model``'s layout:
        each worker its shards, or whole tensors where the strategy does not shard), checked for ``kind``."""
        cluster = self.strategy.cluster
        if cluster.is_chief:  # a sharded checkpoint left aside by a save that crashed mid-replacement, put back
            sharded_checkpoint.exists(path)
        cluster.barrier("finding the checkpoint")
        if not sharded_checkpoint.is_sharded_checkpoint(path):
            return checkpoint.load(path, kind=kind)
        variables = model.named_variables() if model is not None else {}

        def target_for(where, shape, dtype, skeleton):
            return load_target(variables.get(sharded_checkpoint.variable_name(where, skeleton)), shape, dtype)

        return sharded_checkpoint.load(path, kind, target_for, self.strategy.cluster)

    def restore_checkpoint(self, state: dict, path, model) -> None:
        """Restores a checkpoint read by ``checkpoint.load(path, kind="checkpoint")`` into ``model`` (the
        distributed model) and the optimizer, all or nothing (``Trainer.load_checkpoint``); then the epoch,
        step and random streams, and the callbacks' states for the next fit.

        Example::

            state.restore_checkpoint(checkpoint.load("ckpt.pt", kind="checkpoint"), "ckpt.pt", trainer.model)
        """
        self._load_model_and_optimizer(state, path, "checkpoint", model)
        self.epoch, self.step = state["epoch"], state["step"]
        torch.set_rng_state(state["rng"])
        self._replica_rng_loaded = self._restore_replica_rng(state, (state["epoch"], state["step"]))
        self._loaded_callback_states = state.get("callbacks") or None  # for the next fit's callbacks

    def _callback_states(self) -> dict:
        """The states of the stateful callbacks of the running (or last) ``fit`` (``TorchLRScheduler``,
        ``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint``, ``CSVLogger``)."""
        callback_list = self.callbacks
        if callback_list is None:
            return {}
        return {key: cb.state_dict() for key, cb in callback_list.stateful().items()}

    def _restore_callback_states(self, states: dict) -> None:
        """Gives each stateful callback of this ``fit`` its saved state (same class, same rank); outside a
        fit, the states wait for the next one."""
        if self.callbacks is None:
            self._loaded_callback_states = dict(states) or None
            return
        for key, cb in self.callbacks.stateful().items():
            if states.get(key):
                cb.load_state_dict(states[key])

    def _load_model_and_optimizer(self, state: dict, path, kind: str, dm) -> None:
        """Loads ``state["model"]`` into ``dm`` and ``state["optimizer"]``, or neither.

        The optimizer is built for the model's trainable variables first (as Keras does
        when it restores one), so that its state is checked against them now rather than
        at the first training step.
        """
        with self.sharded_reads():  # (sharded parameters: each worker keeps its shards, nothing gathered)
            before = {name: value.detach().clone() for name, value in dm.state_dict().items()}
        try:
            dm.load_state_dict(state["model"])
        except (RuntimeError, ValueError) as error:
            dm.load_state_dict(before)
            if kind == "checkpoint":  # the caller's model is not the one saved: torch's own error says how
                raise
            raise checkpoint.CheckpointError(
                f"The {kind} {str(path)!r} does not fit this model ({str(error).splitlines()[0]}): it was written "
                "for another model. Delete it, or use another backup_dir, to start afresh."
            ) from error
        try:
            if dm.trainable_variables:
                with context.enter_or_assert_strategy(self.strategy):
                    self.optimizer.build_for(dm.trainable_variables)  # for its pieces under sharded states
            self.optimizer.load_state_dict(state["optimizer"])
            # An element-level loss's real elements of the open window: added back when the fit starts.
            window = (state["optimizer"].get("accumulation") or {}).get("denominator")
            self._compiled_loss.restore_window_count(window)
        except (ValueError, TypeError, KeyError) as error:
            dm.load_state_dict(before)
            raise checkpoint.CheckpointError(
                f"The {kind} {str(path)!r} holds an optimizer state that does not fit this "
                f"{type(self.optimizer).__name__} optimizer. {error}"
            ) from error

    # --- backup and restore -----------------------------------------------------------------------------
    def backup(self, epoch: int, step: int, epoch_logs=None, *, model) -> dict:
        """Everything a resumed fit needs, as a backup holds it (``Trainer.training_state``); ``model``: the
        distributed model. Called during a ``fit``, on every worker alike (it gathers across workers). Where the
        strategy shards parameters, the model's weights and the optimizer's slots are ``DTensor`` s of this
        worker's shards (``write`` writes them).

        Example::

            state.backup(epoch + 1, 0, (epoch, dict(logs)), model=trainer.model)
        """
        cursor = self.cursor
        position = (
            (cursor.pass_index, cursor.position)
            if step
            else ((epoch, 0) if not cursor.repeat else (cursor.pass_index, cursor.position))
        )
        with self.sharded_reads():
            return self._backup(epoch, step, epoch_logs, position, model)

    def _backup(self, epoch, step, epoch_logs, position, model) -> dict:
        cursor = self.cursor
        return {
            "format": _FORMAT,
            "epoch": epoch,
            "step": step,
            "cursor": list(position),
            "global_batch_size": cursor.batch_size,
            "data_seed": self.data_seed,
            "data_rng": _data_rng(cursor),
            "model": self._trained_model_state(model),
            "optimizer": self._optimizer_state(),
            "metrics": self._compiled_metrics.state_dict(),
            "metric_replicas": self._compiled_metrics.replica_states(),
            **self._buffer_replica_states(model),
            "history": _history_with(self._trainer.history, epoch_logs),
            "rng": torch.get_rng_state(),
            **self._replica_rng_states(),
            "callbacks": self._callback_states(),
            **self._worker_rng_states(),
        }

    def _trained_model_state(self, dm) -> dict:
        """``model_state_dict()`` with the trained values of variables whose moving averages are swapped in
        (``SwapEMAWeights(swap_on_epoch=True)`` between epochs): a resumed run trains on from those."""
        state = self._trainer.model_state_dict()
        trained = self.optimizer.trained_values() if self.optimizer.use_ema else {}
        if trained and dm is not None:
            for name, variable in dm.named_variables().items():
                if id(variable) in trained:
                    state[name] = trained[id(variable)].detach().to(state[name].device).clone()
        return state

    def _optimizer_state(self) -> dict:
        """``optimizer.state_dict()``, with an open accumulation window's sums of every worker's replicas (and
        an element-level loss's count of its real elements)."""
        state = self.optimizer.state_dict()
        window = state.get("accumulation")
        cluster = self.strategy.cluster
        count = self._compiled_loss.window_count() if window is not None else None
        if count is not None:
            window = dict(window, denominator=count)
            state = dict(state, accumulation=window)
        if window is not None and cluster.num_workers > 1 and not window["aggregated"] and not _whole(window):
            # Every worker's replicas, in order; host copies: they go to a file, and model-sized sums from every
            # replica on a worker's first GPU could run it out of memory.
            own = {key: [t.detach().cpu() for t in sums] for key, sums in window["gradients"].items()}
            parts = cluster.all_gather(own)
            gradients = {key: [t for part in parts for t in part[key]] for key in parts[0]}
            window = dict(window, gradients=gradients, first_replica=0)  # every replica's sums, from replica 0 on
            state = dict(state, accumulation=window)
        return state

    def _worker_rng_states(self) -> dict:
        """``{"worker_rng": [every worker's generator state]}`` across workers (each resumes its own), else ``{}``."""
        cluster = self.strategy.cluster
        if cluster.num_workers == 1:
            return {}
        return {"worker_rng": cluster.all_gather(torch.get_rng_state())}

    def _replica_rng_states(self) -> dict:
        """``{"replica_rng": {"seed", "cpu": [...], "gpu": [...]}}``: every replica's random stream in global
        replica order (gathered across workers); ``{}`` under the default strategy (torch's generator is in "rng")."""
        streams, cluster = self.strategy.extended.replica_streams, self.strategy.cluster
        if streams is None:
            return {}
        own = streams.state_dict()
        if cluster.num_workers > 1 and cluster.failed:  # a survivor alone: its replicas' streams, by global id
            first, count, total = cluster.first_replica_id, len(own["cpu"]), self.strategy.num_replicas_in_sync
            cpu, gpu = [None] * total, [None] * total
            cpu[first : first + count], gpu[first : first + count] = own["cpu"], own["gpu"]
            own = {"seed": own["seed"], "cpu": cpu, "gpu": gpu}
        elif cluster.num_workers > 1:
            parts = cluster.all_gather(own)
            own = {
                "seed": parts[0]["seed"],
                "cpu": [s for part in parts for s in part["cpu"]],
                "gpu": [s for part in parts for s in part["gpu"]],
            }
        return {"replica_rng": own}

    def _restore_replica_rng(self, state: dict, position: tuple, seed=None) -> bool:
        """Puts the saved streams of this worker's replicas back (True), by global replica id, whatever the
        number of replicas that saved them (``ReplicaStreams.resume``): a replica the saver had continues its
        stream; one it did not have (a replica beyond the saver's count, or every replica where the saver ran
        the default strategy, whose one replica drew from torch's generator: then ``seed``, the backup's data
        seed) starts a stream seeded from the saved seed, its global id and ``position`` (epoch, step), so it
        repeats neither another replica's draws nor the start of the run. False (nothing changed) without
        replica streams, or without saved streams and ``seed`` (a checkpoint of the default strategy)."""
        streams, saved = self.strategy.extended.replica_streams, state.get("replica_rng")
        if streams is None or (not saved and seed is None):
            return False
        streams.resume(saved or None, int(saved["seed"]) if saved else int(seed), salt=tuple(int(p) for p in position))
        return True

    def restore_backup(self, state: dict, path, *, model) -> None:
        """Restores a backup read by ``checkpoint.load(path, kind="backup")`` (``Trainer.restore_training_state``);
        ``model``: the distributed model. The running fit goes on from where ``begin_training`` says.

        Example::

            state.restore_backup(checkpoint.load("backup.pt", kind="backup"), "backup.pt", model=trainer.model)
        """
        self._check_global_batch_size(state.get("global_batch_size"), path)
        self._compiled_metrics.check_state_dict(state["metrics"], path)
        self._load_model_and_optimizer(state, path, "backup", model)
        restore_replica_states(self.strategy, self.per_replica_buffers(model), state.get("buffer_replicas") or {})
        # (restored once every callback's on_train_begin has reset it: begin_training)
        self._loaded_callback_states = dict(state.get("callbacks") or {}) or None
        history = self._trainer.history
        history.history = {k: list(v) for k, v in state["history"]["history"].items()}
        history.epoch = list(state["history"]["epoch"])
        self.data_seed = state["data_seed"]
        self.cursor.forget()  # a step read ahead before the restore came from the old seed and random state
        source = self.cursor.source
        if hasattr(source, "seed"):
            source.seed = self.data_seed
        torch.set_rng_state(_own_rng_state(state, self.strategy.cluster))
        self._restore_replica_rng(state, (state["epoch"], state["step"]), seed=state["data_seed"])
        self._restore_data_order(state)
        self._resume = {
            "epoch": state["epoch"],
            "step": state["step"],
            "cursor": tuple(state["cursor"]),
            "metrics": state["metrics"],
            "metric_replicas": state.get("metric_replicas"),
        }

    def _check_global_batch_size(self, saved, path) -> None:
        """A backup resumes only with the global batch size it was written with (any number of workers or
        replicas): ``CheckpointError`` otherwise. A backup without the entry (an earlier version's) loads."""
        used = self.cursor.batch_size
        if saved is None or used is None or int(saved) == int(used):
            return
        raise checkpoint.CheckpointError(
            f"The backup {str(path)!r} was written by a fit with a global batch size of {saved}, and this fit's "
            f"is {used}. A backup resumes on any number of workers or replicas, but only with the same global "
            "batch size: the data position it holds is counted in global batches, and the optimizer's steps "
            "(iterations, learning-rate schedule, accumulation window) assume them. Resume with the same "
            "batch_size (the global one: every replica's rows together), or delete the backup, or use another "
            "backup_dir, to start afresh."
        )

    def _restore_data_order(self, state: dict) -> None:
        """A source that draws its order as a pass begins (a shuffled ``DataLoader``, from torch's generator
        or its own) resumes mid-pass with the pass's order: the pass is begun again from the random state it
        began with (``Cursor.replay``). Its own generators go on from where the backup left them."""
        saved, cursor = state.get("data_rng"), self.cursor
        if not saved:
            return
        cursor.set_generator_states(saved["generators"])
        pass_index, position = state["cursor"]
        if position and saved.get("pass") is not None and not hasattr(cursor.source, "seed"):
            cursor.replay(pass_index, position, saved["pass"], saved["generators"])

    def per_replica_buffers(self, dm) -> dict:
        """The model's buffers that each replica keeps for itself until the epoch's end (``SyncOnRead``: plain
        BatchNorm statistics), by name; ``{}`` with one replica in all."""
        if dm is None or self.strategy.num_replicas_in_sync == 1:
            return {}
        return {
            name: variable
            for name, variable in dm.named_variables().items()
            if isinstance(variable, SyncOnReadVariable)
            and variable.aggregation is not VariableAggregation.ONLY_FIRST_REPLICA
        }

    def _buffer_replica_states(self, dm) -> dict:
        """``{"buffer_replicas": {name: [tensor per replica]}}``: a backup mid-epoch resumes each replica's own
        statistics (the model state holds their mean); ``{}`` where there are none (alike on every worker)."""
        buffers = self.per_replica_buffers(dm)
        return {"buffer_replicas": gather_replica_states(self.strategy, buffers)} if buffers else {}


def _history_with(history, epoch_logs) -> dict:
    records = {k: list(v) for k, v in history.history.items()}
    epochs = list(history.epoch)
    if epoch_logs is not None and epoch_logs[0] not in epochs:
        epoch, logs = epoch_logs
        epochs.append(epoch)
        for key, value in logs.items():
            records.setdefault(key, []).append(value)
    return {"history": records, "epoch": epochs}


def _data_rng(cursor) -> dict:
    """``{"pass": the random state the current pass began with (or None), "generators": [the states of the
    source's own generators now]}`` (``Cursor.random_state``)."""
    return {"pass": cursor.pass_random_state, "generators": [g.get_state() for g in cursor.generators]}


def _whole(window: dict) -> bool:
    """Whether an accumulation window's state holds every replica's sums already (a loaded one, not stepped
    since: alike on every worker), rather than this worker's part."""
    lists = list(window["gradients"].values())
    saver = window.get("replicas_in_sync")
    if saver is None:  # only a loaded window of an earlier version lacks it (a live one always has it): whole
        return True
    return window.get("first_replica", 0) == 0 and bool(lists) and len(lists[0]) == saver


def _own_rng_state(state: dict, cluster):
    """This worker's generator state in a backup (the chief's where the backup has no entry for it)."""
    states = state.get("worker_rng")
    if isinstance(states, (list, tuple)) and len(states) == cluster.num_workers:
        own = states[cluster.worker_index]
        if isinstance(own, torch.Tensor):
            return own
    return state["rng"]
