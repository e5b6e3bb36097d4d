"""``Trainer``: Keras-style ``fit``/``evaluate``/``predict`` for a torch module under any strategy.

One ``strategy.run`` per step. Each replica computes its rows' per-example losses,
sums them and divides by the step's **global** batch size, and hands its gradients to
the optimizer, which sums them across replicas. So ``MirroredStrategy(n)`` takes the
same steps as one device on the same global batches, partial last batch included, and
an empty replica contributes nothing. Metrics accumulate per replica in ``SyncOnRead``
variables and are read, aggregated, when logs are needed.

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

Models that return a dict or tuple are multi-output models, as in Keras: ``loss`` may be
one loss (applied to every output) or a matching dict/list; the total loss is the sum;
logs add ``<output>_loss`` and ``<output>_<metric>`` per output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
from collections.abc import Mapping

import numpy as np
import torch

import replicafit.data as data_layer
import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies import context, nest
from replicafit.strategies.describe import describe_structure
from replicafit.strategies.variables import aggregated_reads

from . import callbacks as callbacks_module
from . import checkpoint, losses, metrics
from .arguments import AUTOCAST, EVALUATE_ARGUMENTS, FIT_ARGUMENTS, check_arguments, check_precision

__all__ = ["Trainer"]

_FORMAT = checkpoint.FORMAT  # the tag of checkpoints and backups (checked by checkpoint.load)
_NOTHING = object()


def _unpack(element):
    """``(x, y, sample_weight)`` of a batch: ``(x, y)``, ``(x, y, w)``, or ``x`` alone."""
    if isinstance(element, (tuple, list)) and not hasattr(element, "_fields"):
        if len(element) == 2:
            return element[0], element[1], None
        if len(element) == 3:
            return element[0], element[1], element[2]
        if len(element) == 1:
            return element[0], None, None
        raise ValueError(f"A batch must be x, (x, y) or (x, y, sample_weight); got a sequence of {len(element)}.")
    return element, None, None


def _rows(x) -> int:
    leaves = nest.flatten(x)
    return leaves[0].shape[0] if leaves else 0


class _Cursor:
    """Where the data stands: the pass over the source and the batches taken from it.

    Batched arrays/datasets (``iterate(pass, start)``) resume exactly; other sources
    skip the consumed batches of a fresh pass.
    """

    def __init__(self, source, distributed, repeat: bool):
        self.source, self.distributed, self.repeat = source, distributed, repeat
        self.pass_index, self.position = 0, 0
        self._iterator = None

    def start(self, pass_index: int, position: int = 0) -> None:
        if self._iterator is not None:
            self._iterator.close()
        self.pass_index, self.position = pass_index, position
        if hasattr(self.source, "iterate"):
            batches = self.source.iterate(pass_index, position)
        else:
            batches = iter(self.source)
            for _ in range(position):
                next(batches)
        total = _length(self.source)  # known: agreed once across workers rather than step by step
        self._iterator = self.distributed.iterate(batches, None if total is None else max(0, total - position))

    def next(self):
        try:
            batch = next(self._iterator)
        except StopIteration:
            if not self.repeat:
                raise
            self.start(self.pass_index + 1, 0)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ValueError(
                    f"The training data yielded no batch on pass {self.pass_index + 1} over it, so steps_per_epoch "
                    "cannot repeat it: a one-shot iterator (such as a generator) is used up after one pass. Pass a "
                    "re-iterable source (arrays, a Dataset, a DataLoader or a list of batches) or fewer steps."
                ) from None
        self.position += 1
        return batch

    @property
    def started(self) -> bool:
        """Whether a pass has been started (``start``)."""
        return self._iterator is not None

    @property
    def global_batch_size(self):
        """Rows of the last batch over every worker (known across workers, else None)."""
        return getattr(self._iterator, "global_batch_size", None)

    def close(self) -> None:
        if self._iterator is not None:
            self._iterator.close()


@dataclasses.dataclass(frozen=True)
class _FitPlan:
    """What each epoch of one ``fit`` does, decided before the first and alike on every worker."""

    steps: int | None  # steps per epoch (None: until the data runs out)
    validation_data: object  # None: no validation
    batch_size: int | None
    batch_logs: bool  # on_train_batch_end gets the logs (agreed across workers)
    agree_logs: bool  # reading the logs is a collective (several workers): every step, on every worker
    agree_each_step: bool  # stop_training is agreed after every step (a callback might set it on one worker)
    accumulating: bool  # the optimizer accumulates gradients over a window of steps
    overlap: object  # the built-in step's reduction in buckets during backward (a context), else None


class Trainer:
    """Trains, evaluates and runs a torch ``nn.Module`` under a strategy, Keras-style.

    Args:
      strategy: any strategy; ``None`` uses the current one (the default strategy
        outside any scope).
      optimizer: a name (``"adam"``), a config dict or a ``replicafit.optimizers.Optimizer``.
      loss: a name, a callable ``(y_true, y_pred) -> per-example loss``, a torch loss
        module, or (multi-output models) a dict/list of them.
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

    Override ``train_step``, ``test_step`` or ``predict_step`` (each runs per replica on
    that replica's slice) for custom logic.
    """

    def __init__(
        self, strategy=None, optimizer="adam", loss="cross_entropy", metrics=("accuracy",), seed=None, precision="32"
    ):
        self.strategy = strategy or ds.get_strategy()
        self.precision = check_precision(precision)
        self._autocast_dtype = AUTOCAST[self.precision]
        with context.enter_or_assert_strategy(self.strategy):
            self.optimizer = optimizers.get(optimizer)
            if self.precision == "16-mixed" and not isinstance(self.optimizer, optimizers.LossScaleOptimizer):
                self.optimizer = optimizers.LossScaleOptimizer(self.optimizer)
        self.loss = nest.map_structure(losses.get, loss) if isinstance(loss, (Mapping, list)) else losses.get(loss)
        self._metric_specs = list(metrics or ())
        self.seed = seed
        self.stop_training = False
        self.history = None
        self._module = None
        self._distributed = None
        self._metrics: list = []
        self._loss_trackers: dict = {}
        self._global_batch = 1
        self._epoch = 0
        self._step = 0
        self._data_seed = seed
        self._resume = None
        self._cursor = None
        self._callback_list = None  # the running (or last) fit's callbacks
        self._float_dtype = torch.get_default_dtype()  # the model's: floating inputs are cast to it
        self._loaded_callback_states = None  # callback states of a checkpoint loaded before a fit
        self._replica_rng_loaded = False  # a checkpoint loaded before a fit gave the replicas' streams

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
        if self._distributed is not None:
            self._distributed.load_state_dict(state)
        else:
            self._module.load_state_dict(state)

    # --- losses and metrics ----------------------------------------------------------------
    def _prepare_metrics(self, outputs_structure, labels=None, outputs=None) -> None:
        """The loss trackers and metrics, per output; ``labels``/``outputs``: one example's, for the shapes
        that resolve ``"accuracy"`` (None when unknown: the loss decides)."""
        multi = isinstance(outputs_structure, (Mapping, tuple, list))
        names = self._output_names(outputs_structure) if multi else [None]
        self._loss_trackers = {"loss": metrics.Mean(name="loss")}
        if multi:
            for name in names:
                self._loss_trackers[f"{name}_loss"] = metrics.Mean(name=f"{name}_loss")
        built = []
        for spec in self._metric_specs:
            for name in names:
                loss = self._loss_for(name)
                y_true, y_pred = labels, outputs
                if name is not None:
                    y_true = _part(labels, self._per_output, name)
                    y_pred = _part(outputs, self._per_output, name)
                metric = metrics.get(spec, loss, y_true=y_true, y_pred=y_pred)
                if isinstance(spec, metrics.Metric) and multi:
                    metric = type(spec)()
                if name is not None:
                    metric.name = f"{name}_{metric.name}"
                built.append((name, metric))
        self._metrics = built
        for tracker in self._loss_trackers.values():
            tracker.build(self.strategy)
        for _, metric in self._metrics:
            metric.build(self.strategy)

    @staticmethod
    def _output_names(outputs) -> list:
        if isinstance(outputs, Mapping):
            return list(outputs.keys())
        return [f"output_{i}" for i in range(len(outputs))]

    def _loss_for(self, name):
        if isinstance(self.loss, Mapping):
            return self.loss[name]
        if isinstance(self.loss, list):
            return self.loss[int(name.rsplit("_", 1)[1])]
        return self.loss

    def _per_output(self, structure, name):
        if isinstance(structure, Mapping):
            return structure[name]
        return structure[int(name.rsplit("_", 1)[1])]

    def compute_loss(self, y, y_pred, sample_weight=None) -> torch.Tensor:
        """Per-example loss (summed over outputs), times ``sample_weight``; also tracked per output."""
        if isinstance(y_pred, (Mapping, tuple, list)):
            total = None
            for name in self._output_names(y_pred):
                values = self._loss_for(name)(self._per_output(y, name), self._per_output(y_pred, name))
                values = values if sample_weight is None else values * sample_weight.reshape(values.shape)
                self._loss_trackers[f"{name}_loss"].update_state(values.detach())
                total = values if total is None else total + values
            return total
        values = self.loss(y, y_pred)
        return values if sample_weight is None else values * sample_weight.reshape(values.shape).to(values.dtype)

    def _update_metrics(self, y, y_pred, sample_weight, per_example) -> None:
        self._loss_trackers["loss"].update_state(per_example.detach())
        if y is None:
            return
        with torch.no_grad():
            for name, metric in self._metrics:
                target = y if name is None else self._per_output(y, name)
                prediction = y_pred if name is None else self._per_output(y_pred, name)
                metric.update_state(target, prediction, sample_weight)

    def _all_metrics(self) -> list:
        return list(self._loss_trackers.values()) + [m for _, m in self._metrics]

    def _reset_metrics(self) -> None:
        for metric in self._all_metrics():
            metric.reset_state()

    def _logs(self) -> dict:
        metrics = self._all_metrics()
        # One batched reduction for every accumulator (across workers: one collective, not one per read).
        with context.enter_or_assert_strategy(self.strategy), aggregated_reads(_metric_variables(metrics)):
            return {metric.name: float(metric.result()) for metric in metrics}

    # --- per-replica steps ---------------------------------------------------------------------
    def train_step(self, data) -> None:
        """One replica's training step on its slice ``data`` (override for custom logic).

        The loss is the per-example loss summed over this replica's rows divided by the
        step's global batch size (``self.global_batch_size``); the optimizer sums the
        replicas' gradients.
        """
        x, y, sample_weight = self._model_floats(*_unpack(data))
        variables = self._trainable
        if _rows(x) == 0:  # an empty replica: no forward pass, zero gradients
            grads = [torch.zeros_like(v.value()) for v in variables]
            self.optimizer.apply_gradients(zip(grads, variables))
            return
        y_pred, per_example = self._forward(x, y, sample_weight)
        loss = self.optimizer.scale_loss(per_example.sum() / self._global_batch)
        grads = torch.autograd.grad(loss, [v.value() for v in variables], allow_unused=True)
        grads = [torch.zeros_like(v.value()) if g is None else g for g, v in zip(grads, variables)]
        self.optimizer.apply_gradients(zip(grads, variables))
        self._update_metrics(y, y_pred, sample_weight, per_example)

    def test_step(self, data) -> None:
        """One replica's evaluation step: losses and metrics of its slice."""
        x, y, sample_weight = self._model_floats(*_unpack(data))
        if _rows(x) == 0:
            return
        with torch.no_grad():
            y_pred, per_example = self._forward(x, y, sample_weight)
        self._update_metrics(y, y_pred, sample_weight, per_example)

    def predict_step(self, data):
        """One replica's prediction: the model's output on its slice."""
        x, _, _ = self._model_floats(*_unpack(data))
        with torch.no_grad():
            if self._autocast_dtype is None:
                return self.model(x)
            with torch.autocast(_device_type(x), dtype=self._autocast_dtype):
                y_pred = self.model(x)
        return nest.map_structure(_as_float32, y_pred)

    def _model_floats(self, x, y, sample_weight) -> tuple:
        """Floating inputs, targets and weights in the model's float type, as Keras casts NumPy's float64
        to its float type (integer labels stay as they are). The built-in steps call it; a custom step
        of one's own may too."""
        dtype = self._float_dtype
        return _as_dtype(x, dtype), _as_dtype(y, dtype), _as_dtype(sample_weight, dtype)

    def _forward(self, x, y, sample_weight):
        """The model's output and the per-example loss (float32) of a replica's slice, under the
        trainer's precision."""
        if self._autocast_dtype is None:
            y_pred = self.model(x)
            return y_pred, self.compute_loss(y, y_pred, sample_weight)
        with torch.autocast(_device_type(x), dtype=self._autocast_dtype):
            y_pred = self.model(x)
            per_example = self.compute_loss(y, y_pred, sample_weight)
        half = per_example.dtype in (torch.float16, torch.bfloat16)
        return y_pred, per_example.float() if half else per_example  # summed in float32 (or wider)

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

    def write_on_chief(self, what: str, write, default=None):
        """``write()`` on the chief only (the one worker that writes files), then every worker waits
        for it, so none races ahead of a file being written. Returns ``write()``'s result (``default``
        elsewhere). ``what`` names the barrier in errors and timeouts. Every worker must call it, in
        the same order (the barrier is a collective); in one process it is ``write()``.

        Example::

            state = trainer.model_state_dict()  # every worker takes part in the read
            trainer.write_on_chief("my weights", lambda: checkpoint.save(state, "weights.pt"))
        """
        result = write() if self.strategy.extended.should_checkpoint else default
        self.strategy.cluster.barrier(what)
        return result

    # --- data --------------------------------------------------------------------------------
    def _source(self, dataset, batch_size, shuffle, seed):
        return data_layer.as_global_batches(
            dataset, batch_size if _batchable(dataset) else None, shuffle=shuffle and _batchable(dataset), seed=seed
        )

    def _split(self, dataset, validation_split: float):
        if validation_split == 0:
            return dataset, None
        if isinstance(dataset, torch.utils.data.Dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
            n = len(dataset)
            cut = _split_point(n, validation_split)
            return (torch.utils.data.Subset(dataset, range(cut)), torch.utils.data.Subset(dataset, range(cut, n)))
        if not _batchable(dataset):
            raise ValueError(
                "validation_split needs arrays, tensors or a torch Dataset (it keeps the last examples "
                "for validation, as Keras does); pass validation_data for other sources."
            )
        leaves = [data_layer.as_tensor(leaf) for leaf in nest.flatten(dataset)]
        n = leaves[0].shape[0]
        cut = _split_point(n, validation_split)
        train = nest.pack_sequence_as(dataset, [leaf[:cut] for leaf in leaves])
        valid = nest.pack_sequence_as(dataset, [leaf[cut:] for leaf in leaves])
        return train, valid

    # --- fit ----------------------------------------------------------------------------------
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
        train_data, source, first, validation_data = self._fit_data(
            dataset, batch_size, validation_data, validation_split, shuffle
        )
        distributed = self.strategy.experimental_distribute_dataset(source)
        dm = self._distribute(model)
        dm.train()
        self._trainable = dm.trainable_variables
        steps = steps_per_epoch if steps_per_epoch is not None else _length(source)
        history, callback_list = self._fit_callbacks(callbacks, model, epochs, steps, verbose)
        self.history, self.stop_training, self._resume = history, False, None
        self._cursor = cursor = _Cursor(source, distributed, repeat=steps_per_epoch is not None)
        self._first_batch_structure(first, dm, "fit()", _in_memory_labels(train_data))
        self._begin_training(callback_list)
        resume = self._resume  # where a backup restored in on_train_begin left off
        start_epoch = initial_epoch if resume is None else resume["epoch"]
        plan = self._fit_plan(callback_list, steps, validation_data, batch_size)
        logs: dict = {}
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
        callback_list.call("on_train_end", logs)
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
        """``(training data, its source of global batches, its first batch, validation data)``, each
        checked to yield a batch (a one-shot validation iterator comes back re-chained)."""
        train_data, split_validation = self._split(dataset, validation_split)
        validation_data = validation_data if validation_data is not None else split_validation
        source = self._source(train_data, batch_size, shuffle, self._data_seed)
        source, first = _first_batch(source, "training data", "fit()", self._probes_outputs())
        if validation_data is not None:
            validation_data = self._checked_validation(validation_data, batch_size)
        return train_data, source, first, validation_data

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
        """Makes ``callback_list`` this fit's (callback states of a checkpoint loaded before it restored) and
        calls ``on_train_begin``, where ``BackupAndRestore`` may restore a backup (``_resume``)."""
        self._callback_list = callback_list
        if self._loaded_callback_states:  # a checkpoint loaded before this fit (load_checkpoint)
            self._restore_callback_states(self._loaded_callback_states)
            self._loaded_callback_states = None
        callback_list.call("on_train_begin", {})
        callback_list.refresh()

    def _fit_plan(self, callback_list, steps, validation_data, batch_size) -> _FitPlan:
        """This fit's decisions, taken once before its first epoch, alike on every worker."""
        cluster = self.strategy.cluster
        batch_logs = callback_list.wants_batch_logs["on_train_batch_end"]
        # Reading the logs is a collective across workers: every worker reads them, or none.
        agree_logs = cluster.num_workers > 1
        batch_logs = cluster.any(batch_logs) if agree_logs else batch_logs
        # Logs are global, so built-in callbacks decide alike on every worker; a user's callback
        # might not (in any hook), so its stop_training is agreed after every step.
        agree_each_step = cluster.num_workers > 1 and callbacks_module.may_stop_training_alone(callback_list)
        # The built-in step applies its gradients once: across workers they can be reduced in buckets
        # started during backward (a custom train_step reduces after backward). An accumulating
        # optimizer reduces once per window, after the window's last backward.
        accumulating = bool(getattr(self.optimizer, "gradient_accumulation_steps", None))
        builtin_step = self._is_builtin("train_step")
        overlap = self.strategy.extended.gradient_step if builtin_step and not accumulating else None
        return _FitPlan(
            steps, validation_data, batch_size, batch_logs, agree_logs, agree_each_step, accumulating, overlap
        )

    def _fit_epoch(self, epoch: int, resumed, dm, cursor, callback_list, plan) -> dict:
        """One epoch of ``fit``: its steps (from where the backup ``resumed`` left off, if given), then the
        epoch's logs (validation's with ``val_``) and ``on_epoch_end``; returns the logs. A callback on any
        worker that sets ``stop_training`` stops every worker."""
        self._epoch = epoch
        self._reset_metrics()
        self._start_epoch_data(epoch, resumed, cursor)
        callback_list.call("on_epoch_begin", epoch, {})
        self._train_steps(resumed["step"] if resumed is not None else 0, cursor, callback_list, plan)
        if plan.accumulating:  # a partial window is applied, not dropped
            with context.enter_or_assert_strategy(self.strategy):
                self.optimizer.apply_accumulated_gradients()
        dm.sync_buffers()  # replica-mean statistics for validation and in the user's module
        logs = self._logs()
        if plan.validation_data is not None:
            val_logs = self._validate(plan.validation_data, plan.batch_size, callback_list)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callback_list.call("on_epoch_end", epoch, logs)
        cluster = self.strategy.cluster
        if cluster.num_workers > 1:  # a callback on any worker stops every worker
            self.stop_training = cluster.any(self.stop_training)
        return logs

    def _start_epoch_data(self, epoch: int, resumed, cursor) -> None:
        """Puts the cursor where ``epoch``'s batches begin: where a backup left off mid-epoch (its metric
        accumulators restored too), a pass of its own per epoch, or on from where it stands when
        ``steps_per_epoch`` repeats the data."""
        if resumed is not None and resumed["step"]:
            self._restore_metrics(resumed["metrics"], resumed.get("metric_replicas"))
            cursor.start(*resumed["cursor"])
        elif not cursor.repeat:
            cursor.start(epoch, 0)
        elif not cursor.started:
            cursor.start(*(resumed["cursor"] if resumed is not None else (0, 0)))

    def _train_steps(self, step: int, cursor, callback_list, plan) -> None:
        """The epoch's training steps from ``step`` on, until ``plan.steps``, the data's end or ``stop_training``."""
        cluster = self.strategy.cluster
        while plan.steps is None or step < plan.steps:
            try:
                batch = cursor.next()
            except StopIteration:
                break
            self._step = step
            if callback_list.wants_batch_logs["on_train_batch_begin"]:
                callback_list.call("on_train_batch_begin", step, {})
            self._run_train_step(batch, plan)
            step += 1
            self._step = step
            # Across workers reading the logs is a collective (agreed once: every step); in one
            # process only when a callback reads them at this step (a bar redraws now and then).
            read = plan.batch_logs and (plan.agree_logs or callback_list.wants_logs_now("on_train_batch_end"))
            callback_list.call("on_train_batch_end", step - 1, self._logs() if read else {})
            if plan.agree_each_step:
                self.stop_training = cluster.any(self.stop_training)
            if self.stop_training:
                break

    def _run_train_step(self, batch, plan) -> None:
        """``train_step`` on every replica's slice of ``batch``."""
        self._set_global_batch(batch)
        if plan.accumulating:  # a window's steps weigh their examples: it equals one step on them all
            self.optimizer._step_weight = float(self._global_batch)
        with plan.overlap(self._trainable) if plan.overlap is not None else contextlib.nullcontext():
            self.strategy.run(self.train_step, args=(batch,))

    def _end_fit(self, cursor, plan) -> None:
        """What a fit leaves behind, however it ends: no open data, no hooks, one's own loop weighing alike."""
        cursor.close()
        self.strategy.extended.release_gradient_hooks()  # the model's parameters keep no hooks of ours
        if plan.accumulating:
            self.optimizer._step_weight = 1.0  # a loop of one's own after fit weighs its steps alike

    def _probes_outputs(self) -> bool:
        """Whether the metrics need the model's outputs on a first batch: to know the outputs (unless the
        loss names them), or the shapes that resolve ``"accuracy"``."""
        resolved = any(metrics.resolved_by_shapes(spec) for spec in self._metric_specs)
        return resolved or not isinstance(self.loss, (Mapping, list))

    def _checked_validation(self, validation_data, batch_size):
        """``validation_data``, checked to yield a batch (a one-shot iterator comes back re-chained)."""
        source = self._source(validation_data, batch_size, False, None)
        checked, _ = _first_batch(source, "validation data", "fit()", False)
        return checked if _one_shot(source) else validation_data

    def _first_batch_structure(self, first, dm, caller: str = "fit()", all_labels=None) -> None:
        """Builds the metrics, which need to know whether the model has several outputs, and the shapes of
        each output's labels and predictions (``"accuracy"`` is resolved from them, as in Keras 3).

        The model (in eval mode, no gradients) is probed with one example of the first
        batch ``first``, unless the loss is a dict or list, which names the outputs, and no
        metric needs shapes.
        """
        structure = output = labels = None
        if isinstance(self.loss, Mapping):
            structure = dict.fromkeys(self.loss)
        elif isinstance(self.loss, list):
            structure = [None] * len(self.loss)
        built_in = self._built_in_loss_step(caller)
        if first is not None and built_in:
            self._check_labels_present(first, caller)
        if first is not None and self._probes_outputs():
            x, y, _ = _unpack(first)
            if x is not None and _rows(x) > 0:
                was_training = dm.module.training
                dm.module.eval()
                try:
                    with torch.no_grad():
                        probe = nest.map_structure(lambda t: data_layer.as_tensor(t)[:1], x)
                        output = dm.module(_as_dtype(probe, self._float_dtype))
                except (TypeError, AttributeError) as error:
                    if not isinstance(x, Mapping):
                        raise
                    raise TypeError(
                        f"The model cannot take the inputs of the first batch of {caller}: {describe_structure(x)} "
                        f"({type(error).__name__}: {error}). {_structures(caller)}"
                    ) from None
                finally:
                    dm.module.train(was_training)
                if structure is None:
                    structure = output if isinstance(output, (Mapping, tuple, list)) else None
                if y is not None:
                    labels = nest.map_structure(lambda t: data_layer.as_tensor(t)[:1], y)
                    labels = _as_dtype(labels, self._float_dtype)
                    if built_in and structure is None:
                        whole = all_labels if all_labels is not None else y
                        self._check_loss_on_first_batch(whole, labels, output, caller)
        self._prepare_metrics(structure, labels, output)

    def _built_in_loss_step(self, caller: str) -> bool:
        """Whether the step that ``caller`` runs is the built-in one with the built-in ``compute_loss`` (only
        then do batches have to be ``x``, ``(x, y)`` or ``(x, y, sample_weight)`` and meet ``loss``)."""
        step = "test_step" if caller.startswith("evaluate") else "train_step"
        return self._is_builtin(step, "compute_loss")

    def _is_builtin(self, *methods: str) -> bool:
        """Whether these methods are ``Trainer``'s own, not a subclass's overrides."""
        return all(getattr(type(self), name) is getattr(Trainer, name) for name in methods)

    def _check_labels_present(self, first, caller: str) -> None:
        """A loss that needs labels, batches without: say which structures are understood and what arrived."""
        _, y, _ = _unpack(first)
        if y is not None or not _needs_labels(self.loss):
            return
        named = [k for k in first if str(k).lower() in _LABEL_KEYS] if isinstance(first, Mapping) else []
        hint = (
            f" The labels look like they are in the dict under {named[0]!r}: yield (inputs, batch[{named[0]!r}])."
            if named
            else ""
        )
        raise ValueError(
            f"{caller} got batches without labels: the first batch is {describe_structure(first)}, which is taken as "
            f"the model's inputs x alone, and the loss {_loss_name(self.loss)} needs labels.{hint} "
            f"{_structures(caller)}"
        )

    def _check_loss_on_first_batch(self, y, labels, output, caller: str) -> None:
        """The loss on one example of the first batch, before any replica runs: labels out of range for a
        class-index loss (``y``: every label of in-memory data, else the first batch's), and a callable in
        torch's ``(input, target)`` order, are said here with the fix."""
        loss = self.loss
        if not isinstance(output, torch.Tensor) or not isinstance(labels, torch.Tensor):
            return
        classes = losses.class_count(loss, output)
        if classes is not None:
            target = data_layer.as_tensor(y) if not isinstance(y, (Mapping, tuple, list)) else None
            if target is not None and not target.is_floating_point() and target.numel():
                ignore = losses.ignore_index(loss)
                outside = (target < 0) | (target >= classes)
                if ignore is not None:
                    outside &= target != ignore
                if bool(outside.any()):
                    raise losses.labels_out_of_range(_loss_name(loss), target, classes, ignore)
        try:
            loss(labels, output)
        except Exception as error:  # noqa: BLE001 - diagnosed below, else raised as it is
            fn = loss.fn if isinstance(loss, losses._Callable) else None  # a callable of one's own
            if fn is None or not _works(fn, output, labels):
                raise
            raise ValueError(
                f"The loss {_loss_name(loss)} takes its arguments in torch's order (input, target): replicafit "
                f"calls loss(y_true, y_pred), as Keras does, and it failed on the first batch of {caller} "
                f"({type(error).__name__}: {error}). Pass loss=lambda y_true, y_pred: {_call_name(fn)}"
                f"(y_pred, y_true), or a torch loss module (torch.nn.CrossEntropyLoss()), which is called in "
                "torch's order."
            ) from None

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
        source = self._source(dataset, batch_size, False, None)
        source, first = _first_batch(source, "evaluation data", "evaluate()", self._probes_outputs())
        dm = self._distribute(model)
        self._first_batch_structure(first, dm, "evaluate()", _in_memory_labels(dataset))
        was_training = dm.training
        dm.eval()
        callback_list = callbacks_module.CallbackList(
            list(callbacks or []), trainer=self, model=model, params={"steps": steps, "verbose": verbose}
        )
        logs = self._test_loop(dm, was_training, source, steps, callback_list)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _validate(self, validation_data, batch_size, callback_list) -> dict:
        """The validation logs of an epoch of ``fit`` (its callbacks get the test hooks). ``fit`` checked its
        validation data once, before training, and built the metrics; validation must not disturb the
        training accumulators, so they are put back afterwards."""
        source = self._source(validation_data, batch_size, False, None)
        saved = {m.name: m.state_dict() for m in self._all_metrics()}
        dm = self._distributed
        was_training = dm.training
        dm.eval()
        return self._test_loop(dm, was_training, source, None, callback_list, saved)

    def _test_loop(self, dm, was_training: bool, source, steps, callback_list, saved=None) -> dict:
        """``test_step`` over ``source`` (``steps`` batches at most) with the test hooks, ``dm`` in eval mode
        (``was_training`` is put back); the logs. ``saved`` metric states, if any, are loaded back before
        ``on_test_end``."""
        callback_list.call("on_test_begin", {})
        try:
            self._reset_metrics()
            for index, batch in enumerate(self.strategy.experimental_distribute_dataset(source)):
                if steps is not None and index >= steps:
                    break
                callback_list.call("on_test_batch_begin", index, {})
                self.strategy.run(self.test_step, args=(batch,))
                callback_list.call("on_test_batch_end", index, {})
            logs = self._logs()
        finally:
            dm.train(was_training)
            if saved is not None:
                for metric in self._all_metrics():
                    metric.load_state_dict(saved[metric.name])
        callback_list.call("on_test_end", logs)
        return logs

    def predict(self, model, dataset, batch_size=None, steps=None, verbose="auto"):
        """The model's outputs for every example of ``dataset``, in input order, concatenated
        across replicas and batches (the partial batch included); nests keep their shape."""
        inputs = dataset
        if _batchable(dataset) and not isinstance(dataset, torch.utils.data.Dataset):
            inputs = dataset if isinstance(dataset, tuple) else (dataset,)
        check_arguments("predict", EVALUATE_ARGUMENTS, batch_size=batch_size, steps=steps)
        source = self._source(inputs, batch_size, False, None)
        dm = self._distribute(model)
        was_training = dm.training
        dm.eval()
        outputs = []
        try:
            for index, batch in enumerate(self.strategy.experimental_distribute_dataset(source)):
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
        """The states of the stateful callbacks of the running (or last) ``fit`` (``TorchLRScheduler``)."""
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
                    self.optimizer.build(dm.trainable_variables)
            self.optimizer.load_state_dict(state["optimizer"])
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
        callbacks' states and where the data stands; to resume at ``step`` of ``epoch`` (``step=0``:
        that epoch's start). ``epoch_logs`` is ``(epoch, logs)`` of an epoch that ends now and that the
        History callback (which runs last) has not recorded yet. Called during a ``fit``, on every
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
            "data_seed": self._data_seed,
            "model": self._trained_model_state(),
            "optimizer": self._optimizer_state(),
            "metrics": self._metric_states(),
            "metric_replicas": self._metric_replica_states(),
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
        trained = self.optimizer._trained_values() if getattr(self.optimizer, "use_ema", False) else {}
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
        if window is not None and cluster.num_workers > 1 and not window["aggregated"]:
            parts = cluster.all_gather(window["gradients"])  # every worker's replicas, in order
            window = dict(window, gradients={key: [t for part in parts for t in part[key]] for key in parts[0]})
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

    def _restore_replica_rng(self, state: dict, position: tuple) -> bool:
        """Puts the saved streams of this worker's replicas back (True), when the file has them. Saved by a
        strategy with another number of replicas, they cannot continue: the streams are seeded anew from
        the saved seed and ``position`` (epoch, step), so they do not repeat the start of the run."""
        streams, saved = self.strategy.extended.replica_streams, state.get("replica_rng")
        if streams is None or not saved:
            return False
        cluster = self.strategy.cluster
        first, local = cluster.first_replica_id, cluster.num_local_replicas
        if len(saved["cpu"]) == self.strategy.num_replicas_in_sync:
            part = slice(first, first + local)
            streams.load_state_dict({"seed": saved["seed"], "cpu": saved["cpu"][part], "gpu": saved["gpu"][part]})
        else:
            streams.seed(int(saved["seed"]), salt=tuple(int(p) for p in position))
        return True

    def restore_training_state(self, state: dict, path) -> None:
        """Restores a backup read by ``checkpoint.load(path, kind="backup")`` (its structure is checked there):
        the running ``fit`` goes on from the epoch and step of ``training_state``. Called from
        ``on_train_begin`` (before the first step), on every worker alike; ``path`` names the file in errors.

        A backup that does not fit this model, optimizer or metrics raises
        ``CheckpointError`` before anything is restored.

        Example::

            class Resume(Callback):
                def on_train_begin(self, logs=None):
                    if os.path.exists("backup.pt"):
                        self.trainer.restore_training_state(checkpoint.load("backup.pt", kind="backup"), "backup.pt")
        """
        self._check_metric_states(state["metrics"], path)
        self._load_model_and_optimizer(state, path, "backup")
        self._restore_callback_states(state.get("callbacks") or {})
        self.history.history = {k: list(v) for k, v in state["history"]["history"].items()}
        self.history.epoch = list(state["history"]["epoch"])
        self._data_seed = state["data_seed"]
        source = self._cursor.source
        if hasattr(source, "seed"):
            source.seed = self._data_seed
        torch.set_rng_state(_own_rng_state(state, self.strategy.cluster))
        self._restore_replica_rng(state, (state["epoch"], state["step"]))
        self._resume = {
            "epoch": state["epoch"],
            "step": state["step"],
            "cursor": tuple(state["cursor"]),
            "metrics": state["metrics"],
            "metric_replicas": state.get("metric_replicas"),
        }

    def _check_metric_states(self, states: dict, path) -> None:
        """Each saved metric state must have this trainer's accumulators (names and shapes)."""
        for metric in self._all_metrics():
            saved, current = states.get(metric.name), metric.state_dict()
            if not saved or not current:
                continue
            expected = {name: list(value.shape) for name, value in current.items()}
            found = {name: list(value.shape) for name, value in saved.items()}
            if found != expected:
                raise checkpoint.CheckpointError(
                    f"The backup {str(path)!r} holds metric {metric.name!r} with accumulators {found}, but this "
                    f"trainer's has {expected}: it was written with other metrics. Delete it, or use another "
                    "backup_dir, to start afresh."
                )

    def _metric_states(self) -> dict:
        metrics = self._all_metrics()
        with aggregated_reads(_metric_variables(metrics)):
            return {m.name: m.state_dict() for m in metrics}

    def _restore_metrics(self, states: dict, replicas=None) -> None:
        for metric in self._all_metrics():
            if metric.name in states and states[metric.name]:
                metric.load_state_dict(states[metric.name])
        if replicas:
            self._restore_metric_replicas(replicas)

    def _metric_replica_states(self) -> dict:
        """Every replica's own metric accumulators, of every worker: ``{"metric/state": [tensor per replica]}``.

        Restoring these (rather than dividing the aggregate among the replicas) makes a resumed
        epoch's logs bit-identical to the uninterrupted run's.
        """
        states = {
            f"{metric.name}/{name}": [
                c.value().detach().clone() for c in self.strategy.experimental_local_results(variable)
            ]
            for metric in self._all_metrics()
            for name, variable in metric.state_variables().items()
        }
        parts = self.strategy.cluster.all_gather(states)  # every worker's replicas, in order
        return {key: [t for part in parts for t in part[key]] for key in states}

    def _restore_metric_replicas(self, replicas: dict) -> None:
        cluster = self.strategy.cluster
        first, count = cluster.first_replica_id, cluster.num_local_replicas
        for metric in self._all_metrics():
            for name, variable in metric.state_variables().items():
                saved = replicas.get(f"{metric.name}/{name}")
                components = self.strategy.experimental_local_results(variable)
                if not isinstance(saved, list) or len(saved) != self.strategy.num_replicas_in_sync:
                    continue  # another replica count: the aggregate, divided among the replicas, stands
                for index, (component, value) in enumerate(zip(components, saved[first : first + count])):
                    if isinstance(value, torch.Tensor) and value.shape == component.shape:
                        variable.assign_component(index, value)


def _device_type(x) -> str:
    """The device type (``"cpu"``, ``"cuda"``) of a replica's inputs: where its autocast applies."""
    leaves = nest.flatten(x)
    return leaves[0].device.type if leaves and isinstance(leaves[0], torch.Tensor) else "cpu"


def _as_float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def _batchable(dataset) -> bool:
    """Arrays, tensors, tuples/dicts of them, or a map-style Dataset: batched by the trainer."""
    if isinstance(dataset, torch.utils.data.Dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return data_layer.is_array_nest(dataset)


def _history_with(history, epoch_logs) -> dict:
    records = {k: list(v) for k, v in history.history.items()}
    epochs = list(history.epoch)
    if epoch_logs is not None and epoch_logs[0] not in epochs:
        epoch, logs = epoch_logs
        epochs.append(epoch)
        for key, value in logs.items():
            records.setdefault(key, []).append(value)
    return {"history": records, "epoch": epochs}


def _metric_variables(metrics) -> list:
    return [variable for metric in metrics for variable in metric.variables]


def _own_rng_state(state: dict, cluster):
    """This worker's generator state in a backup (the chief's where the backup has no entry for it)."""
    states = state.get("worker_rng")
    if isinstance(states, (list, tuple)) and len(states) == cluster.num_workers:
        own = states[cluster.worker_index]
        if isinstance(own, torch.Tensor):
            return own
    return state["rng"]


def _split_point(n: int, validation_split: float) -> int:
    """Where ``validation_split`` cuts ``n`` examples; both parts must hold one at least (as in Keras)."""
    cut = n - int(n * validation_split)
    if cut == 0 or cut == n:
        raise ValueError(
            f"validation_split={validation_split} of {n} examples leaves {cut} for training and {n - cut} for "
            "validation, and each needs at least one: pass more data or another validation_split (or "
            "validation_data)."
        )
    return cut


def _as_dtype(structure, dtype):
    """``structure`` with its floating tensors of another float type cast to ``dtype``."""
    if structure is None:
        return None
    if type(structure) is torch.Tensor:  # the common case, without a walk of the structure
        floating = structure.is_floating_point() and structure.dtype != dtype
        return structure.to(dtype) if floating else structure

    def cast(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return nest.map_structure(cast, structure)


def _part(structure, per_output, name):
    """One output's part of ``structure`` (None when it has none: the shapes are then unknown)."""
    try:
        return per_output(structure, name) if isinstance(structure, (Mapping, tuple, list)) else None
    except (KeyError, IndexError, ValueError, TypeError):
        return None


def _structures(caller: str) -> str:
    """Which batch structures the built-in steps understand, and the fix, for ``caller`` ("fit()")."""
    return (
        "Batches are understood as x, (x, y) or (x, y, sample_weight) (tuples or lists); a dict is the "
        "model's inputs x, as in Keras (its keys are the model's input names): pass "
        f"{caller.removesuffix('()')}(model, (x, y)), or a DataLoader that yields (inputs, labels)."
    )


_LABEL_KEYS = {"y", "label", "labels", "target", "targets"}


def _loss_name(loss) -> str:
    if isinstance(loss, (Mapping, list)):
        return "given per output"
    return getattr(loss, "name", type(loss).__name__)


def _in_memory_labels(data):
    """The labels of ``(x, y[, w])`` arrays or tensors (checked whole at the entry), else None."""
    if isinstance(data, (tuple, list)) and len(data) in (2, 3) and isinstance(data[1], (np.ndarray, torch.Tensor)):
        return data[1]
    return None


def _call_name(fn) -> str:
    name = getattr(fn, "__name__", "")
    return name if name.isidentifier() else "your_loss"


def _needs_labels(loss) -> bool:
    """Whether ``loss`` certainly needs labels (a built-in or torch loss; a callable of one's own may not)."""
    if isinstance(loss, Mapping):
        return any(_needs_labels(v) for v in loss.values())
    if isinstance(loss, list):
        return any(_needs_labels(v) for v in loss)
    return not isinstance(loss, losses._Callable)


def _works(fn, *args) -> bool:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - only whether it works is asked
        return False
    return True


def _first_batch(source, what: str, caller: str, want_batch: bool):
    """``(source, first batch or None)``, after checking that ``source`` yields a batch at all.

    A sized source is checked by its length (and read only when ``want_batch``); others
    are read for one batch, and a one-shot iterator gets it put back in front. An empty
    source raises ``ValueError`` naming ``what`` was empty.
    """
    length = _length(source)
    first = None
    if length != 0 and (length is None or want_batch):
        if _one_shot(source):
            first = next(source, _NOTHING)
            if first is not _NOTHING:
                source = itertools.chain([first], source)
        else:
            first = next(source.iterate(0, 0) if hasattr(source, "iterate") else iter(source), _NOTHING)
    if length == 0 or first is _NOTHING:
        raise ValueError(
            f"The {what} of {caller} is empty: it yields no batch. Pass at least one example "
            "(check the arrays, Dataset or iterable, and any filtering or splitting before it)."
        )
    return source, first


def _one_shot(source) -> bool:
    """An iterator that is its own iterator (a generator) can be read once only."""
    return iter(source) is source


def _length(source):
    try:
        return len(source)
    except TypeError:
        return None
