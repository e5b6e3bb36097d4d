"""Gradient accumulation: the open window of ``Optimizer(gradient_accumulation_steps=N)``.

Each replica adds its own local gradients of a step into its own sums, weighted by the
step's weight, with no communication; the N-th step of the window hands the sums to the
optimizer's pipeline (one batched reduction across replicas and workers, divided by the
window's total weight, then clipping and the update). The trainer gives each step the
weight of its global batch size (the number of examples), so a window equals one step on
its batches together, whatever their sizes: the per-step loss ``sum / B_k`` times ``B_k``
summed over the window, divided by ``sum(B_k)``, is the mean over every example of the
window. A step of one's own (a custom loop) weighs 1, which gives Keras 3's rule, the mean
of the N gradients.
"""

from __future__ import annotations

import torch

__all__ = ["GradientWindow"]


class GradientWindow:
    """The sums of one open accumulation window, per local replica.

    ``sums[r]`` is local replica ``r``'s list of weighted gradient sums (one tensor per
    variable, in the window's variable order); ``counts[r]`` and ``weights[r]`` its steps and
    total weight so far (equal on every replica: each adds once per step). ``aggregated`` is
    true when the steps were applied in cross-replica context with gradients already reduced:
    those sums are applied as they are, never reduced again.
    """

    def __init__(self, variables: list, aggregated: bool):
        self.variables = variables
        self.aggregated = aggregated
        self.sums: dict = {}
        self.counts: dict = {}
        self.weights: dict = {}

    def add(self, replica: int, grads: list, weight: float) -> int:
        """Adds ``weight * grads`` to replica ``replica``'s sums; returns its step count."""
        grads = [g.detach() for g in grads]
        with torch.no_grad():
            sums = self.sums.get(replica)
            if sums is None:  # a new list: the window's sums are never the caller's tensors
                self.sums[replica] = torch._foreach_mul(grads, weight)
            else:
                torch._foreach_add_(sums, grads, alpha=weight)
        self.counts[replica] = self.counts.get(replica, 0) + 1
        self.weights[replica] = self.weights.get(replica, 0.0) + weight
        return self.counts[replica]

    @property
    def count(self) -> int:
        """Steps in the window (the first replica's count; every replica's is the same)."""
        return self.counts[min(self.counts)] if self.counts else 0

    @property
    def weight(self) -> float:
        return self.weights[min(self.weights)] if self.weights else 0.0

    def matches(self, variables: list) -> bool:
        return len(variables) == len(self.variables) and all(map(lambda a, b: a is b, variables, self.variables))
