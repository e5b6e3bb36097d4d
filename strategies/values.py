"""Distributed values: one value per replica, and the rules that group and split them.

``PerReplica`` holds values that differ per replica (the result of ``strategy.run``,
a split batch). ``Mirrored`` holds values known to be equal on every replica (the
result of ``reduce_to``/``batch_reduce_to``/``update``). Both are plain containers
with ``.values``; only variables act as tensors.

Example::

    >>> import torch, replicafit.strategies as ds
    >>> pr = ds.PerReplica((torch.tensor(1.0), torch.tensor(2.0)))
    >>> pr.values
    (tensor(1.), tensor(2.))
    >>> print(pr)
    PerReplica:{
      0: tensor(1.),
      1: tensor(2.)
    }
"""

from __future__ import annotations

import functools

from . import context, nest
from .devices import canonicalize
from .operators import BINARY, CONVERSIONS, UNARY

__all__ = [
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "regroup",
    "select_replica",
    "local_results",
    "value_container",
]


class DistributedValues:
    """Base class of values with one component per replica (``.values``).

    Args:
      values: the components, one per replica, in replica order.
      devices: the (canonical) device of each component; inferred from the current
        strategy when omitted.
    """

    _is_variable = False

    def __init__(self, values, devices=None):
        self._values = tuple(values)
        self._devices = tuple(devices) if devices is not None else _infer_devices(self._values)

    @property
    def values(self) -> tuple:
        """The components, one per replica, in replica order."""
        return self._values

    @property
    def devices(self) -> tuple:
        """The canonical device of each component (given, or inferred when the value was made)."""
        return self._devices

    @classmethod
    def _make(cls, values: tuple, devices: tuple):
        """Builds one from a tuple of components and their devices, without checks (hot paths)."""
        obj = cls.__new__(cls)
        obj._values = values
        obj._devices = devices
        return obj

    def _local_results(self) -> tuple:
        return self._values

    def _get(self):
        """The component of the replica running this code (component 0 elsewhere)."""
        return self._values[_local_index(len(self._values))]

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    __str__ = __repr__


def _not_a_tensor(self, *args, **kwargs):
    kind = type(self).__name__
    raise TypeError(
        f"A {kind} holds one value per replica and is not a tensor. Pass it to strategy.run(fn, "
        f"args=(value,)) so that each replica gets its own component, reduce it with strategy.reduce(...), or "
        f"take its components with strategy.experimental_local_results(value)."
    )


class _Container(DistributedValues):
    """``PerReplica``/``Mirrored``: containers, not tensors (operators explain what to do instead)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for leaf in nest.flatten(list(args)):
            if isinstance(leaf, _Container):
                _not_a_tensor(leaf)
        return NotImplemented


for _name in (*BINARY, *UNARY, *CONVERSIONS):  # the one operator table (operators.py)
    setattr(_Container, _name, _not_a_tensor)
_Container.__hash__ = object.__hash__


def check_component_counts(structure, count: int, what: str) -> None:
    """Raises when a PerReplica/Mirrored in ``structure`` does not have ``count`` components."""
    for leaf in nest.flatten(structure):
        if isinstance(leaf, DistributedValues) and not leaf._is_variable and len(leaf._values) != count:
            raise ValueError(
                f"{what} holds a {type(leaf).__name__} with {len(leaf._values)} components, but the strategy has "
                f"{count} replicas: a distributed value must have one component per replica (make it with the "
                "same strategy, e.g. experimental_distribute_values_from_function)."
            )


class PerReplica(_Container):
    """Values that may differ per replica: what ``strategy.run`` returns.

    Passed to ``strategy.run``, each replica receives its own component.

    Example::

        out = strategy.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
        strategy.experimental_local_results(out)   # (0, 1)
    """


class Mirrored(_Container):
    """Values equal on every replica, each component on its replica's device.

    Returned by ``extended.reduce_to``/``batch_reduce_to`` (several destinations) and
    ``extended.update``. Passed to ``strategy.run``, each replica receives its copy.
    Components on logical CPU devices may share one host tensor: treat them as
    read-only.
    """


def _local_index(count: int) -> int:
    mode = context.current_mode()
    if mode.update_replica is not None and mode.update_replica < count:
        return mode.update_replica
    ctx = mode.replica_context
    if ctx is not None:
        replica_id = ctx._replica_id  # this worker's index of the replica
        if replica_id < count:
            return replica_id
    return 0


def _infer_devices(values) -> tuple:
    """The current strategy's replica devices when the count matches, else each value's device."""
    strategy = context.get_strategy()
    worker_devices = strategy.extended.worker_devices
    if len(worker_devices) == len(values):
        return tuple(worker_devices)
    out = []
    for v in values:
        device = getattr(v, "device", None)
        out.append(canonicalize(device) if device is not None else worker_devices[0])
    return tuple(out)


def value_container(value):
    """The distributed variable ``value`` is a component of, else ``value`` itself."""
    ref = getattr(value, "_replicafit_container", None)
    if ref is None:
        return value
    container = ref()
    return value if container is None else container


def _regroup_leaf(wrap_class, always_wrap, devices, *leaves):
    # (loops, not all() over generators: this runs per leaf of every merge_call's arguments, every step)
    first = leaves[0]
    if not always_wrap:
        for leaf in leaves:
            if leaf is not first:
                break
        else:
            return value_container(first)
        container = value_container(first)
        if container is not first:
            for leaf in leaves:
                if value_container(leaf) is not container:
                    break
            else:
                return container
    return wrap_class(leaves, devices)


def regroup(per_replica_values, wrap_class=PerReplica, always_wrap=False, devices=None):
    """Groups one nest per replica into one nest of distributed values.

    Per leaf: the very same object on every replica stays that object; components of
    one distributed variable give the variable; anything else becomes
    ``wrap_class(values)``. Nests must have the same shape on every replica.
    """
    values = tuple(per_replica_values)
    if len(values) == 1 and not always_wrap:
        return nest.map_structure(value_container, values[0])
    return nest.map_structure(
        functools.partial(_regroup_leaf, wrap_class, always_wrap, devices),
        *values,
        names=lambda i: f"replica {i}'s value",
    )


def _select_leaf(replica_id, value):
    if isinstance(value, DistributedValues) and not value._is_variable:
        return value._values[replica_id]
    return value


def select_replica(replica_id: int, structure):
    """Replaces every ``PerReplica``/``Mirrored`` leaf by its component ``replica_id``.

    Distributed variables and plain values are left as they are.
    """
    if not nest.is_nested(structure):
        return _select_leaf(replica_id, structure)
    return nest.map_structure(lambda v: _select_leaf(replica_id, v), structure)


def _leaf_results(value):
    method = getattr(value, "_local_results", None)
    return method() if method is not None else None


def local_results(value) -> tuple:
    """The components of ``value`` held by this worker, as a tuple.

    A distributed value gives its components; a nest holding distributed values gives
    one nest per replica (plain leaves repeated); anything else gives ``(value,)``.
    """
    direct = _leaf_results(value)
    if direct is not None:
        return tuple(direct)
    if not nest.is_nested(value):
        return (value,)
    counts = {len(r) for r in map(_leaf_results, nest.flatten(value)) if r is not None}
    if not counts:
        return (value,)
    if len(counts) > 1:
        raise ValueError(f"The distributed values in this nest have different numbers of components: {sorted(counts)}.")
    count = counts.pop()

    def pick(index):
        def leaf(v):
            r = _leaf_results(v)
            return v if r is None else r[index]

        return nest.map_structure(leaf, value)

    return tuple(pick(i) for i in range(count))
