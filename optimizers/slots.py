"""An optimizer's slot variables (momentum, velocity, moving averages): made for the targets of its state layout.

A slot belongs to a target (a variable, or a slice of one where the state is sharded) and has a name;
``add`` makes it through the layout (``StateLayout.make_slot``: where the target lives, mirrored or
central like its variable, or local to this worker), and keeps the names of each target's slots in the
order they were made (the multi-tensor groups and the saved state follow them).

Example::

    slots = Slots()
    momentum = slots.add(layout, variable, "momentum", torch.zeros(variable.shape))
    slots.of(variable, "momentum") is momentum   # True
"""

from __future__ import annotations

import torch

__all__ = ["Slots", "initial_value"]


def initial_value(initializer, shape, dtype) -> torch.Tensor:
    """A slot's first value: ``"zeros"``, ``"ones"``, a number, or a callable ``(shape, dtype) -> tensor``."""
    if initializer == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if initializer == "ones":
        return torch.ones(shape, dtype=dtype)
    if callable(initializer):
        return torch.as_tensor(initializer(shape, dtype), dtype=dtype)
    return torch.full(shape, float(initializer), dtype=dtype)


class Slots:
    """The slot variables of one optimizer, by target and name."""

    def __init__(self):
        self._slots: dict = {}  # (id(target), name) -> slot variable
        self._names: dict = {}  # id(target) -> [slot names, in the order they were made]

    def add(self, layout, target, name: str, value: torch.Tensor):
        """The slot ``name`` of ``target`` (made through ``layout`` with ``value``, unless it exists)."""
        key = (id(target), name)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = layout.make_slot(target, name, value)
            self._names.setdefault(id(target), []).append(name)
        return slot

    def of(self, target, name: str):
        """The slot ``name`` of ``target`` (``KeyError`` when it has none)."""
        return self._slots[(id(target), name)]

    def get(self, target, name: str):
        """The slot ``name`` of ``target``, or ``None``."""
        return self._slots.get((id(target), name))

    def has(self, target, name: str) -> bool:
        return (id(target), name) in self._slots

    def names_of(self, target) -> list:
        """The names of ``target``'s slots, in the order they were made."""
        return self._names.get(id(target), [])

    def variables(self) -> list:
        """Every slot variable, in the order they were made."""
        return list(self._slots.values())
