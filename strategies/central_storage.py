"""``CentralStorageStrategy``: variables on one parameter device, compute on several."""

from __future__ import annotations

from .cross_device_ops import ReductionToOneDevice
from .devices import canonicalize, canonicalize_list, torch_device
from .distribute_lib import Strategy
from .extended import StrategyExtended
from .mirrored import local_gpus
from .reduce_util import VariableSynchronization
from .variables import CentralStorageVariable, LocalVariable

__all__ = ["CentralStorageStrategy"]


class CentralStorageExtended(StrategyExtended):
    """Variables live once on the parameter device; replicas read copies on their devices.

    ``ON_READ`` variables (metrics, batch-norm statistics) are per-replica
    ``SyncOnReadVariable``s, as under ``MirroredStrategy``.
    """

    def _create_variable(self, spec):
        if spec.synchronization is VariableSynchronization.ON_READ:
            return self._create_distributed_variable(spec, self._worker_devices)
        spec.check_distributable()
        colocated = self._colocated_devices()
        device = colocated[0] if colocated else self._parameter_devices[0]
        return CentralStorageVariable(self._strategy, self._local_variable(spec.initial_value, spec, device))

    def _module_variable(self, name, tensors, trainable, synchronization, aggregation):
        if synchronization is VariableSynchronization.ON_READ:
            return self._replicated_module_variable(name, tensors, trainable, synchronization, aggregation)
        device = self._parameter_devices[0]
        first = tensors[0]
        if torch_device(device) == first.device:
            stored = first  # replica 0's parameter is the stored value: the user's module stays current
        else:
            stored = first.detach().to(torch_device(device)).requires_grad_(first.requires_grad)
        primary = LocalVariable(
            stored,
            name=name,
            device=device,
            trainable=trainable,
            aggregation=aggregation,
            synchronization=synchronization,
            strategy=self._strategy,
        )
        return CentralStorageVariable(self._strategy, primary, replica_tensors=tensors)


class CentralStorageStrategy(Strategy):
    """Variables on one parameter device, computation on several compute devices.

    Args:
      compute_devices: replica devices; ``None`` uses every GPU, or ``["cpu:0"]``.
      parameter_device: where variables are stored; by default the compute device
        when there is one, else ``"cpu:0"``.

    Replicas read a copy of each variable on their device, refreshed after every
    update; gradients are reduced onto the parameter device and applied once. Unlike
    TensorFlow's, the final partial step is not dropped: partial and empty replica
    batches are handled as under every other strategy.

    Example::

        >>> import replicafit.strategies as ds
        >>> strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu:0")
        >>> strategy.extended.parameter_devices
        ('cpu:0',)
    """

    def __init__(self, compute_devices=None, parameter_device=None):
        if not compute_devices:
            compute_devices = local_gpus() or ["cpu:0"]
        compute = canonicalize_list(compute_devices, "compute_devices")
        if parameter_device is None:
            parameter = compute[0] if len(compute) == 1 else "cpu:0"
        else:
            parameter = canonicalize(parameter_device)
        ops = ReductionToOneDevice(reduce_to_device=parameter)
        super().__init__(CentralStorageExtended(self, compute, (parameter,), ops))

    def __repr__(self) -> str:
        extended = self.extended
        return (
            f"CentralStorageStrategy(compute_devices={extended.worker_devices}, "
            f"parameter_device={extended.parameter_devices[0]!r})"
        )
