"""The kinds of variables a strategy makes, as building blocks for its two variable hooks.

A strategy decides what ``ds.Variable(...)`` makes in its scope (``StrategyExtended._create_variable(spec)``)
and how a distributed module's parameters and buffers are wrapped (``_module_variable(...)``); these
functions make the kinds it chooses from:

* ``local_variable``: one tensor on one device (the default strategy, ``OneDeviceStrategy``, and every
  component of the distributed kinds);
* ``distributed_variable``: one component per device, each from the same initial value: a
  ``MirroredVariable`` (``SyncOnReadVariable`` for ``synchronization=ON_READ``);
* ``replicated_module_variable``: the same over the replicas' own module tensors (replica 0's is the
  user's module).

Example (the hooks of ``MirroredStrategy``)::

    def _create_variable(self, spec):
        devices = self._colocated_devices() or self.worker_devices
        return variable_factory.distributed_variable(self._strategy, spec, devices)

    def _module_variable(self, name, tensors, trainable, synchronization, aggregation):
        return variable_factory.replicated_module_variable(
            self._strategy, name, tensors, self.worker_devices, trainable, synchronization, aggregation
        )
"""

from __future__ import annotations

from . import context
from .devices import torch_device
from .reduce_util import VariableSynchronization
from .variables import LocalVariable, MirroredVariable, SyncOnReadVariable, VariableSpec

__all__ = ["distributed_variable", "local_variable", "module_variable", "replicated_module_variable"]


def _owner(strategy):
    """What a variable records as its strategy: ``None`` for the default strategy's (a plain variable)."""
    return None if strategy is context.default_strategy() else strategy


def local_variable(strategy, tensor, spec: VariableSpec, device: str, replica_id: int = 0, name=None) -> LocalVariable:
    """A ``LocalVariable`` of ``strategy`` holding ``tensor`` (moved to ``device``), with ``spec``'s settings."""
    return LocalVariable(
        tensor.to(torch_device(device)),
        name=name or spec.name,
        device=device,
        trainable=spec.trainable,
        aggregation=spec.aggregation,
        synchronization=spec.synchronization,
        strategy=_owner(strategy),
        replica_id=replica_id,
    )


def distributed_variable(strategy, spec: VariableSpec, devices) -> MirroredVariable | SyncOnReadVariable:
    """One component per device of ``devices``, each initialised from ``spec``'s value: a ``MirroredVariable``,
    or a ``SyncOnReadVariable`` for ``synchronization=ON_READ`` (``AUTO`` means ``ON_WRITE``)."""
    spec.check_distributable()
    components = [
        local_variable(
            strategy,
            spec.initial_value.clone(),
            spec,
            device,
            replica_id=i,
            name=spec.name if i == 0 else f"{spec.name}/replica_{i}",
        )
        for i, device in enumerate(devices)
    ]
    kind = SyncOnReadVariable if spec.synchronization is VariableSynchronization.ON_READ else MirroredVariable
    synchronization = (
        VariableSynchronization.ON_WRITE
        if spec.synchronization is VariableSynchronization.AUTO
        else spec.synchronization
    )
    return kind(
        strategy,
        components,
        name=spec.name,
        trainable=spec.trainable,
        aggregation=spec.aggregation,
        synchronization=synchronization,
    )


def module_variable(strategy, name: str, tensor, device: str, trainable, synchronization, aggregation) -> LocalVariable:
    """One module tensor (a parameter or buffer) wrapped as a ``LocalVariable`` on ``device``."""
    return LocalVariable(
        tensor,
        name=name,
        device=device,
        trainable=trainable,
        aggregation=aggregation,
        synchronization=synchronization,
        strategy=_owner(strategy),
    )


def replicated_module_variable(strategy, name: str, tensors, devices, trainable, synchronization, aggregation):
    """One component per replica's module tensor (``tensors[i]`` on ``devices[i]``): a ``MirroredVariable``, or
    for ``ON_READ`` buffers (batch-norm statistics, kept per replica) a ``SyncOnReadVariable``."""
    components = [
        LocalVariable(
            t,
            name=name if i == 0 else f"{name}/replica_{i}",
            device=device,
            trainable=trainable,
            aggregation=aggregation,
            synchronization=synchronization,
            strategy=strategy,
            replica_id=i,
        )
        for i, (t, device) in enumerate(zip(tensors, devices))
    ]
    kind = SyncOnReadVariable if synchronization is VariableSynchronization.ON_READ else MirroredVariable
    return kind(
        strategy, components, name=name, trainable=trainable, aggregation=aggregation, synchronization=synchronization
    )
