"""``Trainer``: Keras-style ``fit``/``evaluate``/``predict`` for a torch module under any strategy.

One ``strategy.run`` per step. Each replica computes its rows' per-example losses,
sums them and divides by the step's **global** batch size, and hands its gradients to
the optimizer, which sums them across replicas. So ``MirroredStrategy(n)`` takes the
same steps as one device on the same global batches, partial last batch included, and
an empty replica contributes nothing. An element-level loss (a prediction per token or
pixel, some ignored or weighted: ``losses`` module docstring) is the loss's own mean over
the whole global batch instead: each replica sums its element losses and counts its real
elements, the counts ride with the gradient reduction, and the optimizer divides by the
global count. Metrics accumulate per replica in ``SyncOnRead`` variables and are read,
aggregated, when logs are needed.

Example::

    import replicafit.strategies as ds
    from replicafit.data import datasets
    from replicafit.trainer import Trainer

    x, y = datasets.load_digits(normalize=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    trainer = Trainer(strategy=ds.MirroredStrategy(["cpu:0", "cpu:1"]), optimizer="adam",
                      loss="cross_entropy", metrics=["accuracy"], seed=0)
    history = trainer.fit(model, (x, y), batch_size=64, epochs=20, validation_split=0.2)
    trainer.evaluate(model, (x, y), batch_size=256, return_dict=True)
    probabilities = trainer.predict(model, x, batch_size=256).softmax(-1)

Models that return a tuple, or a dict whose outputs the loss or the labels name (a dict of them), are
multi-output models, as in Keras: ``loss`` may be one loss (applied to every output) or a matching
dict/list; the total loss is the sum; logs add ``<output>_loss`` and ``<output>_<metric>`` per output.
A dict of inputs goes to ``forward`` as keyword arguments when ``forward`` names its keys (Hugging
Face's convention), and a Hugging Face ``ModelOutput`` (or a dict with ``logits``) gives its logits to
losses, metrics and ``predict``: ``model_io.py`` has the exact rules.

This file holds the public ``Trainer``: its arguments, the model, the per-replica ``train_step``/``test_step``/
``predict_step`` and ``compute_loss``, ``fit``/``evaluate``/``predict``, and the doors to checkpoints and backups.
``Trainer`` composes a few objects, each with its own state, as Keras 3's trainer does: ``CompileLoss``
(``compile_loss.py``: the loss per output and an element-level loss's reduction), ``CompileMetrics``
(``compile_metrics.py``: the loss trackers and metrics), ``InputChecks`` (``input_checks.py``: the checks on the
first batch), ``TrainingState`` (``training_state.py``: where training stands and what checkpoints and backups
keep), and per fit a ``FitLoop`` (``fit_loop.py``: the epochs, steps, validation and preemption, under a
``FitPlan``), which reads the data through an ``inputs.Cursor``. ``arguments.py`` checks the plain arguments and
``model_io.py`` reads the model's outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.data import is_array_nest
from replicafit.lifeline import tell_launcher
from replicafit.strategies import context, nest
from replicafit.strategies.devices import torch_device

from . import callbacks as callbacks_module
from . import losses
from .arguments import AUTOCAST, EVALUATE_ARGUMENTS, FIT_ARGUMENTS, check_arguments, check_precision
from .compile_loss import CompileLoss
from .compile_metrics import CompileMetrics
from .fit_loop import FitLoop, FitPlan, fit_callbacks, unwatch_preemption, watch_preemption
from .input_checks import InputChecks, checked_validation, first_look, in_memory_labels
from .inputs import Cursor, as_dtype, batch_source, rows, split_off_validation, unpack
from .model_io import (
    ModelIO,
    call_model,
    inputs_with_labels,
    metric_targets,
    model_loss,
    prediction_of,
    real_items,
)
from .preemption import PreemptedInValidation
from .training_state import TrainingState

__all__ = ["Trainer"]


class Trainer:
    """Trains, evaluates and runs a torch ``nn.Module`` under a strategy, Keras-style.

    Args:
      strategy: any strategy; ``None`` uses the current one (the default strategy
        outside any scope).
      optimizer: a name (``"adam"``), a config dict or a ``replicafit.optimizers.Optimizer``.
      loss: a name, a callable ``(y_true, y_pred) -> per-example loss`` (or ``ElementLosses``), a
        torch loss module, or (multi-output models) a dict/list of them. ``None``: the loss the model
        returns (a Hugging Face model's ``output.loss``), the labels going into its input dict under
        ``"labels"``; exact where that loss is a mean per example, or where ``forward`` takes
        ``num_items_in_batch`` (Hugging Face's loss kwargs): it gets a constant, its loss is then a
        sum, and the optimizer divides by the global count of real labels after the reduction.
      metrics: names (``"accuracy"`` is resolved from the shapes of the first batch's labels and
        predictions, per output) or ``metrics.Metric`` objects.
      seed: makes shuffling, dropout and the rest of the run reproducible; ``None``
        draws a fresh seed per ``fit``.
      precision: ``"32"`` (float32 throughout), ``"bf16-mixed"`` (each replica's forward
        pass and loss under ``torch.autocast`` to bfloat16 on its device; variables,
        gradients and updates stay float32) or ``"16-mixed"`` (float16 autocast, and the
        optimizer wrapped in an ``optimizers.LossScaleOptimizer`` unless it is one: the
        loss is scaled before backward, the gradients unscaled after the reduction, and a
        step with overflowing gradients is skipped on every replica). Lightning's names;
        ``fit``, ``evaluate`` and ``predict`` all use it (``predict`` returns floating
        outputs as float32). A custom ``train_step`` differentiates
        ``self.optimizer.scale_loss(loss)``.
      input_options: the ``data.InputOptions`` that ``fit``, ``evaluate`` and ``predict`` distribute
        their data with (``None``: the defaults). Its ``auto_shard_policy`` says what each worker
        reads under ``MultiWorkerMirroredStrategy``: by default only its replicas' rows where they
        can be addressed (``data.AutoShardPolicy``).

    Example::

        trainer = Trainer(strategy, input_options=data.InputOptions(auto_shard_policy="FILE"))

    Override ``train_step``, ``test_step`` or ``predict_step`` (each runs per replica on
    that replica's slice) for custom logic.
    """

    def __init__(
        self,
        strategy=None,
        optimizer="adam",
        loss="cross_entropy",
        metrics=("accuracy",),
        seed=None,
        precision="32",
        *,
        input_options=None,
    ):
        self.strategy = strategy or ds.get_strategy()
        self.input_options = input_options
        self.precision = check_precision(precision)
        self._autocast_dtype = AUTOCAST[self.precision]
        with context.enter_or_assert_strategy(self.strategy):
            self.optimizer = optimizers.get(optimizer)
            if self.precision == "16-mixed" and not isinstance(self.optimizer, optimizers.LossScaleOptimizer):
                self.optimizer = optimizers.LossScaleOptimizer(self.optimizer)
        self.seed = seed
        self.stop_training = False
        self.history = None
        self._module = None
        self._distributed = None
        self._float_dtype = torch.get_default_dtype()  # the model's: floating inputs are cast to it
        self._trainable = None  # the trainable variables of the model a fit trains
        self._global_batch = 1
        self._compile_metrics = CompileMetrics(metrics, self.strategy)
        self._compile_loss = CompileLoss(loss, self.strategy, self._compile_metrics)
        self._stand_in = None  # a row an empty replica of a sharded model runs on (InputChecks' FirstBatch)
        self._predict_row = None  # the same for predict: the chief's first row
        self._model_io = ModelIO()  # how the model's outputs are read: decided on a fit's first batch
        self._input_checks = InputChecks(self.strategy, self._compile_loss, self._compile_metrics, self._model_io)
        self._training_state = TrainingState(self, self._compile_metrics, self._compile_loss)

    @property
    def loss(self):
        """The ``loss`` argument as the built-in steps compute it (a ``losses.Loss``, or a dict or list of them for a
        model with several outputs), or None (the loss the model returns).

        Example::

            Trainer(loss="cross_entropy").loss  # a losses.SparseCategoricalCrossentropy(from_logits=True)
        """
        return self._compile_loss.loss

    # --- the model ----------------------------------------------------------------------
    def _distribute(self, model: torch.nn.Module):
        """The distributed model (made once per model; replicas re-synced from the user's module)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"The model must be a torch.nn.Module, got {type(model).__name__}.")
        if self._module is not model or self._distributed is None:
            self._module = model
            self._distributed = self.strategy.distribute_module(model, precision=self.precision)
            self._float_dtype = next(
                (p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype()
            )
        else:
            self._distributed.load_state_dict(model.state_dict())
        self.model = self._distributed
        return self._distributed

    def model_state_dict(self) -> dict:
        """The model's aggregated, strategy-independent state."""
        return self._distributed.state_dict() if self._distributed is not None else self._module.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Loads ``state`` (a ``model_state_dict()``: strategy-independent) into every replica of the model the
        trainer last ran (``fit``, ``evaluate``, ``predict``), the user's module included. The keys must match
        (torch's strict loading). ``EarlyStopping(restore_best_weights=True)`` restores with it."""
        if self._distributed is not None:
            self._distributed.load_state_dict(state)
        else:
            self._module.load_state_dict(state)

    # --- the loss -----------------------------------------------------------------------------------
    def compute_loss(self, y, y_pred, sample_weight=None) -> torch.Tensor:
        """Per-example loss (summed over outputs), times ``sample_weight``; also tracked per output.

        An element-level loss gives each example's own mean over its real elements here; the built-in
        steps reduce it over the whole global batch instead (``losses.Loss.terms``). Override it for a
        per-example loss of one's own: the built-in steps then sum it and divide by the global batch size.
        """
        if self._compile_loss.loss is None:
            raise ValueError(
                "Trainer(loss=None) trains on the loss the model returns: compute_loss() has no loss of its own to "
                "compute. Pass a loss to the Trainer, or read the model's output['loss']."
            )
        return self._compile_loss.terms(y, y_pred, sample_weight, per_example=True).per_example

    def _loss_terms(self, y, y_pred, sample_weight=None, per_example: bool = False) -> losses.LossTerms:
        """This replica's ``LossTerms`` of the loss; an overridden ``compute_loss`` gives per-example losses."""
        if self._is_builtin("compute_loss"):
            return self._compile_loss.terms(y, y_pred, sample_weight, per_example)
        values = self.compute_loss(y, y_pred, sample_weight)  # one's own: per-example losses, summed in float32
        values = values.float() if values.dtype in (torch.float16, torch.bfloat16) else values
        return losses.LossTerms(values.sum(), values.shape[0] if values.dim() else 1, values)

    # --- per-replica steps ---------------------------------------------------------------------
    def train_step(self, data) -> None:
        """One replica's training step on its slice ``data`` (override for custom logic).

        A per-example loss: the sum of this replica's per-example losses divided by the step's global
        batch size (``self.global_batch_size``). An element-level loss (``losses`` module docstring): the
        sum of its element losses, divided by a constant of the fit before backward (which keeps float16
        gradients in the mean's range), and its real elements' weight added to the step
        (``cluster.add_to_step``); the optimizer divides the reduced gradients by the global total,
        which rides with their reduction. The optimizer sums the replicas' gradients.
        """
        x, y, sample_weight = self._model_floats(*unpack(data))
        variables = self._trainable
        compiled_loss = self._compile_loss
        denominator = compiled_loss.element_denominator
        # An empty replica: no forward pass, zero gradients (and no real element); with SyncBatchNorm layers or
        # sharded parameters it takes part in their collectives, forward and backward, with its zero rows.
        empty = rows(x) == 0
        if empty and not self.model.forward_is_collective:
            if denominator is not None:  # every worker carries the same step values, of one kind
                compiled_loss.add_no_elements()
            grads = [torch.zeros_like(v.value()) for v in variables]
            self.optimizer.apply_gradients(zip(grads, variables))
            return
        if empty and self._stand_in is not None:  # sharded parameters: a stand-in row, weight 0 (exact zeros)
            x, y, sample_weight = self._model_floats(*unpack(self._stand_in))
            with compiled_loss.untracked():  # (nor counted in the per-output losses)
                _, terms = self._forward(x, y, sample_weight, per_example=denominator is None)
            if denominator is not None:
                compiled_loss.add_no_elements()
            loss = self.optimizer.scale_loss(terms.total * 0.0)
            self.optimizer.apply_gradients(zip(self.strategy.extended.gradients(loss, variables), variables))
            return
        # Reduced per example where fit decided so (a loss per example, several outputs, or a train_step of
        # one's own that calls this one: fit cannot know it adds the step value).
        y_pred, terms = self._forward(x, y, sample_weight, per_example=denominator is None)
        loss = self.optimizer.scale_loss(compiled_loss.step_loss(terms, self._global_batch))
        grads = self.strategy.extended.gradients(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        if not empty:
            self._compile_metrics.update_state(*metric_targets(self.model, x, y, y_pred), sample_weight, terms)

    def test_step(self, data) -> None:
        """One replica's evaluation step: losses and metrics of its slice."""
        x, y, sample_weight = self._model_floats(*unpack(data))
        if rows(x) == 0:
            if self._stand_in is None or not self.model.gathers_parameters:
                return
            # Sharded parameters: the replica takes part in gathering them, on a stand-in row counted nowhere.
            x, y, sample_weight = self._model_floats(*unpack(self._stand_in))
            with torch.no_grad(), self._compile_loss.untracked():
                self._forward(x, y, sample_weight)
            return
        with torch.no_grad():
            y_pred, terms = self._forward(x, y, sample_weight)
        self._compile_metrics.update_state(*metric_targets(self.model, x, y, y_pred), sample_weight, terms)

    def predict_step(self, data):
        """One replica's prediction: the model's output on its slice."""
        x, _, _ = self._model_floats(*unpack(data))
        stand_in = rows(x) == 0 and self._predict_row is not None and self.model.gathers_parameters
        if stand_in:  # sharded parameters: gathered on a stand-in row, no output
            return nest.map_structure(lambda t: t[:0], self._predict(self._predict_row))
        return self._predict(x)

    def _first_row(self, batch):
        """The chief's first row of a distributed batch's inputs, on every worker (a replica without rows runs the
        model on it where the forward pass is a collective: its parameters are gathered by every worker)."""
        cluster = self.strategy.cluster
        local = nest.map_structure(lambda v: self.strategy.experimental_local_results(v)[0], batch)
        x = unpack(local)[0]
        row = nest.map_structure(lambda t: t[:1], x) if cluster.is_chief else None
        row = cluster.broadcast(row, "broadcasting the chief's first row")
        return self._model_floats(row, None, None)[0]

    def _predict(self, x):
        loss = self._compile_loss.loss
        with torch.no_grad():
            if self._autocast_dtype is None:
                return prediction_of(call_model(self.model, x), loss)
            with torch.autocast(_device_type(x), dtype=self._autocast_dtype):
                y_pred = prediction_of(call_model(self.model, x), loss)
        return nest.map_structure(_as_float32, y_pred)

    def _model_floats(self, x, y, sample_weight) -> tuple:
        """Floating inputs, targets and weights in the model's float type, as Keras casts NumPy's float64
        to its float type (integer labels stay as they are). The built-in steps call it; a custom step
        of one's own may too."""
        dtype = self._float_dtype
        return as_dtype(x, dtype), as_dtype(y, dtype), as_dtype(sample_weight, dtype)

    def _forward(self, x, y, sample_weight, per_example: bool = False):
        """The model's output and the loss terms (summed in float32, or wider) of a replica's slice, under the
        trainer's precision; ``per_example``: every loss reduced per example."""
        if self._autocast_dtype is None:
            return self._output_and_terms(x, y, sample_weight, per_example)
        with torch.autocast(_device_type(x), dtype=self._autocast_dtype):
            y_pred, terms = self._output_and_terms(x, y, sample_weight, per_example)
        if terms.per_example is not None and terms.per_example.dtype in (torch.float16, torch.bfloat16):
            terms = terms._replace(per_example=terms.per_example.float())
        return y_pred, terms

    def _output_and_terms(self, x, y, sample_weight, per_example: bool = False):
        """The model's prediction (its logits, for a ``ModelOutput``) and the loss terms: of the trainer's loss,
        or (``loss=None``) of the loss the model returns, the labels being in its inputs."""
        compiled_loss = self._compile_loss
        if compiled_loss.loss is not None:
            y_pred = self._model_io.prediction(call_model(self.model, x), compiled_loss.loss, y)
            return y_pred, self._loss_terms(y, y_pred, sample_weight, per_example)
        if sample_weight is not None:
            raise ValueError(
                "Trainer(loss=None) trains on the loss the model returns, which sample weights cannot reach: batches "
                "of (x, y, sample_weight) need a loss of the Trainer's (pass loss=...), or drop the weights."
            )
        inputs = inputs_with_labels(self.model, x, y)
        counted = compiled_loss.counts_items and not per_example and isinstance(inputs, Mapping) and "labels" in inputs
        if counted:  # a Hugging Face model divides its loss's sum by num_items_in_batch: our prescale
            denominator = compiled_loss.element_denominator
            prescale = 1.0 if denominator is None else denominator.prescale
            inputs = {**inputs, "num_items_in_batch": prescale}
        output = call_model(self.model, inputs)
        y_pred = self._model_io.prediction(output, None, y)
        loss = model_loss(output).float()
        if counted:  # the sum over this replica's real labels, over the prescale
            return y_pred, losses.LossTerms(loss * prescale, real_items(self.model, inputs))
        # A mean over this replica's rows: weighted by them, it is exact where that mean is per example.
        count = rows(x)
        return y_pred, losses.LossTerms(loss * count, count, loss.detach().expand(count))

    @property
    def global_batch_size(self) -> int:
        """The number of examples in the current step, over all replicas."""
        return self._global_batch

    def _run_train_step(self, batch, plan: FitPlan) -> None:
        """``train_step`` on every replica's slice of ``batch``, under the fit's ``plan`` (the fit loop's
        ``train_function``); the step's global batch size is known from here on."""
        rows_here = sum(t.shape[0] for t in self.strategy.experimental_local_results(nest.flatten(batch)[0]))
        cluster = self.strategy.cluster
        if cluster.num_workers > 1:  # every worker's rows: the data layer knows them
            known = getattr(self._training_state.cursor, "global_batch_size", None)
            rows_here = known or cluster.sum(rows_here, "reduce (the global row count)")
        self._global_batch = max(1, rows_here)
        if plan.accumulating:  # a window's steps weigh their examples: it equals one step on them all
            # (an element-level loss: every step alike, each replica's loss divided by the same constant)
            weight = 1.0 if self._compile_loss.element_denominator is not None else float(self._global_batch)
            self.optimizer.step_weight = weight
        with plan.overlap(self._trainable) if plan.overlap is not None else contextlib.nullcontext():
            self.strategy.run(self.train_step, args=(batch,))

    def _distribute_data(self, source):
        """``source`` split across the replicas, with this trainer's ``input_options``."""
        return self.strategy.experimental_distribute_dataset(source, self.input_options)

    def _is_builtin(self, *methods: str) -> bool:
        """Whether these methods are ``Trainer``'s own, not a subclass's overrides."""
        return all(getattr(type(self), name) is getattr(Trainer, name) for name in methods)

    def _check_first_batch(self, first, dm, caller: str, all_labels=None) -> None:
        """The entry checks on the first batch (``InputChecks``), then the loss trackers and metrics built from
        what it tells (the model's outputs, the shapes that resolve ``"accuracy"``)."""
        step = "test_step" if caller.startswith("evaluate") else "train_step"
        builtin = self._is_builtin(step, "compute_loss")  # only then must batches meet the loss
        found = self._input_checks.check_first_batch(
            first, dm, caller, all_labels, float_dtype=self._float_dtype, builtin_step=builtin
        )
        self._compile_loss.counts_items = found.counts_items
        self._stand_in = found.stand_in
        self._compile_metrics.build(found.structure, found.labels, found.outputs, self._compile_loss.loss_for)

    # --- fit -----------------------------------------------------------------------------------------
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

        A Hugging Face ``datasets.Dataset`` (any format) is a dataset of dict rows like a torch one
        (``batch_size``, shuffled, sharded by rows; each column stacked by ``data.collate_rows``); a
        ``datasets.IterableDataset`` (a stream) takes ``batch_size`` and is never shuffled here (each
        worker reads its shard). Rows of different lengths need a padding collator:
        ``fit(model, data.CollatedDataset(dataset, collator), batch_size=8)``. A dict row goes to
        ``forward`` whole, its ``labels`` included (``Trainer(loss=None)``: the model's own loss).

        Floating inputs, targets and sample weights of another float type (NumPy's float64) are
        cast to the model's float type, as Keras casts them to its own (integer labels are kept).

        The parameters trained, and given optimizer state, are those that require gradients when the
        trainer first runs the model (a LoRA model: its adapters alone). A later fit of that model after
        ``requires_grad`` changed raises ``ValueError``: make a new ``Trainer`` (as Keras compiles again
        after a change of ``trainable``), e.g. ``Trainer(optimizer=optimizers.Adam(1e-5), loss=None)``.

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
        loop = self._begin_fit(
            model,
            dataset,
            callbacks,
            epochs=epochs,
            batch_size=batch_size,
            validation_data=validation_data,
            validation_split=validation_split,
            steps_per_epoch=steps_per_epoch,
            initial_epoch=initial_epoch,
            shuffle=shuffle,
            verbose=verbose,
        )
        logs: dict = {}
        if loop.plan.rescuer is not None:  # (replicafit's launcher then lets this worker notice a peer's failure)
            tell_launcher("watching")
        try:
            try:
                for epoch in range(loop.first_epoch, epochs):
                    logs = loop.run_epoch(epoch)
                    if self.stop_training:
                        break
            except ds.WorkerFailedError as error:  # a survivor writes the backup of the last step every worker finished
                loop.after_peer_failure(error)
            finally:
                loop.close()  # before on_train_end: its callbacks may save, or train on in a loop of their own
            try:
                loop.finish(logs)
            except ds.WorkerFailedError as error:  # (the run is trained: the backup written says so)
                loop.after_peer_failure(error)
        finally:
            if loop.plan.rescuer is not None:
                tell_launcher("done")
            unwatch_preemption(loop.plan.preemption)
        return self.history

    def _begin_fit(
        self,
        model,
        dataset,
        callbacks,
        *,
        epochs,
        batch_size,
        validation_data,
        validation_split,
        steps_per_epoch,
        initial_epoch,
        shuffle,
        verbose,
    ) -> FitLoop:
        """Everything before a fit's first epoch, ``fit``'s arguments checked: the seeds (alike on every worker),
        the data, the preemption watch, the first batch read and checked, the model, the callbacks and their
        ``on_train_begin`` (a backup may be restored there), the plan; the ``FitLoop`` of its epochs. What it
        opened is closed if it raises."""
        state = self._training_state
        state.seed_fit(self.seed)
        train_data, split_validation = split_off_validation(dataset, validation_split)
        validation_data = validation_data if validation_data is not None else split_validation
        source = batch_source(train_data, batch_size, shuffle, state.data_seed)
        if validation_data is not None:
            validation_data = checked_validation(validation_data, batch_size)
        distributed = self._distribute_data(source)
        repeat = steps_per_epoch is not None
        # Before the first batch is read: a DataLoader's worker processes forked from now on inherit the handler.
        watch = watch_preemption(callbacks, self.strategy.cluster)
        state.cursor = cursor = Cursor(source, distributed, repeat=repeat)
        try:
            # The first step of the first epoch, read once: the entry checks look at it, the first step trains on it.
            first = first_look(cursor, 0 if repeat else initial_epoch, "training data", "fit()")
            dm = self._distribute(model)
            _check_trainable_unchanged(dm)
            dm.train()
            self._trainable = dm.trainable_variables
            steps = steps_per_epoch if steps_per_epoch is not None else distributed.steps
            history, callback_list = fit_callbacks(callbacks, self, model, epochs, steps, verbose)
            self.history, self.stop_training = history, False
            self._check_first_batch(first, dm, "fit()", in_memory_labels(train_data))
            resume = state.begin_training(callback_list)  # where a backup restored in on_train_begin left off
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
            unwatch_preemption(watch)
            raise
        return FitLoop(
            self,
            model=dm,
            plan=plan,
            cursor=cursor,
            callbacks=callback_list,
            resume=resume,
            initial_epoch=initial_epoch,
            training_state=state,
            compiled_metrics=self._compile_metrics,
            compiled_loss=self._compile_loss,
            train_function=self._run_train_step,
            validate=self._validate,
        )

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
        accumulating = bool(self.optimizer.gradient_accumulation_steps)
        builtin_step = self._is_builtin("train_step")
        overlap = self.strategy.extended.gradient_step if builtin_step and not accumulating else None
        # A strategy that defers updates (sharded optimizer states gather a step's updated values while the loop
        # moves on) settles them before the batch hooks of callbacks that might read the variables.
        defers = self.strategy.extended.capabilities.defers_updates
        settle = defers and callbacks_module.may_touch_variables_between_steps(callback_list)
        # Across workers, the BackupAndRestore that writes the backup of the last finished step when a worker fails.
        rescuers = [cb for cb in callback_list if getattr(cb, "save_on_peer_failure", False)]
        rescuer = rescuers[0] if rescuers and cluster.num_workers > 1 else None
        return FitPlan(
            steps=steps,
            validation_data=validation_data,
            batch_size=batch_size,
            batch_logs=batch_logs,
            agree_logs=agree_logs,
            agree_each_step=agree_each_step,
            accumulating=accumulating,
            overlap=overlap,
            preemption=watch,
            settle_each_step=settle,
            rescuer=rescuer,
        )

    # --- evaluate / predict ----------------------------------------------------------------------
    def evaluate(
        self,
        model,
        dataset,
        batch_size=None,
        steps=None,
        callbacks=None,
        verbose="auto",
        return_dict: bool = False,
    ):
        """Loss and metrics of ``model`` on ``dataset``, each example counted exactly once.

        Returns ``{"loss": ..., metric: ...}`` with ``return_dict``, else a list in that
        order (a float when there are no metrics). Data with no batch raises ``ValueError``.
        """
        check_arguments("evaluate", EVALUATE_ARGUMENTS, batch_size=batch_size, steps=steps)
        source = batch_source(dataset, batch_size, False, None)
        cursor = Cursor(source, self._distribute_data(source), repeat=False)
        try:
            first = first_look(cursor, 0, "evaluation data", "evaluate()")  # read once: evaluated too
            dm = self._distribute(model)
            self._check_first_batch(first, dm, "evaluate()", in_memory_labels(dataset))
        except BaseException:
            cursor.close()
            raise
        was_training = dm.training
        dm.eval()
        callback_list = callbacks_module.CallbackList(
            list(callbacks or []), trainer=self, model=model, params={"steps": steps, "verbose": verbose}
        )
        logs = self._test_loop(dm, was_training, cursor, steps, callback_list)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _validate(self, validation_data, batch_size, callback_list, preemption=None) -> dict:
        """The validation logs of an epoch of ``fit`` (its callbacks get the test hooks). ``fit`` checked its
        validation data once, before training, and built the metrics; validation must not disturb the
        training accumulators, so they are put back afterwards."""
        source = batch_source(validation_data, batch_size, False, None)
        saved = self._compile_metrics.put_aside()
        dm = self._distributed
        was_training = dm.training
        dm.eval()
        cursor = Cursor(source, self._distribute_data(source), repeat=False)
        return self._test_loop(dm, was_training, cursor, None, callback_list, saved, preemption)

    def _test_loop(self, dm, was_training: bool, cursor, steps, callback_list, saved=None, preemption=None) -> dict:
        """``test_step`` over the batches of ``cursor`` (a ``Cursor``, from its first pass's start unless it
        has read ahead there; ``steps`` batches at most) with the test hooks, ``dm`` in eval mode
        (``was_training`` is put back); the logs. ``saved`` metric states, if any, are loaded back before
        ``on_test_end``. The cursor is closed at the end. ``preemption`` (fit's validation under
        ``save_before_preemption``): after each step, every worker stops when they agree on a preemption
        (``PreemptedInValidation``)."""
        callback_list.call("on_test_begin", {})
        try:
            self._compile_metrics.reset_state()
            cursor.start(0, 0)
            if preemption is not None:
                preemption.begin_validation()
            index = 0
            while steps is None or index < steps:
                try:
                    batch = cursor.next()
                except StopIteration:
                    break
                callback_list.call("on_test_batch_begin", index, {})
                self.strategy.run(self.test_step, args=(batch,))
                callback_list.call("on_test_batch_end", index, {})
                index += 1
                if preemption is not None and preemption.in_validation():
                    raise PreemptedInValidation()
            if preemption is not None:
                preemption.end_validation()
            logs = self._compile_metrics.result()
        finally:
            cursor.close()
            dm.train(was_training)
            if saved is not None:
                self._compile_metrics.put_back(saved)
        callback_list.call("on_test_end", logs)
        return logs

    def predict(self, model, dataset, batch_size=None, steps=None, verbose="auto"):
        """The model's outputs for every example of ``dataset``, in input order, concatenated
        across replicas and batches (the partial batch included); nests keep their shape. A
        ``ModelOutput`` (or a dict with ``logits``) gives its logits (``model_io.prediction_of``).

        Across workers each worker predicts its replicas' rows (it reads only those where they can be
        addressed) and every worker returns every row, as Accelerate's ``gather_for_metrics`` does: the
        same program runs on every worker, so any of them may go on with the predictions. Global batches
        (sharded by rows, or read whole) come back in input order; per-worker inputs (``FILE``, ``OFF``)
        step by step in worker order, with what their samplers repeat (a ``DistributedSampler`` pads).
        The outputs are tensors on the first replica's device (a GPU's stay there: ``.cpu()`` before ``.numpy()``;
        Keras returns NumPy arrays)."""
        inputs = dataset
        if is_array_nest(dataset):  # arrays: x alone, or a tuple whose first part is x
            inputs = dataset if isinstance(dataset, tuple) else (dataset,)
        check_arguments("predict", EVALUATE_ARGUMENTS, batch_size=batch_size, steps=steps)
        source = batch_source(inputs, batch_size, False, None)
        dm = self._distribute(model)
        was_training = dm.training
        dm.eval()
        outputs = []
        self._predict_row = None
        try:
            for index, batch in enumerate(self._distribute_data(source)):
                if steps is not None and index >= steps:
                    break
                if index == 0 and dm.gathers_parameters:
                    self._predict_row = self._first_row(batch)
                result = self.strategy.run(self.predict_step, args=(batch,))
                local = self.strategy.experimental_local_results(result)
                if self.strategy.cluster.num_workers > 1:  # every worker's rows, in input order
                    nest.map_structure(lambda *parts: _same_beyond_first(parts), *local)  # (said here, not in gather)
                    try:
                        outputs.append(self.strategy.gather(result, axis=0))
                    except ValueError as error:
                        raise ValueError(f"{_RAGGED_PREDICTIONS} ({error})") from error
                else:
                    outputs.extend(local)
        finally:
            dm.train(was_training)
        if not outputs:
            raise ValueError("predict() got no data.")
        device = torch_device(self.strategy.extended.worker_devices[0])  # (where strategy.gather puts them too)
        return nest.map_structure(lambda *parts: _concatenated(parts, device), *outputs)

    # --- checkpoints and backups: the training state (training_state.py) -------------------------------
    def write_on_chief(self, what: str, write, default=None):
        """``write()`` on the chief only (the one worker that writes files), then every worker waits
        for it, so none races ahead of a file being written. Returns ``write()``'s result (``default``
        elsewhere). ``what`` names the barrier (in the error when a worker never arrives). Every
        worker calls it, in the same order (the barrier is a collective); in one process it is ``write()``.

        Example::

            state = trainer.model_state_dict()  # every worker takes part in the read
            trainer.write_on_chief("my weights", lambda: checkpoint.save(state, "weights.pt"))
        """
        return self._training_state.write_on_chief(what, write, default)

    def save_checkpoint(self, path, *, sharded: bool = False) -> str:
        """Writes model, optimizer (slots, iterations), epoch/step, RNG state and the state of callbacks that
        keep one (``TorchLRScheduler``), atomically; returns the path. Every worker calls it.

        One file, strategy-independent, that loads with ``torch.load(path, weights_only=True)``: under a
        strategy that shards parameters (``FullyShardedStrategy``) each sharded tensor is gathered whole onto
        the chief alone, one at a time (the consolidated export: the chief holds one whole copy of the state,
        no other worker more than one tensor). ``sharded=True``: a sharded checkpoint directory instead
        (``trainer.sharded_checkpoint``: every worker writes its shards, nothing is gathered), which
        ``load_checkpoint`` reads on any number of workers and in one process.

        Example::

            trainer.save_checkpoint("model.pt")                     # one file
            trainer.save_checkpoint("ckpt", sharded=True)           # a directory, every worker its shards
        """
        return self._training_state.save_checkpoint(path, sharded)

    def write_checkpoint(self, state: dict, path, *, sharded: bool = False) -> str:
        """Writes a state that ``training_state`` (or a callback of one's own) built: one file from the chief
        (sharded tensors gathered one at a time), or with ``sharded=True`` a sharded checkpoint directory (every
        worker its shards). Every worker calls it, in the same order; it replaces what was at ``path``.

        Example::

            state = trainer.training_state(epoch + 1, 0)
            trainer.write_checkpoint(state, "runs/backup", sharded=True)
        """
        return self._training_state.write(state, path, sharded, "write_checkpoint")

    def read_checkpoint(self, path, kind: str = "checkpoint") -> dict:
        """Reads a checkpoint file or a sharded checkpoint directory and checks it for ``kind`` (``"checkpoint"``,
        ``"backup"``, ``"weights"``); a sharded directory is read into the model's layout (each worker its shards
        under a strategy that shards parameters, else whole tensors). Every worker calls it. A missing or damaged
        checkpoint raises ``CheckpointError``.

        Example::

            state = trainer.read_checkpoint("runs/backup", kind="backup")
        """
        return self._training_state.read(path, kind, self._distributed)

    def load_checkpoint(self, path, model=None) -> dict:
        """Restores a ``save_checkpoint`` file or a sharded checkpoint directory into ``model`` (or the model last
        used) and the optimizer, under any strategy and number of workers, whatever wrote it.

        All or nothing: a file that is missing, damaged or lacks an entry (or holds one of
        the wrong type) raises ``CheckpointError`` saying which; a model state that does not
        fit the model raises torch's ``RuntimeError``/``ValueError``; an optimizer state that
        does not fit the optimizer raises ``CheckpointError`` naming the variable and slot.
        In every case the model and optimizer are left as they were.
        """
        if model is not None:
            self._distribute(model)
        state = self._training_state.read(path, "checkpoint", self._distributed)
        if self._distributed is None:
            raise ValueError("load_checkpoint() needs the model: pass model=... (or fit/evaluate it first).")
        self._training_state.restore_checkpoint(state, path, self._distributed)
        return state

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
        return self._training_state.backup(epoch, step, epoch_logs, model=self._distributed)

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
        self._training_state.restore_backup(state, path, model=self._distributed)


def _check_trainable_unchanged(dm) -> None:
    """Refuses a fit of a model whose parameters' ``requires_grad`` changed since this trainer distributed it.

    The distributed variables, and the optimizer's slots, are those of the parameters that required gradients
    then (Keras: a change of ``trainable`` takes effect at the next ``compile()``); trained as they are, a newly
    frozen parameter would fail inside backward and a newly unfrozen one would silently stay as it is."""
    variables = dm.named_variables()
    changed = [
        (name, parameter.requires_grad)
        for name, parameter in dm.module.named_parameters()
        if name in variables and variables[name].trainable != parameter.requires_grad
    ]
    if changed:
        frozen = [name for name, requires in changed if not requires]
        unfrozen = [name for name, requires in changed if requires]
        what = "; ".join(
            text
            for text in (
                f"{frozen} no longer require gradients" if frozen else "",
                f"{unfrozen} now require gradients" if unfrozen else "",
            )
            if text
        )
        raise ValueError(
            f"The model's parameters {what}, since this Trainer first ran the model: it trains the parameters that "
            "required gradients then, with optimizer state for those (as Keras applies a change of trainable at the "
            "next compile()). Make a new Trainer (with a new optimizer) to train the new set, or set requires_grad "
            "back."
        )


_RAGGED_PREDICTIONS = (
    "predict() cannot put the batches' outputs together: they differ beyond the first axis, as a padding collator "
    "makes them (each batch, and each replica's and worker's rows, padded to its own longest row). Pad every batch "
    "to one length (transformers' DataCollatorWithPadding(tokenizer, padding='max_length', max_length=N), or "
    "pad_to_multiple_of with rows no longer than it), or predict batch by batch"
)


def _same_beyond_first(parts) -> None:
    """A clear error where the parts of ``predict``'s outputs differ beyond the first axis."""
    shapes = [tuple(part.shape) for part in parts]
    if len({shape[1:] for shape in shapes}) > 1:
        raise ValueError(f"{_RAGGED_PREDICTIONS}: shapes {', '.join(map(str, dict.fromkeys(shapes)))}.")


def _concatenated(parts, device: torch.device) -> torch.Tensor:
    """The parts of ``predict``'s outputs concatenated along the first axis, on ``device`` (the first replica's:
    replicas on several devices give parts on each)."""
    _same_beyond_first(parts)
    return torch.cat([part.detach().to(device) for part in parts])


def _device_type(x) -> str:
    """The device type (``"cpu"``, ``"cuda"``) of a replica's inputs: where its autocast applies."""
    leaves = nest.flatten(x)
    return leaves[0].device.type if leaves and isinstance(leaves[0], torch.Tensor) else "cpu"


def _as_float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value
