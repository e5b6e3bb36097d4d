"""What ``apply_gradients`` is given, as the variables the pipeline updates (its step 1).

A gradient comes with a variable of a strategy (its distributed variable is taken where a component
is given), or with a plain tensor, such as a parameter of a module no strategy distributed: that one is
wrapped once in a ``LocalVariable`` and the same wrapper is used at every later update (and by
``get_slot`` and ``finalize_variable_values``). A training loop gives the same list every step, so the
last list given is resolved once and reused while the very same objects come again.

Example::

    resolver = VariableResolver()
    grads, variables = resolver.resolve(zip(grads, model.parameters()))   # LocalVariables, made once
"""

from __future__ import annotations

import operator

import torch

import replicafit.strategies as ds
from replicafit.strategies.devices import canonicalize
from replicafit.strategies.values import value_container

__all__ = ["VariableResolver"]


class VariableResolver:
    """The variables behind what an optimizer is given, with the wrappers it made for plain tensors."""

    def __init__(self):
        self.wrapped: dict = {}  # id(raw tensor) -> (tensor, LocalVariable) for plain parameters
        self.last = None  # (the variables last given to apply_gradients, their containers)

    def resolve(self, grads_and_vars) -> tuple:
        """``(gradients, variables)`` without the ``None`` gradients (``ValueError`` when every one is None)."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError(
                "No gradients provided for any variable: every gradient is None. Check that the loss "
                "depends on the variables and that grad mode is enabled."
            )
        grads = [g for g, _ in pairs]
        raw = [v for _, v in pairs]
        last = self.last
        if last is not None and len(last[0]) == len(raw) and all(map(operator.is_, last[0], raw)):
            return grads, last[1]  # the same variables as the previous call (a training loop): resolved once
        variables = [self.variable(v) for v in raw]
        self.last = (raw, variables)
        return grads, variables

    def variable(self, item):
        """The variable ``item`` stands for: its distributed variable, or the wrapper of a plain tensor."""
        entry = self.wrapped.get(id(item))
        if entry is not None and entry[0] is item:
            return entry[1]
        if isinstance(item, ds.Variable):
            return value_container(item)
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"apply_gradients() needs variables or tensors, got {type(item).__name__}.")
        container = value_container(item)
        if container is not item:
            return container
        if entry is None or entry[0] is not item:
            name = f"variable_{len(self.wrapped)}"
            entry = (item, ds.LocalVariable(item, name=name, device=canonicalize(item.device), trainable=True))
            self.wrapped[id(item)] = entry
        return entry[1]

    def known(self, item):
        """The variable ``item`` stands for where it is one or was wrapped already (nothing new is made)."""
        entry = self.wrapped.get(id(item))
        if entry is not None and entry[0] is item:
            return entry[1]
        return value_container(item)
