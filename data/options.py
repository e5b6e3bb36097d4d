"""Input options and contexts: ``InputOptions``, ``AutoShardPolicy``, ``InputContext``, ``InputReplicationMode``."""

from __future__ import annotations

import enum

__all__ = ["AutoShardPolicy", "InputReplicationMode", "InputOptions", "InputContext"]


class AutoShardPolicy(enum.Enum):
    """What each worker of ``MultiWorkerMirroredStrategy`` reads of a distributed dataset
    (``tf.data.experimental.AutoShardPolicy``'s names, with meanings that keep global batches).

    ``AUTO`` (default): a source whose rows can be addressed (arrays, tensors, a map-style ``Dataset``
    with ``batch_size``, a ``DataLoader`` over one) is sharded by rows: each worker fetches, collates
    and moves only the rows of each global batch that its replicas get under the split rule, the
    global batches and their order being one process's. Else a source that offers
    ``shard(num_shards, index)`` is sharded by its shards (``FILE``); else ``DATA``, with a warning
    that says why and how to fix it.
    ``FILE``: each worker reads ``source.shard(num_workers, worker_index)`` as its own input (a
    ``ValueError`` for a source without ``shard``); its batches are its replicas' share of each step.
    ``DATA``: every worker reads every global batch and keeps its replicas' rows (TensorFlow's
    ``DATA`` keeps every ``num_workers``-th element, which would change the split rule; ours does not).
    ``OFF``: the source is not divided: each worker takes it as its own input and its batches as the
    worker's batches (a source sharded by hand, a ``DataLoader`` with a ``DistributedSampler``).

    Example::

        options = data.InputOptions(auto_shard_policy=data.AutoShardPolicy.FILE)
        dist = strategy.experimental_distribute_dataset(sharded_files, options)
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` calls ``dataset_fn``.

    ``PER_WORKER``: once per worker; the worker's replicas take consecutive batches.
    ``PER_REPLICA``: once per replica; each replica reads its own dataset.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class InputOptions:
    """Options for distributing a dataset (``tf.distribute.InputOptions``).

    Args:
      experimental_fetch_to_device: move each replica's slice to its device (``True``)
        or keep it on the host (``False``).
      experimental_replication_mode: an ``InputReplicationMode`` (``PER_REPLICA`` only
        with ``distribute_datasets_from_function``).
      experimental_place_dataset_on_device: kept for TensorFlow compatibility; needs
        ``PER_REPLICA`` and ``experimental_fetch_to_device=False``.
      experimental_per_replica_buffer_size: how many steps a background thread prepares
        ahead (split, pinned, copied to the devices). ``None`` (the default) means 1 when
        a replica device is an accelerator, where copies and device compute overlap with
        input work, and 0 (each step prepared when asked) on host-only devices, where the
        split is free and a thread would only compete for the same cores. (TensorFlow's
        default is 1 everywhere.) ``0`` never uses a thread; ``n >= 1`` always does.

    Example::

        options = data.InputOptions(experimental_fetch_to_device=False)
        dist = strategy.experimental_distribute_dataset(loader, options)
    """

    def __init__(
        self,
        experimental_fetch_to_device: bool = True,
        experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device: bool = False,
        experimental_per_replica_buffer_size: int | None = None,
        auto_shard_policy: AutoShardPolicy | str = AutoShardPolicy.AUTO,
    ):
        mode = InputReplicationMode(experimental_replication_mode)
        policy = _policy(auto_shard_policy)
        if experimental_place_dataset_on_device and mode is not InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "When `experimental_place_dataset_on_device` is set for dataset placement, you must "
                "also specify `PER_REPLICA` for the replication mode"
            )
        if experimental_place_dataset_on_device and experimental_fetch_to_device:
            raise ValueError(
                "`experimental_place_dataset_on_device` can not be set to True when "
                "experimental_fetch_to_device is True and replication mode is set to `PER_REPLICA`"
            )
        size = experimental_per_replica_buffer_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(f"experimental_per_replica_buffer_size must be None or a non-negative int, got {size!r}.")
        self.experimental_fetch_to_device = bool(experimental_fetch_to_device)
        self.experimental_replication_mode = mode
        self.experimental_place_dataset_on_device = bool(experimental_place_dataset_on_device)
        self.experimental_per_replica_buffer_size = experimental_per_replica_buffer_size
        self.auto_shard_policy = policy

    def __repr__(self) -> str:
        return (
            f"InputOptions(experimental_fetch_to_device={self.experimental_fetch_to_device}, "
            f"experimental_replication_mode={self.experimental_replication_mode}, "
            f"experimental_per_replica_buffer_size={self.experimental_per_replica_buffer_size}, "
            f"auto_shard_policy={self.auto_shard_policy})"
        )


def _policy(value) -> AutoShardPolicy:
    """``value`` as an ``AutoShardPolicy`` (a member or its name, any case), else a ``ValueError``."""
    if isinstance(value, AutoShardPolicy):
        return value
    if isinstance(value, str) and value.upper() in AutoShardPolicy.__members__:
        return AutoShardPolicy[value.upper()]
    names = ", ".join(AutoShardPolicy.__members__)
    raise ValueError(f"auto_shard_policy must be an AutoShardPolicy or one of {names}, got {value!r}.")


class InputContext:
    """What ``dataset_fn`` is told about the input pipeline it builds.

    Example::

        def dataset_fn(ctx):
            batch = ctx.get_per_replica_batch_size(64)
            return DataLoader(my_dataset_shard(ctx.input_pipeline_id, ctx.num_input_pipelines), batch_size=batch)
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are in all.

        The number of workers with ``InputReplicationMode.PER_WORKER`` (the default), the number of
        replicas of all workers with ``PER_REPLICA``.
        """
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index in ``[0, num_input_pipelines)``.

        The worker's index with ``PER_WORKER``, the replica's global id with ``PER_REPLICA``: the
        shard ``dataset_fn`` should read.
        """
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas of all workers train in sync (what a global batch is split across)."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; ``ValueError`` when not divisible."""
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync!r} "
            )
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self) -> str:
        return (
            f"tf.distribute.InputContext(input pipeline id {self._input_pipeline_id}, "
            f"total: {self._num_input_pipelines})"
        )

    __repr__ = __str__
