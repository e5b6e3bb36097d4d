"""The default strategy: in force outside any scope, one replica on torch's current device.

TensorFlow's default strategy: ``ds.get_strategy()`` outside any ``scope()`` returns it, its replica context
is in force there (so ``merge_call`` and ``all_reduce`` work in plain code), its collectives are identities
and its variables are plain ``LocalVariable``s; its one replica draws from torch's global generator, as
plain torch code does. Registered with the context stack when the package is imported.

Example::

    >>> import replicafit.strategies as ds
    >>> ds.get_strategy().num_replicas_in_sync
    1
"""

from __future__ import annotations

from . import context
from .devices import default_device
from .distribute_lib import Strategy
from .extended import StrategyExtended
from .replica_context import DefaultReplicaContext
from .values import select_replica

__all__: list = []  # the default strategy is reached through get_strategy()


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
