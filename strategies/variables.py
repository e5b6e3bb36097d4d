"""Variables: a tensor with a name, an aggregation and a synchronization, and their
distributed kinds.

``Variable(...)`` creates, in the current strategy's scope, the variable that strategy
uses: a ``LocalVariable`` (default strategy, OneDevice), a ``MirroredVariable``
(Mirrored), a ``CentralStorageVariable`` (CentralStorage) or, with
``synchronization=ON_READ`` under a strategy with more than one replica, a
``SyncOnReadVariable``. Every kind supports ``assign``/``assign_add``/``assign_sub``,
``read_value()``, ``numpy()``, Python arithmetic, and works as an operand of torch
operations (``__torch_function__``: it stands for its local value).

Assignment follows TensorFlow: in replica context a mirrored variable needs an
aggregation (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``) and the written values are
reduced across replicas; in cross-replica context one value is written to every copy.

Example::

    >>> import replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     v = ds.Variable(1.0, aggregation=ds.VariableAggregation.SUM)
    >>> _ = strategy.run(lambda: v.assign_add(ds.get_replica_context().replica_id_in_sync_group + 1.0))
    >>> [float(c) for c in v.values]      # 1 + (1 + 2) on both copies
    [4.0, 4.0]
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref

import numpy as np
import torch

from . import context
from .devices import torch_device
from .operators import BINARY, EQUALITY, UNARY
from .reduce_util import ReduceOp, VariableAggregation, VariableSynchronization
from .values import DistributedValues, PerReplica, local_results

__all__ = [
    "Variable",
    "LocalVariable",
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "CentralStorageVariable",
]

_ASSIGN_OPS = {
    "assign": torch.Tensor.copy_,
    "assign_add": torch.Tensor.add_,
    "assign_sub": torch.Tensor.sub_,
}


class VariableSpec:
    """Validated arguments of a variable being created."""

    __slots__ = ("initial_value", "trainable", "name", "synchronization", "aggregation")

    def __init__(
        self,
        initial_value,
        trainable=None,
        name=None,
        dtype=None,
        synchronization=VariableSynchronization.AUTO,
        aggregation=VariableAggregation.NONE,
    ):
        name = "Variable" if name is None else str(name)
        try:
            synchronization = VariableSynchronization(synchronization)
        except ValueError:
            raise ValueError(f"Invalid variable synchronization mode: {synchronization} for variable: {name}") from None
        try:
            aggregation = VariableAggregation(aggregation)
        except ValueError:
            raise ValueError(f"Invalid variable aggregation mode: {aggregation} for variable: {name}") from None
        if callable(initial_value) and not isinstance(initial_value, torch.Tensor):
            initial_value = initial_value()
        if isinstance(initial_value, Variable):
            initial_value = initial_value.read_value()
        if isinstance(initial_value, torch.Tensor):
            tensor = initial_value.detach().clone()
            if dtype is not None:
                tensor = tensor.to(dtype)
        else:
            tensor = torch.as_tensor(
                np.asarray(initial_value) if isinstance(initial_value, (list, tuple)) else initial_value, dtype=dtype
            )
            if tensor.dtype == torch.float64 and dtype is None and not isinstance(initial_value, np.ndarray):
                tensor = tensor.to(torch.get_default_dtype())
        if trainable is None:
            trainable = synchronization is not VariableSynchronization.ON_READ
        self.initial_value = tensor
        self.trainable = bool(trainable)
        self.name = name
        self.synchronization = synchronization
        self.aggregation = aggregation

    def check_distributable(self) -> None:
        """The checks TensorFlow makes before creating a distributed variable."""
        if self.synchronization is VariableSynchronization.NONE:
            raise ValueError(
                "`NONE` variable synchronization mode is not supported with tf.distribute strategy. "
                f"Please change the `synchronization` for variable: {self.name}"
            )
        if self.aggregation is VariableAggregation.MEAN and not (
            self.initial_value.is_floating_point() or self.initial_value.is_complex()
        ):
            raise ValueError(
                "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not "
                "supported, please use a different aggregation or dtype"
            )


def _read_one(value):
    return value._read() if isinstance(value, Variable) else value


def _unwrap(value):
    """Replaces variables in (nests of lists/tuples/dicts of) torch-function arguments."""
    if isinstance(value, Variable):
        return value._read()
    if isinstance(value, (list, tuple)):
        items = [_unwrap(v) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else type(value)(*items)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _binary(name):
    op = getattr(torch.Tensor, name)

    def method(self, other):
        return op(self._read(), _read_one(other))

    method.__name__ = name
    return method


def _unary(name):
    op = getattr(torch.Tensor, name)

    def method(self):
        return op(self._read())

    method.__name__ = name
    return method


class _VariableMeta(type):
    def __call__(cls, *args, **kwargs):
        if cls is Variable:
            return _create_in_current_context(VariableSpec(*args, **kwargs))
        return super().__call__(*args, **kwargs)


class Variable(metaclass=_VariableMeta):
    """A variable of the current strategy: ``Variable(initial_value, trainable=None,
    name=None, dtype=None, synchronization=AUTO, aggregation=NONE)``.

    Called directly, it asks the current strategy to create its kind of variable (see
    the module docstring); every kind is an instance of this class. ``initial_value``
    may be a tensor, an array, a number or a callable returning one.
    ``synchronization=ON_READ`` variables are not trainable unless asked.

    Example::

        v = ds.Variable(torch.zeros(3), name="w")
        v.assign_add(torch.ones(3))
        torch.sum(v)        # tensor(3.)
        v * 2               # tensor([2., 2., 2.])
    """

    _is_variable = True
    _after_update = None  # kinds that keep extra copies refresh them here after an update

    # --- what every kind implements ------------------------------------------------
    def _read(self) -> torch.Tensor:
        """The live tensor this variable stands for in the current context."""
        raise NotImplementedError

    def _assign(self, op: str, value):
        raise NotImplementedError

    # --- the public surface ---------------------------------------------------------
    @property
    def name(self) -> str:
        """The name given at creation (``"Variable"`` by default; a parameter's or buffer's name in its module)."""
        return self._name

    @property
    def trainable(self) -> bool:
        """Whether optimizers should update it; fixed at creation (by default ``False`` for ``ON_READ`` variables)."""
        return self._trainable

    @property
    def aggregation(self) -> VariableAggregation:
        """How the replicas' values are combined.

        For writes to a mirrored variable in replica context, and reads of an ``ON_READ`` variable in
        cross-replica context.
        """
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        """When the copies are kept in sync; a ``MirroredVariable`` made with ``AUTO`` has ``ON_WRITE``."""
        return self._synchronization

    @property
    def dtype(self) -> torch.dtype:
        """The ``torch.dtype`` of the value."""
        return self._primary_tensor().dtype

    @property
    def shape(self) -> torch.Size:
        """The ``torch.Size`` of the value (the same on every replica)."""
        return self._primary_tensor().shape

    @property
    def device(self) -> str:
        """The canonical device of the value this context reads (``"cpu:1"``)."""
        return self._device_name()

    @property
    def distribute_strategy(self):
        """The strategy that created this variable (``None`` for the default strategy)."""
        return self._distribute_strategy

    def assign(self, value, read_value: bool = True):
        """Writes ``value`` (see the module docstring for the distributed rules)."""
        result = self._assign("assign", value)
        return result if read_value else None

    def assign_add(self, delta, read_value: bool = True):
        """Adds ``delta`` in place."""
        result = self._assign("assign_add", delta)
        return result if read_value else None

    def assign_sub(self, delta, read_value: bool = True):
        """Subtracts ``delta`` in place."""
        result = self._assign("assign_sub", delta)
        return result if read_value else None

    def assign_component(self, index: int, value) -> None:
        """Writes ``value`` into one of this worker's components alone: ``experimental_local_results(v)[index]``
        (a ``LocalVariable`` is its own only component), with no aggregation and no communication; the
        other components keep theirs. For restoring one replica's own value, such as a ``SyncOnRead``
        metric accumulator saved per replica (a cross-replica ``assign`` of a ``SUM`` variable gives each
        replica a share instead). ``value`` must have the variable's shape.

        Example::

            strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
            with strategy.scope():
                total = ds.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
            total.assign_component(1, 3.0)
            [float(c) for c in strategy.experimental_local_results(total)]  # [0.0, 3.0]
        """
        component = self._local_results()[index]
        tensor = as_assign_value(value, component._tensor, self._name)
        with torch.no_grad():
            component._tensor.copy_(tensor)
        cached = getattr(_aggregates, "values", None)
        if cached:
            cached.pop(id(self), None)  # an aggregate read up front is stale after a write
        if self._after_update is not None:
            self._after_update()  # a copy kept beside the stored value is refreshed

    def value(self) -> torch.Tensor:
        """The tensor this variable stands for here (live: later writes show in it)."""
        return self._read()

    def read_value(self) -> torch.Tensor:
        """A snapshot of the value (later writes do not change it; gradients flow)."""
        return self._read().clone()

    def numpy(self) -> np.ndarray:
        """The value as a NumPy array (a copy)."""
        return self._read().detach().cpu().numpy().copy()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs:
            target = kwargs.get("out", args[0] if args else None)
            if isinstance(target, Variable) and not isinstance(target, LocalVariable):
                raise TypeError(
                    f"{name}() would write into {type(target).__name__} '{target.name}' in place, changing one copy "
                    "only. Use assign(), assign_add() or assign_sub(), or strategy.extended.update(var, fn)."
                )
        return func(*_unwrap(args), **_unwrap(kwargs))

    def copy_tensors(self) -> tuple:
        """Every tensor that holds a copy of this variable: its components' (live) tensors, and with
        central storage the central value and its replicas' copies. For code that writes every copy
        in one kernel (then ``strategy.extended.after_direct_update``), or checks them all.

        Example::

            all(t.grad is None for t in variable.copy_tensors())
        """
        raise NotImplementedError

    def __setattr__(self, name, value):
        if name in ("grad", "requires_grad"):
            # Gradient bookkeeping belongs to every copy, not to this wrapper.
            for tensor in self.copy_tensors():
                setattr(tensor, name, value)
            return
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name.endswith("_") and not isinstance(self, LocalVariable):
            # An in-place tensor method would change one copy only: the replicas would diverge.
            raise AttributeError(
                f"{type(self).__name__} '{self._name}' has no in-place tensor method {name}(): it would change "
                "one copy only. Use assign(), assign_add() or assign_sub(), which keep every copy right, or "
                "strategy.extended.update(var, fn) to run fn on each component."
            )
        return getattr(self._read(), name)

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __bool__(self):
        return bool(self._read().detach())

    def __float__(self):
        return float(self._read().detach())

    def __int__(self):
        return int(self._read().detach())

    def __index__(self):
        return self._read().detach().__index__()

    def __complex__(self):
        return complex(self._read().detach())

    def __len__(self):
        return len(self._read())

    def __iter__(self):
        return iter(self._read())

    def __getitem__(self, index):
        return self._read()[_unwrap(index)]

    def __format__(self, spec):
        return self._read().detach().__format__(spec)

    __hash__ = object.__hash__

    def _value_repr(self) -> str:
        array = self.numpy()
        return repr(array.item()) if array.ndim == 0 else repr(array)

    def _short_repr(self, name=None, device=None) -> str:
        return (
            f"<replicafit.Variable '{name or self.name}' shape={tuple(self.shape)} "
            f"dtype={str(self.dtype).replace('torch.', '')}, device='{device or self.device}', "
            f"numpy={self._value_repr()}>"
        )


for _name in (*BINARY, *EQUALITY):  # the one operator table (operators.py)
    if hasattr(torch.Tensor, _name):
        setattr(Variable, _name, _binary(_name))
for _name in UNARY:
    setattr(Variable, _name, _unary(_name))
Variable.__hash__ = object.__hash__


def as_assign_value(value, like: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` as a tensor of ``like``'s dtype and device, with ``like``'s shape."""
    if isinstance(value, Variable):
        value = value._read()
    elif isinstance(value, DistributedValues):
        value = value._get()
    tensor = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if tensor.shape != like.shape:
        raise ValueError(
            f"Cannot assign a value of shape {tuple(tensor.shape)} to variable '{name}' of shape "
            f"{tuple(like.shape)}; the shapes must match."
        )
    return tensor


class LocalVariable(Variable):
    """A variable holding one tensor on one device.

    What the default strategy and ``OneDeviceStrategy`` create, and the component type
    of distributed variables (one per replica). Writes are always local. Under a
    ``DistributedModule`` the tensor is the module's own parameter or buffer.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        name: str,
        device: str,
        trainable: bool = True,
        aggregation=VariableAggregation.NONE,
        synchronization=VariableSynchronization.AUTO,
        strategy=None,
        replica_id: int = 0,
    ):
        if trainable and (tensor.is_floating_point() or tensor.is_complex()) and tensor.is_leaf:
            tensor.requires_grad_(True)
        self._tensor = tensor
        self._name = name
        self._device = device
        self._trainable = bool(trainable)
        self._aggregation = VariableAggregation(aggregation)
        self._synchronization = VariableSynchronization(synchronization)
        self._distribute_strategy = strategy
        self._replica_id = replica_id

    def _read(self) -> torch.Tensor:
        return self._tensor

    def copy_tensors(self) -> tuple:
        return (self._tensor,)

    def _primary_tensor(self) -> torch.Tensor:
        return self._tensor

    def _device_name(self) -> str:
        return self._device

    def _assign(self, op: str, value):
        if op != "assign" and (type(value) is int or (type(value) is float and self._tensor.is_floating_point())):
            with torch.no_grad():  # a Python number needs no conversion (iterations += 1 every step)
                _ASSIGN_OPS[op](self._tensor, value)
            return self
        tensor = as_assign_value(value, self._tensor, self._name)
        with torch.no_grad():
            _ASSIGN_OPS[op](self._tensor, tensor)
        return self

    def _local_results(self) -> tuple:
        return (self,)

    def __repr__(self) -> str:
        return self._short_repr()


class _ContainerRef(weakref.ref):
    """A tensor's link to the distributed variable it is a component of. It does not travel: a copy or a
    pickle of the tensor (``torch.save(model)``, ``copy.deepcopy``) has none (a plain weak reference
    cannot be pickled at all)."""

    __slots__ = ()

    def __reduce__(self):
        return (type(None), ())  # unpickles as None, with builtins alone


def _link(component, container) -> None:
    ref = _ContainerRef(container)
    component._replicafit_container = ref
    component._tensor._replicafit_container = ref


def _own_replica_context(strategy):
    """The replica context of ``strategy`` running this code, else ``None``."""
    ctx = context.current_mode().replica_context
    if ctx is not None and ctx.strategy is strategy and not ctx._is_default:
        return ctx
    return None


def _assign_component(op):
    def fn(component, value):
        return component._assign(op, value)

    return fn


def _aggregation_error(kind: str, name: str) -> ValueError:
    return ValueError(
        f"You must specify an aggregation method to update a {kind} in Replica Context "
        f"(variable '{name}'). You can do so by passing an explicit value for argument `aggregation` to "
        "replicafit.strategies.Variable(..), e.g. `replicafit.strategies.Variable(..., "
        "aggregation=replicafit.strategies.VariableAggregation.SUM)`; "
        "`replicafit.strategies.VariableAggregation` lists the "
        f"possible aggregation methods. This is required because a {kind} should always be kept in sync: "
        "when updating it in a replica context, the values of the replicas are aggregated before the "
        "update, and the aggregation method says how. Alternatively, update it in cross-replica context: "
        "call `replicafit.strategies.get_replica_context().merge_call(merge_fn, ...)` and, inside `merge_fn`, update "
        "the variable with `strategy.extended.update()`."
    )


def _merge_aggregated_update(strategy, var, op, value):
    """merge_fn of a replica-context write: aggregate the replicas' values, update once."""
    aggregation = var.aggregation
    extended = strategy.extended
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        reduced = extended._from_first_worker(local_results(value)[0])  # replica 0 of worker 0
    else:
        reduced = extended.reduce_to(ReduceOp.from_variable_aggregation(aggregation), value, destinations=var)
    extended.update(var, _assign_component(op), args=(reduced,))
    return var


class DistributedVariable(DistributedValues, Variable):
    """Base of variables with one ``LocalVariable`` component per replica.

    In replica context reads give the replica's component; in cross-replica context
    see the subclasses.
    """

    _is_variable = True

    def __init__(self, strategy, components, *, name, trainable, aggregation, synchronization):
        DistributedValues.__init__(self, components, tuple(c.device for c in components))
        self._distribute_strategy = strategy
        self._name = name
        self._trainable = trainable
        self._aggregation = VariableAggregation(aggregation)
        self._synchronization = VariableSynchronization(synchronization)
        for component in components:
            _link(component, self)

    def _primary_tensor(self) -> torch.Tensor:
        return self._values[0]._tensor

    def copy_tensors(self) -> tuple:
        return tuple(c._tensor for c in self._values)

    def _device_name(self) -> str:
        return self._get()._device

    def _assign(self, op: str, value):
        cached = getattr(_aggregates, "values", None)
        if cached:
            cached.pop(id(self), None)  # an aggregate read up front is stale after a write
        mode = context.current_mode()
        if mode.update_replica is not None and mode.strategy is self._distribute_strategy:
            self._values[mode.update_replica]._assign(op, value)
            return self
        ctx = _own_replica_context(self._distribute_strategy)
        if ctx is not None:
            return self._assign_in_replica(ctx, op, value)
        with context.enter_or_assert_strategy(self._distribute_strategy):
            return self._assign_cross_replica(op, value)

    def _assign_cross_replica(self, op, value):
        self._distribute_strategy.extended.update(self, _assign_component(op), args=(value,))
        return self

    def _short_repr(self, name=None, device=None) -> str:
        return self._values[0]._short_repr()


class MirroredVariable(DistributedVariable):
    """A variable kept equal on every replica (``synchronization=ON_WRITE``).

    Replica context: reads give the local copy; writes need an aggregation and are
    reduced across replicas (``SUM``, ``MEAN``) or take replica 0's value
    (``ONLY_FIRST_REPLICA``), then every copy is updated. Aggregation ``NONE`` raises
    ``ValueError`` there (TensorFlow 2.21 would silently update only the local copy,
    letting the copies diverge). Cross-replica context: reads give copy 0, writes
    write every copy.

    Example::

        with strategy.scope():
            v = ds.Variable(1.0, aggregation="MEAN")
        strategy.run(lambda: v.assign(float(ds.get_replica_context().replica_id_in_sync_group)))
        v.numpy()    # 0.5 (mean of 0 and 1) on every copy
    """

    def _read(self) -> torch.Tensor:
        return self._get()._tensor

    def _assign_cross_replica(self, op, value):
        if isinstance(value, PerReplica):
            raise ValueError(
                f"In cross-replica context a MirroredVariable takes one value for every copy, but {op}() on "
                f"'{self._name}' got a PerReplica. Reduce it first (strategy.extended.reduce_to(op, value, var)), or "
                "write the copies explicitly with strategy.extended.update(var, fn, args=(value,))."
            )
        return super()._assign_cross_replica(op, value)

    def _assign_in_replica(self, ctx, op, value):
        if self._aggregation is VariableAggregation.NONE:
            raise _aggregation_error("MirroredVariable", self._name)
        ctx.merge_call(_merge_aggregated_update, args=(self, op, value))
        return self


class SyncOnReadVariable(DistributedVariable):
    """A variable each replica updates on its own (``synchronization=ON_READ``).

    Replica context: reads and writes use the local copy, without communication.
    Cross-replica context: reads aggregate the copies (``SUM``, ``MEAN``,
    ``ONLY_FIRST_REPLICA``; ``NONE`` cannot be read there); ``assign`` of a ``SUM``
    variable gives each copy ``value / num_replicas`` so the sum reads ``value``,
    other writes go to every copy. Saving saves the aggregate. Metrics use these.

    Example::

        with strategy.scope():
            total = ds.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
        strategy.run(lambda: total.assign_add(1.0))
        total.numpy()     # 2.0 with two replicas
    """

    def _read(self) -> torch.Tensor:
        mode = context.current_mode()
        if mode.update_replica is not None or _own_replica_context(self._distribute_strategy) is not None:
            return self._get()._tensor
        return self._aggregate()

    def _device_name(self) -> str:
        return self._get()._device

    def _aggregate(self) -> torch.Tensor:
        cached = getattr(_aggregates, "values", None)
        if cached:
            value = cached.get(id(self))
            if value is not None:
                return value
        aggregation = self._aggregation
        extended = self._distribute_strategy.extended
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return extended._from_first_worker(self._values[0]._tensor)
        op = ReduceOp.from_variable_aggregation(aggregation)
        tensors = [c._tensor for c in self._values]
        return extended._reduce_tensors(op, tensors, self._values[0]._device)

    def _assign_in_replica(self, ctx, op, value):
        self._get()._assign(op, value)
        return self

    def _assign_cross_replica(self, op, value):
        if self._aggregation is VariableAggregation.SUM:
            if op != "assign":
                raise ValueError(
                    f"SyncOnReadVariable does not support `{op}` in cross-replica context when aggregation "
                    "is set to `tf.VariableAggregation.SUM`."
                )
            # Each copy gets its share, so that reading the SUM gives the value back (all workers' copies).
            count = self._distribute_strategy.num_replicas_in_sync

            def share(item):
                tensor = as_assign_value(item, self._primary_tensor(), self._name)
                return (tensor / count).to(tensor.dtype)

            if isinstance(value, DistributedValues) and not value._is_variable:
                value = type(value)([share(v) for v in value.values], value.devices)
            else:
                value = share(value)
        return super()._assign_cross_replica(op, value)


_aggregates = threading.local()


@contextlib.contextmanager
def aggregated_reads(variables):
    """Inside the block, cross-replica reads of these ``SyncOnRead`` variables (``SUM``/``MEAN``/
    ``ONLY_FIRST_REPLICA``) return aggregates computed on entry in one batched reduction per op and
    strategy (one broadcast per dtype of the first replicas' values), instead of one reduction per read
    (across workers each is a collective). Results are bit-identical to
    reading them one by one; a write to one of them drops its aggregate.

    Example::

        with aggregated_reads([v for m in metrics for v in m.variables]):
            logs = {m.name: float(m.result()) for m in metrics}
    """
    groups: dict = {}
    for variable in variables:
        if isinstance(variable, SyncOnReadVariable) and variable.aggregation in (
            VariableAggregation.SUM,
            VariableAggregation.MEAN,
            VariableAggregation.ONLY_FIRST_REPLICA,
        ):
            op = variable.aggregation
            if op is not VariableAggregation.ONLY_FIRST_REPLICA:
                op = ReduceOp.from_variable_aggregation(op)
            groups.setdefault((id(variable._distribute_strategy), op), []).append(variable)
    computed: dict = {}
    for (_, op), members in groups.items():
        extended = members[0]._distribute_strategy.extended
        if op is VariableAggregation.ONLY_FIRST_REPLICA:  # across workers: one broadcast per dtype
            firsts = extended._from_first_worker_many([v._values[0]._tensor for v in members])
            computed.update({id(v): first for v, first in zip(members, firsts)})
            continue
        with context.enter_or_assert_strategy(members[0]._distribute_strategy):
            pairs = []
            for v in members:
                device = v._values[0]._device
                tensors = [c._tensor for c in v._values]
                pairs.append((PerReplica(tensors, (device,) * len(tensors)), device))
            reduced = extended._cross_device_ops.batch_reduce(op, pairs, extended._options)
        computed.update({id(v): r for v, r in zip(members, reduced)})
    outer = getattr(_aggregates, "values", None)
    _aggregates.values = {**(outer or {}), **computed}
    try:
        yield
    finally:
        _aggregates.values = outer


class CentralStorageVariable(Variable):
    """A variable stored once, on the parameter device of a ``CentralStorageStrategy``.

    Replicas read a copy on their compute device (the same tensor where the compute
    device shares the parameter device's memory); copies are refreshed after every
    update. Writes in replica context are aggregated like a mirrored variable's, then
    applied once. ``experimental_local_results`` gives ``(the stored variable,)``.

    Example::

        strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu:0")
        with strategy.scope():
            v = ds.Variable(1.0)
        v.values            # (<replicafit.Variable 'Variable' ... device='cpu:0' ...>,)
    """

    def __init__(self, strategy, primary: LocalVariable, replica_tensors=None):
        self._distribute_strategy = strategy
        self._primary = primary
        self._name = primary._name
        self._trainable = primary._trainable
        self._aggregation = primary._aggregation
        self._synchronization = primary._synchronization
        devices = strategy.extended.worker_devices
        if replica_tensors is None:
            replica_tensors = [self._copy_for(device, i) for i, device in enumerate(devices)]
        self._replica_tensors = tuple(replica_tensors)
        source = primary._tensor
        # Copies in other memory are refreshed after each update; the rest share storage.
        self._stale_copies = tuple(
            t for t in self._replica_tensors if t.device != source.device or t.data_ptr() != source.data_ptr()
        )
        _link(primary, self)
        for tensor in self._replica_tensors:
            tensor._replicafit_container = primary._replicafit_container

    def _copy_for(self, device, replica_id):
        """Replica ``replica_id``'s tensor: its own autograd leaf, sharing storage where memory is shared."""
        source = self._primary._tensor
        target = torch_device(device)
        if source.device == target:
            if replica_id == 0:
                return source
            return source.detach().requires_grad_(source.requires_grad)
        return source.detach().to(target).requires_grad_(source.requires_grad)

    @property
    def values(self) -> tuple:
        """A tuple of the stored variable alone, one ``LocalVariable`` on the parameter device (not one per replica)."""
        return (self._primary,)

    def _local_results(self) -> tuple:
        return (self._primary,)

    def _primary_tensor(self) -> torch.Tensor:
        return self._primary._tensor

    def copy_tensors(self) -> tuple:
        tensors = [self._primary._tensor]
        tensors += [t for t in self._replica_tensors if t is not tensors[0]]
        return tuple(tensors)

    def _read(self) -> torch.Tensor:
        ctx = _own_replica_context(self._distribute_strategy)
        if ctx is not None:
            return self._replica_tensors[ctx._replica_id]
        return self._primary._tensor

    def _device_name(self) -> str:
        ctx = _own_replica_context(self._distribute_strategy)
        if ctx is not None:
            return self._distribute_strategy.extended.worker_devices[ctx._replica_id]
        return self._primary._device

    def _after_update(self) -> None:
        """Refreshes the replicas' copies from the stored value."""
        source = self._primary._tensor
        with torch.no_grad():
            for tensor in self._stale_copies:
                tensor.copy_(source)

    def _assign(self, op: str, value):
        ctx = _own_replica_context(self._distribute_strategy)
        if ctx is not None:
            if self._aggregation is VariableAggregation.NONE:
                raise _aggregation_error("CentralStorageVariable", self._name)
            ctx.merge_call(_merge_aggregated_update, args=(self, op, value))
            return self
        mode = context.current_mode()
        if mode.update_replica is not None and mode.strategy is self._distribute_strategy:
            self._primary._assign(op, value)
            self._after_update()
            return self
        with context.enter_or_assert_strategy(self._distribute_strategy):
            self._distribute_strategy.extended.update(self, _assign_component(op), args=(value,))
        return self

    def __repr__(self) -> str:
        return f"CentralStorageVariable:{{\n  {self._primary._device}: {self._primary._short_repr()}\n}}"


def _create_in_current_context(spec: VariableSpec):
    mode = context.current_mode()
    ctx = mode.replica_context
    if ctx is not None and not ctx._is_default:
        # Created inside strategy.run: every replica asks, the variable is made once
        # (from replica 0's initial value) and shared, as TensorFlow does.
        return ctx.merge_call(_merge_create_variable, args=(spec,))
    return mode.strategy.extended._create_variable(spec)


def canonical_name(name: str) -> str:
    """TensorFlow's canonical variable name: ``foo_1`` and ``scope_1/foo`` match ``foo``/``scope/foo``."""
    return re.sub(r"_\d$", "", re.sub(r"_\d/", "/", name))


def _merge_create_variable(strategy, spec):
    specs = local_results(spec)
    for replica_id, other in enumerate(specs):
        if canonical_name(other.name) != canonical_name(specs[0].name):
            raise RuntimeError(
                f"Tried to create variable {other.name} with mismatching name on device {replica_id}: replica 0 "
                f"created {specs[0].name!r}; every replica must create the same variables in the same order."
            )
    return strategy.extended._create_variable(specs[0])


def first_tensor(value) -> torch.Tensor:
    """The tensor of ``value``'s first local copy: a tensor itself, a variable's value (its first component's
    for a distributed one), a distributed value's first component, or anything ``torch.as_tensor`` takes.

    Example::

        first_tensor(mirrored_variable)   # replica 0's tensor
    """
    if type(value) is torch.Tensor:
        return value
    first = local_results(value)[0]
    if isinstance(first, Variable):
        first = first.value()
    return first if isinstance(first, torch.Tensor) else torch.as_tensor(first)
