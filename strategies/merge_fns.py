"""The merge functions of the replica collectives, ``all_reduce`` and ``all_gather``.

A collective of replicas is a ``merge_call``: every replica hands in its tensors and one merge
function, run once in cross-replica context, reduces or gathers them with the strategy's
cross-device ops. ``_batch_all_reduce`` and ``_batch_all_gather`` are those functions (the
replica context, ``replica_context.py``, hands them to ``merge_call``); the rendezvous
(``rendezvous.py``) knows them by identity, to check that every replica made the same collective
(``_same_call``) and to name it in its messages (``_describe``). ``PerReplicaConstant`` is a
merge result that every replica gets unchanged. They sit below both, and import only values.
"""

from __future__ import annotations

from .values import Mirrored, PerReplica


def _per_replica(strategy, value):
    if isinstance(value, PerReplica):
        return value
    return PerReplica([value] * strategy.extended._num_local_replicas)


def _owned(result):
    """A Mirrored whose replicas get tensors of their own (reductions share one host tensor).

    Runs inside the merge_fn, before the replicas resume, so no replica can be writing
    to the tensor being copied.
    """
    if not isinstance(result, Mirrored):
        return result
    seen: set = set()
    values = []
    for value in result.values:
        values.append(value.clone() if id(value) in seen else value)
        seen.add(id(value))
    return Mirrored(values, result.devices)


def _batch_all_reduce(strategy, op, flat_values, options):
    values = [_per_replica(strategy, v) for v in flat_values]
    return [_owned(r) for r in strategy.extended.batch_reduce_to(op, [(v, v) for v in values], options)]


def _batch_all_gather(strategy, axis, flat_values, with_sizes=False):
    """The gathered values; with ``with_sizes`` (for the gradient) also every replica's size along
    ``axis``, of every worker (across workers that is one more collective, so only when asked)."""
    out = []
    for value in flat_values:
        value = _per_replica(strategy, value)
        sizes = None
        if with_sizes:
            sizes = tuple(t.shape[axis] if t.dim() > axis else 0 for t in value.values)
            sizes = strategy.extended._all_workers_sizes(sizes)
        out.append((_owned(strategy.extended._gather_to(value, axis, value)), PerReplicaConstant(sizes)))
    return out


class PerReplicaConstant:
    """A merge result passed unchanged to every replica."""

    def __init__(self, value):
        self.value = value


def _describe(merge_fn, args) -> str:
    """What a collective is, for messages: ``all_reduce(SUM, 2 tensors)``, ``merge_call(apply)``."""
    if merge_fn is _batch_all_reduce:
        return f"all_reduce({args[0].value}, {_count(len(args[1]))})"
    if merge_fn is _batch_all_gather:
        return f"all_gather(axis={args[0]}, {_count(len(args[1]))})"
    return f"merge_call({getattr(merge_fn, '__qualname__', type(merge_fn).__name__)})"


def _count(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def _same_call(request) -> tuple:
    """What must agree across replicas at one collective: its kind, and the reduce op or axis.

    Different merge_fns are not compared: as in TensorFlow, replica 0's runs.
    """
    merge_fn, args, _ = request
    if merge_fn is _batch_all_reduce:
        return ("all_reduce", args[0])
    if merge_fn is _batch_all_gather:
        return ("all_gather", args[0])
    return ("merge_call",)
