"""torchmetrics metrics under every strategy: ``Trainer(metrics=[MulticlassF1Score(num_classes=3)])``.

A torchmetrics ``Metric`` declares how each of its states combines across processes (``dist_reduce_fx``:
``"sum"``, ``"mean"``, ``"cat"``, ``"min"``, ``"max"``, a callable, or None). ``TorchMetric`` adapts one to
the trainer's ``metrics.Metric`` protocol:

- every replica updates its own copy of the metric (made by ``build``, on the replica's device), with no
  communication: the update is torchmetrics' own ``update(preds, target)``;
- a read outside the replicas (the logs, ``evaluate``, a backup) combines the copies' states by each state's
  own reduction, over this worker's replicas and then over the workers (one ``cluster.all_gather`` per read
  when there are several workers; none in one process), and runs torchmetrics' ``compute()`` on the
  combined states: the value equals one device's ``compute()`` on the same data (exactly where the states
  are integer counts; ``cat`` states are concatenated in the input's order, step by step and replica by
  replica in global replica order, as one device would have appended them);
- ``reset_state``, checkpoints and backups (the combined states, restored into the first replica's copy) as
  for the trainer's own metrics.

torchmetrics stays an optional dependency: nothing here imports it until a torchmetrics metric is given.

Where we differ from torchmetrics: torchmetrics synchronises through ``torch.distributed`` itself when
``compute()`` is called in an initialised process group; here that is switched off on our copies
(``sync_on_compute``), since the strategy combines the states over its replicas and workers itself, with
its own timeouts. The metric object given is a template: it is copied, never updated itself. torchmetrics
metrics take no per-example weights: examples of weight 0 are left out (a partial batch's padding), other
weights are refused. Where we differ from Keras: Keras 3 takes no torchmetrics metrics.

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
    element): a metric that computes several values (``average=None``) is refused with the fix.

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

    # --- state ----------------------------------------------------------------------------------------
    def build(self, strategy=None) -> None:
        """Makes one copy of the metric per replica of this worker, on the replica's device, and the
        ``SyncOnRead`` variables of its sum and mean states and of its count of updates (again if built for
        another strategy)."""
        strategy = strategy or context.get_strategy()
        if self._strategy is strategy and self._copies:
            return
        self._strategy = strategy
        self._devices = [torch_device(device) for device in strategy.extended.worker_devices]
        self._copies = [self._fresh().to(device) for device in self._devices]
        self._reader = self._fresh().to(self._devices[0])
        self._states = {}
        with context.enter_or_assert_strategy(strategy):
            self.build_state()
        self.reset_state()

    def _fresh(self):
        metric = copy.deepcopy(self.metric)
        metric.reset()
        # The strategy combines the states over its replicas and workers: torchmetrics must not synchronise
        # through torch.distributed on its own (it would, in the workers' process group, with no timeout of ours).
        metric.sync_on_compute = False
        metric._to_sync = False  # private: torchmetrics reads this flag, not sync_on_compute, in compute()
        metric.dist_sync_on_step = False
        return metric

    def build_state(self) -> None:
        """A ``SyncOnRead`` variable per state that sums (``"sum"``) or averages (``"mean"``) a tensor of fixed
        shape, and ``update_count``: their reads ride the trainer's one batched reduction of the logs (no
        collective of their own). Each replica's copy of the metric holds its component as that state."""
        self._states["update_count"] = _variable(f"{self.name}/update_count", torch.zeros((), dtype=torch.int64))
        for name, default in _defaults(self._reader).items():
            reduction = _reduction_name(self._reader, name)
            if isinstance(default, torch.Tensor) and reduction in ("dim_zero_sum", "dim_zero_mean"):
                self._states[name] = _variable(f"{self.name}/{name}", default, mean=reduction == "dim_zero_mean")

    def _components(self, index: int) -> dict:
        """``{state name: replica index's component tensor}`` of the variables of the states."""
        local = self._strategy.experimental_local_results
        return {name: local(variable)[index].value() for name, variable in self._states.items()}

    def _set_state(self, index: int, name: str, value) -> None:
        """Sets one state of one replica's copy: into its variable's component where it has one."""
        metric = self._copies[index]
        if name in self._states:
            component = self._components(index)[name]
            component.copy_(value)
            setattr(metric, name, component)
        else:
            setattr(metric, name, value)

    def _copy(self):
        """This replica's copy (the first outside the replicas)."""
        if not self._copies:
            self.build()
        replica = get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return 0, self._copies[0]
        index = replica.replica_id_in_sync_group - self._strategy.cluster.first_replica_id
        return index, self._copies[index]

    def reset_state(self) -> None:
        """Resets every replica's copy (its variables' components to the states' defaults)."""
        for index, metric in enumerate(self._copies):
            metric.reset()
            for name, component in self._components(index).items():
                component.copy_(getattr(metric, name) if name != "update_count" else torch.zeros_like(component))
                if name != "update_count":
                    setattr(metric, name, component)
        self._marks = [[] for _ in self._copies]

    # --- the metric ----------------------------------------------------------------------------------
    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds one batch to this replica's copy: torchmetrics' ``update(y_pred, y_true)`` (its argument order
        is predictions first). Examples of ``sample_weight`` 0 are left out; a replica without examples adds
        nothing."""
        index, metric = self._copy()
        if isinstance(y_pred, torch.Tensor) and y_pred.dim() and y_pred.shape[0] == 0:
            return
        if sample_weight is not None:
            y_true, y_pred = _weighted_rows(y_true, y_pred, sample_weight, self.name)
            if y_pred.shape[0] == 0:
                return
        try:
            metric.update(y_pred.detach(), y_true.detach() if isinstance(y_true, torch.Tensor) else y_true)
        except (RuntimeError, ValueError, TypeError) as error:
            raise type(error)(
                f"Metric {self.name!r} ({type(metric).__name__}.update(preds, target)) failed on preds "
                f"{_describe(y_pred)} and target {_describe(y_true)}: {error}"
            ) from error
        for name, component in self._components(index).items():
            if name == "update_count":
                component.add_(1)
            elif getattr(metric, name) is not component:  # the update made a new tensor: keep the component's
                component.copy_(getattr(metric, name))
                setattr(metric, name, component)
        self._marks[index].append(_list_lengths(metric))

    def result(self) -> torch.Tensor:
        """Inside a replica: that replica's own ``compute()``. Outside: ``compute()`` on the states combined
        over every replica and worker (across workers a collective: every worker reads)."""
        replica = get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            return _as_number(self._copy()[1].compute(), self.name)
        return _as_number(self._compute(self._combined()), self.name)

    def _compute(self, states: dict):
        if not states["_update_count"]:  # no data yet: 0, as the trainer's own metrics (torchmetrics would warn)
            return torch.zeros(())
        reader = self._reader
        reader.reset()
        for name, default in _defaults(reader).items():
            value = states[name]
            if isinstance(default, list):  # a list state stays a list (torchmetrics' reset clears it in place)
                value = [value] if isinstance(value, torch.Tensor) else list(value)
            setattr(reader, name, value)
        reader._update_count = states["_update_count"]  # private: torchmetrics warns on a compute before an update
        return reader.compute()

    def _combined(self, reduce: bool = True) -> dict:
        """Every state combined over the replicas of every worker by its own reduction, on the first device:
        the variables' aggregates (batched with the other logs' inside ``aggregated_reads``), the other
        states gathered (across workers one ``all_gather``, only for a metric that has such states)."""
        if not self._copies:
            self.build()
        with context.enter_or_assert_strategy(self._strategy):
            read = {name: variable.read_value() for name, variable in self._states.items()}
        states = {"_update_count": int(read.pop("update_count"))}
        states.update({name: value.to(self._devices[0]) for name, value in read.items()})
        others = [name for name in _defaults(self._reader) if name not in self._states]
        if not others:
            return states
        parts = [self._local_part(index, others) for index in range(len(self._copies))]
        cluster = self._strategy.cluster
        if cluster.num_workers > 1:
            gathered = cluster.all_gather(parts, f"combining the states of metric {self.name!r}")
            parts = [part for worker in gathered for part in worker]
        states.update(_combine(self._reader, others, parts, self._devices[0], reduce))
        return states

    def _local_part(self, index: int, names: list) -> dict:
        """One copy's ``names`` states, for combining: tensor states as they are, list states concatenated
        with the number of rows each update added (on the CPU when they cross workers)."""
        metric, marks = self._copies[index], self._marks[index]
        crossing = self._strategy.cluster.num_workers > 1
        part = {}
        for name in names:
            value = getattr(metric, name)
            if isinstance(value, torch.Tensor):
                part[name] = value.detach().cpu() if crossing else value.detach()
                continue
            entries = [_at_least_1d(v) for v in value]
            sizes, start = [], 0
            for mark in marks:
                end = mark.get(name, start)
                sizes.append(sum(int(e.shape[0]) for e in entries[start:end]))
                start = end
            rows = torch.cat(entries) if entries else None
            part[name] = (rows.cpu() if crossing and rows is not None else rows, sizes)
        return part

    # --- checkpoints and backups ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The combined states (list states concatenated in input order) and the update count: what
        ``load_state_dict`` restores under any strategy. Across workers a collective."""
        if not self._copies:
            return {}
        states = self._combined(reduce=False)
        count = torch.tensor(states.pop("_update_count"))
        empty = torch.zeros(0)  # a list state without rows (a backup holds tensors only)
        return {
            "_update_count": count,
            **{
                name: value.detach().clone() if isinstance(value, torch.Tensor) else empty
                for name, value in states.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()``: the first replica's copy takes the combined states (a ``"mean"``,
        ``"min"`` or ``"max"`` state every copy), the others start from their defaults; reads then give the
        saved value, and later updates add to it. (A backup also holds each replica's own variables, which
        ``CompileMetrics`` gives back on as many replicas.)"""
        if not self._copies:
            self.build()
        self.reset_state()
        if not state:
            return
        count = int(state.get("_update_count", 0))
        for index, (metric, device) in enumerate(zip(self._copies, self._devices)):
            for name in _defaults(metric):
                if name not in state:
                    continue
                value = state[name]
                if isinstance(getattr(metric, name), list):
                    if index == 0 and value.numel():
                        getattr(metric, name).append(value.to(device))
                elif index == 0 or _keeps_value(_reduction_name(metric, name)):
                    self._set_state(index, name, value.to(device))
            metric._update_count = count if index == 0 else 0  # private: torchmetrics' count of updates, restored
            self._components(index)["update_count"].fill_(count if index == 0 else 0)
            self._marks[index].append(_list_lengths(metric))

    def saved_layout(self, state: dict) -> dict:
        """The state names, with the shapes of the tensor states whose shape never changes (a list state's
        length grows with the data)."""
        fixed = {n for n, v in _defaults(self._reader).items() if isinstance(v, torch.Tensor)}
        return {
            name: (list(value.shape) if name in fixed and isinstance(value, torch.Tensor) else None)
            for name, value in state.items()
        }

    def local_values(self) -> list:
        """This worker's copies' states, copied (no communication): what ``load_local_values`` puts back."""
        return [
            (
                {name: _clone(getattr(metric, name)) for name in _defaults(metric)},
                metric.update_count,
                [dict(mark) for mark in marks],
            )
            for metric, marks in zip(self._copies, self._marks)
        ]

    def load_local_values(self, values: list) -> None:
        """Gives this worker's copies the states of ``local_values``."""
        for index, (metric, (states, count, _)) in enumerate(zip(self._copies, values)):
            for name, value in states.items():
                self._set_state(index, name, _clone(value))
            metric._update_count = count  # private: torchmetrics' count of updates, restored
            metric._computed = None  # private: torchmetrics' cached result
            self._components(index)["update_count"].fill_(count)
        self._marks = [[dict(mark) for mark in marks] for _, _, marks in values]

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


def _reduction_name(metric, name: str) -> str:
    reduction = metric._reductions[name]  # private: torchmetrics' dist_reduce_fx per state (no public accessor)
    return getattr(reduction, "__name__", "") if reduction is not None else ""


def _combine(reader, names: list, parts: list, device, reduce: bool = True) -> dict:
    """The ``names`` states of ``parts`` (``_local_part`` of every replica, in global replica order) combined
    by their reductions as torchmetrics' own synchronisation does: tensor states stacked and reduced; list
    states concatenated update by update, replica by replica (the input's order), then reduced (``reduce``;
    else concatenated, as a backup keeps them)."""
    states = {}
    for name in names:
        reduction = reader._reductions[name]  # private: torchmetrics' dist_reduce_fx per state
        values = [part[name] for part in parts]
        if not isinstance(values[0], tuple):
            stacked = torch.stack([v.to(device) for v in values])
            states[name] = reduction(stacked) if reduction is not None else stacked
            continue
        per_replica = [list(torch.split(rows.to(device), sizes)) if rows is not None else [] for rows, sizes in values]
        steps = max(len(chunks) for chunks in per_replica)
        ordered = [
            chunks[step] for step in range(steps) for chunks in per_replica if step < len(chunks) and len(chunks[step])
        ]
        if not reduce or _is_cat(reduction):
            states[name] = torch.cat(ordered) if ordered else []
        else:
            states[name] = reduction(ordered) if reduction is not None else ordered
    return states


def _is_cat(reduction) -> bool:
    return getattr(reduction, "__name__", "") == "dim_zero_cat"


def _keeps_value(reduction: str) -> bool:
    """Whether combining equal copies gives the value back (mean, min, max): every copy restores it."""
    return reduction in ("dim_zero_mean", "dim_zero_min", "dim_zero_max")


def _list_lengths(metric) -> dict:
    states = ((name, getattr(metric, name)) for name in _defaults(metric))
    return {name: len(value) for name, value in states if isinstance(value, list)}


def _defaults(metric) -> dict:
    """``{state name: its default}`` of a torchmetrics metric (a list default: a list state)."""
    return metric._defaults  # private: torchmetrics' declared states (torchmetrics has no public accessor)


def _at_least_1d(value: torch.Tensor) -> torch.Tensor:
    return value.unsqueeze(0) if value.dim() == 0 else value


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
