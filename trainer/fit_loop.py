"""``FitLoop``: one ``fit``'s epochs of steps, with validation, the callbacks' hooks and saving before a
preemption, under a ``FitPlan`` decided before the first epoch alike on every worker.

Across workers every worker makes the same collectives in the same order: the seeds and the verbose
level are broadcast from the chief, whether to read the logs and to stop are agreed, and reading the
logs (aggregated metrics) is itself a collective, so each worker reads them at the same steps.

``Trainer.fit`` makes one per fit, once the fit's setup is done (seeding, the data, the callbacks of
``fit_callbacks``, the preemption watch of ``watch_preemption``, the entry checks), runs its epochs, then
``close``s and ``finish``es it. The loop runs the trainer's steps through the ``train_function`` and
``validate`` it is given, resets and reads the metrics (``CompileMetrics``) and moves where training
stands (``TrainingState``) on.

Example::

    history = trainer.fit(model, (x, y), batch_size=64, epochs=10, validation_split=0.2)
"""

from __future__ import annotations

import dataclasses
import signal

import torch

from replicafit.lifeline import tell_launcher
from replicafit.strategies import WorkerFailedError, context
from replicafit.strategies.rng import VALIDATION

from . import callbacks as callbacks_module
from .peer_failure import Point, claim, claims_folder
from .preemption import Preempted, PreemptedInValidation, PreemptionWatch, noting

__all__ = ["FitLoop", "FitPlan", "fit_callbacks", "unwatch_preemption", "watch_preemption"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitPlan:
    """What each epoch of one ``fit`` does, decided before the first and alike on every worker.

    Example::

        plan = FitPlan(steps=100, validation_data=None, batch_size=64, batch_logs=True, agree_logs=False,
                       agree_each_step=False, accumulating=False, overlap=None)
    """

    steps: int | None  # steps per epoch (None: until the data runs out)
    validation_data: object  # None: no validation
    batch_size: int | None
    batch_logs: bool  # on_train_batch_end gets the logs (agreed across workers)
    agree_logs: bool  # reading the logs is a collective (several workers): every step, on every worker
    agree_each_step: bool  # stop_training is agreed after every step (a callback might set it on one worker)
    accumulating: bool  # the optimizer accumulates gradients over a window of steps
    overlap: object  # the built-in step's reduction in buckets during backward (a context), else None
    preemption: object = None  # the PreemptionWatch of BackupAndRestore(save_before_preemption=...), else None
    settle_each_step: bool = True  # a step's deferred update (sharded optimizer states) is settled before batch hooks
    rescuer: object = None  # the BackupAndRestore that saves on a peer's failure (several workers), else None


def fit_callbacks(callbacks, trainer, model, epochs, steps, verbose) -> tuple:
    """``(History, CallbackList)`` of a fit: the user's ``callbacks``, then History, then the progress bar
    (``verbose``: resolved, and the chief's on every worker).

    Example::

        history, callback_list = fit_callbacks([EarlyStopping()], trainer, model, 10, 100, "auto")
    """
    history = callbacks_module.History()
    verbose_level = callbacks_module.resolve_verbose(verbose)
    # "auto" depends on each process's terminal; the per-step work must not (chief decides).
    verbose_level = trainer.strategy.cluster.broadcast(verbose_level)
    cbs = list(callbacks or []) + [history]  # History last, as in Keras: it sees what callbacks add to logs
    if verbose_level:
        cbs.append(callbacks_module.ProgbarLogger(verbose_level))
    callback_list = callbacks_module.CallbackList(
        cbs, trainer=trainer, model=model, params={"epochs": epochs, "steps": steps, "verbose": verbose_level}
    )
    return history, callback_list


def watch_preemption(callbacks, cluster):
    """The ``PreemptionWatch`` of the ``BackupAndRestore(save_before_preemption=...)`` among ``callbacks``,
    installed (None without one); ``unwatch_preemption`` removes it.

    Example::

        watch = watch_preemption(callbacks, strategy.cluster)  # before the first batch is read
    """
    backups = [cb for cb in callbacks or () if getattr(cb, "preemption_signals", ())]
    if not backups:
        return None
    if len(backups) > 1:
        raise ValueError(
            f"{len(backups)} BackupAndRestore callbacks save before preemption; one backup is written at a "
            "preemption: keep save_before_preemption on one of them."
        )
    watch = PreemptionWatch(backups[0].preemption_signals, cluster)
    watch.backup, backups[0].watch = backups[0], watch
    watch.start()
    watch.install()
    return watch


def unwatch_preemption(watch) -> None:
    """Removes what ``watch_preemption`` installed (nothing for None)."""
    if watch is not None:
        watch.uninstall()
        watch.backup.watch = None


class FitLoop:
    """The epochs of one ``fit``: made by ``Trainer.fit`` once everything before the first epoch is done.

    Args:
      trainer: the ``Trainer`` (its public ``strategy``, ``optimizer`` and ``stop_training``).
      model: the distributed model this fit trains.
      plan: this fit's ``FitPlan``.
      cursor: the fit's ``inputs.Cursor``, its first step read ahead by the entry checks.
      callbacks: the fit's ``CallbackList``.
      resume: where a backup restored in ``on_train_begin`` left off (``TrainingState.begin_training``), or
        None; the fit starts at its epoch, else at ``initial_epoch``.
      initial_epoch: ``fit``'s argument.
      training_state: the trainer's ``TrainingState``, whose ``epoch`` and ``step`` the loop moves on.
      compiled_metrics: the trainer's ``CompileMetrics``, reset per epoch and read for the logs.
      compiled_loss: the trainer's ``CompileLoss``, whose element-level reduction ends with the fit.
      train_function: ``train_function(batch, plan)`` runs ``train_step`` on every replica's slice of a step.
      validate: ``validate(validation_data, batch_size, callbacks, preemption)``: the validation logs.

    Example::

        loop = FitLoop(trainer, model=dm, plan=plan, cursor=cursor, ...)
        for epoch in range(loop.first_epoch, epochs):
            logs = loop.run_epoch(epoch)
    """

    def __init__(
        self,
        trainer,
        *,
        model,
        plan: FitPlan,
        cursor,
        callbacks,
        resume,
        initial_epoch: int,
        training_state,
        compiled_metrics,
        compiled_loss,
        train_function,
        validate,
    ):
        self._trainer = trainer
        self.strategy = trainer.strategy
        self._model = model
        self.plan = plan
        self._cursor = cursor
        self._callbacks = callbacks
        self._resume = resume
        self.first_epoch = initial_epoch if resume is None else resume["epoch"]
        self._state = training_state
        self._metrics = compiled_metrics
        self._loss = compiled_loss
        self._train_function = train_function
        self._validate = validate
        self._streams = self.strategy.extended.replica_streams  # keyed per step (rng.ReplicaStreams.key)
        self._point = None  # where the fit stands, for a save after a peer's failure (plan.rescuer only)
        self._forward_changes = None  # (per-replica buffers, several outputs): what a step's forward changes
        self._began = (self.first_epoch, resume["step"] if resume is not None else 0)  # where this fit's steps began

    @property
    def optimizer(self):
        """The trainer's optimizer (read at each use, as ``Trainer.optimizer`` is)."""
        return self._trainer.optimizer

    def run_epoch(self, epoch: int) -> dict:
        """One epoch: its steps (the first epoch from where a restored backup left off), then the epoch's logs
        (validation's with ``val_``) and ``on_epoch_end``; returns the logs. A callback on any worker that
        sets ``stop_training`` stops every worker.

        Example::

            logs = loop.run_epoch(epoch)
        """
        trainer, plan = self._trainer, self.plan
        resumed = self._resume if epoch == self.first_epoch else None
        self._state.epoch = epoch
        self._metrics.reset_state()
        self._start_epoch_data(epoch, resumed)
        self._callbacks.call("on_epoch_begin", epoch, {})
        watch = plan.preemption
        step, preempted = self._train_steps(resumed["step"] if resumed is not None else 0)
        self.strategy.extended.settle_updates()  # every variable holds the last update from here on
        if preempted:
            self._preempted(epoch, step)
        if plan.rescuer is not None:  # validation and the epoch's end change only what this puts back
            self._point = Point("epoch", epoch, step, self._rewind_point(), window=plan.accumulating)
        if plan.accumulating:  # a partial window is applied, not dropped
            with context.enter_or_assert_strategy(self.strategy):
                self.optimizer.apply_accumulated_gradients()
            if plan.rescuer is not None:  # (its reduction closes the window first: a failure in it loses the window)
                self._point.window = False
        self._model.sync_buffers()  # replica-mean statistics for validation and in the user's module
        logs = self._metrics.result()
        if plan.validation_data is not None:
            logs.update({f"val_{k}": v for k, v in self._validation_logs(epoch, step).items()})
        if plan.rescuer is not None:
            self._point = Point("epoch_hooks", epoch, step, logs=logs)
        self._callbacks.call("on_epoch_end", epoch, logs)
        if plan.rescuer is not None:
            self._point.phase = "done"
        cluster = self.strategy.cluster
        if watch is not None:  # stop_training and the preemption flags agreed in one sum
            trainer.stop_training, preempted = watch.at_epoch_end(trainer.stop_training)
            if preempted and not trainer.stop_training:  # (a fit that stops here has ended: nothing to resume)
                self._preempted(epoch + 1, 0, (epoch, logs))
        elif cluster.num_workers > 1:  # a callback on any worker stops every worker
            trainer.stop_training = cluster.any(trainer.stop_training)
        return logs

    def _validation_logs(self, epoch: int, step: int) -> dict:
        """The epoch's validation logs; a preemption agreed during validation writes the backup of the epoch's
        training steps (the resumed fit validates from the start)."""
        watch = self.plan.preemption
        rewind = self._rewind_point() if watch is not None else None
        if self._streams is not None:  # validation draws alike however the fit got here (a resume at the epoch's end)
            self._streams.key(epoch, 0, VALIDATION)
        try:
            return self._validate(self.plan.validation_data, self.plan.batch_size, self._callbacks, watch)
        except PreemptedInValidation:
            self._rewind(rewind)
            self._preempted(epoch, step)

    def _preempted(self, epoch: int, step: int, epoch_logs=None):
        """Every worker agreed to stop: the chief writes the backup of ``step`` steps of ``epoch`` done, then
        ``Preempted`` (a ``SystemExit``) ends the fit on every worker."""
        watch = self.plan.preemption
        path = watch.backup.save_for_preemption(epoch, step, epoch_logs)
        raise Preempted(watch.received.name if watch.received is not None else None, path, epoch, step)

    def _rewind_point(self) -> dict:
        """What validation may change and a backup of the training steps must not see (this worker's own,
        no communication): the random streams and every replica's metric accumulators."""
        streams = self.strategy.extended.replica_streams
        return {
            "rng": torch.get_rng_state(),
            "streams": streams.state_dict() if streams is not None else None,
            "metrics": self._metrics.local_values(),
        }

    def _rewind(self, point: dict) -> None:
        torch.set_rng_state(point["rng"])
        if point["streams"] is not None:
            self.strategy.extended.replica_streams.load_state_dict(point["streams"])
        self._metrics.load_local_values(point["metrics"])

    def _step_point(self) -> tuple:
        """What a training step changes before its update (this worker's own, no communication): where the data
        stands, torch's generator, the replicas' random streams (their states are replaced, never changed in
        place: the snapshot keeps references) and what its forward pass changes (per-replica BatchNorm
        statistics, copied; several outputs' loss trackers, copied only for such a model)."""
        streams = self.strategy.extended.replica_streams
        cursor = self._cursor
        if self._forward_changes is None:  # (found once: a model's own statistics, several outputs' loss trackers)
            buffers = self._state.per_replica_buffers(self._model)
            self._forward_changes = (list(buffers.values()), not self._metrics.single_output)
        variables, output_losses = self._forward_changes
        # What the forward pass changes before the update: per-replica statistics (BatchNorm), per-output losses.
        changed = (
            [[c.value().detach().clone() for c in self.strategy.experimental_local_results(v)] for v in variables],
            self._metrics.local_values() if output_losses else None,
        )
        position = (cursor.pass_index, cursor.position)
        return position, torch.get_rng_state(), streams.snapshot() if streams else None, changed

    # --- a peer's failure -----------------------------------------------------------------------
    def after_peer_failure(self, error: WorkerFailedError):
        """Another worker died or stopped arriving (``error``, raised here by a collective): where the state is
        whole on this worker, the survivor chosen among those left writes the backup of the last step every
        worker finished (``peer_failure``); then ``WorkerFailedError`` again, saying what was written. Raises
        always.

        Example::

            try:
                logs = loop.run_epoch(epoch)
            except WorkerFailedError as error:
                loop.after_peer_failure(error)
        """
        rescuer, point = self.plan.rescuer, self._point
        if rescuer is None:
            raise error
        cluster = self.strategy.cluster
        reason = self._no_rescue(point, cluster)
        if reason is not None:
            raise WorkerFailedError(f"{error} No backup was written on this failure: {reason}.") from error
        folder = claims_folder(rescuer.backup_dir, rescuer.peer_failure_token)
        # A launcher stops the survivors with SIGTERM once it saw the worker fail: noted, not acted on, until the
        # backup is written (it waits a while before SIGKILL).
        with noting([signal.SIGTERM]), cluster.alone():
            tell_launcher("saving")  # (replicafit's launcher waits for this worker before it stops the others)
            if not claim(folder, cluster.worker_index, point.progress, cluster.num_workers - 1):
                raise WorkerFailedError(
                    f"{error} Another surviving worker writes the backup of the last step every worker finished "
                    f"(in {rescuer.backup_dir!r}): restart the workers to resume from it."
                ) from error
            written = rescuer.saved_at  # a periodic backup every worker finished writing (before the hooks below)
            try:
                epoch, step = self._rescue_position(point)
                ended = (point.epoch, point.logs) if point.phase in ("epoch_hooks", "done") else None
                if written != (epoch, step):
                    stateful = self._callbacks.stateful().items()
                    chief_only = [key for key, cb in stateful if getattr(cb, "_state_on_chief", False)]
                    path = rescuer.save_after_peer_failure(epoch, step, ended, chief_only)
            except Exception as failure:  # noqa: BLE001 (any: the last good backup is whole, saves are atomic)
                raise WorkerFailedError(
                    f"{error} This worker was to write the backup of the last step every worker finished, and could "
                    f"not ({type(failure).__name__}: {failure}); the last periodic backup stands."
                ) from error
        done = f"epoch {epoch} at its start" if step == 0 else f"epoch {epoch} after step {step}"
        if written == (epoch, step):  # it holds every worker's part (random streams, metrics): it stands
            raise WorkerFailedError(
                f"{error} The backup of the last step every worker finished ({done}) was written before the "
                f"failure, in {rescuer.backup_dir!r}: restart the workers to resume from it with no step lost."
            ) from error
        raise WorkerFailedError(
            f"{error} Worker {cluster.worker_index} wrote the backup of the last step every worker finished "
            f"({done}) to {path!r}: restart the workers to resume from it with no step lost."
        ) from error

    def _no_rescue(self, point, cluster):
        """Why no backup can be written after this failure (None: it can)."""
        capabilities = self.strategy.extended.capabilities
        if not capabilities.whole_state_on_every_worker or capabilities.shards_parameters:
            return (
                "the state is sharded across the workers (sharded parameters or optimizer states), and the dead "
                "worker's part is gone; the last periodic backup stands"
            )
        if not cluster.failed:
            return "the cluster reports no failed collective; the last periodic backup stands"
        if point is None or (point.phase == "step" and (point.epoch, point.step) == self._began):
            return "it came before the first training step's update (nothing was trained since the fit began)"
        window = self.optimizer.state_dict().get("accumulation") is not None
        # (A window's last step closes the window before its reduction, and so does the epoch's partial window: a
        # failure there leaves no open window and no applied update.)
        if window or (self.plan.accumulating and point.phase == "step") or (point.phase == "epoch" and point.window):
            return (
                "it came inside a gradient accumulation window, whose sums on the dead worker are gone; the last "
                "periodic backup stands"
            )
        current = self._callbacks.current
        if point.phase in ("hooks", "epoch_hooks") and current is not None and current is not self.plan.rescuer:
            hook = "on_train_batch_end" if point.phase == "hooks" else "on_epoch_end"
            return (
                f"it came inside {type(current).__name__}.{hook}, between callbacks (some ran, some did not); the "
                "last periodic backup stands"
            )
        return None

    def _rescue_position(self, point) -> tuple:
        """``(epoch, step)`` of the backup after a peer's failure at ``point``, this worker's state put where the
        backup is taken (alone: no communication)."""
        if point.phase == "step":  # the step never updated: back to where it began
            (pass_index, position), rng, streams, (values, metrics) = point.snapshot
            self._cursor.pass_index, self._cursor.position = pass_index, position
            torch.set_rng_state(rng)
            if streams is not None:
                self.strategy.extended.replica_streams.rewind(streams)
            for variable, components in zip(self._forward_changes[0], values):
                for index, value in enumerate(components):
                    variable.assign_component(index, value)
            if metrics is not None:
                self._metrics.load_local_values(metrics)
            return point.epoch, point.step
        if point.phase == "applied":  # the update applied, its logs unread: its hooks run here, alone
            read = self.plan.batch_logs
            self._callbacks.call("on_train_batch_end", point.step - 1, self._metrics.result() if read else {})
            return point.epoch, point.step
        if point.phase in ("hooks", "agreed"):
            return point.epoch, point.step
        if point.phase == "epoch":  # the epoch's training steps done: validation runs again on resume
            self._rewind(point.snapshot)
            return point.epoch, point.step
        return point.epoch + 1, 0  # "epoch_hooks" (the saving callback's own hook) or "done"

    def _start_epoch_data(self, epoch: int, resumed) -> None:
        """Puts the cursor where ``epoch``'s batches begin: where a backup left off mid-epoch (its metric
        accumulators restored too), a pass of its own per epoch, or on from where it stands when
        ``steps_per_epoch`` repeats the data."""
        cursor = self._cursor
        if resumed is not None and resumed["step"]:
            self._metrics.load_state_dict(resumed["metrics"], resumed.get("metric_replicas"))
            cursor.start(*resumed["cursor"])
        elif not cursor.repeat:
            cursor.start(epoch, 0)
        elif resumed is not None:  # (the cursor may have read ahead at the start: it goes where the backup left)
            cursor.start(*resumed["cursor"])
        elif not cursor.started:
            cursor.start(0, 0)

    def _train_steps(self, step: int) -> tuple:
        """The epoch's training steps from ``step`` on, until ``plan.steps``, the data's end, ``stop_training``
        or an agreed preemption; ``(steps done, preempted)``."""
        trainer, plan, cursor = self._trainer, self.plan, self._cursor
        callback_list, state = self._callbacks, self._state
        cluster = self.strategy.cluster
        watch = plan.preemption
        rescuing = plan.rescuer is not None
        while plan.steps is None or step < plan.steps:
            if rescuing:  # what the step changes before its update, to put back after a peer's failure
                self._point = Point("step", state.epoch, step, self._step_point())
            try:
                batch = cursor.next()
            except StopIteration:
                break
            state.step = step
            if self._streams is not None:  # each replica draws what it drew at this step in any run of this seed
                self._streams.key(state.epoch, step)
            if callback_list.wants_batch_logs["on_train_batch_begin"]:
                callback_list.call("on_train_batch_begin", step, {})
            if watch is not None:  # this worker's flag rides with the step's reduction
                watch.before_step()
            self._train_function(batch, plan)
            if plan.settle_each_step:
                self.strategy.extended.settle_updates()
            step += 1
            state.step = step
            if rescuing:
                self._point = Point("applied", state.epoch, step)
            # Across workers reading the logs is a collective (agreed once: every step); in one
            # process only when a callback reads them at this step (a bar redraws now and then).
            read = plan.batch_logs and (plan.agree_logs or callback_list.wants_logs_now("on_train_batch_end"))
            logs = self._metrics.result() if read else {}
            if rescuing:
                self._point.phase = "hooks"
            callback_list.call("on_train_batch_end", step - 1, logs)
            if rescuing:
                self._point.phase = "agreed"
            if plan.agree_each_step:
                trainer.stop_training = cluster.any(trainer.stop_training)
            if trainer.stop_training:
                break
            if watch is not None and watch.after_step():
                return step, True
        return step, False

    def close(self) -> None:
        """What a fit leaves behind, however it ends: no open data, no hooks, one's own loop weighing alike.

        Example::

            loop.close()  # in a finally, before on_train_end
        """
        self._cursor.close()
        self.strategy.extended.release_gradient_hooks()  # the model's parameters keep no hooks of ours
        if self.plan.accumulating:
            self.optimizer.step_weight = 1.0  # a loop of one's own after fit weighs its steps alike
        self._loss.end_element_reduction(self.optimizer)

    def finish(self, logs: dict) -> None:
        """A fit that ran its epochs: the model ends with the moving averages (where the optimizer keeps
        them), then ``on_train_end`` with the last epoch's ``logs``.

        Example::

            loop.finish(logs)  # after close()
        """
        if self.optimizer.use_ema:  # as Keras' fit: the model ends with the averages
            self.optimizer.finalize_variable_values(self._model.trainable_variables)
        # (a signal from the last agreed boundary on is noted and ignored: the fit is complete, and its
        # backup is not deleted by on_train_end under a default action)
        self._callbacks.call("on_train_end", logs)
