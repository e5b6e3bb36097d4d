"""The arguments every optimizer shares, kept in one place, and the stages made from them.

``Optimizer.__init__``'s keyword arguments (``weight_decay``, ``clipnorm``, ``clipvalue``,
``global_clipnorm``, ``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency``,
``gradient_accumulation_steps``) are spelt once, in its signature; ``SHARED_ARGUMENTS`` reads them from
there (for ``get_config`` and ``from_torch``). The optimizer keeps their values in ``_options`` and is
given them as attributes (``option``): setting one, as Keras allows (``optimizer.clipnorm = 1.0``),
makes the stages again (``configure``).

Example::

    optimizer = optimizers.SGD(0.1, clipnorm=1.0)
    optimizer.clipnorm = 0.5          # the next update clips to 0.5
"""

from __future__ import annotations

from . import stages
from .accumulation import GradientAccumulation, check_accumulation_steps
from .ema import MovingAverages, check_ema

__all__ = ["configure", "option"]


def option(name: str, doc: str) -> property:
    """A shared argument of ``Optimizer`` as an attribute: read from ``_options``; set, the stages are made again
    (a value that does not pass the checks is refused, and the previous one kept)."""

    def get(self):
        return self._options[name]

    def set_(self, value) -> None:
        previous = self._options[name]
        self._options[name] = value
        try:
            configure(self)
        except (TypeError, ValueError):
            self._options[name] = previous
            configure(self)
            raise

    return property(get, set_, doc=doc)


def configure(optimizer) -> None:
    """Makes ``optimizer``'s stages from its shared arguments (``optimizer._options``), checked: weight decay,
    clipping (by value, else by norm, else by global norm: only one may be given to the constructor),
    accumulation and moving averages. Stages made before keep their state (an open window, exclusions)."""
    options = optimizer._options
    optimizer._weight_decay.rate = stages.check_decay(options["weight_decay"])
    for name in ("clipnorm", "clipvalue", "global_clipnorm"):
        options[name] = stages.check_positive(name, options[name])
    # Clipping by value, else by norm, else by global norm (only one may be given to the constructor).
    clipvalue, clipnorm = options["clipvalue"], options["clipnorm"]
    optimizer._clipping = stages.clipping(
        clipnorm if clipvalue is None else None,
        clipvalue,
        options["global_clipnorm"] if clipvalue is None and clipnorm is None else None,
    )
    steps = check_accumulation_steps(options["gradient_accumulation_steps"])
    if not steps:
        optimizer._accumulation = None
    elif optimizer._accumulation is None:
        optimizer._accumulation = GradientAccumulation(steps, f"{type(optimizer).__name__} {optimizer.name!r}")
    else:
        optimizer._accumulation.steps = steps
    use_ema, momentum, frequency = check_ema(
        options["use_ema"], options["ema_momentum"], options["ema_overwrite_frequency"]
    )
    options.update(gradient_accumulation_steps=steps, use_ema=use_ema, ema_momentum=momentum)
    options.update(ema_overwrite_frequency=frequency, weight_decay=optimizer._weight_decay.rate)
    if not use_ema:
        optimizer._averages = None
    elif optimizer._averages is None:
        optimizer._averages = MovingAverages(momentum, frequency)
    else:
        optimizer._averages.momentum, optimizer._averages.overwrite_frequency = momentum, frequency
