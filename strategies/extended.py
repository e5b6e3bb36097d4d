"""``StrategyExtended``: a strategy's advanced members, and the surface a strategy author writes against.

TensorFlow's pattern: each public method checks its context and arguments, then calls a protected hook
(``reduce_to`` → ``_batch_reduce_to``, ``update`` → ``_update``, ``ds.Variable(...)`` → ``_create_variable``).
A concrete strategy is a ``Strategy`` whose ``extended`` is a subclass of ``StrategyExtended`` made with its
devices and cross-device ops; it overrides only the hooks where it differs and declares its capabilities.
The hooks (``docs/guides/writing-a-strategy.md`` builds a strategy from them):

=============================================  =================================================================
hook                                           what it must do (default)
=============================================  =================================================================
``_create_variable(spec)``                     the variable ``ds.Variable`` makes in scope; slots use the devices
                                               of ``_colocated_devices()`` (one ``LocalVariable``)
``_module_variable(name, tensors, ...)``       wrap a distributed module's parameter/buffer, one tensor per
                                               replica (replica 0's alone)
``_call_for_each_replica(fn, args, kwargs,``   run ``fn`` once per local replica in its replica context; return
``timeout)``                                   the regrouped results (the replica runner)
``_batch_reduce_to(op, pairs, options)``       reduce each ``(value, destinations)``; a list of results (the
                                               cross-device ops: ``CrossDeviceOps.batch_reduce``)
``_update(var, fn, args, kwargs, group)``      run ``fn`` on every component of ``var`` on its device (each
                                               local component in turn)
``_gather_to(value, axis, destinations)``      concatenate the replicas' values (the cross-device ops)
``state_layout(variables)``                    where an optimizer's state lives (``WholeVariables``)
``capabilities``                               what the strategy declares (``StrategyCapabilities()``)
``cluster``                                    the workers (a cluster of one)
``gradients(loss, variables)``                 a replica's gradients of ``loss`` (``torch.autograd.grad``)
``gradient_step(variables)``,                  a training step's gradients reduced while backward runs, updates
``settle_updates()``,                          whose communication runs on past the step, and what to drop when a
``release_gradient_hooks()``                   fit ends (nothing to overlap, nothing deferred)
=============================================  =================================================================

The variable hooks build on ``_create_distributed_variable``, ``_replicated_module_variable`` and
``_local_variable`` (``variable_factory`` has the kinds they make), as ``mirrored.py`` does. Across
processes a strategy also overrides the worker-level hooks (``_num_replicas_in_sync``,
``_as_local_replicas``, ``_all_workers_sizes``, ``_from_first_worker``/``_from_first_worker_many``,
``_sync_module_state``, ``_prepare_module``, ``_reduce_with_step_values``): ``multi_worker_mirrored.py`` is the
example, ``fully_sharded.py`` one whose parameters are sharded.

Example::

    def merge_fn(strategy, grad, var):
        reduced = strategy.extended.reduce_to("SUM", grad, destinations=var)
        return strategy.extended.update(var, lambda v, g: v.assign_sub(0.1 * g), args=(reduced,))
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from . import context, nest, v1, variable_factory
from .capabilities import StrategyCapabilities
from .cluster import Cluster
from .cross_device_ops import CrossDeviceOps, ReductionToOneDevice, destination_devices
from .devices import torch_device
from .reduce_util import CommunicationOptions, ReduceOp, as_reduce_op
from .rng import ReplicaStreams
from .runner import ReplicaRunner, inline_call
from .scope import require_cross_replica
from .state_layout import StateLayout, WholeVariables
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
from .variables import Variable, VariableSpec

__all__ = ["StrategyExtended", "first_component", "tensor_of"]


class StrategyExtended:
    """Advanced members of a strategy (``strategy.extended``): reductions, updates, devices; and the hooks a
    strategy overrides (the module docstring lists them).

    Args:
      strategy: the ``Strategy`` this belongs to (kept as a weak reference).
      worker_devices: the replicas' devices, in replica order (canonical strings: ``"cpu:0"``, ``"cuda:1"``).
      parameter_devices: where variables are stored.
      cross_device_ops: how values are reduced across the replicas (``ReductionToOneDevice()``).
      options: the ``CommunicationOptions`` of every reduction.

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
    def capabilities(self) -> StrategyCapabilities:
        """What this strategy declares about itself (``StrategyCapabilities``): the layers above ask this, never
        probe the strategy's attributes.

        Example::

            if strategy.extended.capabilities.whole_state_on_every_worker:
                ...   # any worker's copy of the model and optimizer state is the whole of it
        """
        return StrategyCapabilities()

    def state_layout(self, variables) -> StateLayout:
        """Hook: where an optimizer's state for ``variables`` lives, and how its updates reach them
        (``state_layout.py``). Every worker holds whole variables and slots by default (``WholeVariables``).

        Example::

            layout = strategy.extended.state_layout(model.trainable_variables)
            layout.slices_variables   # False: the optimizer's slots are shaped like the variables
        """
        return WholeVariables(self._strategy)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints and other files, by default the chief (TensorFlow's name).

        The chief question has one answer, the cluster's (``cluster.is_chief``: always, in one process; worker 0
        only, across workers); this declaration, and ``should_save_summary``, default to it, and a strategy
        that writes files elsewhere says so here.
        """
        return self.cluster.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries such as TensorBoard's, by default the chief (TensorFlow's name)."""
        return self.cluster.is_chief

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

    def gradients(self, loss: torch.Tensor, variables) -> list:
        """Hook: a replica's gradients of ``loss`` with respect to ``variables`` (its trainable variables), one
        tensor per variable (zeros where ``loss`` does not depend on it): what the trainer's step and
        ``Optimizer.minimize`` hand to ``apply_gradients``. The default is ``torch.autograd.grad`` of the
        variables' tensors; a strategy whose parameters are sharded runs backward and gives this worker's shards
        of the gradients (``FullyShardedStrategy``).

        Example::

            def train_step(x, y):
                loss = loss_fn(dm(x), y) / global_batch_size
                grads = strategy.extended.gradients(loss, dm.trainable_variables)
                optimizer.apply_gradients(zip(grads, dm.trainable_variables))
        """
        tensors = [v.value() for v in variables]
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]

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

    def _prepare_module(self, module: torch.nn.Module, precision: str = "32") -> bool:
        """Hook: what the strategy does to the user's module once its values are worker 0's, before its variables
        are made (``FullyShardedStrategy`` shards it, gathering parameters in ``precision``'s compute dtype);
        whether its forward pass is a collective then (every worker runs it every step, with an empty batch
        too). Nothing by default."""
        return False

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
        return results[:-1], first_component(results[-1])

    def _reduce_step_values_alone(self, payload) -> torch.Tensor:
        carried = (PerReplica(payload.as_dtype(torch.float32), self._worker_devices), self._worker_devices)
        (result,) = self._batch_reduce_to(ReduceOp.SUM, [carried], self._options)
        return first_component(result)

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
        return self._cross_device_ops.broadcast(tensor_of(tensor), destinations)

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

            foreach.add_(copies, deltas)
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
        """Hook: the strategy's kind of variable for ``ds.Variable(...)`` in its scope (``variable_factory``
        has the kinds). The default: one ``LocalVariable`` on the first replica device, or on the devices of
        ``colocate_vars_with``'s variable."""
        colocated = self._colocated_devices()
        device = colocated[0] if colocated else self._worker_devices[0]
        return variable_factory.local_variable(self._strategy, spec.initial_value, spec, device)

    def _module_variable(self, name, tensors, trainable, synchronization, aggregation):
        """Hook: wraps one parameter or buffer of a distributed module, given every replica's tensor of it
        (``tensors[i]`` is replica ``i``'s; replica 0's is the user's module). The default: replica 0's alone."""
        return variable_factory.module_variable(
            self._strategy, name, tensors[0], self._worker_devices[0], trainable, synchronization, aggregation
        )

    # Building blocks for the two variable hooks (``variable_factory`` has the kinds).
    def _local_variable(self, tensor, spec, device, replica_id=0, name=None):
        """One ``LocalVariable`` of this strategy holding ``tensor`` on ``device`` (``variable_factory``)."""
        return variable_factory.local_variable(self._strategy, tensor, spec, device, replica_id, name)

    def _create_distributed_variable(self, spec, devices):
        """A mirrored (or, ``ON_READ``, sync-on-read) variable over ``devices`` (``variable_factory``)."""
        return variable_factory.distributed_variable(self._strategy, spec, devices)

    def _replicated_module_variable(self, name, tensors, trainable, synchronization, aggregation):
        """A module tensor per replica as one distributed variable over the replicas' devices (a
        ``_module_variable`` for strategies that mirror parameters)."""
        return variable_factory.replicated_module_variable(
            self._strategy, name, tensors, self._worker_devices, trainable, synchronization, aggregation
        )

    def _group(self, value) -> None:
        """Hook of ``Strategy.group``: waits until the pending work on this strategy's devices is done."""
        v1.group(value, self._torch_devices)

    def _colocated_devices(self) -> tuple:
        """The devices of the variable ``colocate_vars_with`` is in force for on this thread (a slot being
        made), else ``()``."""
        colocated = self._colocated_with()
        return destination_devices(colocated) if colocated is not None else ()


@contextlib.contextmanager
def _cuda_device(device):
    if isinstance(device, str) and device.startswith("cuda"):
        with torch.cuda.device(torch_device(device)):
            yield
    else:
        yield


def first_component(value) -> torch.Tensor:
    """The first component of a distributed value (the value itself otherwise)."""
    return value.values[0] if isinstance(value, DistributedValues) else value


def tensor_of(value):
    """The tensor of a variable (its value), a tensor, or anything ``torch.as_tensor`` takes."""
    if isinstance(value, Variable):
        return value.value()
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
