"""``OneDeviceStrategy``: every variable and every computation on one device."""

from __future__ import annotations

from .devices import canonicalize
from .distribute_lib import Strategy
from .extended import StrategyExtended

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Runs one replica on ``device`` (``"cpu"``, ``"cpu:0"``, ``"cuda:1"``, ``torch.device``).

    Variables are plain ``LocalVariable``s on the device; ``run`` calls the function
    on the caller's thread with a replica context; datasets are moved to the device.
    Useful to check that code written for a strategy works before scaling out.

    Example::

        >>> import torch, replicafit.strategies as ds
        >>> strategy = ds.OneDeviceStrategy("cpu:0")
        >>> with strategy.scope():
        ...     v = ds.Variable(1.0)
        >>> strategy.run(lambda: v * 3)
        tensor(3., grad_fn=<MulBackward0>)
    """

    def __init__(self, device):
        device = canonicalize(device)
        super().__init__(StrategyExtended(self, (device,), (device,)))
