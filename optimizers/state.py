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

from replicafit.strategies.describe import brief
from replicafit.strategies.values import local_results

__all__ = ["PendingState", "check_learning_rate", "describe", "parse"]


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
