"""The layout of an optimizer's ``state_dict()``: per-variable entries keyed by position.

::

    {"iterations": 7,
     "variables": [{"name": "0.weight", "shape": [8, 4]}, {"name": "0.bias", "shape": [8]}],
     "slots": {0: {"momentum": tensor, ...}, 1: {...}},     # TorchOptimizer: "torch_state"
     "learning_rate": 0.01}                                  # absent when it is a schedule

An entry belongs to the variable at the same position in the optimizer's variable list
(the order it was built with), as in Keras 3 and ``torch.optim``: names need not be
unique (every unnamed ``Variable`` is called ``"Variable"``), so keying by name let two
variables share, and overwrite, one entry. ``variables`` records each position's name
and shape as a check: restoring into variables whose count, names or shapes differ is a
``ValueError`` naming the position. Values are aggregated (one copy per variable), so
the state is the same under every strategy and loads under any other.

States written before positions (``{"slots": {variable name: {...}}}``, no
``variables``) still load when every name they use belongs to exactly one variable; a
name shared by several variables is refused, since its entry cannot be placed.

Example::

    state = optimizer.state_dict()
    fresh.load_state_dict(state)      # restored into the variables fresh is (or will be) built for
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from replicafit.strategies import context
from replicafit.strategies.describe import brief
from replicafit.strategies.values import local_results

from .ema import with_average

__all__ = [
    "PendingState",
    "SlotPart",
    "assign_all",
    "check_learning_rate",
    "describe",
    "parse",
    "plan_restore",
    "prepare",
    "whole_slots",
    "with_pending",
]


def check_learning_rate(value, what: str = "learning_rate") -> float:
    """``value`` as a float if it is a finite number >= 0 (0 is valid, as in Keras and torch.optim)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`{what}` must be a finite number >= 0 (or a schedule), got {value!r}: 0 is allowed, negative, NaN "
            "and infinite rates are not."
        )
    return float(value)


def _shape(variable) -> list:
    return list(local_results(variable)[0].shape)


def describe(variables) -> list:
    """``[{"name", "shape"}]`` of ``variables``, in order: what a state's entries belong to."""
    return [{"name": v.name, "shape": _shape(v)} for v in variables]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(state, entries_key: str, owner: str):
    """Checks the structure of a ``state_dict()`` output; returns ``(iterations, PendingState)``.

    Raises ``ValueError`` saying what is missing or of the wrong type; nothing is changed.
    """
    if not isinstance(state, Mapping) or "iterations" not in state or entries_key not in state:
        raise ValueError(
            f"{owner}.load_state_dict() needs the dict returned by {owner}.state_dict() (keys 'iterations' and "
            f"{entries_key!r}), got {brief(state)}."
        )
    iterations = state["iterations"]
    if not _is_int(iterations) or iterations < 0:
        raise ValueError(f"The optimizer state's 'iterations' must be an int >= 0, got {brief(iterations)}.")
    entries = state[entries_key]
    if not isinstance(entries, Mapping):
        raise ValueError(f"The optimizer state's {entries_key!r} must be a dict, got {brief(entries)}.")
    records = state.get("variables")
    if records is None:  # the name-keyed layout of earlier versions
        if not all(isinstance(key, str) for key in entries):
            raise ValueError(
                f"The optimizer state's {entries_key!r} has keys {brief(list(entries))}, but no 'variables' list: "
                "positions need the 'variables' list, variable names are the only other keys accepted."
            )
    else:
        records = _parse_records(records)
        bad = [key for key in entries if not _is_int(key) or not 0 <= key < len(records)]
        if bad:
            raise ValueError(
                f"The optimizer state's {entries_key!r} has keys {brief(bad)}; they must be the positions "
                f"0..{len(records) - 1} of its {len(records)} 'variables'."
            )
    parsed = {}
    for key, entry in entries.items():
        if not isinstance(entry, Mapping) or not all(isinstance(name, str) for name in entry):
            raise ValueError(
                f"The optimizer state's entry for variable {key!r} must be a dict keyed by slot name, got "
                f"{brief(entry)}."
            )
        parsed[key] = dict(entry)
    return iterations, PendingState(records, parsed)


def _parse_records(records) -> list:
    if not isinstance(records, (list, tuple)):
        raise ValueError(f"The optimizer state's 'variables' must be a list, got {brief(records)}.")
    parsed = []
    for position, record in enumerate(records):
        name = record.get("name") if isinstance(record, Mapping) else None
        shape = record.get("shape") if isinstance(record, Mapping) else None
        if not isinstance(name, str) or not isinstance(shape, (list, tuple)) or not all(map(_is_int, shape)):
            raise ValueError(
                f"The optimizer state's variable {position} must be {{'name': str, 'shape': [int, ...]}}, got "
                f"{brief(record)}."
            )
        parsed.append({"name": name, "shape": list(shape)})
    return parsed


class PendingState:
    """Loaded entries not yet restored: they go to variables as the optimizer is built for them.

    ``records`` is the saved ``variables`` list (``None`` for a name-keyed state), and
    ``entries`` maps a position (or, name-keyed, a name) to that variable's entry.
    """

    def __init__(self, records, entries: dict):
        self.records, self.entries = records, entries
        self.checked = -1  # how many variables were built when it was last matched (nothing to redo until more)

    def match(self, variables: list) -> dict:
        """``{position: entry}`` for those of ``variables`` (the optimizer's, in order) that have one.

        Checks, for a positional state, that the count, names and shapes agree (a state
        saved before the optimizer was built, with no variables, restores nothing); a
        ``ValueError`` names the first position that differs. Changes nothing.
        """
        return self._match_names(variables) if self.records is None else self._match_positions(variables)

    def discard(self, taken: dict, variables: list) -> None:
        """Forgets the entries ``match`` returned, once they are restored."""
        for position in taken:
            self.entries.pop(position if self.records is not None else variables[position].name)
        self.checked = len(variables)

    def done(self, built: int) -> bool:
        """Nothing left to restore or check once ``built`` variables are built."""
        return not self.entries and (self.records is None or built >= len(self.records))

    def _match_positions(self, variables: list) -> dict:
        if not self.records:  # saved before the optimizer was built: no per-variable state
            return {}
        if len(variables) > len(self.records):
            extra = [v.name for v in variables[len(self.records) :]]
            raise ValueError(
                f"The optimizer state holds {len(self.records)} variables, but this optimizer has {len(variables)} "
                f"(the extra ones: {brief(extra)}): the state was saved for another model or another variable list."
            )
        for position, variable in enumerate(variables):
            record = self.records[position]
            shape = _shape(variable)
            if record["name"] != variable.name or record["shape"] != shape:
                raise ValueError(
                    f"The optimizer state's variable {position} is {record['name']!r} of shape {record['shape']}, "
                    f"but this optimizer's variable {position} is {variable.name!r} of shape {shape}: the state was "
                    "saved for another model or another variable order."
                )
        return {p: self.entries[p] for p in range(len(variables)) if p in self.entries}

    def _match_names(self, variables: list) -> dict:
        positions: dict = {}
        for position, variable in enumerate(variables):
            positions.setdefault(variable.name, []).append(position)
        taken = {}
        for name, entry in self.entries.items():
            found = positions.get(name, [])
            if len(found) > 1:
                raise ValueError(
                    f"This optimizer state keys its entries by variable name (the layout of earlier versions), and "
                    f"variables {found} are all named {name!r}: their entries cannot be told apart. Re-create the "
                    "state with this version, which keys entries by position, or give the variables unique names."
                )
            if found:
                taken[found[0]] = entry
        return taken


def with_pending(pending, records: list, entries: dict, built: bool) -> tuple:
    """``(records, entries)`` of a state with what a loaded state holds for variables not built yet, as loaded: a
    name-keyed state loaded before any build as it is (then without records), a positional one's entries beyond
    the built variables appended."""
    if pending is not None and pending.records is None and not built:
        return None, {name: dict(entry) for name, entry in pending.entries.items()}
    if pending is not None and pending.records:
        for position in range(len(records), len(pending.records)):
            records.append(dict(pending.records[position]))
            if position in pending.entries:
                entries[position] = dict(pending.entries[position])
    return records, entries


class SlotPart:
    """Where a loaded slot value goes: the slot ``name`` of one target (a variable, or this worker's slice of one),
    made once every check has passed where the optimizer has not made it yet (an optional slot a state brings).

    Example::

        assign_all([(SlotPart(optimizer, variable, "momentum"), value)])
    """

    def __init__(self, optimizer, target, name: str):
        self.optimizer, self.target, self.name = optimizer, target, name

    def assign(self, value) -> None:
        """Writes ``value`` into every copy of the slot (making the slot first where it is missing)."""
        optimizer = self.optimizer
        slot = optimizer._slots.get(self.target, self.name)
        if slot is None:
            optimizer._plans.clear()  # the multi-tensor groups follow each target's slot names
            slot = optimizer.add_variable_from_reference(self.target, self.name)
        strategy = slot.distribute_strategy or context.get_strategy()
        with context.enter_or_assert_strategy(strategy):
            slot.assign(value)


def assign_all(assignments) -> None:
    """Writes loaded values (``[(SlotPart, value)]``, planned and checked first) into the optimizer's slots."""
    for part, value in assignments:
        part.assign(value)


def prepare(optimizer) -> None:
    """What ``state_dict`` needs first: slots a hyper-parameter asks for, a state loaded since the last
    build restored, and the variables of an open window (opened before any update built) built for."""
    if optimizer._slots_outdated:
        optimizer._refresh_slots()
    if optimizer._pending is not None and optimizer._pending.checked != len(optimizer._variables):
        optimizer._restore_pending()
    window = optimizer._accumulation.window if optimizer._accumulation is not None else None
    if window is not None:  # a first window opens before the first update builds
        variables = window.variables
        optimizer._build(optimizer._strategy_of(variables), variables)
        if optimizer._pending is not None and optimizer._pending.checked != len(optimizer._variables):
            optimizer._restore_pending()


def whole_slots(optimizer) -> dict:
    """``{position: {slot name: whole tensor}}`` of the built variables (gathered from every worker's
    slices where the layout slices them: a collective)."""
    layout = optimizer._layout
    if layout is None or not optimizer._variables:
        return {}
    names = _slot_names_by_position(optimizer, layout)
    slots: dict = {position: {} for position in range(len(optimizer._variables))}
    every = []
    for position in sorted(names):
        every += [name for name in names[position] if name not in every]
    for name in every:
        per_target = [_first_value(optimizer._slots.get(t, name)) for t in layout.targets]
        whole = layout.whole(per_target, f"the optimizer's {name!r} slots")
        for position in range(len(optimizer._variables)):
            if name in names.get(position, ()):
                slots[position][name] = whole[position]
    return slots


def plan_restore(optimizer, pending) -> tuple:
    """``(entries taken, [(slot part, value)])`` for the built variables; ``ValueError`` if they do not fit."""
    if not optimizer._variables:
        return {}, []
    taken = pending.match(optimizer._variables)
    layout = optimizer._layout
    firsts: dict = {}  # position -> its first target here (one pass, not one per variable)
    for target in layout.targets:
        firsts.setdefault(layout.position_of(target), target)
    any_target = layout.targets[0] if layout.targets else None
    assignments = []
    for position, entry in taken.items():
        variable = optimizer._variables[position]
        # The slot names of its targets here (those of any target here when this worker holds none of the
        # variable: every target of an element-wise rule has the same); None without any target.
        first = firsts.get(position, any_target)
        names = None if first is None else list(optimizer._slots.names_of(first))
        if names is None:  # this worker holds no part of this variable: nothing here to check or keep
            continue
        entry = with_average(entry, names, variable)
        if (set(entry) ^ set(names)) - set(optimizer._optional_slots):
            raise ValueError(
                f"The optimizer state's variable {position} ({variable.name!r}) has slots {sorted(entry)}, but "
                f"{type(optimizer).__name__} {optimizer.name!r} keeps {sorted(names)} for it: the state was saved by "
                "another optimizer or with other options."
            )
        expected = list(local_results(variable)[0].shape)
        for name in [*names, *(n for n in entry if n not in names)]:
            if name not in entry:  # an optional slot the state lacks starts again
                value = torch.zeros(expected, dtype=local_results(variable)[0].dtype)
            else:
                value = entry[name]
                if not isinstance(value, torch.Tensor) or list(value.shape) != expected:
                    tensor = isinstance(value, torch.Tensor)
                    shown = f"shape {list(value.shape)}" if tensor else type(value).__name__
                    raise ValueError(
                        f"The optimizer state's slot {name!r} of variable {position} ({variable.name!r}) must be "
                        f"a tensor of shape {expected}, got {shown}."
                    )
            for target, part in layout.cut(position, value):
                assignments.append((SlotPart(optimizer, target, name), part))
    return taken, assignments


def _first_value(slot):
    return None if slot is None else local_results(slot)[0].value().detach()


def _slot_names_by_position(optimizer, layout) -> dict:
    """``{position: [slot names]}`` of every built variable, agreed across workers where each holds slices (a
    variable's slices may all be on other workers)."""
    mine: dict = {}
    for target in layout.targets:
        mine.setdefault(layout.position_of(target), list(optimizer._slots.names_of(target)))
    names: dict = {}
    for part in layout.gather_objects(mine, "the optimizer's slot names"):
        for position, found in part.items():
            names.setdefault(position, found)
    every = []
    for position in sorted(names):
        every += [name for name in names[position] if name not in every]
    for position, variable in enumerate(layout.variables):  # an empty variable has no slice anywhere
        if position not in names and not local_results(variable)[0].value().numel():
            names[position] = list(every)
    return names
