"""``Strategy``: the public API of a distribution strategy (``tf.distribute.Strategy``).

Each method checks its arguments and context, then asks ``strategy.extended`` (``extended.py``), whose hooks
a concrete strategy overrides. The rest of the old ``distribute_lib`` lives beside it: the scope
(``scope.py``), the kinds of variables (``variable_factory.py``), the default strategy in force outside any
scope (``default_strategy.py``), the input layer the dataset methods hand their dataset to
(``input_layer.py``) and TensorFlow 1's members (``v1.py``).

Example::

    >>> import torch, replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> out = strategy.run(lambda: torch.tensor(float(ds.get_replica_context().replica_id_in_sync_group)))
    >>> strategy.reduce("SUM", out, axis=None)
    tensor(1.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import context, nest, v1
from .cluster import Cluster
from .cross_device_ops import component_tensors
from .extended import StrategyExtended, tensor_of
from .input_layer import input_layer
from .reduce_util import CommunicationOptions, ReduceOp, as_reduce_op
from .scope import StrategyScope, require_cross_replica
from .values import DistributedValues, Mirrored, check_component_counts, local_results, regroup
from .variables import MirroredVariable

__all__ = ["Strategy", "StrategyExtended", "ValueContext"]


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` is told.

    Example::

        def value_fn(ctx):
            return torch.tensor(float(ctx.replica_id_in_sync_group))

        strategy.experimental_distribute_values_from_function(value_fn)   # PerReplica{0: 0., 1: 1.}
    """

    __slots__ = ("_replica_id", "_num_replicas")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id = replica_id_in_sync_group
        self._num_replicas = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica the value is for, ``0 <= id < num_replicas_in_sync``.

        Global across workers: a worker's ``value_fn`` is called with the ids of its own replicas only.
        """
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas the strategy has in all (those of every worker)."""
        return self._num_replicas

    def __str__(self) -> str:
        return (
            f"tf.distribute.ValueContext(replica id {self._replica_id},  total replicas in sync: {self._num_replicas})"
        )

    __repr__ = __str__


class Strategy:
    """A distribution strategy: how computation and variables are spread over replicas.

    Use one of ``OneDeviceStrategy``, ``MirroredStrategy``, ``CentralStorageStrategy``;
    the default strategy (``ds.get_strategy()`` outside any scope) runs one
    replica on torch's current device.

    Example::

        strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            v = ds.Variable(1.0)                        # a MirroredVariable

        def step(x):
            return x * v

        out = strategy.run(step, args=(per_replica_x,))          # PerReplica
        strategy.reduce("SUM", out, axis=0)
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended

    # --- basics ----------------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        """The strategy's ``StrategyExtended``, with devices, reductions and updates (the advanced API)."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in every reduction (all workers)."""
        return self._extended._num_replicas_in_sync

    @property
    def cluster(self) -> Cluster:
        """The cluster contract (``cluster.py``), what a layer above may ask about the workers.

        Whether this worker is the chief, how many workers and which one this is; broadcast from
        the chief, gather from every worker, agree on a flag or a sum, a barrier. A cluster of one
        (no communication) except across the processes of a ``MultiWorkerMirroredStrategy``. Not in
        TensorFlow, whose layers above read the cluster resolver and the strategy's internals.

        Example::

            if strategy.cluster.is_chief:
                save(model)
            strategy.cluster.barrier("saved")
        """
        return self._extended.cluster

    def scope(self):
        """Enters this strategy's cross-replica context; variables made inside are distributed.

        Re-entering the same strategy's scope is fine; entering a different strategy's
        scope inside it raises ``RuntimeError("Mixing different ... Strategy objects ...")``.
        """
        return StrategyScope(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self._extended.worker_devices})"

    # --- running replicas -------------------------------------------------------------
    def run(self, fn, args=(), kwargs=None, options=None):
        """Calls ``fn(*args, **kwargs)`` once per replica, in that replica's context.

        ``PerReplica``/``Mirrored`` arguments give each replica its component;
        distributed variables and other values are passed as they are. Returns the
        replicas' results regrouped: a ``PerReplica`` per leaf, the object itself where
        every replica returned the very same object, a plain value with one replica.
        Nests keep their shape. ``options`` may be a ``CommunicationOptions`` whose
        ``timeout_seconds`` bounds every ``merge_call``/collective wait of this call
        (``TimeoutError`` naming the replicas that did not arrive).

        Example::

            def step(x):
                return {"double": 2 * x, "id": ds.get_replica_context().replica_id_in_sync_group}

            strategy.run(step, args=(dist_x,))
        """
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"positional args must be a list or tuple, got {type(args)}")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError(f"kwargs must be a mapping, got {type(kwargs)}")
        timeout = None
        if isinstance(options, CommunicationOptions):
            timeout = options.timeout_seconds
        elif options is not None:
            raise TypeError(
                f"run(options=...) takes a replicafit.strategies.CommunicationOptions or None, got {options!r}."
            )
        if args or kwargs:
            check_component_counts((args, kwargs), self._extended._num_local_replicas, "An argument of strategy.run()")
        with StrategyScope(self):
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}), timeout)

    experimental_run_v2 = run

    def experimental_run(self, fn, input_iterator=None):
        """v1: runs ``fn`` per replica on one ``get_next()`` of ``input_iterator`` (if any)."""
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(input_iterator.get_next(),))

    # --- reductions -------------------------------------------------------------------
    def reduce(self, reduce_op, value, axis=None):
        """Reduces ``value`` across replicas (and along ``axis``) to one tensor.

        ``axis=None`` combines the replicas' values (same shape on every replica);
        ``axis=k`` also reduces dimension ``k`` inside each replica, and ``MEAN`` then
        divides by the total count along ``k`` (a batch split ``[4, 2]`` divides by 6;
        empty replicas count 0). A value that is not distributed is the same value on
        every replica: ``SUM`` of ``t`` is ``t * num_replicas_in_sync``, ``MEAN`` is
        ``t``. (TensorFlow raises for ``SUM`` of a plain value with ``axis=None``.)
        Nests are reduced leaf by leaf. The result lives on the first replica's device.

        Example::

            per_example_loss = strategy.run(step, args=(batch,))
            strategy.reduce("MEAN", per_example_loss, axis=0)      # the global mean
        """
        require_cross_replica(self)
        op = as_reduce_op(reduce_op)
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise TypeError(f"`axis` must be None or an int, got {axis!r}.")
        with context.enter_or_assert_strategy(self):
            return nest.map_structure(lambda leaf: self._reduce_leaf(op, leaf, axis), value)

    def _reduce_leaf(self, op, value, axis):
        value = self._extended._as_local_replicas(value)
        device = self._extended.worker_devices[0]
        count = self.num_replicas_in_sync
        distributed = isinstance(value, DistributedValues)
        tensors = component_tensors(value) if distributed else [tensor_of(value)]
        if axis is None:
            if distributed:
                if isinstance(value, Mirrored | MirroredVariable) and op is ReduceOp.MEAN:
                    return tensors[0].clone()  # equal everywhere already; a snapshot, not the live copy
                return self._extended._reduce_tensors(op, tensors, device)
            return tensors[0] * count if op is ReduceOp.SUM and count != 1 else tensors[0]
        for t in tensors:
            if not -t.dim() <= axis < t.dim():
                raise ValueError(
                    f"Invalid reduction axis {axis} for per-replica values of shape {tuple(t.shape)}; use "
                    "axis=None to combine whole values across replicas."
                )
        # Integers keep their dtype (torch would widen them to int64), as TensorFlow does.
        sums = [t.sum(dim=axis, dtype=t.dtype if _is_integer(t) else None) for t in tensors]
        total = self._extended._reduce_tensors(ReduceOp.SUM, sums, device)
        if not distributed and count != 1:
            total = total * count
        if op is ReduceOp.SUM:
            return total
        if distributed:
            elements = self._extended.cluster.sum(sum(t.shape[axis] for t in tensors), "reduce (the global row count)")
        else:
            elements = tensors[0].shape[axis] * count
        return total / elements

    def gather(self, value, axis: int):
        """Concatenates the replicas' values along ``axis`` (sizes on ``axis`` may differ).

        A value that is not distributed is returned as it is.
        """
        require_cross_replica(
            self,
            "replicafit.strategies.Strategy.gather method requires cross-replica context, use "
            "get_replica_context().all_gather() instead",
        )
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise TypeError(f"`axis` must be an int, got {axis!r}.")

        def leaf(v):
            v = self._extended._as_local_replicas(v)
            if not isinstance(v, DistributedValues):
                return v
            return self._extended._gather_to(v, axis, self._extended.worker_devices[0])

        with context.enter_or_assert_strategy(self):
            return nest.map_structure(leaf, value)

    def experimental_local_results(self, value) -> tuple:
        """The components of ``value`` on this worker, as a tuple (``(value,)`` if plain)."""
        return local_results(value)

    unwrap = experimental_local_results

    # --- input (the data layer's, reached as the input layer: input_layer.py) -----------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of ``dataset`` across the replicas (see ``data``).

        Example::

            for batch in strategy.experimental_distribute_dataset(loader):
                strategy.run(step, args=(batch,))
        """
        return input_layer().distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Calls ``dataset_fn(InputContext)`` for per-replica batches (see ``data``)."""
        return input_layer().distribute_datasets_from_function(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_values_from_function(self, value_fn):
        """``value_fn(ValueContext)`` once per replica, grouped into a ``PerReplica``.

        With one replica the value is returned as it is.
        """
        count = self.num_replicas_in_sync
        first = self._extended._replica_id_offset  # this worker's replicas get their global ids
        values = [value_fn(ValueContext(first + i, count)) for i in range(self._extended._num_local_replicas)]
        if len(values) == 1:
            return values[0]
        return regroup(values, always_wrap=True, devices=self._extended.worker_devices)

    def experimental_make_numpy_dataset(self, numpy_input):
        """A nest of arrays as an unbatched ``torch.utils.data.Dataset`` of tensor nests on the host."""
        return input_layer().numpy_dataset(numpy_input)

    def make_dataset_iterator(self, dataset):
        """v1: an iterator (``get_next()``, ``initialize()``) over ``experimental_distribute_dataset``."""
        return v1.make_dataset_iterator(self, dataset)

    def make_input_fn_iterator(self, input_fn, replication_mode=None):
        """v1: an iterator over ``input_fn(InputContext)``'s per-replica batches (PER_WORKER only)."""
        return v1.make_input_fn_iterator(self, input_fn, replication_mode)

    # --- modules ----------------------------------------------------------------------
    def distribute_module(self, module: torch.nn.Module, *, precision: str = "32"):
        """Replicates ``module`` over this strategy's replicas (see ``DistributedModule``). ``precision``: the
        ``Trainer``'s (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``), for a strategy that gathers parameters for the
        forward pass (``FullyShardedStrategy`` gathers them in the compute dtype); the others need not know."""
        from .module import DistributedModule

        return DistributedModule(self, module, precision=precision)

    # --- v1 and housekeeping (v1.py) ---------------------------------------------------------
    def group(self, value, name=None) -> None:
        """Waits until pending work on every device is done; returns ``None``."""
        self._extended._group(value)
        return None

    def experimental_initialize(self) -> list:
        """Returns the initialization work still to run (none for these strategies)."""
        return []

    def experimental_finalize(self) -> list:
        """Returns the finalization work still to run (none for these strategies)."""
        return []

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None) -> None:
        """Cluster set-up for multi-worker strategies; validated and otherwise a no-op here."""
        v1.configure(self, session_config, cluster_spec, task_type, task_id)

    def update_config_proto(self, config):
        """Returns an updated copy of a mapping of runtime settings (never mutates ``config``)."""
        return v1.update_config_proto(config)


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)
