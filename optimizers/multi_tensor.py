"""The multi-tensor fast path: every copy of every variable grouped by device and dtype, updated one kernel per group.

A built-in optimizer (``_multi_tensor = True``) writes its update once more over lists of
tensors (``_update_many``); ``_apply_multi_tensor`` then runs each update as a handful of
``torch._foreach_*`` kernels per group instead of a few kernels per variable copy: weight
decay, the optimizer's ``_update_many``, the moving averages. The groups (the plan) are
made once per list of variables and kept: ``(parameters, {slot name: slot copies},
[(variable index, copy index)], decayed)``, one group per (device, dtype, slot names,
decayed). Every element sees the same operations as on the per-variable path
(``update_step``), so both give the same bits.
"""

from __future__ import annotations

import torch

from replicafit.strategies import foreach
from replicafit.strategies.values import local_results

from .ema import move_averages
from .tensors import _no_grad, _tensor_of

__all__ = ["MultiTensorUpdates"]


class MultiTensorUpdates:
    """The multi-tensor path of ``Optimizer`` (a mixin): the plans, and the update that runs them.

    Uses the optimizer's slots (``_slots``, ``_slot_names``), ``_no_decay`` and ``weight_decay``;
    keeps ``_plans``, the plan of each list of variables updated so far.
    """

    #: Built-ins implement ``_update_many`` over lists of tensors (one kernel per device/dtype).
    _multi_tensor = False

    def _init_plans(self) -> None:
        self._plans: dict = {}  # multi-tensor plans per variable list

    def _takes_multi_tensor_path(self) -> bool:
        """Whether updates run as plans: the class says so and implements ``_update_many``."""
        return self._multi_tensor and type(self)._update_many is not MultiTensorUpdates._update_many

    def _update_many(self, params: list, grads: list, slots: dict, learning_rate: float) -> None:
        """Built-ins: updates lists of same-device, same-dtype tensors (slots: name -> list)."""
        raise NotImplementedError

    def _apply_multi_tensor(self, grads, variables, learning_rate, ema=None) -> None:
        plan = self._plan(variables)
        with _no_grad():
            for group_params, group_slots, positions, decayed in plan:
                group_grads = [
                    g if type(g) is torch.Tensor else local_results(g)[copy]
                    for g, copy in ((grads[var_index], copy) for var_index, copy in positions)
                ]
                if self.weight_decay and decayed:
                    foreach.sub_(group_params, foreach.mul(group_params, self.weight_decay * learning_rate))
                self._update_many(group_params, group_grads, group_slots, learning_rate)
                if ema is not None:
                    move_averages(group_slots["average"], group_params, ema)

    def _plan(self, variables) -> list:
        """Groups every copy of every variable by (device, dtype, slots, decayed), once per variable list."""
        key = tuple(id(v) for v in variables)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        groups: dict = {}
        for var_index, variable in enumerate(variables):
            names = self._slot_names.get(id(variable), [])
            slot_copies = {n: local_results(self._slots[(id(variable), n)]) for n in names}
            decayed = id(variable) not in self._no_decay
            for copy, component in enumerate(local_results(variable)):
                tensor = _tensor_of(component)
                group = groups.setdefault(
                    (tensor.device, tensor.dtype, tuple(names), decayed), ([], {n: [] for n in names}, [], decayed)
                )
                group[0].append(tensor)
                for n in names:
                    group[1][n].append(slot_copies[n][copy].value())
                group[2].append((var_index, copy))
        plan = list(groups.values())
        self._plans[key] = plan
        return plan
