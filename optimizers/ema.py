"""Moving averages of the variables (``use_ema``): an average beside every variable, moved after each update.

Keras 3's rule: after each update ``average = ema_momentum * average + (1 - ema_momentum) *
variable``, except the first (``iterations == 0``), which sets ``average = variable``; after
the update whose ``iterations + 1`` is a multiple of ``ema_overwrite_frequency`` the
variables are overwritten with their averages. An average is the slot ``"average"``, living
where its variable lives; ``move_averages`` is the rule, written once for every path (the
per-variable update, the multi-tensor plans, ``from_torch``). ``MovingAverages`` gives the
optimizer what is done with the averages: writing them into the variables for good
(``finalize_variable_values``) or for a while (``averaged_weights``, or ``swap_in_averages``
then ``swap_out_averages``).
"""

from __future__ import annotations

import contextlib

from replicafit.strategies import context, foreach
from replicafit.strategies.values import local_results, value_container

from .tensors import _first_tensor, _no_grad, _tensor_of

__all__ = ["MovingAverages", "check_ema", "move_averages"]


class MovingAverages:
    """The optimizer's moving averages (a mixin of ``Optimizer``, which creates the ``"average"`` slots in
    ``build`` and moves them in its update).

    Uses the optimizer's ``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency``, slots
    (``_slots``, ``get_slot``), built variables (``_variables``, ``_wrapped``), ``_strategy_of`` and
    ``updates_so_far``; keeps ``_swapped``, the trained values while the averages are swapped in.
    """

    def _init_averages(self) -> None:
        self._swapped: list | None = None  # (variable, its copies' trained values) while averages are swapped in

    def finalize_variable_values(self, var_list) -> None:
        """Keras 3's end-of-training hook: with ``use_ema``, writes each variable's moving average into it.

        ``var_list``: variables or a module's parameters (``model.parameters()``); those the
        optimizer keeps no average for (never updated by it) are left as they are. Every copy
        of a variable gets its own copy's average (``extended.update``), so copies stay equal;
        under ``MultiWorkerMirroredStrategy`` every worker calls it (no communication, except with
        ``shard_optimizer_states``: the averages are gathered from every worker's part then). Without
        ``use_ema`` it does nothing. ``Trainer.fit`` calls it at its end, before ``on_train_end``
        (as Keras' ``fit`` does), so the model holds the averages after training.

        Example::

            optimizer = optimizers.Adam(1e-3, use_ema=True)
            ...                                       # a training loop of one's own
            optimizer.finalize_variable_values(model.parameters())
        """
        if not self.use_ema:
            return
        variables = self._averaged(var_list)
        if self._shards is not None:  # whole averages gathered from the pieces (every worker calls this)
            self._shards.settle()  # the last update's values first (a gather the trainer's step may defer)
            self._write_averages(variables)
            return
        for variable in variables:
            self._strategy_of([variable]).extended.update(variable, self._take_average, group=False)

    @contextlib.contextmanager
    def averaged_weights(self, var_list=None):
        """Inside the block the variables hold their moving averages; after it, their trained values again.

        The callback-free way to evaluate (or save) with the averages in the middle of
        training. ``var_list`` defaults to every variable the optimizer updates; needs
        ``use_ema=True``. Call it in cross-replica context (outside ``strategy.run``).

        Example::

            with optimizer.averaged_weights():
                val_logs = trainer.evaluate(model, (x_val, y_val), batch_size=256, return_dict=True)
        """
        self.swap_in_averages(var_list, "averaged_weights()")
        try:
            yield
        finally:
            self.swap_out_averages()

    @property
    def averages_swapped_in(self) -> bool:
        """Whether the variables hold their moving averages now.

        True when swapped in by ``swap_in_averages`` (or ``averaged_weights``) and not swapped out or
        kept since.

        Example::

            if not optimizer.averages_swapped_in:
                optimizer.swap_in_averages()
        """
        return self._swapped is not None

    def swap_in_averages(self, var_list=None, caller: str = "swap_in_averages()") -> None:
        """Writes the moving averages into the variables, keeping their trained values for ``swap_out_averages``.

        ``averaged_weights`` for code whose start and end are apart (``SwapEMAWeights``' swap from
        ``on_test_begin`` to ``on_test_end``). ``var_list`` defaults to every variable the optimizer
        updates; ``caller`` names the caller in the errors: ``ValueError`` without ``use_ema``,
        ``RuntimeError`` while the averages are swapped in already. Call it in cross-replica context
        (outside ``strategy.run``).

        Example::

            optimizer.swap_in_averages()
            try:
                trainer.evaluate(model, (x_val, y_val), batch_size=256)
            finally:
                optimizer.swap_out_averages()
        """
        if not self.use_ema:
            raise ValueError(
                f"{caller} needs an optimizer with use_ema=True; {type(self).__name__} {self.name!r} keeps no "
                "moving averages."
            )
        if self._swapped is not None:
            raise RuntimeError(f"{caller}: the averages are swapped in already (averaged_weights() do not nest).")
        variables = self._averaged(self._variables if var_list is None else var_list)
        if self._shards is not None:
            self._shards.settle()  # the trained values kept are the last update's (its gather may be deferred)
        saved = [[_tensor_of(c).detach().clone() for c in local_results(v)] for v in variables]
        if self._shards is not None:  # whole averages gathered from the pieces (every worker calls this)
            self._write_averages(variables)
        for variable in variables if self._shards is None else ():
            self._strategy_of([variable]).extended.update(variable, self._take_average, group=False)
        self._swapped = list(zip(variables, saved))

    def swap_out_averages(self) -> None:
        """Puts back the trained values ``swap_in_averages`` kept (nothing when nothing is swapped in).

        Example::

            optimizer.swap_out_averages()   # at the next epoch's start: training continues from the trained values
        """
        swapped, self._swapped = self._swapped, None
        for variable, values in swapped or ():
            self._strategy_of([variable]).extended.update(variable, _take_saved, args=(values,), group=False)

    def keep_averages(self) -> None:
        """Ends a swap without putting the trained values back: the averages stay in the variables.

        For a swap that training's end makes final (``fit`` writes the averages into the model then,
        ``finalize_variable_values``). Nothing happens when nothing is swapped in.

        Example::

            optimizer.swap_in_averages()
            optimizer.keep_averages()   # the model keeps the averages; swap_out_averages() has nothing to put back
        """
        self._swapped = None

    def trained_values(self) -> dict:
        """``{id(variable): its first copy's trained value}`` while the averages are swapped in, else ``{}``.

        What a backup of the model must hold instead of the averages the variables hold then (a
        resumed run trains on from the trained values).

        Example::

            with optimizer.averaged_weights():
                trained = optimizer.trained_values()   # {id(variable): tensor}, the values training left
        """
        return {id(variable): values[0] for variable, values in self._swapped or ()}

    def _averaged(self, var_list) -> list:
        """The containers of ``var_list`` that have an ``"average"`` slot, each once, in order."""
        found, seen = [], set()
        for item in var_list:
            entry = self._wrapped.get(id(item))
            container = entry[1] if entry is not None and entry[0] is item else value_container(item)
            averaged = (id(container), "average") in self._slots or (
                self._shards is not None and id(container) in self._built_ids and self.use_ema
            )
            if averaged and id(container) not in seen:
                seen.add(id(container))
                found.append(container)
        return found

    def _take_average(self, component) -> None:
        with _no_grad():
            _tensor_of(component).copy_(_tensor_of(self.get_slot(component, "average")))

    def _ema_step(self) -> tuple | None:
        """``(momentum, overwrite)`` of this update's moving averages (Keras 3's rule), or None without EMA."""
        if not self.use_ema:
            return None
        step = self.updates_so_far()  # before this update counts
        momentum = self.ema_momentum if step else 0.0  # the first update: average = variable
        frequency = self.ema_overwrite_frequency
        return momentum, bool(frequency) and (step + 1) % frequency == 0


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


def _with_average(entry: dict, names: list, variable) -> dict:
    """A loaded slot entry fitted to ``use_ema``: an average saved by an optimizer with ``use_ema`` is
    dropped by one without; one without gives an optimizer with ``use_ema`` the variable's current value
    as its average (turning ``use_ema`` on when resuming a run starts the average there)."""
    if ("average" in entry) == ("average" in names):
        return entry
    entry = dict(entry)
    if "average" in entry:
        del entry["average"]
    else:
        entry["average"] = _first_tensor(variable).detach().clone()
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
