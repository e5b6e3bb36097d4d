"""Where an optimizer's state lives: the layout a strategy provides, so the optimizer never asks which strategy runs.

An optimizer keeps slots (momentum, moving averages, ...) for what it updates, and an update has to reach
every copy of every variable. Where those live is the strategy's business: every worker may hold whole
variables and whole slots (every strategy's default), or each worker may own slices of them (sharded
optimizer states, ``MultiWorkerMirroredStrategy(shard_optimizer_states=True)``), or the parameters themselves
may be sharded. The optimizer asks ``strategy.extended.state_layout(variables)`` once, and from then on it
talks to the layout only:

* the layout's **targets** are what the update rule updates and what slots are made for: the variables
  themselves, or 1-D slices of them (``slices_variables``: then only an element-wise rule is right);
* ``reduce`` sums the replicas' gradients (one batched reduction, or a reduce-scatter that hands this
  worker the gradients of its targets), ``take`` takes gradients reduced already;
* ``sum_over_workers``/``all_agree``/``counts``: what clipping norms and a loss scaler's finite check need
  when each worker holds part of the gradients;
* ``make_slot``, ``update`` (the per-variable path), ``finish`` (after the update: the updated slices
  gathered into every worker's variables, the kinds that keep extra copies refreshed);
* ``whole``/``cut``/``copy_from_slots``: the optimizer's state in the unsharded layout, and back.

``WholeVariables`` (here) is the layout of every strategy that keeps whole state on every worker;
``state_sharding.StateShards`` is the sliced one. A new strategy that lays the state out in its own way
returns a ``StateLayout`` of its own from ``state_layout``: the optimizers need no change.

Example (what an optimizer does with it; ``grads`` per replica, in cross-replica context)::

    layout = strategy.extended.state_layout(variables)
    reduced = layout.reduce(grads, variables)               # summed over every replica
    for grad, target in zip(reduced.values, layout.targets_of(variables)):
        layout.update(target, rule, (grad,))
    layout.finish(reduced, variables, direct=False)
"""

from __future__ import annotations

import torch

from . import context
from .reduce_util import ReduceOp
from .values import DistributedValues, local_results
from .variables import LocalVariable, Variable, first_tensor

__all__ = ["ReducedGradients", "StateLayout", "WholeVariables"]


class ReducedGradients:
    """The gradients of one update, summed over every replica: what a layout's ``reduce`` or ``take`` returns.

    ``values`` holds one tensor per target (what the gradient stages read and replace). Until a stage
    replaces them, ``copies`` keeps what the reduction gave each copy of a variable (a ``Mirrored`` of one
    tensor per replica device), so an update that changes nothing uses those instead of copying ``values``
    to every device again. ``buffers`` is the reduction's memory a sharded layout gathers the update into.

    Example::

        reduced = layout.reduce(grads, variables)
        reduced.replace([g * 0.5 for g in reduced.values])   # a stage's result: the copies follow from it
    """

    __slots__ = ("values", "copies", "buffers")

    def __init__(self, values: list, copies: list | None = None, buffers=None):
        self.values = values
        self.copies = copies
        self.buffers = buffers

    def replace(self, values: list) -> None:
        """``values`` from now on (a gradient stage's result); each copy then gets them (``StateLayout.per_copy``)."""
        self.values = values
        self.copies = None


class StateLayout:
    """Where an optimizer's state lives and how an update reaches the variables (see the module docstring).

    A strategy returns one from ``extended.state_layout(variables)``; the optimizer keeps it for its life and
    registers the variables it builds for with ``extend``. Methods marked *collective* are called by every
    worker, in the same order.

    Attributes:
      variables: the variables registered, in the optimizer's order (its state's positions).
      slices_variables: whether targets are slices of variables: an update rule that reads a whole tensor
        (a norm per variable, a factorisation by shape) is wrong on them and must be refused.
    """

    slices_variables = False

    def __init__(self, strategy):
        self.strategy = strategy
        self.variables: list = []

    # --- the variables and their targets ---------------------------------------------------------
    def extend(self, variables) -> list:
        """Registers ``variables`` (not registered yet) and returns their targets, to build slots for."""
        raise NotImplementedError

    def targets_of(self, variables) -> list:
        """The targets of ``variables`` (registered), in order: what the update rule updates."""
        raise NotImplementedError

    @property
    def targets(self) -> list:
        """Every target of the registered variables."""
        return self.targets_of(self.variables)

    def position_of(self, target) -> int:
        """The position (in ``variables``) of the variable ``target`` belongs to."""
        raise NotImplementedError

    # --- a step ------------------------------------------------------------------------------------
    def reduce(self, grads: list, variables: list) -> ReducedGradients:
        """*Collective.* ``grads`` (one ``PerReplica`` per variable, this worker's replicas) summed over every
        replica of every worker, one value per target of ``variables``. Cross-replica context."""
        raise NotImplementedError

    def take(self, grads: list, variables: list) -> ReducedGradients:
        """Gradients of ``variables`` reduced already (one whole value each), as one value per target."""
        raise NotImplementedError

    def per_copy(self, values: list, variables: list) -> list:
        """``values`` (one per target) as what every copy of each target gets: a ``Mirrored`` where a target
        has copies on several devices, else the value itself."""
        return values

    def sum_over_workers(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """*Collective.* ``tensor`` summed over the workers where each holds a part of the gradients (the
        partial squares of a norm); ``tensor`` itself where each worker holds them whole."""
        return tensor

    def all_agree(self, flag: bool, what: str) -> bool:
        """*Collective.* Whether ``flag`` holds on every worker, where each decided it on its part; else ``flag``."""
        return flag

    def counts(self, index: int) -> bool:
        """Whether this worker counts target ``index`` (of ``targets``) in sums over the workers: a target that
        every worker holds whole is counted by one of them."""
        return True

    @property
    def device(self) -> torch.device:
        """Where sums over the workers are made (the first reduction's device)."""
        return torch.device("cpu")

    def make_slot(self, target, name: str, value: torch.Tensor) -> Variable:
        """A slot variable of ``target`` holding ``value``, living where the target lives."""
        raise NotImplementedError

    def update(self, target, fn, args: tuple) -> None:
        """``fn(copy, *args)`` for every copy of ``target``, each on its device (a ``Mirrored`` argument gives each
        copy its own component): the per-variable path of the update rule."""
        raise NotImplementedError

    def finish(self, reduced: ReducedGradients, variables: list, direct: bool) -> None:
        """*Collective.* After the update of ``variables``: what makes every copy hold it. ``direct``: the
        copies' tensors were written directly (a multi-tensor kernel, ``torch.optim``'s step), not through
        ``update``."""

    def refresh(self) -> bool:
        """Follows variables whose memory moved (``param.data = ...``); whether any did (the optimizer then
        re-makes what holds their tensors)."""
        return False

    def settle(self) -> None:
        """*Collective.* Makes every variable hold the last update where its communication was let run on."""

    # --- the state in the unsharded layout ---------------------------------------------------------
    def whole(self, per_target: list, what: str) -> list:
        """*Collective.* One tensor per registered variable, shaped like it, from one tensor per target
        (``None``: zeros): a slot's whole value for ``state_dict``."""
        raise NotImplementedError

    def cut(self, position: int, value: torch.Tensor) -> list:
        """``[(target, part of value)]``: a whole value of variable ``position`` (``load_state_dict``) as this
        worker's targets hold it (none, where they are all on other workers)."""
        raise NotImplementedError

    def copy_from_slots(self, variables: list, slot_of) -> None:
        """*Collective.* Every copy of each of ``variables`` takes the value of its targets' slot ``slot_of(target)``
        (moving averages written into the variables)."""
        raise NotImplementedError

    def gather_objects(self, obj, what: str) -> list:
        """*Collective.* Every worker's ``obj`` where each holds a part of the state; ``[obj]`` otherwise."""
        return [obj]


class WholeVariables(StateLayout):
    """Every worker holds whole variables and whole slots: each target is a variable, the slots are variables of
    the strategy colocated with it (mirrored under ``MirroredStrategy``, on the parameter device under
    ``CentralStorageStrategy``), the reduction is one ``batch_reduce_to(SUM)`` and every copy is updated
    through ``extended.update``. The default ``state_layout`` of every strategy. Each call works under the
    strategy of the variables it is given (the current one for plain variables), as an optimizer may be used
    under several.

    Example::

        layout = WholeVariables(strategy)
        layout.extend(model.trainable_variables)    # the targets: the variables themselves
    """

    def __init__(self, strategy=None):
        super().__init__(strategy)
        self._positions: dict = {}  # id(variable) -> position

    def extend(self, variables) -> list:
        new = [v for v in variables if id(v) not in self._positions]
        for variable in new:
            self._positions[id(variable)] = len(self.variables)
            self.variables.append(variable)
        return new

    def targets_of(self, variables) -> list:
        return variables  # (each target is its variable)

    def position_of(self, target) -> int:
        return self._positions[id(target)]

    def reduce(self, grads: list, variables: list) -> ReducedGradients:
        reduced = _strategy_of(variables).extended.batch_reduce_to(ReduceOp.SUM, list(zip(grads, variables)))
        return self.take(reduced, variables)

    def take(self, grads: list, variables: list) -> ReducedGradients:
        plain = all(type(g) is torch.Tensor for g in grads)
        values = list(grads) if plain else [first_tensor(g) for g in grads]
        return ReducedGradients(values, self.per_copy(list(grads), variables))

    def per_copy(self, values: list, variables: list) -> list:
        if all(type(g) is torch.Tensor for g in values) and all(type(v) is LocalVariable for v in variables):
            return values  # one copy each: nothing to spread
        extended = _strategy_of(variables).extended
        return [_per_copy(extended, g, v) for g, v in zip(values, variables)]

    def make_slot(self, target, name: str, value: torch.Tensor) -> Variable:
        strategy = _strategy_of([target])
        with context.enter_or_assert_strategy(strategy), strategy.extended.colocate_vars_with(target):
            return Variable(value, trainable=False, name=f"{target.name}/{name}")

    def update(self, target, fn, args: tuple) -> None:
        _strategy_of([target]).extended.update(target, fn, args=args, group=False)

    def finish(self, reduced: ReducedGradients, variables: list, direct: bool) -> None:
        if direct:
            _strategy_of(variables).extended.after_direct_update(variables)

    def whole(self, per_target: list, what: str) -> list:
        return [
            (t if t is not None else torch.zeros_like(first_tensor(v))).detach().clone()
            for t, v in zip(per_target, self.variables)
        ]

    def cut(self, position: int, value: torch.Tensor) -> list:
        return [(self.variables[position], value)]

    def copy_from_slots(self, variables: list, slot_of) -> None:
        for variable in variables:
            _strategy_of([variable]).extended.update(variable, _copy_from, args=(slot_of(variable),), group=False)


def _strategy_of(variables):
    """The strategy of ``variables`` (the first one's), or the current one for plain variables."""
    owner = variables[0].distribute_strategy if variables else None
    return owner if owner is not None else context.get_strategy()


def _copy_from(component, slot) -> None:
    """``extended.update``'s function: a copy takes the matching copy of ``slot`` (its update replica's)."""
    index = context.current_mode().update_replica or 0
    source = local_results(slot)[index] if len(local_results(slot)) > index else local_results(slot)[0]
    with torch.no_grad():
        component.value().copy_(source.value())


def _per_copy(extended, grad, variable):
    """``grad`` for every copy of ``variable``: itself where the variable has one copy or it is per copy already."""
    if type(variable) is LocalVariable or isinstance(grad, DistributedValues) or len(local_results(variable)) == 1:
        return grad
    return extended.broadcast_to(grad, variable)
