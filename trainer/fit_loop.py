"""The fit loop: ``fit``'s setup (seeding alike on every worker, the data, the callbacks, the per-fit
decisions of a ``FitPlan``) and its epochs of steps, with validation and the callbacks' hooks.

Across workers every worker makes the same collectives in the same order: the seeds and the verbose
level are broadcast from the chief, whether to read the logs and to stop are agreed, and reading the
logs (aggregated metrics) is itself a collective, so each worker reads them at the same steps.

``FitLoop`` is a part of ``Trainer`` (``trainer.py``), whose steps, loss (``CompileLoss``), metrics
(``CompileMetrics``), entry checks (``input_checks.py``) and training state (``training_state.py``) it drives.

Example::

    history = trainer.fit(model, (x, y), batch_size=64, epochs=10, validation_split=0.2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import torch

from replicafit.strategies import context

from . import callbacks as callbacks_module
from .arguments import FIT_ARGUMENTS, check_arguments
from .input_checks import in_memory_labels
from .inputs import Cursor, batch_source, split_off_validation
from .preemption import Preempted, PreemptedInValidation, PreemptionWatch

__all__ = ["FitLoop", "FitPlan"]


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """What each epoch of one ``fit`` does, decided before the first and alike on every worker."""

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


class FitLoop:
    """``fit`` and its loop (a part of ``Trainer``)."""

    def fit(
        self,
        model,
        dataset,
        epochs: int = 1,
        batch_size=None,
        validation_data=None,
        validation_split=0.0,
        callbacks=None,
        steps_per_epoch=None,
        initial_epoch: int = 0,
        shuffle: bool = True,
        verbose="auto",
    ):
        """Trains ``model`` on ``dataset``; returns a ``History`` (``history.history["loss"]``, ...).

        ``dataset``: arrays/tensors (``(x, y)`` or ``(x, y, sample_weight)``) or a torch
        ``Dataset`` with ``batch_size`` (shuffled per epoch when ``shuffle``), or a
        ``DataLoader``/iterable of batches. ``steps_per_epoch`` repeats the data when it
        runs out. ``validation_split`` keeps the last fraction of arrays/datasets for
        validation (both parts need at least one example).

        Floating inputs, targets and sample weights of another float type (NumPy's float64) are
        cast to the model's float type, as Keras casts them to its own (integer labels are kept).

        Training or validation data with no batch at all raises ``ValueError`` before any
        callback runs (as ``predict`` does): an empty run has no loss to report. Arguments of
        the wrong type are refused here, with the fix (Keras' ``fit(x, y)`` habit puts ``y``
        into ``epochs``: pass ``fit(model, (x, y), ...)``).
        """
        check_arguments(
            "fit",
            FIT_ARGUMENTS,
            epochs=epochs,
            batch_size=batch_size,
            validation_split=validation_split,
            steps_per_epoch=steps_per_epoch,
            initial_epoch=initial_epoch,
            shuffle=shuffle,
        )
        self._seed_fit()
        train_data, source, validation_data = self._fit_data(
            dataset, batch_size, validation_data, validation_split, shuffle
        )
        distributed = self._distribute_data(source)
        repeat = steps_per_epoch is not None
        # Before the first batch is read: a DataLoader's worker processes forked from now on inherit the handler.
        watch = self._watch_preemption(callbacks)
        self._cursor = cursor = Cursor(source, distributed, repeat=repeat)
        try:
            # The first step of the first epoch, read once: the entry checks look at it, the first step trains on it.
            first = self._first_look(cursor, 0 if repeat else initial_epoch, "training data", "fit()")
            dm = self._distribute(model)
            dm.train()
            self._trainable = dm.trainable_variables
            steps = steps_per_epoch if steps_per_epoch is not None else distributed.steps
            history, callback_list = self._fit_callbacks(callbacks, model, epochs, steps, verbose)
            self.history, self.stop_training, self._resume = history, False, None
            self._first_batch_structure(first, dm, "fit()", in_memory_labels(train_data))
            self._begin_training(callback_list)
            resume = self._resume  # where a backup restored in on_train_begin left off
            start_epoch = initial_epoch if resume is None else resume["epoch"]
            plan = self._fit_plan(callback_list, steps, validation_data, batch_size, watch)
            self._compile_loss.start_element_reduction(
                first,
                cursor.batch_size,  # the first global batch's rows (survives a restore: its read-ahead is gone)
                self.optimizer,
                single_output=self._compile_metrics.single_output,
                builtin_step=self._is_builtin("train_step", "compute_loss"),
            )
        except BaseException:
            cursor.close()  # the pass read ahead (its loader's worker processes, a prefetch thread)
            self._unwatch_preemption(watch)
            raise
        logs: dict = {}
        try:
            try:
                for epoch in range(start_epoch, epochs):
                    resumed = resume if epoch == start_epoch else None
                    logs = self._fit_epoch(epoch, resumed, dm, cursor, callback_list, plan)
                    if self.stop_training:
                        break
            finally:
                self._end_fit(cursor, plan)
            if getattr(self.optimizer, "use_ema", False):  # as Keras' fit: the model ends with the averages
                self.optimizer.finalize_variable_values(self._trainable)
            # (a signal from the last agreed boundary on is noted and ignored: the fit is complete, and its
            # backup is not deleted by on_train_end under a default action)
            callback_list.call("on_train_end", logs)
        finally:
            self._unwatch_preemption(watch)
        return history

    def _seed_fit(self) -> None:
        """Seeds this fit alike on every worker: torch's generator, the data's shuffles (``_data_seed``) and
        each replica's own random stream (dropout...)."""
        if self.seed is not None:
            torch.manual_seed(self.seed)
        self._data_seed = self.seed if self.seed is not None else random.randrange(2**31)
        # Every worker must shuffle alike: a seed drawn per process would train on other rows.
        cluster = self.strategy.cluster
        self._data_seed = cluster.broadcast(self._data_seed)
        if self.seed is None and cluster.num_workers > 1:
            # torch's generator too (a DataLoader's shuffle draws from it): the chief's on every
            # worker, as a seed would make it.
            torch.set_rng_state(cluster.broadcast(torch.get_rng_state()))
        # Each replica's own random stream (dropout...), from (seed, global replica id); a checkpoint
        # loaded before a seedless fit keeps the streams it held, as it keeps torch's generator.
        streams = self.strategy.extended.replica_streams
        if streams is not None and (self.seed is not None or not self._replica_rng_loaded):
            streams.seed(self._data_seed)
        self._replica_rng_loaded = False

    def _fit_data(self, dataset, batch_size, validation_data, validation_split, shuffle) -> tuple:
        """``(training data, its source of global batches, validation data)``, the validation data checked
        to yield a batch (a one-shot validation iterator comes back re-chained)."""
        train_data, split_validation = split_off_validation(dataset, validation_split)
        validation_data = validation_data if validation_data is not None else split_validation
        source = batch_source(train_data, batch_size, shuffle, self._data_seed)
        if validation_data is not None:
            validation_data = self._checked_validation(validation_data, batch_size)
        return train_data, source, validation_data

    def _fit_callbacks(self, callbacks, model, epochs, steps, verbose) -> tuple:
        """``(History, CallbackList)`` of this fit: the user's callbacks, then History, then the progress bar."""
        history = callbacks_module.History()
        verbose_level = callbacks_module.resolve_verbose(verbose)
        # "auto" depends on each process's terminal; the per-step work must not (chief decides).
        verbose_level = self.strategy.cluster.broadcast(verbose_level)
        cbs = list(callbacks or []) + [history]  # History last, as in Keras: it sees what callbacks add to logs
        if verbose_level:
            cbs.append(callbacks_module.ProgbarLogger(verbose_level))
        callback_list = callbacks_module.CallbackList(
            cbs, trainer=self, model=model, params={"epochs": epochs, "steps": steps, "verbose": verbose_level}
        )
        return history, callback_list

    def _begin_training(self, callback_list) -> None:
        """Makes ``callback_list`` this fit's and calls ``on_train_begin``, where ``BackupAndRestore`` may
        restore a backup (``_resume``); then the callbacks' saved states (the backup's, else those of a
        checkpoint loaded before this fit) are restored, after every callback's ``on_train_begin`` has
        reset its own (whatever their order)."""
        self._callback_list = callback_list
        callback_list.call("on_train_begin", {})
        states, self._loaded_callback_states = self._loaded_callback_states, None
        if states:
            self._restore_callback_states(states)
        callback_list.refresh()

    def _watch_preemption(self, callbacks):
        """The ``PreemptionWatch`` of the ``BackupAndRestore(save_before_preemption=...)`` among ``callbacks``,
        installed (None without one)."""
        backups = [cb for cb in callbacks or () if getattr(cb, "preemption_signals", ())]
        if not backups:
            return None
        if len(backups) > 1:
            raise ValueError(
                f"{len(backups)} BackupAndRestore callbacks save before preemption; one backup is written at a "
                "preemption: keep save_before_preemption on one of them."
            )
        watch = PreemptionWatch(backups[0].preemption_signals, self.strategy.cluster)
        watch.backup, backups[0].watch = backups[0], watch
        watch.start()
        watch.install()
        return watch

    @staticmethod
    def _unwatch_preemption(watch) -> None:
        if watch is not None:
            watch.uninstall()
            watch.backup.watch = None

    def _preempted(self, watch, epoch: int, step: int, epoch_logs=None):
        """Every worker agreed to stop: the chief writes the backup of ``step`` steps of ``epoch`` done, then
        ``Preempted`` (a ``SystemExit``) ends the fit on every worker."""
        path = watch.backup.save_for_preemption(epoch, step, epoch_logs)
        raise Preempted(watch.received.name if watch.received is not None else None, path, epoch, step)

    def _fit_plan(self, callback_list, steps, validation_data, batch_size, watch=None) -> FitPlan:
        """This fit's decisions, taken once before its first epoch, alike on every worker."""
        cluster = self.strategy.cluster
        batch_logs = callback_list.wants_batch_logs["on_train_batch_end"]
        # Reading the logs is a collective across workers: every worker reads them, or none.
        agree_logs = cluster.num_workers > 1
        if agree_logs:  # (with whether each worker saves before preemption: every worker must, or none)
            logs_wanted, watching = cluster.sum([int(batch_logs), int(watch is not None)], "agreeing on the plan")
            batch_logs = logs_wanted > 0
            if watching not in (0, cluster.num_workers):
                raise ValueError(
                    f"BackupAndRestore saves before preemption on {watching} of {cluster.num_workers} workers: every "
                    "worker must run the same fit with the same callbacks (save_before_preemption alike everywhere)."
                )
        # Logs are global, so built-in callbacks decide alike on every worker; a user's callback
        # might not (in any hook), so its stop_training is agreed after every step.
        agree_each_step = cluster.num_workers > 1 and callbacks_module.may_stop_training_alone(callback_list)
        # The built-in step applies its gradients once: across workers they can be reduced in buckets
        # started during backward (a custom train_step reduces after backward). An accumulating
        # optimizer reduces once per window, after the window's last backward.
        accumulating = bool(getattr(self.optimizer, "gradient_accumulation_steps", None))
        builtin_step = self._is_builtin("train_step")
        overlap = self.strategy.extended.gradient_step if builtin_step and not accumulating else None
        # Sharded optimizer states gather a step's updated values while the loop moves on, unless a callback's
        # batch hooks might read the variables (then they are settled before those hooks).
        settle = callbacks_module.may_touch_variables_between_steps(callback_list)
        return FitPlan(
            steps, validation_data, batch_size, batch_logs, agree_logs, agree_each_step, accumulating, overlap, watch,
            settle,
        )  # fmt: skip

    def _fit_epoch(self, epoch: int, resumed, dm, cursor, callback_list, plan) -> dict:
        """One epoch of ``fit``: its steps (from where the backup ``resumed`` left off, if given), then the
        epoch's logs (validation's with ``val_``) and ``on_epoch_end``; returns the logs. A callback on any
        worker that sets ``stop_training`` stops every worker."""
        self._epoch = epoch
        self._compile_metrics.reset_state()
        self._start_epoch_data(epoch, resumed, cursor)
        callback_list.call("on_epoch_begin", epoch, {})
        watch = plan.preemption
        step, preempted = self._train_steps(resumed["step"] if resumed is not None else 0, cursor, callback_list, plan)
        self.strategy.extended.settle_updates()  # every variable holds the last update from here on
        if preempted:
            self._preempted(watch, epoch, step)
        if plan.accumulating:  # a partial window is applied, not dropped
            with context.enter_or_assert_strategy(self.strategy):
                self.optimizer.apply_accumulated_gradients()
        dm.sync_buffers()  # replica-mean statistics for validation and in the user's module
        logs = self._compile_metrics.result()
        if plan.validation_data is not None:
            rewind = self._rewind_point() if watch is not None else None
            try:
                val_logs = self._validate(plan.validation_data, plan.batch_size, callback_list, watch)
            except PreemptedInValidation:
                # The backup of the epoch's training steps done: the resumed fit validates from the start.
                self._rewind(rewind)
                self._preempted(watch, epoch, step)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callback_list.call("on_epoch_end", epoch, logs)
        cluster = self.strategy.cluster
        if watch is not None:  # stop_training and the preemption flags agreed in one sum
            self.stop_training, preempted = watch.at_epoch_end(self.stop_training)
            if preempted and not self.stop_training:  # (a fit that stops here has ended: nothing to resume)
                self._preempted(watch, epoch + 1, 0, (epoch, logs))
        elif cluster.num_workers > 1:  # a callback on any worker stops every worker
            self.stop_training = cluster.any(self.stop_training)
        return logs

    def _rewind_point(self) -> dict:
        """What validation may change and a backup of the training steps must not see (this worker's own,
        no communication): the random streams and every replica's metric accumulators."""
        streams = self.strategy.extended.replica_streams
        return {
            "rng": torch.get_rng_state(),
            "streams": streams.state_dict() if streams is not None else None,
            "metrics": self._compile_metrics.local_values(),
        }

    def _rewind(self, point: dict) -> None:
        torch.set_rng_state(point["rng"])
        if point["streams"] is not None:
            self.strategy.extended.replica_streams.load_state_dict(point["streams"])
        self._compile_metrics.load_local_values(point["metrics"])

    def _start_epoch_data(self, epoch: int, resumed, cursor) -> None:
        """Puts the cursor where ``epoch``'s batches begin: where a backup left off mid-epoch (its metric
        accumulators restored too), a pass of its own per epoch, or on from where it stands when
        ``steps_per_epoch`` repeats the data."""
        if resumed is not None and resumed["step"]:
            self._compile_metrics.load_state_dict(resumed["metrics"], resumed.get("metric_replicas"))
            cursor.start(*resumed["cursor"])
        elif not cursor.repeat:
            cursor.start(epoch, 0)
        elif resumed is not None:  # (the cursor may have read ahead at the start: it goes where the backup left)
            cursor.start(*resumed["cursor"])
        elif not cursor.started:
            cursor.start(0, 0)

    def _train_steps(self, step: int, cursor, callback_list, plan) -> tuple:
        """The epoch's training steps from ``step`` on, until ``plan.steps``, the data's end, ``stop_training``
        or an agreed preemption; ``(steps done, preempted)``."""
        cluster = self.strategy.cluster
        watch = plan.preemption
        while plan.steps is None or step < plan.steps:
            try:
                batch = cursor.next()
            except StopIteration:
                break
            self._step = step
            if callback_list.wants_batch_logs["on_train_batch_begin"]:
                callback_list.call("on_train_batch_begin", step, {})
            if watch is not None:  # this worker's flag rides with the step's reduction
                watch.before_step()
            self._run_train_step(batch, plan)
            if plan.settle_each_step:
                self.strategy.extended.settle_updates()
            step += 1
            self._step = step
            # Across workers reading the logs is a collective (agreed once: every step); in one
            # process only when a callback reads them at this step (a bar redraws now and then).
            read = plan.batch_logs and (plan.agree_logs or callback_list.wants_logs_now("on_train_batch_end"))
            callback_list.call("on_train_batch_end", step - 1, self._compile_metrics.result() if read else {})
            if plan.agree_each_step:
                self.stop_training = cluster.any(self.stop_training)
            if self.stop_training:
                break
            if watch is not None and watch.after_step():
                return step, True
        return step, False

    def _run_train_step(self, batch, plan) -> None:
        """``train_step`` on every replica's slice of ``batch``."""
        self._set_global_batch(batch)
        if plan.accumulating:  # a window's steps weigh their examples: it equals one step on them all
            # (an element-level loss: every step alike, each replica's loss divided by the same constant)
            weight = 1.0 if self._compile_loss.element_denominator is not None else float(self._global_batch)
            self.optimizer.step_weight = weight
        with plan.overlap(self._trainable) if plan.overlap is not None else contextlib.nullcontext():
            self.strategy.run(self.train_step, args=(batch,))

    def _end_fit(self, cursor, plan) -> None:
        """What a fit leaves behind, however it ends: no open data, no hooks, one's own loop weighing alike."""
        cursor.close()
        self.strategy.extended.release_gradient_hooks()  # the model's parameters keep no hooks of ours
        if plan.accumulating:
            self.optimizer.step_weight = 1.0  # a loop of one's own after fit weighs its steps alike
        self._compile_loss.end_element_reduction(self.optimizer)
