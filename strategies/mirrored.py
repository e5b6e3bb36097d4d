"""``MirroredStrategy``: one process, one replica per device, variables kept in sync."""

from __future__ import annotations

import torch

from .cross_device_ops import CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from .devices import canonicalize_list, list_logical_devices, torch_device
from .distribute_lib import Strategy
from .extended import StrategyExtended

__all__ = ["MirroredStrategy"]


def local_gpus() -> list[str]:
    """Every GPU device of this process (its logical GPUs where one is split)."""
    return [d for d in list_logical_devices() if d.startswith("cuda:")]


def _nccl_available() -> bool:
    try:
        torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return False
    return True


def _default_cross_device_ops(devices) -> CrossDeviceOps:
    gpus = {torch_device(d) for d in devices if d.startswith("cuda")}
    if len(gpus) == len(devices) > 1 and _nccl_available():  # distinct physical GPUs only
        return NcclAllReduce()
    return ReductionToOneDevice()


class MirroredExtended(StrategyExtended):
    """Variables are mirrored: one copy per replica device, equal after every write."""

    def _create_variable(self, spec):
        return self._create_distributed_variable(spec, self._colocated_devices() or self._worker_devices)

    _module_variable = StrategyExtended._replicated_module_variable


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one process (``tf.distribute.MirroredStrategy``).

    Args:
      devices: the replica devices (``["cpu:0", "cpu:1"]``, ``["cuda:0", "cuda:1"]``,
        TensorFlow spellings too). ``None`` uses every visible GPU, or ``["cpu:0"]``
        when there is none. ``"cpu:N"`` are logical CPU devices.
      cross_device_ops: a ``CrossDeviceOps``; by default ``NcclAllReduce`` on several
        distinct GPUs, else ``ReductionToOneDevice`` (logical GPUs that share a physical one,
        ``set_logical_device_configuration``, are reduced on it).

    Replicas on distinct devices run side by side, each on a thread of its own (replica 0 on
    the caller's); replicas that share one device (logical CPUs, several replicas on one GPU)
    take turns on the caller's thread as greenlets, switching where they meet
    (``set_replica_execution``). Variables created in ``scope()`` are ``MirroredVariable``s
    (``SyncOnReadVariable`` for ``synchronization=ON_READ``); ``run`` returns ``PerReplica`` values.

    Example::

        >>> import torch, replicafit.strategies as ds
        >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     v = ds.Variable(1.0)
        >>> def merge_fn(strategy, value):
        ...     reduced = strategy.extended.batch_reduce_to("SUM", [(value, v)])[0]
        ...     return strategy.extended.update(v, lambda c, x: c.assign(x), args=(reduced,))
        >>> _ = strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn, args=(torch.tensor(1.0),)))
        >>> [float(c) for c in v.values]
        [2.0, 2.0]
    """

    def __init__(self, devices=None, cross_device_ops: CrossDeviceOps | None = None):
        if not devices:
            devices = local_gpus() or ["cpu:0"]
        devices = canonicalize_list(devices, "devices")
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(
                f"cross_device_ops must be a replicafit.strategies.CrossDeviceOps, got {cross_device_ops!r}."
            )
        ops = cross_device_ops or _default_cross_device_ops(devices)
        super().__init__(MirroredExtended(self, devices, devices, ops))
