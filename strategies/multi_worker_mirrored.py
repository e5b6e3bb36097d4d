"""``MultiWorkerMirroredStrategy``: one process per worker, replicas on each worker's devices.

TensorFlow's between-graph model on ``torch.distributed``: the same program runs in every
worker process. ``run``, ``merge_call`` and ``experimental_local_results`` are local to the
worker (its replicas are threads, as under ``MirroredStrategy``); ``reduce``,
``batch_reduce_to``, ``gather``, replica-context ``all_reduce``/``all_gather``, reading a
``SyncOnRead`` variable and creating variables or distributed modules are collectives that
**every worker calls in the same order** (the SPMD rule: branch on ``worker_index`` only
around code that makes no collective, such as writing a file).

Example (run with ``replicafit fit RECIPE --workers 2``, ``torchrun --nproc-per-node 2``, or
one process per worker with ``SimpleClusterResolver``)::

    import replicafit.strategies as ds

    strategy = ds.MultiWorkerMirroredStrategy()            # the cluster comes from the environment
    with strategy.scope():
        v = ds.Variable(0.0)                                # worker 0's initial value everywhere
    out = strategy.run(lambda: torch.tensor(1.0 + ds.get_replica_context().replica_id_in_sync_group))
    strategy.reduce("SUM", out, axis=None)                  # 3.0 on both workers of a 2-worker cluster
"""

from __future__ import annotations

import contextlib
import pickle

import torch

from .buckets import GradientBuckets
from .capabilities import StrategyCapabilities
from .cluster import Cluster, CollectiveCluster
from .cluster_resolver import ClusterResolver, resolve_cluster
from .collective import Collective, WorkerFailedError
from .cross_device_ops import CollectiveAllReduce, _broadcast, destination_devices
from .devices import canonicalize_list, torch_device
from .distribute_lib import Strategy
from .extended import StrategyExtended, tensor_of
from .mirrored import _default_cross_device_ops
from .reduce_util import CommunicationOptions, ReduceOp
from .state_layout import StateLayout, WholeVariables
from .state_sharding import StateShards
from .values import DistributedValues, PerReplica

__all__ = ["MultiWorkerMirroredStrategy", "WorkerFailedError"]


def _default_devices(resolver: ClusterResolver) -> tuple:
    # The resolver knows the GPU conventions (one per process under torchrun, all of them with
    # TF_CONFIG); without GPUs a worker has one replica on the host.
    return tuple(resolver.local_devices() or ("cpu:0",))


class MultiWorkerMirroredExtended(StrategyExtended):
    """Mirrored variables on this worker's devices; reductions across every worker."""

    def __init__(
        self, strategy, devices, resolver: ClusterResolver, options: CommunicationOptions, shard_states: bool = False
    ):
        self._resolver = resolver
        #: Whether each worker keeps the optimizer state of its part of the variables only (``state_shards``).
        self.shard_optimizer_states = bool(shard_states)
        self._shards = None  # the StateShards of the last list of variables asked for
        self._num_workers = resolver.num_workers
        self._worker_index = resolver.worker_index
        self._replica_id_offset = resolver.worker_index * len(devices)
        self._collective = None
        self._grad_buckets = None  # GradientBuckets of the trainer's variables, built at its first step
        self._grad_step = None  # the buckets of the step running now
        #: Start the gradient all-reduces of a training step during backward (buckets.py).
        self.overlap_gradients = True
        if resolver.num_workers > 1:
            self._collective = Collective.get(
                resolver.worker_index,
                resolver.num_workers,
                resolver.master_address,
                resolver.master_port,
                torch_device(devices[0]),
                options.timeout_seconds,
                options.implementation.value,
                resolver.shared_store,
            )
            nccl = self._collective.backend == "nccl"
            mine = (len(devices), _gpu_identities(devices) if nccl else ())
            gathered = self._collective.all_gather_object(mine, "checking each worker's replicas")
            counts = [count for count, _ in gathered]
            if len(set(counts)) > 1:
                shown = ", ".join(f"worker {w}: {c}" for w, c in enumerate(counts))
                raise ValueError(
                    f"Every worker of a MultiWorkerMirroredStrategy needs the same number of local replicas ({shown})."
                )
            _check_gpus_not_shared([gpus for _, gpus in gathered], devices)
            ops = CollectiveAllReduce(self._collective, len(devices) * resolver.num_workers)
        else:
            ops = _default_cross_device_ops(devices)
        super().__init__(strategy, devices, devices, ops, options)

    # --- workers ---------------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._worker_devices) * self._num_workers

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def experimental_should_init(self) -> bool:
        return True

    @property
    def _in_multi_worker_mode(self) -> bool:
        return self._num_workers > 1

    def gradient_step(self, variables):
        """A training step whose gradients of ``variables`` are all-reduced in buckets started
        during backward (``buckets.py``), consumed by the step's ``batch_reduce_to``. With
        ``overlap_gradients = False`` the step reduces through the same buckets after backward."""
        if self._collective is None or not variables:
            return contextlib.nullcontext()
        buckets = self._grad_buckets
        if buckets is None or not buckets.matches(variables):
            self.release_gradient_hooks()
            bytes_per_bucket = self._options.bytes_per_pack or 0
            parts, whole = 1, frozenset()
            shards = self.state_shards(variables)
            if shards is not None:  # each worker keeps its part of each bucket the shards cut
                parts, whole = self._num_workers, shards.plan.whole
            buckets = GradientBuckets(
                self._collective, variables, len(self._worker_devices), bytes_per_bucket, parts=parts, whole=whole
            )
            self._grad_buckets = buckets
        return self._bucket_step(buckets)

    @contextlib.contextmanager
    def _bucket_step(self, buckets):
        self.settle_updates()  # the previous step's gathered values, before this step's forward reads them
        shards = self._shards if self._shards is not None and self._shards.matches(buckets.variables) else None
        buckets.arm(hooks=self.overlap_gradients)
        self._grad_step = buckets
        if shards is not None:  # the step's gather of updated values may run on past its end (settle_updates)
            shards.defer = True
        try:
            yield
        except BaseException:
            self._grad_step = None
            if shards is not None:
                shards.defer = False
                shards.settle(quiet=True)  # no gather left in flight; the step's own error is the one to report
            buckets.disarm(quiet=True)
            raise
        self._grad_step = None
        if shards is not None:
            shards.defer = False
        buckets.disarm()

    def settle_updates(self) -> None:
        """Finishes the gather of the last update's values where sharded optimizer states deferred it (the
        trainer's built-in step lets it run on while the trainer moves to the next step): after this every
        variable holds its updated value. The strategy calls it before the next step and any ``run``; the
        trainer before callbacks that may read the variables and at the end of the steps."""
        if self._shards is not None and self._shards.pending:
            self._shards.settle()

    def _call_for_each_replica(self, fn, args, kwargs, timeout=None):
        self.settle_updates()
        return super()._call_for_each_replica(fn, args, kwargs, timeout)

    def release_gradient_hooks(self) -> None:
        if self._shards is not None:  # (quietly: a fit that failed keeps its own error)
            self._shards.settle(quiet=True)
        if self._grad_buckets is not None:
            self._grad_buckets.remove()
            self._grad_buckets = None

    def _buckets_for(self, op, pairs):
        """The step's gradient buckets where they reduce exactly ``pairs`` (the step's gradients), else None."""
        buckets = self._grad_step
        if (
            buckets is not None
            and op is ReduceOp.SUM
            and all(isinstance(value, PerReplica) for value, _ in pairs)
            and buckets.matches([d for _, d in pairs])
        ):
            return buckets
        return None

    def _reduce_with_step_values(self, pairs, options, payload) -> tuple:
        buckets = self._buckets_for(ReduceOp.SUM, pairs)
        if buckets is None or buckets.cut:
            return super()._reduce_with_step_values(pairs, options, payload)
        # In the spare elements of the last bucket where its dtype sums them exactly, else on their own.
        carried = payload.as_dtype(buckets.carrier_dtype) if buckets.carrier_dtype is not None else None
        reduced = buckets.reduce([value for value, _ in pairs], carried)
        results = [_broadcast(t, destination_devices(d)) for t, (_, d) in zip(reduced, pairs)]
        limbs = buckets.carried if carried is not None else self._reduce_step_values_alone(payload)
        return results, limbs

    def _batch_reduce_to(self, op, pairs, options) -> list:
        buckets = self._buckets_for(op, pairs)
        if buckets is not None and buckets.cut:
            buckets = None  # they reduce into parts, for the sharded optimizer only: the packed path reduces these
        if buckets is not None:
            reduced = buckets.reduce([value for value, _ in pairs])
            return [_broadcast(t, destination_devices(d)) for t, (_, d) in zip(reduced, pairs)]
        if self._collective is not None:
            # As in TensorFlow: a plain value is this worker's (each local replica's) value.
            pairs = [(self._as_local_replicas(value), d) for value, d in pairs]
        return super()._batch_reduce_to(op, pairs, options)

    # --- sharded optimizer states ----------------------------------------------------------
    @property
    def capabilities(self) -> StrategyCapabilities:
        """Whole state on every worker, unless the optimizer states are sharded: then each worker keeps its
        part of them, and an update's gather may run on past its step (``settle_updates``)."""
        sharded = self.shard_optimizer_states and self._collective is not None
        return StrategyCapabilities(
            whole_state_on_every_worker=not sharded,
            shards_optimizer_states=sharded,
            defers_updates=sharded,
            sharded_checkpoints=sharded,
        )

    def state_layout(self, variables) -> StateLayout:
        """``state_shards(variables)`` where they are cut (each worker keeps the optimizer state of its pieces),
        else whole variables and slots on every worker (``WholeVariables``)."""
        shards = self.state_shards(variables)
        return shards if shards is not None else WholeVariables(self._strategy)

    def state_shards(self, variables):
        """The ``StateShards`` of ``variables`` when this strategy shards optimizer states across several
        workers (``shard_optimizer_states=True``) and at least one of their buckets reaches
        ``StateShards.min_bytes``, else ``None``: the optimizer keeps every slot then. One list at a time (asking
        for another list makes its shards anew)."""
        if not self.shard_optimizer_states or self._collective is None or not variables:
            return None
        self.settle_updates()
        shards = self._shards
        if shards is None or not shards.matches(variables):
            shards = self._shards = StateShards(self._collective, variables, self._options.bytes_per_pack or 0, self)
        if len(shards.plan.whole) == len(shards.plan.segments):  # every bucket under StateShards.min_bytes
            return None  # nothing to cut: the optimizer keeps its whole state, as unsharded
        return shards

    def reduce_scatter_gradients(self, shards, grads: list) -> tuple:
        """``(chunks, buffers)``: this worker's chunk of each of ``shards``' segments, summed over every replica
        of every worker, and the segments' buffers (free once the chunks are used: ``shards.publish`` gathers
        into them). ``grads`` are ``PerReplica`` gradients of ``shards.variables`` (cross-replica context). In a
        training step the buckets started during backward did most of it; else one reduction per segment (a
        reduce-scatter on NCCL, an all-reduce of which this worker keeps its part on gloo).
        The pending step values ride along (every worker gets their totals) as with ``batch_reduce_to``."""
        values = self._step_values
        payload = values.take() if values.pending else None
        pairs = list(zip(grads, shards.variables))
        buckets = self._buckets_for(ReduceOp.SUM, pairs)
        limbs = None
        if buckets is not None and buckets.cut:
            carried = None
            if payload is not None and buckets.carrier_dtype is not None:
                carried = payload.as_dtype(buckets.carrier_dtype)
            chunks, buffers = buckets.reduce([value for value, _ in pairs], carried), buckets.regions()
            if carried is not None:
                limbs = buckets.carried
        else:
            values_to_sum = list(grads)
            if payload is not None and shards.carrier is not None:
                values_to_sum.append(PerReplica(payload.as_dtype(shards.dtypes[shards.carrier]), self._worker_devices))
            local = self._cross_device_ops.local_sums(values_to_sum, self._worker_devices[0], self._options)
            carried = local[len(grads)] if len(local) > len(grads) else None
            chunks, buffers, limbs = shards.reduce_scatter(local[: len(grads)], carried)
        if payload is not None:
            if limbs is None:
                limbs = self._reduce_step_values_alone(payload)
            values.finish(payload, limbs)
        return chunks, buffers

    def _as_local_replicas(self, value):
        if self._collective is None or isinstance(value, DistributedValues):
            return value
        # Across workers a plain value is this worker's value (each local replica's), as in TensorFlow:
        # with one replica per worker, what strategy.run returned on this worker.
        tensor = tensor_of(value)
        return PerReplica((tensor,) * len(self._worker_devices), self._worker_devices)

    # --- collectives across workers ---------------------------------------------------
    def _all_workers_sizes(self, sizes: tuple) -> tuple:
        if self._collective is None:
            return sizes
        parts = self._collective.all_gather_ints(list(sizes), "all_gather (sizes)")
        return tuple(int(s) for part in parts for s in part)

    @property
    def cluster(self) -> Cluster:
        """The workers of this strategy (``cluster.py``).

        One collective each call, or a cluster of one when this strategy is one worker.
        """
        cluster = self.__dict__.get("_cluster")
        if cluster is None:
            local, values = len(self._worker_devices), self._step_values
            if self._collective is None:
                made = Cluster(local, values)
            else:
                made = CollectiveCluster(self._collective, local, values)
            cluster = self.__dict__.setdefault("_cluster", made)
        return cluster

    def _from_first_worker(self, value):
        if self._collective is None:
            return value
        tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        host = tensor.to(self._collective.device).contiguous()
        self._collective.broadcast(host, "broadcasting replica 0's value")
        return host.to(tensor.device)

    def _from_first_worker_many(self, tensors: list) -> list:
        if self._collective is None:
            return list(tensors)
        copies = [t.detach().clone().to(self._collective.device) for t in tensors]
        _broadcast_in_place(self._collective, copies, "broadcasting replica 0's values")
        return [copy.to(t.device) for copy, t in zip(copies, tensors)]

    def _sync_module_state(self, module: torch.nn.Module) -> None:
        if self._collective is None:
            return
        tensors = [("parameter", n, p) for n, p in module.named_parameters()]
        tensors += [("buffer", n, b) for n, b in module.named_buffers() if b is not None]
        layout = [(kind, name, tuple(t.shape), str(t.dtype)) for kind, name, t in tensors]
        _check_same(self._collective, layout, f"the module {type(module).__name__}")
        _broadcast_in_place(self._collective, [t for _, _, t in tensors], "broadcasting the module's initial values")

    # --- variables ---------------------------------------------------------------------
    def _create_variable(self, spec):
        devices = self._colocated_devices() or self._worker_devices
        if self._collective is not None:
            value = torch.as_tensor(spec.initial_value)
            _check_same(self._collective, (spec.name, tuple(value.shape), str(value.dtype)), "a variable")
            value = value.detach().clone().contiguous()
            _broadcast_in_place(self._collective, [value], f"broadcasting the initial value of {spec.name!r}")
            spec.initial_value = value
        return self._create_distributed_variable(spec, devices)

    _module_variable = StrategyExtended._replicated_module_variable


def checked_cluster(communication_options, cluster_resolver, replicas: int | None = None) -> tuple:
    """``(communication options, cluster resolver, this worker's devices)`` of a multi-worker strategy's arguments:
    the defaults filled in (``CommunicationOptions()``, ``resolve_cluster()``), each checked (``ValueError`` naming
    what was given), the devices the resolver's (at most ``replicas`` of them)."""
    if communication_options is None:
        communication_options = CommunicationOptions()
    if not isinstance(communication_options, CommunicationOptions):
        raise ValueError(
            "communication_options must be a replicafit.strategies.CommunicationOptions, got "
            f"{communication_options!r}."
        )
    if cluster_resolver is None:
        cluster_resolver = resolve_cluster()
    if not isinstance(cluster_resolver, ClusterResolver):
        raise ValueError(
            "cluster_resolver must be a replicafit.strategies ClusterResolver (TorchrunClusterResolver, "
            f"TFConfigClusterResolver, SlurmClusterResolver, SimpleClusterResolver), got {cluster_resolver!r}."
        )
    devices = canonicalize_list(list(_default_devices(cluster_resolver))[:replicas], "devices")
    if communication_options.implementation.value == "NCCL" and not all(d.startswith("cuda") for d in devices):
        raise ValueError(f"CommunicationImplementation.NCCL needs CUDA devices; this worker's are {list(devices)}.")
    return communication_options, cluster_resolver, devices


def check_cluster_spec(cluster_spec, num_workers: int) -> None:
    """``ValueError`` unless ``configure``'s ``cluster_spec`` (if any) names ``num_workers`` tasks: a multi-worker
    strategy's cluster comes from its resolver, and ``configure`` may only restate it."""
    if cluster_spec:
        tasks = sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in dict(cluster_spec).values())
        if tasks != num_workers:
            raise ValueError(
                f"configure(cluster_spec=...) names {tasks} tasks, but this strategy's cluster has {num_workers} "
                "workers: pass the cluster as cluster_resolver when building it."
            )


def _gpu_identities(devices) -> tuple:
    """What tells this worker's physical GPUs apart from another process's: each GPU's UUID (two
    processes see the same GPU under other indices when their ``CUDA_VISIBLE_DEVICES`` differ)."""
    identities = []
    for index in sorted({torch_device(d).index for d in devices if d.startswith("cuda")}):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is None:
            return ()  # nothing to compare by: NCCL reports a shared GPU itself, at the first collective
        identities.append(str(uuid))
    return tuple(identities)


def _check_gpus_not_shared(per_worker: list, devices) -> None:
    """NCCL refuses two ranks on one GPU (at the first collective, in its own words): say so at once, with the fix."""
    owners: dict = {}
    for worker, gpus in enumerate(per_worker):
        for gpu in gpus:
            owners.setdefault(gpu, []).append(worker)
    shared = [workers for workers in owners.values() if len(workers) > 1]
    if shared:
        raise ValueError(
            f"Workers {shared[0]} of this MultiWorkerMirroredStrategy use the same GPU (this worker's devices: "
            f"{list(devices)}), and NCCL needs a GPU of its own for each worker. Give each worker its own GPU "
            "(torchrun and the SLURM resolver use LOCAL_RANK; a SimpleClusterResolver takes devices=[...]), or pass "
            "communication_options=CommunicationOptions(implementation=CommunicationImplementation.RING) to "
            "communicate over gloo, which lets workers share a GPU."
        )


def _check_same(collective, layout, what: str) -> None:
    """Raises ``ValueError`` on every worker unless every worker passes the same ``layout``."""
    digest = pickle.dumps(layout)
    layouts = collective.all_gather_object(digest, f"checking that every worker creates the same {what}")
    for worker, other in enumerate(layouts):
        if other != digest:
            raise ValueError(
                f"Worker {worker} creates {what} as {pickle.loads(other)!r} but worker "
                f"{collective.rank} as {layout!r}: every worker must create the same variables and modules, "
                "in the same order (only their initial values may differ; worker 0's are used)."
            )


def _broadcast_in_place(collective, tensors, what: str) -> None:
    """Worker 0's values into ``tensors``: one flat broadcast per dtype."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for (_, _device), members in groups.items():
            flat = torch.cat([t.detach().reshape(-1) for t in members]).to(collective.device)
            collective.broadcast(flat, what)
            offset = 0
            for tensor in members:
                count = tensor.numel()
                tensor.copy_(flat[offset : offset + count].view_as(tensor))
                offset += count


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training over several worker processes (``tf.distribute.MultiWorkerMirroredStrategy``).

    Args:
      communication_options: a ``CommunicationOptions``: ``bytes_per_pack`` for the packs
        that cross processes, ``timeout_seconds`` for every wait (local rendezvous and the
        process group: a worker that stops arriving is a ``WorkerFailedError`` after it;
        ``None``: torch's default, 30 minutes on gloo and 10 on NCCL), ``implementation`` (``AUTO``: gloo for CPU
        devices, NCCL for CUDA devices, a small sum on gloo an all-gather and a local sum in worker order;
        ``RING`` means gloo and its ring all-reduce, for CUDA devices too, which is how
        several worker processes share one GPU (NCCL refuses two ranks on one device);
        ``NCCL`` needs CUDA devices).
      cluster_resolver: a ``ClusterResolver``; ``None`` detects the environment
        (``resolve_cluster()``: ``torchrun``'s variables, then SLURM's, then ``TF_CONFIG``, else one
        local worker).
      shard_optimizer_states: ``True``: each worker keeps the optimizer state (slots, moving averages)
        of its part of the variables only, about ``1/num_workers`` of it, balanced by bytes (ZeRO
        stage 1, as torch's ``ZeroRedundancyOptimizer``). Each gradient bucket of at least
        ``StateShards.min_bytes`` (1 MiB) is cut into one part per worker: reduced into parts
        during backward (a reduce-scatter on NCCL; on gloo an all-reduce of which each worker keeps
        its part), each worker updates its part once, and the updated values are gathered into
        every worker's variables (smaller buckets stay whole); every element-wise optimizer (the
        built-ins, a ``build`` + ``update_step`` subclass, ``from_torch``) does this with no code of
        its own, and gives the unsharded run's results (within float rounding where clipping norms
        are summed from parts). ``trainer.save_checkpoint(path)`` writes the whole state in the
        unsharded layout; backups and ``ModelCheckpoint`` write sharded checkpoint directories (every
        worker its chunks of the slots, nothing gathered), which load anywhere the file does.
        Variables and gradients stay whole on every worker (unlike FSDP). No effect with one worker.

    The cluster is joined when the strategy is built (every worker must build it). Each
    worker's replicas run on its local devices (the resolver's ``devices``; else every GPU,
    one GPU per process under ``torchrun`` with several processes per machine, or
    ``"cpu:0"``); ``num_replicas_in_sync`` counts the replicas of every worker and
    ``replica_id_in_sync_group`` is global. Initial values of variables and distributed
    modules are worker 0's. Only the chief (worker 0) writes files
    (``extended.should_checkpoint``).

    Example::

        strategy = ds.MultiWorkerMirroredStrategy(
            cluster_resolver=ds.SimpleClusterResolver(2, worker_index, "127.0.0.1", port),
            communication_options=ds.CommunicationOptions(timeout_seconds=60))
        trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy")
        trainer.fit(model, (x, y), batch_size=64)          # the same call on every worker
    """

    def __init__(
        self,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver=None,
        *,
        shard_optimizer_states: bool = False,
    ):
        communication_options, cluster_resolver, devices = checked_cluster(communication_options, cluster_resolver)
        if not isinstance(shard_optimizer_states, bool):
            raise TypeError(f"shard_optimizer_states must be True or False, got {shard_optimizer_states!r}.")
        self._cluster_resolver = cluster_resolver
        extended = MultiWorkerMirroredExtended(
            self, devices, cluster_resolver, communication_options, shard_optimizer_states
        )
        super().__init__(extended)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster this strategy belongs to (read-only)."""
        return self._cluster_resolver

    def __repr__(self) -> str:
        extended = self._extended
        return (
            f"MultiWorkerMirroredStrategy(worker {extended._worker_index} of {extended._num_workers}, "
            f"devices={extended.worker_devices}"
            + (", shard_optimizer_states=True" if extended.shard_optimizer_states else "")
            + ")"
        )

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None) -> None:
        """Validated; the cluster itself comes from ``cluster_resolver`` (it must match)."""
        Strategy.configure(self, session_config, None, task_type, task_id)
        check_cluster_spec(cluster_spec, self._extended._num_workers)
