"""torchmetrics metrics under every strategy: ``Trainer(metrics=[MulticlassF1Score(num_classes=3)])``.

A torchmetrics ``Metric`` declares how each of its states combines across processes (``dist_reduce_fx``:
``"sum"``, ``"mean"``, ``"cat"``, ``"min"``, ``"max"``, a callable, or None). ``TorchMetric`` adapts one to
the trainer's ``metrics.Metric`` protocol:

- every replica updates its own copy of the metric (made by ``build``, on the replica's device), with no
  communication: the update is torchmetrics' own ``update(preds, target)``;
- a read outside the replicas (the logs, ``evaluate``, a backup) combines the copies' states by each state's
  own reduction, over this worker's replicas and then over the workers, and runs torchmetrics' ``compute()``
  on the combined states: the value equals one device's ``compute()`` on the same data (exactly where the
  states are integer counts; ``cat`` states are concatenated in the input's order, step by step and replica
  by replica in global replica order, as one device would have appended them). Sum and mean states are
  ``SyncOnRead`` variables (the replica's copy holds its component), read in the logs' batched reduction with
  the trainer's own accumulators; the other states are gathered (one ``cluster.all_gather`` per read across
  workers, none in one process);
- ``reset_state``, checkpoints and backups (the combined states, counted once again when restored, on any
  number of replicas and workers) as for the trainer's own metrics.

``torch_metric_states.py`` reads a metric's states (its own and those of the metrics inside it) and combines
them.

torchmetrics stays an optional dependency: nothing here imports it until a torchmetrics metric is given.

Where we differ from torchmetrics: torchmetrics synchronises through ``torch.distributed`` itself when
``compute()`` is called in an initialised process group; here that is switched off on our copies
(``sync_on_compute``), since the strategy combines the states over its replicas and workers itself, with
its own timeouts. The metric object given is a template: it is copied, never updated itself. torchmetrics
metrics take no per-example weights: examples of weight 0 are left out (a partial batch's padding), other
weights are refused. Predictions with their classes last (a language model's ``(batch, tokens, classes)``, the
trainer's convention) reach torchmetrics with their classes second, as it takes them, where the metric's
``num_classes`` tells which axis they are. Where we differ from Keras: Keras 3 takes no torchmetrics metrics.

Example::

    import torchmetrics
    trainer = Trainer(loss="cross_entropy", metrics=[torchmetrics.classification.MulticlassF1Score(num_classes=3)])
    history = trainer.fit(model, (x, y), batch_size=64)
    history.history["multiclass_f1_score"]
"""

from __future__ import annotations

import copy
import sys

import torch

import replicafit.strategies as ds
from replicafit.strategies import context, get_replica_context
from replicafit.strategies.devices import torch_device

from . import torch_metric_states as states
from .metrics import Metric, _snake

__all__ = ["TorchMetric", "is_torchmetrics_metric", "MINIMUM_TORCHMETRICS"]

#: The oldest torchmetrics whose metrics ``TorchMetric`` takes (states declared with ``add_state``, their
#: reductions in ``_reductions``, ``sync_on_compute``).
MINIMUM_TORCHMETRICS = (1, 0)


def is_torchmetrics_metric(obj) -> bool:
    """Whether ``obj`` is a torchmetrics ``Metric`` (False, importing nothing, where torchmetrics was never
    imported: an object of it cannot exist then).

    Example::

        >>> is_torchmetrics_metric("accuracy")
        False
    """
    module = sys.modules.get("torchmetrics")
    return module is not None and isinstance(obj, module.Metric)


def is_torchmetrics_class(cls) -> bool:
    """Whether ``cls`` is a torchmetrics ``Metric`` subclass (importing nothing, as ``is_torchmetrics_metric``).

    Example::

        >>> is_torchmetrics_class(int)
        False
    """
    module = sys.modules.get("torchmetrics")
    return module is not None and isinstance(cls, type) and issubclass(cls, module.Metric)


def expanded(spec) -> list:
    """``[spec]``, or for a torchmetrics ``MetricCollection`` a ``TorchMetric`` per metric it holds, named by
    its key in the collection (with the collection's prefix and postfix; a key that is the class's own name
    gives the snake-case name, as a metric given alone).

    Example::

        expanded(MetricCollection([MulticlassF1Score(3), MulticlassAUROC(3)], prefix="train_"))
        # [TorchMetric(MulticlassF1Score, name='train_MulticlassF1Score'), ...]
    """
    module = sys.modules.get("torchmetrics")
    if module is None or not isinstance(spec, module.MetricCollection):
        return [spec]
    return [TorchMetric(metric, name if name != type(metric).__name__ else None) for name, metric in spec.items()]


def _check_version() -> None:
    import torchmetrics

    version = tuple(int(p) for p in torchmetrics.__version__.split(".")[:2] if p.isdigit())
    if version < MINIMUM_TORCHMETRICS:
        wanted = ".".join(map(str, MINIMUM_TORCHMETRICS))
        raise ImportError(
            f"torchmetrics {torchmetrics.__version__} is too old for replicafit's metrics: {wanted} or newer is "
            f'needed. Upgrade it: pip install "torchmetrics>={wanted}" (or pip install "replicafit[torchmetrics]").'
        )


class TorchMetric(Metric):
    """A torchmetrics ``Metric`` as one of the trainer's metrics (the module docstring has the semantics).

    ``Trainer(metrics=[...])`` wraps a torchmetrics metric in one itself; make one directly to give it
    another name. Logged under ``name``: by default the metric's class name in snake case
    (``MulticlassF1Score`` → ``multiclass_f1_score``). ``compute()`` must give a number (a tensor of one
    element): a metric that computes several values (``average=None``) is refused with the fix. Metrics made
    of metrics (``MeanSquaredError() + MeanAbsoluteError()``, torchmetrics' wrappers) combine the states of
    every metric inside.

    Args:
      metric: a torchmetrics ``Metric`` (a template: copied per replica, never updated itself).
      name: the name in the logs.

    Example::

        from torchmetrics.classification import MulticlassAUROC
        trainer = Trainer(metrics=[TorchMetric(MulticlassAUROC(num_classes=3), name="auroc")])
    """

    def __init__(self, metric, name: str | None = None):
        if not is_torchmetrics_metric(metric):
            raise TypeError(
                f"TorchMetric wraps a torchmetrics Metric, got {type(metric).__name__}; the trainer's own metrics "
                "go to Trainer(metrics=[...]) as they are."
            )
        _check_version()
        super().__init__(name or _snake(type(metric).__name__))
        self.metric = metric
        self._copies: list = []  # one per local replica, on its device
        self._marks: list = []  # per copy: the lengths of its list states after each update
        self._reader = None  # a copy whose states are set to the combined ones, to compute from
        self._devices: list = []  # the copies' devices
        self._keys: dict = {}  # every state of the metric (and of the metrics inside it): key -> (path, name)
        self._restored = None  # states a backup restored on this worker, other than the variables' (or None)

    # --- state ----------------------------------------------------------------------------------------
    def build(self, strategy=None) -> None:
        """Makes one copy of the metric per replica of this worker, on the replica's device, and the
        ``SyncOnRead`` variables of its sum and mean states and of its count of updates (again if built for
        another strategy). Outside ``strategy.run``: every replica's copy is made at once."""
        strategy = strategy or context.get_strategy()
        if self._strategy is strategy and self._copies:
            return
        replica = get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            raise RuntimeError(
                f"Metric {self.name!r} (torchmetrics) is used inside strategy.run before it was built: its replicas' "
                "copies are made together, outside the replicas. Call metric.build(strategy) first (the Trainer "
                "does it for its metrics)."
            )
        self._strategy = strategy
        self._devices = [torch_device(device) for device in strategy.extended.worker_devices]
        self._reader = self._fresh().to(self._devices[0])
        self._keys = states.state_keys(self._reader)
        self._copies = [self._fresh().to(device) for device in self._devices]
        self._states = {}
        with context.enter_or_assert_strategy(strategy):
            self.build_state()
        self.reset_state()

    def _fresh(self):
        metric = copy.deepcopy(self.metric)
        metric.reset()
        # The strategy combines the states over its replicas and workers: torchmetrics must not synchronise
        # through torch.distributed on its own (it would, in the workers' process group, with no timeout of ours).
        for inner in states.metrics_in(metric):
            inner.sync_on_compute = False
            inner._to_sync = False  # private: torchmetrics reads this flag, not sync_on_compute, in compute()
            inner.dist_sync_on_step = False
        return metric

    def build_state(self) -> None:
        """A ``SyncOnRead`` variable per state that sums (``"sum"``) or averages (``"mean"``) a tensor of fixed
        shape, and ``update_count``: their reads ride the trainer's batched reduction of the logs, one buffer
        per dtype (integer counts, torchmetrics' usual, add one all-reduce per read across workers for every
        metric together, started with the float32 one). Each replica's copy of the metric holds its component as
        that state."""
        self._states["update_count"] = _variable(f"{self.name}/update_count", torch.zeros((), dtype=torch.int64))
        for key in self._keys:
            initial, reduction = states.default(self._reader, self._keys, key), self._reduction(key)
            if isinstance(initial, torch.Tensor) and reduction in ("dim_zero_sum", "dim_zero_mean"):
                self._states[key] = _variable(f"{self.name}/{key}", initial, mean=reduction == "dim_zero_mean")

    def _reduction(self, key: str) -> str:
        return states.reduction_name(self._reader, self._keys, key)

    def _components(self, index: int) -> dict:
        """``{state key: replica index's component tensor}`` of the variables of the states."""
        local = self._strategy.experimental_local_results
        return {key: local(variable)[index].value() for key, variable in self._states.items()}

    def _copy(self):
        """This replica's copy (the first outside the replicas)."""
        if not self._copies:
            self.build()
        replica = get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return 0, self._copies[0]
        index = replica.replica_id_in_sync_group - self._strategy.cluster.first_replica_id
        return index, self._copies[index]

    def _holds_restored(self) -> bool:
        """Whether this worker holds what a backup restored: the one with global replica 0 (else every worker
        would add it once)."""
        return self._strategy.cluster.first_replica_id == 0

    def reset_state(self) -> None:
        """Resets every replica's copy (its variables' components to the states' defaults)."""
        for index, metric in enumerate(self._copies):
            metric.reset()
            for key, component in self._components(index).items():
                if key == "update_count":
                    component.zero_()
                else:
                    component.copy_(states.get(metric, self._keys, key))
                    states.put(metric, self._keys, key, component)
        self._marks = [[] for _ in self._copies]
        self._restored = None

    # --- the metric ----------------------------------------------------------------------------------
    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds one batch to this replica's copy: torchmetrics' ``update(y_pred, y_true)`` (its argument order
        is predictions first). Examples of ``sample_weight`` 0 are left out; a replica without examples adds
        nothing (its step still counts, for the input's order)."""
        index, metric = self._copy()
        if sample_weight is not None and _rows(y_pred):
            y_true, y_pred = _weighted_rows(y_true, y_pred, sample_weight, self.name)
        if _rows(y_pred):
            y_pred = _classes_second(metric, y_true, y_pred)
            try:
                metric.update(y_pred.detach(), y_true.detach() if isinstance(y_true, torch.Tensor) else y_true)
            except (RuntimeError, ValueError, TypeError) as error:
                raise type(error)(
                    f"Metric {self.name!r} ({type(metric).__name__}.update(preds, target)) failed on preds "
                    f"{_describe(y_pred)} and target {_describe(y_true)}: {error}"
                ) from error
            for key, component in self._components(index).items():
                if key == "update_count":
                    component.add_(1)
                elif states.get(metric, self._keys, key) is not component:  # a new tensor: keep the component
                    component.copy_(states.get(metric, self._keys, key))
                    states.put(metric, self._keys, key, component)
        self._marks[index].append(states.list_lengths(metric, self._keys))

    def result(self) -> torch.Tensor:
        """Inside a replica: that replica's own ``compute()``. Outside: ``compute()`` on the states combined
        over every replica and worker (across workers a collective: every worker reads)."""
        replica = get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            return _as_number(self._copy()[1].compute(), self.name)
        return _as_number(self._compute(self._combined()), self.name)

    def _compute(self, combined: dict):
        count = combined["_update_count"]
        if not count:  # no data yet: 0, as the trainer's own metrics (torchmetrics would warn)
            return torch.zeros(())
        reader = self._reader
        reader.reset()
        for key in self._keys:
            value = combined[key]
            if isinstance(states.default(reader, self._keys, key), list):  # a list state stays a list
                value = [value] if isinstance(value, torch.Tensor) else list(value)
            states.put(reader, self._keys, key, value)
        for inner in states.metrics_in(reader):
            inner._update_count = count  # private: torchmetrics warns on a compute before an update
        return reader.compute()

    def _combined(self, reduce: bool = True) -> dict:
        """Every state combined over the replicas of every worker by its own reduction, on the first device:
        the variables' aggregates (batched with the other logs' inside ``aggregated_reads``), the other
        states gathered (across workers one ``all_gather``, only for a metric that has such states)."""
        if not self._copies:
            self.build()
        with context.enter_or_assert_strategy(self._strategy):
            read = {key: variable.read_value() for key, variable in self._states.items()}
        combined = {"_update_count": int(read.pop("update_count"))}
        combined.update({key: value.to(self._devices[0]) for key, value in read.items()})
        others = [key for key in self._keys if key not in self._states]
        if not others:
            return combined
        cluster = self._strategy.cluster
        crossing = cluster.num_workers > 1
        parts = [
            states.local_part(metric, marks, others, self._keys, crossing)
            for metric, marks in zip(self._copies, self._marks)
        ]
        if self._restored is not None:  # counted once, before every replica's
            restored = {key: value.cpu() if crossing else value for key, value in self._restored.items()}
            parts.insert(0, states.restored_part(restored, self._reader, self._keys))
        if crossing:
            gathered = cluster.all_gather(parts, f"combining the states of metric {self.name!r}")
            parts = [part for worker in gathered for part in worker]
        combined.update(states.combine(self._reader, self._keys, others, parts, self._devices[0], reduce))
        return combined

    # --- checkpoints and backups ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The combined states (list states concatenated in input order) and the update count: what
        ``load_state_dict`` restores under any strategy. Across workers a collective."""
        if not self._copies:
            return {}
        combined = self._combined(reduce=False)
        count = torch.tensor(combined.pop("_update_count"))
        empty = torch.zeros(0)  # a list state without rows (a backup holds tensors only)
        return {
            "_update_count": count,
            **{
                key: value.detach().clone() if isinstance(value, torch.Tensor) else empty
                for key, value in combined.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()``: the replica of global id 0 takes the combined sum and mean states (a mean
        every replica) and the count of updates, and the worker that holds it the other states, which reads
        combine before every replica's (the others start from their defaults); reads then give the saved
        value, and later updates add to it. (A backup also holds each replica's own variables, which
        ``CompileMetrics`` gives back on as many replicas.)"""
        if not self._copies:
            self.build()
        self.reset_state()
        if not state:
            return
        first = self._holds_restored()
        for index, (metric, device) in enumerate(zip(self._copies, self._devices)):
            holder = first and index == 0
            for key in self._states:
                if key in state and (holder or self._reduction(key) == "dim_zero_mean"):
                    component = self._components(index)[key]
                    component.copy_(state[key].to(device))
                    states.put(metric, self._keys, key, component)
            count = int(state.get("_update_count", 0)) if holder else 0
            self._components(index)["update_count"].fill_(count)
            metric._update_count = count  # private: torchmetrics' count of updates, restored
        others = {key: state[key] for key in self._keys if key not in self._states and key in state}
        self._restored = {key: value.to(self._devices[0]) for key, value in others.items()} if first else None

    def saved_layout(self, state: dict) -> dict:
        """The state keys, with the shapes of the tensor states whose shape never changes (a list state's length
        grows with the data, an unreduced state's with the number of replicas)."""
        fixed = {
            key
            for key in self._keys
            if isinstance(states.default(self._reader, self._keys, key), torch.Tensor)
            and states.reduction(self._reader, self._keys, key) is not None
        }
        return {
            key: (list(value.shape) if key in fixed and isinstance(value, torch.Tensor) else None)
            for key, value in state.items()
        }

    def local_values(self) -> dict:
        """This worker's copies' states, copied (no communication): what ``load_local_values`` puts back."""
        copies = [
            (
                {key: _clone(states.get(metric, self._keys, key)) for key in self._keys},
                [inner.update_count for inner in states.metrics_in(metric)],
                [dict(mark) for mark in marks],
            )
            for metric, marks in zip(self._copies, self._marks)
        ]
        components = [{k: c.clone() for k, c in self._components(i).items()} for i in range(len(self._copies))]
        return {"copies": copies, "components": components, "restored": self._restored}

    def load_local_values(self, values: dict) -> None:
        """Gives this worker's copies the states of ``local_values``."""
        for index, (metric, (saved, counts, _)) in enumerate(zip(self._copies, values["copies"])):
            components = self._components(index)
            for key, value in saved.items():
                if key in components:
                    components[key].copy_(value)
                    states.put(metric, self._keys, key, components[key])
                else:
                    states.put(metric, self._keys, key, _clone(value))
            components["update_count"].copy_(values["components"][index]["update_count"])
            for inner, count in zip(states.metrics_in(metric), counts):
                inner._update_count = count  # private: torchmetrics' count of updates, restored
                inner._computed = None  # private: torchmetrics' cached result
        self._marks = [[dict(mark) for mark in marks] for _, _, marks in values["copies"]]
        self._restored = values["restored"]

    def get_config(self) -> dict:
        """``{"name": ..., "metric": <the torchmetrics class name>}``."""
        return {"name": self.name, "metric": type(self.metric).__name__}

    def __repr__(self) -> str:
        return f"TorchMetric({type(self.metric).__name__}, name={self.name!r})"


def _variable(name: str, default: torch.Tensor, mean: bool = False):
    """A ``SyncOnRead`` accumulator like the trainer's own metrics' (``SUM``; ``MEAN`` for a mean state)."""
    return ds.Variable(
        default.detach().clone(),
        trainable=False,
        name=name,
        synchronization=ds.VariableSynchronization.ON_READ,
        aggregation=ds.VariableAggregation.MEAN if mean else ds.VariableAggregation.SUM,
    )


def _classes_second(metric, y_true, y_pred):
    """``y_pred`` with its classes second, as torchmetrics takes them, where they are last (a language model's
    ``(batch, tokens, classes)``, the trainer's convention) and the metric's ``num_classes`` tells them apart."""
    classes = getattr(metric, "num_classes", None)
    if (
        isinstance(classes, int)
        and isinstance(y_pred, torch.Tensor)
        and isinstance(y_true, torch.Tensor)
        and y_pred.dim() >= 3
        and y_pred.dim() == y_true.dim() + 1
        and y_pred.shape[-1] == classes
        and y_pred.shape[1] != classes
    ):
        return y_pred.movedim(-1, 1)
    return y_pred


def _rows(value) -> int:
    """The number of examples of a prediction (1 for a scalar or anything but a tensor)."""
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else 1


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return [v.detach().clone() for v in value]


def _weighted_rows(y_true, y_pred, sample_weight, name: str):
    """The rows of weight other than 0; weights other than 0 and 1 are refused (torchmetrics counts each
    example once)."""
    weight = torch.as_tensor(sample_weight).detach()
    if weight.dim() != 1:
        raise ValueError(
            f"Metric {name!r} (torchmetrics) takes one weight per example (0: left out, 1: counted), got "
            f"sample_weight of shape {tuple(weight.shape)}."
        )
    keep = weight != 0
    if bool(((weight != 0) & (weight != 1)).any()):
        raise ValueError(
            f"Metric {name!r} (torchmetrics) counts each example once and cannot weigh it: its sample_weight "
            "must be 0 (left out) or 1. Use one of replicafit's metrics (they take weights), or fit without "
            "sample_weight."
        )
    if bool(keep.all()):
        return y_true, y_pred
    keep = keep.to(y_pred.device)
    return y_true[keep.to(y_true.device)], y_pred[keep]


def _as_number(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.reshape(())
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(
        f"Metric {name!r} (torchmetrics) computed {shape}, but logs hold numbers: give the metric a reduction "
        "that makes one value (e.g. average='macro' instead of average=None), or wrap each value you want in a "
        "metric of its own."
    )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__
