"""The multi-tensor fast path: every copy of every target grouped by device and dtype, updated one kernel per group.

A built-in optimizer (``_multi_tensor = True``) writes its update once more over lists of tensors
(``_update_many``); ``MultiTensorPlans.run`` then runs each update as a handful of ``foreach`` kernels per
group instead of a few kernels per variable copy, in the pipeline's order: weight decay, the optimizer's
``_update_many``, the moving averages. The groups (a plan) are made once per list of targets and kept:
``(parameters, {slot name: slot copies}, [(target index, copy index)], decayed)``, one group per (device,
dtype, slot names, decayed). Every element sees the same operations as on the per-variable path
(``update_step``), so both give the same bits.

Example::

    plans = MultiTensorPlans()
    plans.run(optimizer, grads, targets, learning_rate, ema)   # one kernel per group and operation
"""

from __future__ import annotations

import torch

from replicafit.strategies.values import local_results

from .ema import move_averages
from .tensors import _no_grad, _tensor_of

__all__ = ["MultiTensorPlans"]


class MultiTensorPlans:
    """The plans of the multi-tensor path, one per list of targets updated so far (made again when the slots
    change: ``clear``)."""

    def __init__(self):
        self._plans: dict = {}

    def clear(self) -> None:
        """Forgets every plan (a slot was made, or the targets' memory moved)."""
        self._plans.clear()

    def run(self, optimizer, grads: list, targets: list, learning_rate: float, ema=None) -> None:
        """The update of ``targets`` (``grads``: one per target, a value or one per copy): decay, the optimizer's
        ``_update_many``, the moving averages, group by group."""
        plan = self._plan(optimizer, targets)
        decay = optimizer._weight_decay
        with _no_grad():
            for group_params, group_slots, positions, decayed in plan:
                group_grads = [
                    g if type(g) is torch.Tensor else local_results(g)[copy]
                    for g, copy in ((grads[index], copy) for index, copy in positions)
                ]
                if decay.rate and decayed:
                    decay.apply_many(group_params, learning_rate)
                optimizer._update_many(group_params, group_grads, group_slots, learning_rate)
                if ema is not None:
                    move_averages(group_slots["average"], group_params, ema)

    def _plan(self, optimizer, targets) -> list:
        """Groups every copy of every target by (device, dtype, slots, decayed), once per list of targets."""
        key = tuple(id(t) for t in targets)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        slots, decay = optimizer._slots, optimizer._weight_decay
        groups: dict = {}
        for index, target in enumerate(targets):
            names = slots.names_of(target)
            slot_copies = {n: local_results(slots.of(target, n)) for n in names}
            decayed = decay.rate_for(target) is not None
            for copy, component in enumerate(local_results(target)):
                tensor = _tensor_of(component)
                group = groups.setdefault(
                    (tensor.device, tensor.dtype, tuple(names), decayed), ([], {n: [] for n in names}, [], decayed)
                )
                group[0].append(tensor)
                for n in names:
                    group[1][n].append(slot_copies[n][copy].value())
                group[2].append((index, copy))
        plan = list(groups.values())
        self._plans[key] = plan
        return plan
