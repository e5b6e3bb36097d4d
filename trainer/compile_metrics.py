"""``CompileMetrics``: the trainer's loss trackers and metrics (Keras 3's ``CompileMetrics``, with the loss
trackers Keras keeps beside it): built per output from a fit's (or an evaluation's) first batch, updated
by every replica in its steps, read aggregated when logs are needed, and kept by checkpoints and backups.

Each accumulator is a ``SyncOnRead`` variable: a replica adds to its own component, and a read outside the
replicas aggregates the components (across workers too). ``result`` reads every accumulator in one batched
reduction, so the logs of a step cost one collective across workers, not one per metric.

The logs hold ``loss``, then each output's ``<output>_loss`` (a model with several outputs), then the
metrics, ``<output>_<metric>`` per output.

Used by ``Trainer`` (its steps update it; ``evaluate`` and validation reset and read it), ``CompileLoss``
(each output's loss), ``InputChecks`` (the specs that need the first batch's shapes), ``FitLoop`` (reset per
epoch, the logs of steps and epochs, a snapshot that a preemption during validation rewinds to) and
``TrainingState`` (the accumulators a backup keeps, aggregated and per replica).

Example::

    compiled = CompileMetrics(["accuracy"], strategy)
    compiled.build(None, labels, outputs, compiled_loss.loss_for)  # one output: "loss" and "accuracy"
    strategy.run(lambda: compiled.update_state(y, y_pred, None, terms))
    compiled.result()  # {"loss": 0.31, "accuracy": 0.9}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replicafit.strategies import context
from replicafit.strategies.variables import aggregated_reads

from . import checkpoint, metrics, torch_metrics
from .compile_loss import output_names, output_part
from .replica_states import gather_replica_states, restore_replica_states
from .torch_metrics import TorchMetric, is_torchmetrics_metric

__all__ = ["CompileMetrics"]


class CompileMetrics:
    """The loss trackers and metrics of a trainer, per output.

    Args:
      specs: ``Trainer``'s ``metrics`` argument: names (``"accuracy"`` is resolved from the shapes of the
        first batch's labels and predictions, per output), ``metrics.Metric`` objects, or torchmetrics metrics
        (each wrapped in a ``TorchMetric``, per output; a ``MetricCollection`` gives one per metric it holds).
      strategy: the trainer's strategy, under which the accumulators are made.

    Example::

        compiled = CompileMetrics(["accuracy"], strategy)
        compiled.build({"classes": None, "flag": None}, labels, outputs, compiled_loss.loss_for)
        [m.name for m in compiled.all_metrics]  # ["loss", "classes_loss", "flag_loss", "classes_accuracy", ...]
    """

    def __init__(self, specs, strategy):
        self.specs = [metric for spec in specs or () for metric in torch_metrics.expanded(spec)]
        self._strategy = strategy
        self._loss_trackers: dict = {}  # "loss", then "<output>_loss" per output of a model with several
        self._metrics: list = []  # (output name, or None for a model with one output; metric)

    def build(self, outputs_structure, labels=None, outputs=None, loss_for=None) -> None:
        """Makes the loss trackers and metrics, per output, and their accumulators under the strategy.
        ``outputs_structure``: the model's outputs (a dict, tuple or list of several; else one);
        ``labels``/``outputs``: one example's, for the shapes that resolve ``"accuracy"`` (None when unknown:
        the loss decides); ``loss_for(output name)``: each output's loss (``CompileLoss.loss_for``).

        Example::

            compiled.build(None, y[:1], model(x[:1]), compiled_loss.loss_for)
        """
        multi = isinstance(outputs_structure, (Mapping, tuple, list))
        names = output_names(outputs_structure) if multi else [None]
        self._loss_trackers = {"loss": metrics.Mean(name="loss")}
        if multi:
            for name in names:
                self._loss_trackers[f"{name}_loss"] = metrics.Mean(name=f"{name}_loss")
        built, taken = [], set(self._loss_trackers)
        for spec in self.specs:
            for name in names:
                loss = loss_for(name)
                y_true, y_pred = labels, outputs
                if name is not None:
                    y_true = _part(labels, name)
                    y_pred = _part(outputs, name)
                if is_torchmetrics_metric(spec):  # a copy per output, as every output's own metric
                    metric = TorchMetric(spec)
                elif isinstance(spec, TorchMetric) and multi:
                    metric = TorchMetric(spec.metric, spec.name)
                else:
                    metric = metrics.get(spec, loss, y_true=y_true, y_pred=y_pred)
                    if isinstance(spec, metrics.Metric) and multi:
                        metric = type(spec)()
                if name is not None:
                    metric.name = f"{name}_{metric.name}"
                if any(metric is other for _, other in built):  # the same object given twice: once
                    continue
                if metric.name in taken:  # two of one name (one class, other arguments): Keras 2's suffix
                    metric.name = next(
                        f"{metric.name}_{n}" for n in range(1, len(taken) + 2) if f"{metric.name}_{n}" not in taken
                    )
                taken.add(metric.name)
                built.append((name, metric))
        self._metrics = built
        for tracker in self._loss_trackers.values():
            tracker.build(self._strategy)
        for _, metric in self._metrics:
            metric.build(self._strategy)

    @property
    def single_output(self) -> bool:
        """Whether the trackers were built for a model with one output (one loss tracker, ``loss``)."""
        return list(self._loss_trackers) == ["loss"]

    @property
    def metrics(self) -> list:
        """The metrics built from ``specs``, per output (the loss trackers aside), in the logs' order."""
        return [metric for _, metric in self._metrics]

    @property
    def all_metrics(self) -> list:
        """The loss trackers, then the metrics: every ``metrics.Metric`` of the logs, in their order."""
        return list(self._loss_trackers.values()) + [m for _, m in self._metrics]

    @property
    def variables(self) -> list:
        """Every accumulator of the loss trackers and metrics (read together: ``aggregated_reads``)."""
        return [variable for metric in self.all_metrics for variable in metric.variables]

    # --- in the replicas ------------------------------------------------------------------------------
    def update_state(self, y, y_pred, sample_weight, terms) -> None:
        """Adds a replica's step: its loss ``terms`` (``losses.LossTerms``) to ``loss``, and its labels and
        predictions to each metric (of its output). No labels: the loss alone.

        Example::

            compiled.update_state(y, y_pred, sample_weight, terms)  # in a replica's step
        """
        self._loss_trackers["loss"].update_totals(terms.total, terms.count)
        if y is None:
            return
        with torch.no_grad():
            for name, metric in self._metrics:
                target = y if name is None else output_part(y, name)
                prediction = y_pred if name is None else output_part(y_pred, name)
                metric.update_state(target, prediction, sample_weight)

    def update_output_loss(self, name: str, values) -> None:
        """Adds one output's per-example losses ``values`` to its tracker ``<name>_loss``.

        Example::

            compiled.update_output_loss("classes", per_example.detach())
        """
        self._loss_trackers[f"{name}_loss"].update_state(values)

    # --- reading and resetting ------------------------------------------------------------------------
    def reset_state(self) -> None:
        """Zeroes every accumulator (an epoch's or an evaluation's start)."""
        for metric in self.all_metrics:
            metric.reset_state()

    def result(self) -> dict:
        """The logs: ``{name: value}`` of every tracker and metric, aggregated over the replicas and workers
        (across workers a collective: every worker reads them at the same steps).

        Example::

            logs = compiled.result()  # {"loss": 0.31, "accuracy": 0.9}
        """
        metrics = self.all_metrics
        # One batched reduction for every accumulator (across workers: one collective, not one per read).
        with context.enter_or_assert_strategy(self._strategy), aggregated_reads(self.variables):
            return {metric.name: float(metric.result()) for metric in metrics}

    def put_aside(self) -> dict:
        """The accumulators as they stand, to be put back with ``put_back`` (validation must not disturb
        the training epoch's).

        Example::

            saved = compiled.put_aside()
            ...  # validation resets and updates the metrics
            compiled.put_back(saved)
        """
        return {m.name: m.state_dict() for m in self.all_metrics}

    def put_back(self, saved: dict) -> None:
        """Loads what ``put_aside`` returned."""
        for metric in self.all_metrics:
            metric.load_state_dict(saved[metric.name])

    def local_values(self) -> list:
        """This worker's own replicas' accumulators, copied (no communication): what ``load_local_values``
        puts back.

        Example::

            point = compiled.local_values()  # before validation, which a preemption may interrupt
        """
        return [metric.local_values() for metric in self.all_metrics]

    def load_local_values(self, values: list) -> None:
        """Gives this worker's replicas' accumulators the values of ``local_values``."""
        for metric, own in zip(self.all_metrics, values):
            metric.load_local_values(own)

    # --- checkpoints and backups ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{metric name: its aggregated accumulators}`` (one batched read; across workers a collective).

        Example::

            backup["metrics"] = compiled.state_dict()
        """
        metrics = self.all_metrics
        with aggregated_reads(self.variables):
            return {m.name: m.state_dict() for m in metrics}

    def load_state_dict(self, states: dict, replicas=None) -> None:
        """Restores a ``state_dict()``, then each replica's own accumulators where ``replicas``
        (``replica_states``) has them for this number of replicas.

        Example::

            compiled.load_state_dict(backup["metrics"], backup.get("metric_replicas"))
        """
        for metric in self.all_metrics:
            if metric.name in states and states[metric.name]:
                metric.load_state_dict(states[metric.name])
        if replicas:
            restore_replica_states(self._strategy, self._variables_by_key(), replicas)

    def check_state_dict(self, states: dict, path) -> None:
        """Each saved metric state must have these accumulators (names and shapes): ``CheckpointError``
        naming the backup ``path`` otherwise.

        Example::

            compiled.check_state_dict(backup["metrics"], "backup.pt")  # before anything is restored
        """
        for metric in self.all_metrics:
            saved, current = states.get(metric.name), metric.state_dict()
            if not saved or not current:
                continue
            expected, found = metric.saved_layout(current), metric.saved_layout(saved)
            if found != expected:
                raise checkpoint.CheckpointError(
                    f"The backup {str(path)!r} holds metric {metric.name!r} with accumulators {found}, but this "
                    f"trainer's has {expected}: it was written with other metrics. Delete it, or use another "
                    "backup_dir, to start afresh."
                )

    def replica_states(self) -> dict:
        """Every replica's own accumulators, of every worker: ``{"metric/state": [tensor per replica]}``.

        Restoring these (rather than dividing the aggregate among the replicas) makes a resumed
        epoch's logs bit-identical to the uninterrupted run's.

        Example::

            backup["metric_replicas"] = compiled.replica_states()  # every worker calls it
        """
        return gather_replica_states(self._strategy, self._variables_by_key())

    def _variables_by_key(self) -> dict:
        return {
            f"{metric.name}/{name}": variable
            for metric in self.all_metrics
            for name, variable in metric.state_variables().items()
        }


def _part(structure, name):
    """One output's part of ``structure`` (None when it has none: the shapes are then unknown)."""
    try:
        return output_part(structure, name) if isinstance(structure, (Mapping, tuple, list)) else None
    except (KeyError, IndexError, ValueError, TypeError):
        return None
