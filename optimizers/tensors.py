"""The tensors behind a variable, reached the cheap way: the small helpers every part of the optimizer shares.

A variable's value is read from one copy (``_tensor_of``; its first copy's is the strategies'
``variables.first_tensor``), and the per-step updates switch grad mode off with ``_no_grad``, which
costs less than ``torch.no_grad``'s decorator machinery on every step.
"""

from __future__ import annotations

import torch

import replicafit.strategies as ds

# torch's private used here, and why: ``torch._C._set_grad_enabled`` is the switch ``torch.no_grad`` itself flips,
# without the context-manager and decorator machinery around it, which shows in a per-step cost.

__all__: list = []  # package-internal helpers


class _no_grad:  # noqa: N801 - torch.no_grad without its decorator machinery (a per-step cost)
    __slots__ = ("previous",)

    def __enter__(self):
        self.previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # private: the switch torch.no_grad flips (docstring above)

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self.previous)  # private: the switch torch.no_grad flips


def _tensor_of(component) -> torch.Tensor:
    return component.value() if isinstance(component, ds.Variable) else component
