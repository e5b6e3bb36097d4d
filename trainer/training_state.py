"""The training state that checkpoints and backups keep, saved and restored: the model (with the trained
values where moving averages are swapped in), the optimizer's state (an open accumulation window's sums
of every worker), the metrics' accumulators (aggregated and per replica), the history, the random streams
of torch, of every worker and of every replica, the stateful callbacks' states and where the data stands.

``TrainingState`` is a part of ``Trainer`` (``trainer.py``): ``save_checkpoint``/``load_checkpoint``, and
``training_state``/``restore_training_state`` for ``BackupAndRestore``; only the chief writes files
(``write_on_chief``). Across workers saving is a collective: every worker saves, in the same order.

Example::

    trainer.save_checkpoint("ckpt.pt")  # model, optimizer, epoch/step, random streams, callbacks
    trainer.load_checkpoint("ckpt.pt", model)
    state = trainer.training_state(epoch, step)  # during a fit: what a backup holds
"""

from __future__ import annotations

import os

import torch

from replicafit.strategies import context
from replicafit.strategies.variables import SyncOnReadVariable, VariableAggregation

from . import checkpoint
from .replica_states import gather_replica_states, restore_replica_states

__all__ = ["TrainingState"]

_FORMAT = checkpoint.FORMAT  # the tag of checkpoints and backups (checked by checkpoint.load)


class TrainingState:
    """Checkpoints and backups of a ``Trainer`` (a part of it): what they hold, saved and restored."""

    # --- writing files ----------------------------------------------------------------------
    def write_on_chief(self, what: str, write, default=None):
        """``write()`` on the chief only (the one worker that writes files), then every worker waits
        for it, so none races ahead of a file being written. Returns ``write()``'s result (``default``
        elsewhere). ``what`` names the barrier (in the error when a worker never arrives). Every
        worker calls it, in the same order (the barrier is a collective); in one process it is ``write()``.

        Example::

            state = trainer.model_state_dict()  # every worker takes part in the read
            trainer.write_on_chief("my weights", lambda: checkpoint.save(state, "weights.pt"))
        """
        result = write() if self.strategy.extended.should_checkpoint else default
        self.strategy.cluster.barrier(what)
        return result

    # --- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path) -> str:
        """Writes model, optimizer (slots, iterations), epoch/step, RNG state and the state of callbacks that
        keep one (``TorchLRScheduler``), atomically.

        Strategy-independent; loads with ``torch.load(path, weights_only=True)``.
        """
        state = {
            "format": _FORMAT,
            "model": self.model_state_dict(),  # every worker takes part (SyncOnRead reads are collectives)
            "optimizer": self._optimizer_state(),
            "epoch": self._epoch,
            "step": self._step,
            "rng": torch.get_rng_state(),
            **self._replica_rng_states(),
            "callbacks": self._callback_states(),
        }
        return self.write_on_chief("save_checkpoint", lambda: checkpoint.save(state, path), os.fspath(path))

    def load_checkpoint(self, path, model=None) -> dict:
        """Restores a ``save_checkpoint`` file into ``model`` (or the model last used) and the optimizer.

        All or nothing: a file that is missing, damaged or lacks an entry (or holds one of
        the wrong type) raises ``CheckpointError`` saying which; a model state that does not
        fit the model raises torch's ``RuntimeError``/``ValueError``; an optimizer state that
        does not fit the optimizer raises ``CheckpointError`` naming the variable and slot.
        In every case the model and optimizer are left as they were.
        """
        state = checkpoint.load(path, kind="checkpoint")
        if model is not None:
            self._distribute(model)
        if self._distributed is None:
            raise ValueError("load_checkpoint() needs the model: pass model=... (or fit/evaluate it first).")
        self._load_model_and_optimizer(state, path, "checkpoint")
        self._epoch, self._step = state["epoch"], state["step"]
        torch.set_rng_state(state["rng"])
        self._replica_rng_loaded = self._restore_replica_rng(state, (state["epoch"], state["step"]))
        self._loaded_callback_states = state.get("callbacks") or None  # for the next fit's callbacks
        return state

    def _callback_states(self) -> dict:
        """The states of the stateful callbacks of the running (or last) ``fit`` (``TorchLRScheduler``,
        ``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint``, ``CSVLogger``)."""
        callback_list = self._callback_list
        if callback_list is None:
            return {}
        return {key: cb.state_dict() for key, cb in callback_list.stateful().items()}

    def _restore_callback_states(self, states: dict) -> None:
        """Gives each stateful callback of this ``fit`` its saved state (same class, same rank); outside a
        fit, the states wait for the next one."""
        if self._callback_list is None:
            self._loaded_callback_states = dict(states) or None
            return
        for key, cb in self._callback_list.stateful().items():
            if states.get(key):
                cb.load_state_dict(states[key])

    def _load_model_and_optimizer(self, state: dict, path, kind: str) -> None:
        """Loads ``state["model"]`` and ``state["optimizer"]``, or neither.

        The optimizer is built for the model's trainable variables first (as Keras does
        when it restores one), so that its state is checked against them now rather than
        at the first training step.
        """
        dm = self._distributed
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
                    self.optimizer._build_missing(dm.trainable_variables)  # for its pieces under sharded states
            self.optimizer.load_state_dict(state["optimizer"])
            # An element-level loss's real elements of the open window: added back when the fit starts.
            window = (state["optimizer"].get("accumulation") or {}).get("denominator")
            self._compile_loss.restore_window_count(window)
        except (ValueError, TypeError, KeyError) as error:
            dm.load_state_dict(before)
            raise checkpoint.CheckpointError(
                f"The {kind} {str(path)!r} holds an optimizer state that does not fit this "
                f"{type(self.optimizer).__name__} optimizer. {error}"
            ) from error

    # --- backup and restore ----------------------------------------------------------------------
    def training_state(self, epoch: int, step: int, epoch_logs=None) -> dict:
        """Everything a resumed fit needs, as a backup holds it (``BackupAndRestore`` saves it): model,
        optimizer, metric accumulators (aggregated and per replica), history, random streams, the
        callbacks' states, where the data stands (the pass, the global batches consumed, the random state
        the pass began with) and the global batch size; to resume at ``step`` of ``epoch`` (``step=0``:
        that epoch's start), on any number of workers or replicas with that global batch size.
        ``epoch_logs`` is ``(epoch, logs)`` of an epoch that ends now and that the History callback
        (which runs last) has not recorded yet. Called during a ``fit``, on every
        worker alike (it gathers across workers).

        Example::

            class Backup(Callback):
                def on_epoch_end(self, epoch, logs=None):
                    state = self.trainer.training_state(epoch + 1, 0, (epoch, dict(logs)))
                    self.trainer.write_on_chief("Backup", lambda: checkpoint.save(state, "backup.pt"))
        """
        cursor = self._cursor
        position = (
            (cursor.pass_index, cursor.position)
            if step
            else ((epoch, 0) if not cursor.repeat else (cursor.pass_index, cursor.position))
        )
        return {
            "format": _FORMAT,
            "epoch": epoch,
            "step": step,
            "cursor": list(position),
            "global_batch_size": cursor.batch_size,
            "data_seed": self._data_seed,
            "data_rng": _data_rng(cursor),
            "model": self._trained_model_state(),
            "optimizer": self._optimizer_state(),
            "metrics": self._compile_metrics.state_dict(),
            "metric_replicas": self._compile_metrics.replica_states(),
            **self._buffer_replica_states(),
            "history": _history_with(self.history, epoch_logs),
            "rng": torch.get_rng_state(),
            **self._replica_rng_states(),
            "callbacks": self._callback_states(),
            **self._worker_rng_states(),
        }

    def _trained_model_state(self) -> dict:
        """``model_state_dict()`` with the trained values of variables whose moving averages are swapped in
        (``SwapEMAWeights(swap_on_epoch=True)`` between epochs): a resumed run trains on from those."""
        state = self.model_state_dict()
        trained = self.optimizer.trained_values() if getattr(self.optimizer, "use_ema", False) else {}
        if trained and self._distributed is not None:
            for name, variable in self._distributed.named_variables().items():
                if id(variable) in trained:
                    state[name] = trained[id(variable)].detach().to(state[name].device).clone()
        return state

    def _optimizer_state(self) -> dict:
        """``optimizer.state_dict()``, with an open accumulation window's sums of every worker's replicas."""
        state = self.optimizer.state_dict()
        window = state.get("accumulation")
        cluster = self.strategy.cluster
        count = self._compile_loss.window_count() if window is not None else None
        if count is not None:
            window = dict(window, denominator=count)
            state = dict(state, accumulation=window)
        if window is not None and cluster.num_workers > 1 and not window["aggregated"] and not _whole(window):
            parts = cluster.all_gather(window["gradients"])  # every worker's replicas, in order
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
        if cluster.num_workers > 1:
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

    def restore_training_state(self, state: dict, path) -> None:
        """Restores a backup read by ``checkpoint.load(path, kind="backup")`` (its structure is checked there):
        the running ``fit`` goes on from the epoch and step of ``training_state``. Called from
        ``on_train_begin`` (before the first step), on every worker alike; ``path`` names the file in errors.

        A backup that does not fit this model, optimizer or metrics, or that was written with another
        global batch size, raises ``CheckpointError`` before anything is restored (docs/guides/resume.md has
        the rules of a resume on another number of workers or replicas).

        Example::

            class Resume(Callback):
                def on_train_begin(self, logs=None):
                    if os.path.exists("backup.pt"):
                        self.trainer.restore_training_state(checkpoint.load("backup.pt", kind="backup"), "backup.pt")
        """
        self._check_global_batch_size(state.get("global_batch_size"), path)
        self._compile_metrics.check_state_dict(state["metrics"], path)
        self._load_model_and_optimizer(state, path, "backup")
        restore_replica_states(self.strategy, self._per_replica_buffers(), state.get("buffer_replicas") or {})
        # (restored once every callback's on_train_begin has reset it: fit's _begin_training)
        self._loaded_callback_states = dict(state.get("callbacks") or {}) or None
        self.history.history = {k: list(v) for k, v in state["history"]["history"].items()}
        self.history.epoch = list(state["history"]["epoch"])
        self._data_seed = state["data_seed"]
        self._cursor.forget()  # a step read ahead before the restore came from the old seed and random state
        source = self._cursor.source
        if hasattr(source, "seed"):
            source.seed = self._data_seed
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
        used = self._cursor.batch_size
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
        saved, cursor = state.get("data_rng"), self._cursor
        if not saved:
            return
        cursor.set_generator_states(saved["generators"])
        pass_index, position = state["cursor"]
        if position and saved.get("pass") is not None and not hasattr(cursor.source, "seed"):
            cursor.replay(pass_index, position, saved["pass"], saved["generators"])

    def _per_replica_buffers(self) -> dict:
        """The model's buffers that each replica keeps for itself until the epoch's end (``SyncOnRead``: plain
        BatchNorm statistics), by name; ``{}`` with one replica in all."""
        dm = self._distributed
        if dm is None or self.strategy.num_replicas_in_sync == 1:
            return {}
        return {
            name: variable
            for name, variable in dm.named_variables().items()
            if isinstance(variable, SyncOnReadVariable)
            and variable.aggregation is not VariableAggregation.ONLY_FIRST_REPLICA
        }

    def _buffer_replica_states(self) -> dict:
        """``{"buffer_replicas": {name: [tensor per replica]}}``: a backup mid-epoch resumes each replica's own
        statistics (the model state holds their mean); ``{}`` where there are none (alike on every worker)."""
        buffers = self._per_replica_buffers()
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
