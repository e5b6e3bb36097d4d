"""The distribution runtime: TensorFlow's ``tf.distribute`` programming model on torch.

Example::

    >>> import torch, replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> out = strategy.run(lambda: torch.tensor([1.0, 2.0]) * (ds.get_replica_context().replica_id_in_sync_group + 1))
    >>> strategy.reduce("SUM", out, axis=None)
    tensor([3., 6.])

The cluster contract. What a layer above the strategies (the trainer, callbacks, the data layer,
a user's own callback) may ask about the workers is ``strategy.cluster`` (``cluster.py``):
``is_chief``, ``num_workers``, ``worker_index``, ``num_local_replicas``, ``first_replica_id``,
``broadcast(obj)`` from the chief, ``all_gather(obj)``, ``any(flag)``/``all(flag)``, ``sum(ints)``,
``start_sum(ints)`` (finished later), ``barrier(name)`` and ``input_channel()`` (the same calls on
a channel of their own, for an input pipeline's thread). In one process it answers without
communicating; across the processes of a ``MultiWorkerMirroredStrategy`` each call is one small
collective, bounded by the communication timeout. Nothing outside ``strategies`` reads a
strategy's private state::

    >>> cluster = strategy.cluster
    >>> cluster.is_chief, cluster.num_workers, cluster.all_gather("mine"), cluster.any(False)
    (True, 1, ['mine'], False)

Rooms: the strategies (``distribute_lib.py``'s ``Strategy``/``StrategyExtended``, ``one_device.py``,
``mirrored.py``, ``central_storage.py``, ``multi_worker_mirrored.py``, ``fully_sharded.py``); contexts
(``context.py``);
values and variables (``values.py``, ``variables.py``, ``module.py``, with ``sync_batchnorm.py`` for
``nn.SyncBatchNorm`` across replicas and workers); the replica runner
(``runner.py``, with ``replica_context.py``, ``rendezvous.py`` for ``merge_call``,
``cooperative.py`` for replicas taking turns on one thread, ``thread_state.py``, ``merge_fns.py``);
reductions (``cross_device_ops.py``, ``buckets.py``, ``step_values.py``); across processes
(``cluster_resolver.py`` with ``slurm.py``, ``collective.py``, ``cluster.py``); devices and randomness
(``devices.py``, ``rng.py``); sharded state (``state_layout.py``, ``state_sharding.py``, ``parameter_shards.py``,
``distributed_checkpoint.py``); and helpers (``nest.py``, ``describe.py``, ``reduce_util.py``).
"""

from . import default_strategy as _default_strategy  # noqa: F401 - registers the strategy in force outside any scope
from . import variable_factory
from .capabilities import StrategyCapabilities
from .central_storage import CentralStorageStrategy
from .cluster import Cluster, CollectiveCluster
from .cluster_resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)
from .collective import WorkerFailedError
from .context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from .cross_device_ops import CollectiveAllReduce, CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from .devices import (
    get_logical_cpu_count,
    get_logical_device_configuration,
    list_logical_devices,
    set_logical_cpu_count,
    set_logical_device_configuration,
)
from .distribute_lib import Strategy, StrategyExtended, ValueContext
from .fully_sharded import FullyShardedStrategy
from .mirrored import MirroredStrategy
from .module import DistributedModule
from .multi_worker_mirrored import MultiWorkerMirroredStrategy
from .one_device import OneDeviceStrategy
from .parameter_shards import ParameterShards, ShardedVariable, sharded_state_dict
from .reduce_util import (
    CommunicationImplementation,
    CommunicationOptions,
    ReduceOp,
    VariableAggregation,
    VariableSynchronization,
)
from .rendezvous import get_stall_warning_seconds, set_stall_warning_seconds
from .replica_context import ReplicaContext
from .rng import replica_seed, seed_replicas
from .runner import get_replica_execution, set_replica_execution
from .slurm import SlurmClusterResolver
from .state_layout import ReducedGradients, StateLayout, WholeVariables
from .values import DistributedValues, Mirrored, PerReplica
from .variables import (
    CentralStorageVariable,
    DistributedVariable,
    LocalVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
)

__all__ = [
    "CentralStorageStrategy",
    "CentralStorageVariable",
    "Cluster",
    "ClusterResolver",
    "CollectiveCluster",
    "CollectiveAllReduce",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedModule",
    "DistributedValues",
    "DistributedVariable",
    "FullyShardedStrategy",
    "LocalVariable",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterShards",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReducedGradients",
    "ReplicaContext",
    "StateLayout",
    "Strategy",
    "StrategyCapabilities",
    "StrategyExtended",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "ShardedVariable",
    "SyncOnReadVariable",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "WholeVariables",
    "WorkerFailedError",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_logical_cpu_count",
    "get_logical_device_configuration",
    "get_replica_context",
    "get_replica_execution",
    "get_stall_warning_seconds",
    "get_strategy",
    "sharded_state_dict",
    "has_strategy",
    "in_cross_replica_context",
    "list_logical_devices",
    "replica_seed",
    "resolve_cluster",
    "seed_replicas",
    "set_logical_cpu_count",
    "set_logical_device_configuration",
    "set_replica_execution",
    "set_stall_warning_seconds",
    "variable_factory",
]
