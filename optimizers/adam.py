"""Adam and AdamW, with Keras 3's formulas and defaults."""

from __future__ import annotations

import math

import torch

from replicafit.strategies import foreach

from .base import Optimizer

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba), as Keras 3 computes it.

    With ``t`` the step number (``iterations + 1``)::

        alpha = learning_rate * sqrt(1 - beta_2**t) / (1 - beta_1**t)
        m += (g - m) * (1 - beta_1)
        v += (g * g - v) * (1 - beta_2)
        v_hat = max(v_hat, v)                          # amsgrad only; then v = v_hat
        w -= m * alpha / (sqrt(v) + epsilon)

    Example::

        optimizer = Adam(learning_rate=1e-3, amsgrad=True)
    """

    _multi_tensor = True

    def __init__(
        self,
        learning_rate=0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs,
    ):
        super().__init__(learning_rate, **kwargs)
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0 <= value < 1:
                raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")
        self.beta_1, self.beta_2, self.epsilon, self.amsgrad = float(beta_1), float(beta_2), float(epsilon), amsgrad
        self._alpha = 0.0

    def build(self, variables) -> None:
        super().build(variables)
        for variable in variables:
            self.add_variable_from_reference(variable, "momentum")
            self.add_variable_from_reference(variable, "velocity")
            if self.amsgrad:
                self.add_variable_from_reference(variable, "velocity_hat")

    def _prepare_step(self, learning_rate: float) -> None:
        step = self.updates_so_far() + 1  # (no read of the counter back from the device)
        self._alpha = learning_rate * math.sqrt(1 - self.beta_2**step) / (1 - self.beta_1**step)

    def update_step(self, gradient, variable, learning_rate) -> None:
        w = variable.value()
        m = self.get_slot(variable, "momentum").value()
        v = self.get_slot(variable, "velocity").value()
        m.lerp_(gradient, 1 - self.beta_1)  # m + (g - m) * (1 - beta_1)
        v.lerp_(gradient * gradient, 1 - self.beta_2)
        if self.amsgrad:
            v_hat = self.get_slot(variable, "velocity_hat").value()
            torch.maximum(v_hat, v, out=v_hat)
            v = v_hat
        w.addcdiv_(m, v.sqrt().add_(self.epsilon), value=-self._alpha)

    def _update_many(self, params, grads, slots, learning_rate) -> None:
        # The same elementwise operations as update_step, one kernel per list.
        m, v = slots["momentum"], slots["velocity"]
        foreach.lerp_(m, grads, 1 - self.beta_1)
        foreach.lerp_(v, foreach.mul(grads, grads), 1 - self.beta_2)
        if self.amsgrad:
            foreach.maximum_(slots["velocity_hat"], v)
            v = slots["velocity_hat"]
        denominator = foreach.sqrt(v)
        foreach.add_(denominator, self.epsilon)
        foreach.addcdiv_(params, m, denominator, value=-self._alpha)

    def get_config(self) -> dict:
        return super().get_config() | {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            "amsgrad": self.amsgrad,
        }


class AdamW(Adam):
    """Adam with decoupled weight decay (Keras 3's ``AdamW``; ``weight_decay`` defaults to 0.004).

    Before each Adam step: ``w -= w * weight_decay * learning_rate``.

    Example::

        optimizer = AdamW(learning_rate=1e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs,
    ):
        if weight_decay is None:
            raise ValueError("AdamW needs a `weight_decay` (a float); use Adam for none.")
        super().__init__(
            learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            weight_decay=weight_decay,
            **kwargs,
        )
