"""Moving averages of the variables (``use_ema``): an average beside every variable, moved after each update.

Keras 3's rule: after each update ``average = ema_momentum * average + (1 - ema_momentum) *
variable``, except the first (``iterations == 0``), which sets ``average = variable``; after
the update whose ``iterations + 1`` is a multiple of ``ema_overwrite_frequency`` the
variables are overwritten with their averages. An average is the slot ``"average"``, living
where its variable lives; ``move_averages`` is the rule, written once for every path (the
per-variable update, the multi-tensor plans, ``from_torch``). ``MovingAverages`` is the stage: the
rule's settings, and what is done with the averages: writing them into the variables for good
(``finalize_variable_values``) or for a while (``averaged_weights``, or ``swap_in_averages``
then ``swap_out_averages``): the optimizer's public methods call it, and its state layout writes
every copy (``StateLayout.copy_from_slots``: gathered from every worker's part where the state is
sharded).
"""

from __future__ import annotations

from replicafit.strategies import context, foreach
from replicafit.strategies.values import local_results
from replicafit.strategies.variables import first_tensor

from .tensors import _no_grad, _tensor_of

__all__ = ["MovingAverages", "check_ema", "move_averages", "with_average"]


class MovingAverages:
    """The moving-average stage of the pipeline (``use_ema``): the rule's settings, and the averages written into
    the variables for good or for a while.

    Args:
      momentum: ``ema_momentum``, in ``[0, 1]``.
      overwrite_frequency: ``ema_overwrite_frequency`` (``None``: never).

    The averages themselves are the optimizer's slots ``"average"`` (made in ``build``, saved with its state);
    ``swapped`` holds the trained values while the averages are swapped in.

    Example::

        averages = MovingAverages(0.99, None)
        averages.step(0)   # (0.0, False): the first update sets average = variable
    """

    def __init__(self, momentum: float, overwrite_frequency):
        self.momentum = momentum
        self.overwrite_frequency = overwrite_frequency
        self.swapped: list | None = None  # (variable, its copies' trained values) while averages are swapped in

    def step(self, updates_so_far: int) -> tuple:
        """``(momentum, overwrite)`` of the update that follows ``updates_so_far`` updates (Keras 3's rule)."""
        momentum = self.momentum if updates_so_far else 0.0  # the first update: average = variable
        frequency = self.overwrite_frequency
        return momentum, bool(frequency) and (updates_so_far + 1) % frequency == 0

    def write(self, variables: list, layout, slot_of) -> None:
        """Every copy of each of ``variables`` takes its moving average (``slot_of(target)``: the target's
        ``"average"`` slot); a collective where each worker holds part of the averages."""
        layout.copy_from_slots(variables, slot_of)

    def swap_in(self, variables: list, layout, slot_of, caller: str) -> None:
        """Writes the averages into ``variables``, keeping their trained values for ``swap_out``."""
        if self.swapped is not None:
            raise RuntimeError(f"{caller}: the averages are swapped in already (averaged_weights() do not nest).")
        layout.settle()  # the trained values kept are the last update's (its gather may be deferred)
        saved = [[c.value().detach().clone() for c in local_results(v)] for v in variables]
        self.write(variables, layout, slot_of)
        self.swapped = list(zip(variables, saved))

    def swap_out(self, strategy_of) -> None:
        """Puts back the trained values ``swap_in`` kept (every copy its own), if any."""
        swapped, self.swapped = self.swapped, None
        for variable, values in swapped or ():
            strategy_of([variable]).extended.update(variable, _take_saved, args=(values,), group=False)

    def trained_values(self) -> dict:
        """``{id(variable): its first copy's trained value}`` while the averages are swapped in."""
        return {id(variable): values[0] for variable, values in self.swapped or ()}


def move_averages(averages: list, weights: list, ema: tuple) -> None:
    """The rule, in place: ``average = momentum * average + (1 - momentum) * weight`` for each pair of
    tensors, then, on an overwrite update, ``weight = average``. ``ema`` is ``(momentum, overwrite)``
    (``MovingAverages._ema_step``). Call it with grad mode off."""
    momentum, overwrite = ema
    foreach.mul_(averages, momentum)
    foreach.add_(averages, weights, alpha=1.0 - momentum)
    if overwrite:
        foreach.copy_(weights, averages)


def _take_saved(component, values) -> None:
    """``averaged_weights``' way back: the copy gets the value it held before."""
    index = context.current_mode().update_replica or 0
    with _no_grad():
        _tensor_of(component).copy_(values[index])


def with_average(entry: dict, names: list, variable) -> dict:
    """A loaded slot entry fitted to ``use_ema``: an average saved by an optimizer with ``use_ema`` is
    dropped by one without; one without gives an optimizer with ``use_ema`` the variable's current value
    as its average (turning ``use_ema`` on when resuming a run starts the average there)."""
    if ("average" in entry) == ("average" in names):
        return entry
    entry = dict(entry)
    if "average" in entry:
        del entry["average"]
    else:
        entry["average"] = first_tensor(variable).detach().clone()
    return entry


def check_ema(use_ema, momentum, overwrite_frequency) -> tuple:
    """``(use_ema, ema_momentum, ema_overwrite_frequency)`` checked (Keras 3's ranges)."""
    if not isinstance(use_ema, bool):
        raise TypeError(f"`use_ema` must be True or False, got {use_ema!r}.")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
        raise ValueError(f"`ema_momentum` must be a number in [0, 1], got {momentum!r}.")
    if overwrite_frequency is not None and (
        isinstance(overwrite_frequency, bool) or not isinstance(overwrite_frequency, int) or overwrite_frequency < 1
    ):
        raise ValueError(
            f"`ema_overwrite_frequency` must be None (never) or an integer >= 1, got {overwrite_frequency!r}."
        )
    return use_ema, float(momentum), overwrite_frequency
