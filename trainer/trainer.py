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

This file holds the public ``Trainer`` and its steps: the model, losses and metrics, the
per-replica ``train_step``/``test_step``/``predict_step``, ``evaluate`` and ``predict``. Its other
parts have files of their own: the fit loop (``fit_loop.py``), the training state that checkpoints
and backups keep (``training_state.py``), the checks at the entry (``arguments.py`` for the plain
arguments, ``input_checks.py`` for the data) and the data as the trainer reads it (``inputs.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies import context, nest

from . import callbacks as callbacks_module
from . import losses
from .arguments import AUTOCAST, EVALUATE_ARGUMENTS, check_arguments, check_precision
from .compile_loss import CompileLoss
from .compile_metrics import CompileMetrics
from .fit_loop import FitLoop
from .input_checks import InputChecks, in_memory_labels
from .inputs import Cursor, as_dtype, batch_source, batchable, rows, unpack
from .model_io import ModelIO, call_model, inputs_with_labels, model_loss, prediction_of, real_items
from .preemption import PreemptedInValidation
from .training_state import TrainingState

__all__ = ["Trainer"]


class Trainer(FitLoop, TrainingState, InputChecks):
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
        self._global_batch = 1
        self._compile_metrics = CompileMetrics(metrics, self.strategy)
        self._compile_loss = CompileLoss(loss, self.strategy, self._compile_metrics)
        self._model_io = ModelIO()  # how the model's outputs are read: decided on a fit's first batch
        self._epoch = 0
        self._step = 0
        self._data_seed = seed
        self._resume = None
        self._cursor = None
        self._callback_list = None  # the running (or last) fit's callbacks
        self._float_dtype = torch.get_default_dtype()  # the model's: floating inputs are cast to it
        self._loaded_callback_states = None  # callback states of a checkpoint loaded before a fit
        self._replica_rng_loaded = False  # a checkpoint loaded before a fit gave the replicas' streams

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
            self._distributed = self.strategy.distribute_module(model)
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
        # An empty replica: no forward pass, zero gradients (and no real element); with SyncBatchNorm layers
        # it takes part in their collectives, forward and backward, with its zero rows.
        empty = rows(x) == 0
        if empty and not self.model.synchronizes_batchnorm:
            if denominator is not None:  # every worker carries the same step values, of one kind
                compiled_loss.add_no_elements()
            grads = [torch.zeros_like(v.value()) for v in variables]
            self.optimizer.apply_gradients(zip(grads, variables))
            return
        # Reduced per example where fit decided so (a loss per example, several outputs, or a train_step of
        # one's own that calls this one: fit cannot know it adds the step value).
        y_pred, terms = self._forward(x, y, sample_weight, per_example=denominator is None)
        loss = self.optimizer.scale_loss(compiled_loss.step_loss(terms, self._global_batch))
        grads = torch.autograd.grad(loss, [v.value() for v in variables], allow_unused=True)
        grads = [torch.zeros_like(v.value()) if g is None else g for g, v in zip(grads, variables)]
        self.optimizer.apply_gradients(zip(grads, variables))
        if not empty:
            self._compile_metrics.update_state(y, y_pred, sample_weight, terms)

    def test_step(self, data) -> None:
        """One replica's evaluation step: losses and metrics of its slice."""
        x, y, sample_weight = self._model_floats(*unpack(data))
        if rows(x) == 0:
            return
        with torch.no_grad():
            y_pred, terms = self._forward(x, y, sample_weight)
        self._compile_metrics.update_state(y, y_pred, sample_weight, terms)

    def predict_step(self, data):
        """One replica's prediction: the model's output on its slice."""
        x, _, _ = self._model_floats(*unpack(data))
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

    def _set_global_batch(self, batch) -> None:
        first = nest.flatten(batch)[0]
        rows = sum(t.shape[0] for t in self.strategy.experimental_local_results(first))
        cluster = self.strategy.cluster
        if cluster.num_workers > 1:  # every worker's rows: the data layer knows them
            known = getattr(self._cursor, "global_batch_size", None)
            rows = known or cluster.sum(rows, "reduce (the global row count)")
        self._global_batch = max(1, rows)

    def _distribute_data(self, source):
        """``source`` split across the replicas, with this trainer's ``input_options``."""
        return self.strategy.experimental_distribute_dataset(source, self.input_options)

    def _is_builtin(self, *methods: str) -> bool:
        """Whether these methods are ``Trainer``'s own, not a subclass's overrides."""
        return all(getattr(type(self), name) is getattr(Trainer, name) for name in methods)

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
            first = self._first_look(cursor, 0, "evaluation data", "evaluate()")  # read once: evaluated too
            dm = self._distribute(model)
            self._first_batch_structure(first, dm, "evaluate()", in_memory_labels(dataset))
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
        step by step in worker order, with what their samplers repeat (a ``DistributedSampler`` pads)."""
        inputs = dataset
        if batchable(dataset) and not isinstance(dataset, torch.utils.data.Dataset):
            inputs = dataset if isinstance(dataset, tuple) else (dataset,)
        check_arguments("predict", EVALUATE_ARGUMENTS, batch_size=batch_size, steps=steps)
        source = batch_source(inputs, batch_size, False, None)
        dm = self._distribute(model)
        was_training = dm.training
        dm.eval()
        outputs = []
        try:
            for index, batch in enumerate(self._distribute_data(source)):
                if steps is not None and index >= steps:
                    break
                result = self.strategy.run(self.predict_step, args=(batch,))
                if self.strategy.cluster.num_workers > 1:  # every worker's rows, in input order
                    outputs.append(self.strategy.gather(result, axis=0))
                else:
                    outputs.extend(self.strategy.experimental_local_results(result))
        finally:
            dm.train(was_training)
        if not outputs:
            raise ValueError("predict() got no data.")
        return nest.map_structure(lambda *parts: torch.cat([p.detach() for p in parts]), *outputs)


def _device_type(x) -> str:
    """The device type (``"cpu"``, ``"cuda"``) of a replica's inputs: where its autocast applies."""
    leaves = nest.flatten(x)
    return leaves[0].device.type if leaves and isinstance(leaves[0], torch.Tensor) else "cpu"


def _as_float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value
