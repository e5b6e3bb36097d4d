"""``Strategy`` and ``StrategyExtended``: the public methods, validated, over a few hooks.

A concrete strategy overrides only the hooks it needs (variable creation, the
devices, the cross-device ops); everything else is shared here. The default strategy
(one replica on torch's current device, identity collectives) is current outside any
scope.

Example::

    >>> import torch, replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> out = strategy.run(lambda: torch.tensor(float(ds.get_replica_context().replica_id_in_sync_group)))
    >>> strategy.reduce("SUM", out, axis=None)
    tensor(1.)
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Mapping

import torch

from . import context, nest
from .cluster import Cluster
from .cross_device_ops import CrossDeviceOps, ReductionToOneDevice, component_tensors, destination_devices
from .devices import default_device, torch_device
from .reduce_util import CommunicationOptions, ReduceOp, VariableSynchronization, as_reduce_op
from .replica_context import DefaultReplicaContext
from .rng import ReplicaStreams
from .runner import ReplicaRunner, inline_call
from .step_values import StepValues, carrier
from .values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    check_component_counts,
    local_results,
    regroup,
    select_replica,
    value_container,
)
from .variables import LocalVariable, MirroredVariable, SyncOnReadVariable, Variable, VariableSpec

__all__ = ["Strategy", "StrategyExtended", "ValueContext"]

_CROSS_REPLICA_ONLY = "Method requires being in cross-replica context, use get_replica_context().merge_call()"


def require_cross_replica(strategy, message: str = _CROSS_REPLICA_ONLY) -> None:
    """Raises unless we are in ``strategy``'s cross-replica context or the default context."""
    mode = context.current_mode()
    ctx = mode.replica_context
    if ctx is not None and not ctx._is_default:
        if ctx.strategy is strategy:
            raise RuntimeError(message)
        raise context.mixing_error(ctx.strategy, strategy)
    if mode.strategy is not strategy and mode.strategy is not context.default_strategy():
        raise context.mixing_error(mode.strategy, strategy)


class _Scope:
    """``strategy.scope()``: enters the strategy's cross-replica context."""

    def __init__(self, strategy):
        self._strategy = strategy
        self._mode = None

    def __enter__(self):
        strategy = self._strategy
        mode = context.current_mode()
        default = context.default_strategy()
        if mode.replica_context is not None and not mode.replica_context._is_default:
            if mode.strategy is strategy:
                raise RuntimeError(_CROSS_REPLICA_ONLY)
            raise context.mixing_error(mode.strategy, strategy)
        if mode.strategy is not strategy and mode.strategy is not default:
            if strategy is default:
                raise RuntimeError("Must not nest tf.distribute.Strategy scopes.")
            raise context.mixing_error(mode.strategy, strategy)
        if strategy is default:
            # The default strategy's scope changes nothing: still its replica context.
            self._mode = context.Mode(strategy, _DEFAULT_REPLICA_CONTEXT, None)
        else:
            self._mode = context.Mode(strategy, None, strategy)
        context.push(self._mode)
        return strategy

    def __exit__(self, *exc):
        context.pop(self._mode)
        return False


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


class StrategyExtended:
    """Advanced members of a strategy (``strategy.extended``): reductions, updates, devices.

    Example::

        def merge_fn(strategy, grad, var):
            reduced = strategy.extended.reduce_to("SUM", grad, destinations=var)
            return strategy.extended.update(var, lambda v, g: v.assign_sub(0.1 * g), args=(reduced,))
    """

    def __init__(
        self,
        strategy,
        worker_devices: tuple,
        parameter_devices: tuple,
        cross_device_ops: CrossDeviceOps | None = None,
        options: CommunicationOptions | None = None,
    ):
        self._strategy_ref = weakref.ref(strategy)
        self._worker_devices = tuple(worker_devices)
        self._parameter_devices = tuple(parameter_devices)
        self._torch_devices = tuple(torch_device(d) for d in self._worker_devices)
        self._cross_device_ops = cross_device_ops or ReductionToOneDevice()
        self._options = options or CommunicationOptions()
        self._colocation = threading.local()
        # Distributed modules with SyncBatchNorm layers: while one trains, the replicas run on threads (module.py).
        self._synchronized_modules = weakref.WeakSet()
        self._runner = None
        if len(self._worker_devices) > 1:
            self._runner = ReplicaRunner(type(strategy).__name__, self._worker_devices, self._torch_devices)
            weakref.finalize(self, self._runner.shutdown)

    @property
    def _strategy(self):
        return self._strategy_ref()

    # --- devices ---------------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple:
        """The devices the replicas run on (canonical strings), in replica order."""
        return self._worker_devices

    @property
    def parameter_devices(self) -> tuple:
        """The devices variables are stored on."""
        return self._parameter_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Whether inputs must have static shapes (TensorFlow's TPU strategies); always ``False`` here.

        Replicas may get batches of different sizes, empty ones included (the split of a partial last batch).
        """
        return False

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints (TensorFlow's name).

        Always, in one process; the chief only, across workers.
        """
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries such as TensorBoard's (TensorFlow's name).

        The same as ``should_checkpoint``.
        """
        return self.should_checkpoint

    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._worker_devices)

    # --- workers (one here; MultiWorkerMirroredStrategy overrides these) -------------
    _replica_id_offset = 0  # global id of this worker's first replica
    _num_workers = 1
    _worker_index = 0

    @property
    def _num_local_replicas(self) -> int:
        """The replicas of this worker (``experimental_local_results`` has this many components)."""
        return len(self._worker_devices)

    def _all_workers_sizes(self, sizes: tuple) -> tuple:
        """The sizes of every replica of every worker, given this worker's (a collective across workers)."""
        return sizes

    @property
    def cluster(self) -> Cluster:
        """The cluster contract (``cluster.py``), what a layer above may ask about the workers.

        One process here: a cluster of one, no communication.
        """
        cluster = self.__dict__.get("_cluster")
        if cluster is None:
            cluster = self.__dict__.setdefault("_cluster", Cluster(self._num_local_replicas, self._step_values))
        return cluster

    def _from_first_worker(self, value):
        """Worker 0's ``value`` (a tensor or number of the same shape on every worker; a collective)."""
        return value

    def _from_first_worker_many(self, tensors: list) -> list:
        """Worker 0's ``tensors`` (the same shapes on every worker): one collective per dtype, not per tensor."""
        return list(tensors)

    def gradient_step(self, variables):
        """A context for one training step whose gradients of ``variables`` may be reduced while
        backward runs: across workers they are all-reduced in buckets started during backward
        (``buckets.py``) and the step's ``batch_reduce_to`` finds them done; in one process there is
        nothing to overlap. The trainer's built-in step uses it.

        Example::

            with strategy.extended.gradient_step(trainable_variables):
                strategy.run(train_step, args=(batch,))
        """
        return contextlib.nullcontext()

    def release_gradient_hooks(self) -> None:
        """Drops what ``gradient_step`` built (the hooks on the model's parameters), e.g. when a
        fit ends."""

    def settle_updates(self) -> None:
        """Makes every variable hold the last update where the strategy let its communication run on past the
        step (sharded optimizer states under ``MultiWorkerMirroredStrategy``); nothing elsewhere.

        Example::

            strategy.extended.settle_updates()   # before reading weights between two built-in steps
        """

    def _as_local_replicas(self, value):
        """``value`` as a distributed value of this worker's replicas where a plain value is
        worker-specific (across workers); unchanged in one process."""
        return value

    def _sync_module_state(self, module: torch.nn.Module) -> None:
        """Makes ``module``'s parameters and buffers worker 0's (before replication)."""

    @property
    def replica_streams(self) -> ReplicaStreams | None:
        """This worker's replicas' random streams (``rng.py``).

        Seeded from a seed and the global replica id, and saved in checkpoints; ``None`` for the default
        strategy, whose one replica draws from torch's global generator as plain torch code does.

        Example::

            strategy.extended.replica_streams.seed(42)
            saved = strategy.extended.replica_streams.state_dict()
        """
        return self._replica_streams

    @property
    def _replica_streams(self) -> ReplicaStreams | None:
        """This worker's replicas' random streams (``rng.py``); None for the default strategy, whose
        one replica draws from torch's global generator as plain torch code does."""
        streams = self.__dict__.get("_streams")
        if streams is None:
            streams = self.__dict__.setdefault("_streams", ReplicaStreams(self._torch_devices, self._replica_id_offset))
        return streams

    # --- replicas --------------------------------------------------------------------
    def call_for_each_replica(self, fn, args=(), kwargs=None):
        """Runs ``fn`` once per replica (``strategy.run`` without the argument checks)."""
        strategy = self._strategy
        check_component_counts((args, kwargs), self._num_local_replicas, "An argument of call_for_each_replica()")
        with strategy.scope():
            return self._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    def _call_for_each_replica(self, fn, args, kwargs, timeout=None):
        streams = self._replica_streams
        if streams is not None:
            streams.ensure_seeded()  # the first call only
        if self._runner is None:
            if args:
                args = select_replica(0, args)
            if kwargs:
                kwargs = select_replica(0, kwargs)
            return inline_call(self._strategy, fn, args, kwargs, self._torch_devices[0])
        timeout = self._options.timeout_seconds if timeout is None else timeout
        outputs = self._runner.run(self._strategy, fn, args, kwargs, timeout)
        return regroup(outputs, devices=self._worker_devices)

    # --- reductions ------------------------------------------------------------------
    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduces ``value`` across replicas onto ``destinations``.

        ``destinations``: a variable, a distributed value, a device string or a list of
        device strings. Returns a ``Mirrored`` on those devices, or a tensor for one
        device. A value that is not distributed is the same on every replica: ``MEAN``
        returns it, ``SUM`` needs one replica (else ``ValueError``, as TensorFlow).
        """
        require_cross_replica(self._strategy)
        op = as_reduce_op(reduce_op)
        return self._batch_reduce_to(op, [(value, destinations)], self._options.merge(options))[0]

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None) -> list:
        """``reduce_to`` for many ``(value, destinations)`` pairs in one batched reduction.

        Tensors are packed into flat buffers of at most ``options.bytes_per_pack`` bytes
        (``0``: one pack per dtype and device set). Returns one result per pair.

        Example::

            reduced = strategy.extended.batch_reduce_to("SUM", [(g, v) for g, v in grads_and_vars])
        """
        require_cross_replica(self._strategy)
        op = as_reduce_op(reduce_op)
        pairs, options = list(value_destination_pairs), self._options.merge(options)
        payload = self._step_values.take() if op is ReduceOp.SUM and self._step_values.pending else None
        if payload is None:
            return self._batch_reduce_to(op, pairs, options)
        results, limbs = self._reduce_with_step_values(pairs, options, payload)
        self._step_values.finish(payload, limbs)
        return results

    @property
    def _step_values(self) -> StepValues:
        """The step values added this step (``step_values.py``), carried by the next SUM reduction."""
        values = self.__dict__.get("_step_values_store")
        if values is None:
            alone = self._strategy.num_replicas_in_sync == 1  # a total is the value itself: no reduction
            reduce_alone = None if alone else self._reduce_step_values_alone
            made = StepValues(self._torch_devices, self._replica_id_offset, reduce_alone)
            values = self.__dict__.setdefault("_step_values_store", made)
        return values

    def _reduce_with_step_values(self, pairs, options, payload) -> tuple:
        """``(the SUM of pairs, the step values' summed limbs)`` in one reduction: the limbs are one more
        pair, packed with the gradients of their dtype."""
        dtype, destinations = carrier(pairs, self._worker_devices)
        carried = (PerReplica(payload.as_dtype(dtype), self._worker_devices), destinations)
        results = self._batch_reduce_to(ReduceOp.SUM, pairs + [carried], options)
        return results[:-1], _first_component(results[-1])

    def _reduce_step_values_alone(self, payload) -> torch.Tensor:
        carried = (PerReplica(payload.as_dtype(torch.float32), self._worker_devices), self._worker_devices)
        (result,) = self._batch_reduce_to(ReduceOp.SUM, [carried], self._options)
        return _first_component(result)

    def _batch_reduce_to(self, op: ReduceOp, pairs, options) -> list:
        results: list = [None] * len(pairs)
        distributed = []
        for index, (value, destinations) in enumerate(pairs):
            if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
                # Equal on every replica already: the mean is the value itself.
                results[index] = self._cross_device_ops.broadcast(value.values[0], destinations)
            elif isinstance(value, DistributedValues):
                distributed.append(index)
            else:
                results[index] = self._reduce_non_distributed(op, value, destinations)
        if distributed:
            reduced = self._cross_device_ops.batch_reduce(op, [pairs[i] for i in distributed], options)
            for index, result in zip(distributed, reduced):
                results[index] = result
        return results

    def broadcast_to(self, tensor, destinations):
        """``tensor`` on every device of ``destinations``: a ``Mirrored`` (a tensor for one device).

        Copies where memory differs; replicas sharing host memory share the tensor.

        Example::

            clipped = strategy.extended.broadcast_to(gradient * scale, destinations=var)
        """
        require_cross_replica(self._strategy)
        return self._cross_device_ops.broadcast(_tensor_of(tensor), destinations)

    def _reduce_non_distributed(self, op, value, destinations):
        if isinstance(value, Variable):
            value = value._read()
        if op is ReduceOp.SUM and self._num_replicas_in_sync != 1:
            shown = (
                value
                if not isinstance(value, torch.Tensor) or value.numel() <= 8
                else (f"<tensor of shape {tuple(value.shape)}>")
            )
            raise ValueError(
                f"A non-DistributedValues value {shown} cannot be reduced with the given reduce op {op}: with "
                f"{self._num_replicas_in_sync} replicas, SUM of one value is ambiguous. Pass a PerReplica (what "
                "strategy.run returns), or use strategy.reduce(), which treats a plain value as the same value "
                "on every replica."
            )
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        return self._cross_device_ops.broadcast(tensor, destinations)

    def _reduce_tensors(self, op: ReduceOp, tensors, device: str) -> torch.Tensor:
        """Reduces a list of per-replica tensors onto one device, in replica order."""
        per_replica = PerReplica(tensors, (device,) * len(tensors))
        return self._cross_device_ops.batch_reduce(op, [(per_replica, device)], self._options)[0]

    def _gather_to(self, value, axis: int, destinations):
        return self._cross_device_ops.gather(value, axis, destinations)

    # --- updates ---------------------------------------------------------------------
    def update(self, var, fn, args=(), kwargs=None, group: bool = True):
        """Runs ``fn(component, *args, **kwargs)`` once per component of ``var``.

        Cross-replica only (in a replica, call it from a ``merge_fn``). Each call runs
        on the component's device; ``Mirrored``/``PerReplica`` arguments are unwrapped to
        the component's replica, and distributed variables read as that component.
        Returns the results regrouped (``group=True``: a ``Mirrored``, the variable
        itself, or a plain value with one component) or one tuple per result with an
        entry per component (``group=False``).

        Example::

            strategy.extended.update(v, lambda c, delta: c.assign_add(delta), args=(reduced,))
        """
        ctx = context.current_mode().replica_context
        if ctx is not None and not ctx._is_default and ctx.strategy is self._strategy:
            raise RuntimeError(
                "extended.update() requires cross-replica context: inside strategy.run(), call it from a "
                "merge_fn, e.g. get_replica_context().merge_call(lambda s: s.extended.update(var, fn, args))."
            )
        with context.enter_or_assert_strategy(self._strategy):
            return self._update(var, fn, tuple(args), dict(kwargs or {}), group)

    def _update(self, var, fn, args, kwargs, group):
        strategy = self._strategy
        components = local_results(var)
        updates = []
        for replica_id, component in enumerate(components):
            mode = context.Mode(strategy, None, strategy, update_replica=replica_id)
            device = getattr(component, "device", None)
            with context.entered(mode), _cuda_device(device):
                updates.append(fn(component, *select_replica(replica_id, args), **select_replica(replica_id, kwargs)))
        after_update = getattr(var, "_after_update", None)
        if after_update is not None:
            after_update()
        devices = destination_devices(var) if isinstance(var, (Variable, DistributedValues)) else None
        grouped = regroup(updates, wrap_class=Mirrored, devices=devices)
        return grouped if group else nest.map_structure(local_results, grouped)

    def after_direct_update(self, variables) -> None:
        """Call after writing the copies of ``variables`` directly instead of through ``update``
        (a multi-tensor update writes every copy in one ``torch._foreach_*`` call): keeps what
        ``update`` keeps, e.g. ``CentralStorageStrategy``'s variables refresh their replicas' copies.

        Example::

            torch._foreach_add_(copies, deltas)
            strategy.extended.after_direct_update(variables)
        """
        for variable in variables:
            if variable._after_update is not None:
                variable._after_update()

    # --- variables -------------------------------------------------------------------
    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """Variables created inside live on ``colocate_with_variable``'s devices (slots use this)."""
        if not self.variable_created_in_scope(colocate_with_variable):
            raise ValueError(
                "`colocate_vars_with` must only be passed a variable created in this "
                f"tf.distribute.Strategy.scope(), not: {colocate_with_variable!r}"
            )
        stack = self._colocation.__dict__.setdefault("stack", [])
        stack.append(colocate_with_variable)
        try:
            yield
        finally:
            stack.pop()

    def _colocated_with(self):
        stack = self._colocation.__dict__.get("stack")
        return stack[-1] if stack else None

    def variable_created_in_scope(self, v) -> bool:
        """Whether ``v`` was created in this strategy's scope."""
        owner = getattr(v, "_distribute_strategy", None)
        if self._strategy is context.default_strategy():
            return owner is None or owner is self._strategy
        return owner is self._strategy

    def value_container(self, value):
        """The distributed variable that ``value`` (a component) belongs to, else ``value``."""
        return value_container(value)

    def _create_variable(self, spec: VariableSpec):
        """Creates the strategy's kind of variable (a hook for the concrete strategies)."""
        colocated = self._colocated_with()
        device = destination_devices(colocated)[0] if colocated is not None else self._worker_devices[0]
        return self._local_variable(spec.initial_value, spec, device, replica_id=0)

    def _local_variable(self, tensor, spec, device, replica_id=0, name=None):
        owner = None if self._strategy is context.default_strategy() else self._strategy
        return LocalVariable(
            tensor.to(torch_device(device)),
            name=name or spec.name,
            device=device,
            trainable=spec.trainable,
            aggregation=spec.aggregation,
            synchronization=spec.synchronization,
            strategy=owner,
            replica_id=replica_id,
        )

    def _mirrored_components(self, spec, devices):
        """One ``LocalVariable`` per device, each initialised from the same value."""
        return [
            self._local_variable(
                spec.initial_value.clone(),
                spec,
                device,
                replica_id=i,
                name=spec.name if i == 0 else f"{spec.name}/replica_{i}",
            )
            for i, device in enumerate(devices)
        ]

    def _create_distributed_variable(self, spec, devices):
        spec.check_distributable()
        components = self._mirrored_components(spec, devices)
        kind = SyncOnReadVariable if spec.synchronization is VariableSynchronization.ON_READ else MirroredVariable
        synchronization = (
            VariableSynchronization.ON_WRITE
            if spec.synchronization is VariableSynchronization.AUTO
            else spec.synchronization
        )
        return kind(
            self._strategy,
            components,
            name=spec.name,
            trainable=spec.trainable,
            aggregation=spec.aggregation,
            synchronization=synchronization,
        )

    def _module_variable(self, name, tensors, trainable, synchronization, aggregation):
        """Wraps one parameter/buffer of the replicas' modules (a hook; one replica here)."""
        owner = None if self._strategy is context.default_strategy() else self._strategy
        return LocalVariable(
            tensors[0],
            name=name,
            device=self._worker_devices[0],
            trainable=trainable,
            aggregation=aggregation,
            synchronization=synchronization,
            strategy=owner,
        )

    def _replicated_module_variable(self, name, tensors, trainable, synchronization, aggregation):
        """One component per replica's tensor: a ``MirroredVariable`` or, for ON_READ, a ``SyncOnReadVariable``."""
        owner = self._strategy
        components = [
            LocalVariable(
                t,
                name=name if i == 0 else f"{name}/replica_{i}",
                device=device,
                trainable=trainable,
                aggregation=aggregation,
                synchronization=synchronization,
                strategy=owner,
                replica_id=i,
            )
            for i, (t, device) in enumerate(zip(tensors, self._worker_devices))
        ]
        kind = SyncOnReadVariable if synchronization is VariableSynchronization.ON_READ else MirroredVariable
        return kind(
            owner, components, name=name, trainable=trainable, aggregation=aggregation, synchronization=synchronization
        )

    # --- v1 leftovers and misc ------------------------------------------------------
    def _group(self, value) -> None:
        for device in {t.device for t in _all_tensors(value)} | set(self._torch_devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def _all_tensors(value):
    out = []
    for leaf in nest.flatten(value):
        for item in local_results(leaf):
            if isinstance(item, Variable):
                item = item._read()
            if isinstance(item, torch.Tensor):
                out.append(item)
    return out


@contextlib.contextmanager
def _cuda_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        with torch.cuda.device(torch_device(device)):
            yield
    else:
        yield


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
        return _Scope(self)

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
        with _Scope(self):
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
        tensors = component_tensors(value) if distributed else [_tensor_of(value)]
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

    # --- input ------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of ``dataset`` across the replicas (see ``data``).

        Example::

            for batch in strategy.experimental_distribute_dataset(loader):
                strategy.run(step, args=(batch,))
        """
        from replicafit.data import DistributedDataset  # the data layer sits above; imported on use

        return DistributedDataset(dataset, self, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Calls ``dataset_fn(InputContext)`` for per-replica batches (see ``data``)."""
        from replicafit.data import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self, options)

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
        from replicafit.data import NumpyDataset

        return NumpyDataset(numpy_input)

    def make_dataset_iterator(self, dataset):
        """v1: an iterator (``get_next()``, ``initialize()``) over ``experimental_distribute_dataset``."""
        from replicafit.data import make_v1_iterator

        return make_v1_iterator(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(self, input_fn, replication_mode=None):
        """v1: an iterator over ``input_fn(InputContext)``'s per-replica batches (PER_WORKER only)."""
        from replicafit.data import InputReplicationMode, make_v1_iterator

        mode = InputReplicationMode.PER_WORKER if replication_mode is None else replication_mode
        if not isinstance(mode, InputReplicationMode) and mode in ("PER_WORKER", "PER_REPLICA"):
            mode = InputReplicationMode(mode)
        if mode is not InputReplicationMode.PER_WORKER:
            raise ValueError(f"Input replication mode not supported: {mode!r}")
        return make_v1_iterator(self.distribute_datasets_from_function(input_fn))

    # --- modules ----------------------------------------------------------------------
    def distribute_module(self, module: torch.nn.Module):
        """Replicates ``module`` over this strategy's replicas (see ``DistributedModule``)."""
        from .module import DistributedModule

        return DistributedModule(self, module)

    # --- v1 and housekeeping -----------------------------------------------------------
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
        if session_config is not None and not isinstance(session_config, Mapping):
            raise TypeError(f"session_config must be a mapping or None, got {type(session_config).__name__}.")
        if cluster_spec:
            if not isinstance(cluster_spec, Mapping):
                raise TypeError(f"cluster_spec must be a mapping of task type to addresses, got {cluster_spec!r}.")
            tasks = sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in cluster_spec.values())
            if tasks > 1:
                raise ValueError(
                    f"{type(self).__name__} runs in one process; a cluster of {tasks} tasks needs "
                    "MultiWorkerMirroredStrategy."
                )
        if task_id is not None and (not isinstance(task_id, int) or task_id < 0):
            raise ValueError(f"task_id must be a non-negative int, got {task_id!r}.")
        if task_type is not None and not isinstance(task_type, str):
            raise ValueError(f"task_type must be a string, got {task_type!r}.")

    def update_config_proto(self, config):
        """Returns an updated copy of a mapping of runtime settings (never mutates ``config``)."""
        if not isinstance(config, Mapping):
            raise TypeError(f"update_config_proto() needs a mapping of settings, got {type(config).__name__}.")
        return copy.deepcopy(dict(config))


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _first_component(value) -> torch.Tensor:
    return value.values[0] if isinstance(value, DistributedValues) else value


def _tensor_of(value):
    if isinstance(value, Variable):
        return value._read()
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class _DefaultExtended(StrategyExtended):
    def __init__(self, strategy):
        super().__init__(strategy, (default_device(),), (default_device(),))

    _replica_streams = None  # the default strategy draws from torch's global generator

    @property
    def worker_devices(self) -> tuple:
        return (default_device(),)

    @property
    def parameter_devices(self) -> tuple:
        return (default_device(),)

    def _call_for_each_replica(self, fn, args, kwargs, timeout=None):
        if args:
            args = select_replica(0, args)
        if kwargs:
            kwargs = select_replica(0, kwargs)
        mode = context.current_mode()
        if mode.replica_context is _DEFAULT_REPLICA_CONTEXT:
            return fn(*args, **kwargs)
        with context.entered(context.Mode(self._strategy, _DEFAULT_REPLICA_CONTEXT, None)):
            return fn(*args, **kwargs)


class _DefaultStrategy(Strategy):
    """The strategy in force outside any scope: one replica on torch's current device."""

    def __init__(self):
        super().__init__(_DefaultExtended(self))

    def __repr__(self) -> str:
        return "<default strategy>"


_DEFAULT_STRATEGY = _DefaultStrategy()
_DEFAULT_REPLICA_CONTEXT = DefaultReplicaContext(_DEFAULT_STRATEGY, 0, None)
context.set_default_strategy(_DEFAULT_STRATEGY, _DEFAULT_REPLICA_CONTEXT)
