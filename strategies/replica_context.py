"""The replica context: what a replica function sees of its replica, and its collectives.

Inside ``strategy.run`` each replica's function gets its ``ReplicaContext`` from
``get_replica_context()`` (``tf.distribute.ReplicaContext``): its replica id, devices and
strategy, and the collectives ``merge_call``, ``all_reduce`` and ``all_gather``. Each collective
is a ``merge_call`` (of a merge function from ``merge_fns.py`` for the last two), handed to the
rendezvous of the call (``rendezvous.py``); a context without one (a single replica, the default
strategy) runs ``merge_fn`` at once. ``all_reduce`` and ``all_gather`` are differentiable: their
gradient is another collective, met in the backward pass (``_AllReduce``, ``_AllGather``). The
runner (``runner.py``) gives every replica its context; ``DefaultReplicaContext`` is the default
strategy's.
"""

from __future__ import annotations

import torch

from . import context, nest
from .cooperative import _backward_needs_threads
from .merge_fns import _batch_all_gather, _batch_all_reduce
from .reduce_util import ReduceOp, as_reduce_op

__all__ = ["ReplicaContext"]


def require_replica_context(replica_ctx) -> None:
    current = context.current_mode().replica_context
    if current is replica_ctx:
        return
    if current is None:
        raise RuntimeError(
            "Need to be inside `call_for_each_replica()`: this ReplicaContext's merge_call/all_reduce/"
            "all_gather can only be called from its own replica function (inside strategy.run())."
        )
    if current.strategy is replica_ctx.strategy:
        raise RuntimeError("Mismatching ReplicaContext: this replica context belongs to another replica or run.")
    raise RuntimeError(f"Mismatching tf.distribute.Strategy objects: {current.strategy} is not {replica_ctx.strategy}.")


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Example::

        def step(x):
            ctx = ds.get_replica_context()
            total = ctx.all_reduce("SUM", x.sum())          # same value on every replica
            return total, ctx.replica_id_in_sync_group

        strategy.run(step, args=(per_replica_batch,))
    """

    _is_default = False

    def __init__(self, strategy, replica_id: int, state=None):
        self._strategy = strategy
        self._replica_id = replica_id
        self._state = state

    @property
    def strategy(self):
        """The strategy running this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in every reduction, those of all workers (the strategy's)."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, ``0 <= id < num_replicas_in_sync`` (a Python int).

        Global across workers (``worker_index * local replicas + local index``) under
        ``MultiWorkerMirroredStrategy``, as in TensorFlow.
        """
        return self._replica_id + self._strategy.extended._replica_id_offset

    @property
    def devices(self) -> tuple:
        """The device(s) of this replica."""
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every replica must call it. Arguments are regrouped across replicas (values
        that differ become ``PerReplica``; the same object on every replica stays
        itself); each replica gets its own part of the result.

        Example::

            def merge_fn(strategy, value):
                return strategy.reduce("SUM", value, axis=None)

            def step():
                ctx = ds.get_replica_context()
                return ctx.merge_call(merge_fn, args=(torch.tensor(1.0),))
        """
        require_replica_context(self)
        return self._merge_call(merge_fn, tuple(args), dict(kwargs or {}))

    def _merge_call(self, merge_fn, args, kwargs):
        if self._state is None:
            strategy = self._strategy
            with context.entered(context.Mode(strategy, None, strategy)):
                return merge_fn(strategy, *args, **kwargs)
        return self._state.merge_call(self._replica_id, merge_fn, args, kwargs)

    def all_reduce(self, reduce_op, value, options=None):
        """Reduces ``value`` (any nest of tensors) across replicas in one batched reduction.

        Every replica gets the result. Gradients flow: the gradient of an all-reduce is
        the same all-reduce of the incoming gradients.
        """
        require_replica_context(self)
        op = as_reduce_op(reduce_op)
        flat = [_as_tensor(v) for v in nest.flatten(value)]
        if self._state is None and self._strategy.num_replicas_in_sync == 1:
            return nest.pack_sequence_as(value, flat)
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            prepare_backward_collective(self)
            reduced = _AllReduce.apply(self, op, options, *flat)
        else:
            reduced = self._merge_call(_batch_all_reduce, (op, flat, options), {})
        return nest.pack_sequence_as(value, list(reduced))

    def all_gather(self, value, axis: int, options=None):
        """Concatenates ``value`` (any nest of tensors) of every replica along ``axis``.

        Shapes may differ only along ``axis``. Gradients flow back to each replica's slice.
        """
        require_replica_context(self)
        flat = [_as_tensor(v) for v in nest.flatten(value)]
        if self._state is None and self._strategy.num_replicas_in_sync == 1:
            return nest.pack_sequence_as(value, flat)
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            prepare_backward_collective(self)
            gathered = _AllGather.apply(self, axis, options, *flat)
        else:
            gathered = [g for g, _ in self._merge_call(_batch_all_gather, (axis, flat), {})]
        return nest.pack_sequence_as(value, list(gathered))

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r}, replica_id_in_sync_group={self.replica_id_in_sync_group})"


class DefaultReplicaContext(ReplicaContext):
    """The replica context of the default strategy (outside any scope): one replica, inline."""

    _is_default = True


def prepare_backward_collective(replica_ctx, what: str = "A differentiable all_reduce/all_gather") -> None:
    """Before a replica records a collective that its backward pass will meet: replicas taking turns on
    one thread start again on threads (``_backward_needs_threads``; ``what`` names the collective in the
    error where they cannot). On threads, replicas on an accelerator run their backward passes on their
    own threads (``runner.py``), so they meet there."""
    _backward_needs_threads(replica_ctx._state, what)


def _as_tensor(value):
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, replica_ctx, op, options, *tensors):
        ctx.replica_ctx, ctx.op, ctx.options = replica_ctx, op, options
        return tuple(replica_ctx._merge_call(_batch_all_reduce, (op, list(tensors), options), {}))

    @staticmethod
    def backward(ctx, *grads):
        reduced = ctx.replica_ctx._merge_call(_batch_all_reduce, (ctx.op, list(grads), ctx.options), {})
        return (None, None, None, *reduced)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, replica_ctx, axis, options, *tensors):
        ctx.replica_ctx, ctx.axis, ctx.options = replica_ctx, axis, options
        results = replica_ctx._merge_call(_batch_all_gather, (axis, list(tensors), True), {})
        ctx.sizes = [sizes.value for _, sizes in results]
        return tuple(g for g, _ in results)

    @staticmethod
    def backward(ctx, *grads):
        reduced = ctx.replica_ctx._merge_call(_batch_all_reduce, (ReduceOp.SUM, list(grads), ctx.options), {})
        replica_id = ctx.replica_ctx.replica_id_in_sync_group  # sizes are of every replica, all workers
        out = []
        for grad, sizes in zip(reduced, ctx.sizes):
            start = sum(sizes[:replica_id])
            out.append(grad.narrow(ctx.axis, start, sizes[replica_id]))
        return (None, None, None, *out)
