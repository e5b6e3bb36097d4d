"""RMSprop and Adagrad, with Keras 3's formulas and defaults."""

from __future__ import annotations

from replicafit.strategies import foreach

from .base import Optimizer

__all__ = ["RMSprop", "Adagrad"]


class RMSprop(Optimizer):
    """RMSprop (Keras 3): a running mean of squared gradients scales each step.

    ::

        v = rho * v + (1 - rho) * g * g
        a = rho * a + (1 - rho) * g                     # centered only
        d = v - a * a + epsilon   (centered)   or   v + epsilon
        increment = learning_rate * g / sqrt(d)
        mom = momentum * mom + increment; w -= mom     # momentum > 0
        w -= increment                                  # otherwise

    ``momentum`` may change between updates, from 0 too, as ``torch.optim.RMSprop``'s may
    (``TorchLRScheduler`` with ``OneCycleLR`` cycles it): the momentum slots are made at the
    first update that uses them, and kept from then on.

    Example::

        optimizer = RMSprop(learning_rate=1e-3, momentum=0.9, centered=True)
    """

    _multi_tensor = True
    _optional_slots = ("momentum",)

    def __init__(
        self,
        learning_rate=0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        **kwargs,
    ):
        super().__init__(learning_rate, **kwargs)
        if not 0 <= rho < 1:
            raise ValueError(f"`rho` must be in [0, 1), got {rho!r}.")
        self._momentum = 0.0
        self.momentum = momentum
        self.rho, self.epsilon, self.centered = float(rho), float(epsilon), centered

    @property
    def momentum(self) -> float:
        """The momentum of the next update, in [0, 1); set above 0, it makes the momentum slots at that update."""
        return self._momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"`momentum` must be a number in [0, 1), got {value!r}.")
        if value and not self._momentum:
            self._slots_changed()
        self._momentum = float(value)

    def build(self, variables) -> None:
        super().build(variables)
        for variable in variables:
            self.add_variable_from_reference(variable, "velocity")
            if self.momentum > 0:
                self.add_variable_from_reference(variable, "momentum")
            if self.centered:
                self.add_variable_from_reference(variable, "average_gradient")

    def update_step(self, gradient, variable, learning_rate) -> None:
        w = variable.value()
        v = self.get_slot(variable, "velocity").value()
        v.mul_(self.rho).add_(gradient * gradient * (1 - self.rho))
        if self.centered:
            a = self.get_slot(variable, "average_gradient").value()
            a.mul_(self.rho).add_(gradient * (1 - self.rho))
            denominator = v - a * a + self.epsilon
        else:
            denominator = v + self.epsilon
        increment = (gradient * learning_rate) / denominator.sqrt()
        if self.momentum > 0:
            mom = self.get_slot(variable, "momentum").value()
            mom.mul_(self.momentum).add_(increment)
            w.sub_(mom)
        else:
            w.sub_(increment)

    def _update_many(self, params, grads, slots, learning_rate) -> None:
        v = slots["velocity"]
        foreach.mul_(v, self.rho)
        foreach.add_(v, foreach.mul(foreach.mul(grads, grads), 1 - self.rho))
        if self.centered:
            a = slots["average_gradient"]
            foreach.mul_(a, self.rho)
            foreach.add_(a, foreach.mul(grads, 1 - self.rho))
            denominator = foreach.sub(v, foreach.mul(a, a))
            foreach.add_(denominator, self.epsilon)
        else:
            denominator = foreach.add(v, self.epsilon)
        increment = foreach.mul(grads, learning_rate)
        foreach.div_(increment, foreach.sqrt(denominator))
        if self.momentum > 0:
            mom = slots["momentum"]
            foreach.mul_(mom, self.momentum)
            foreach.add_(mom, increment)
            foreach.sub_(params, mom)
        else:
            foreach.sub_(params, increment)

    def get_config(self) -> dict:
        return super().get_config() | {
            "rho": self.rho,
            "momentum": self.momentum,
            "epsilon": self.epsilon,
            "centered": self.centered,
        }


class Adagrad(Optimizer):
    """Adagrad (Keras 3): steps shrink with the sum of squared gradients.

    ::

        acc += g * g                                   # acc starts at initial_accumulator_value
        w -= learning_rate * g / sqrt(acc + epsilon)

    Example::

        optimizer = Adagrad(learning_rate=0.01)
    """

    _multi_tensor = True

    def __init__(self, learning_rate=0.001, initial_accumulator_value: float = 0.1, epsilon: float = 1e-7, **kwargs):
        super().__init__(learning_rate, **kwargs)
        if initial_accumulator_value < 0:
            raise ValueError(f"`initial_accumulator_value` must be >= 0, got {initial_accumulator_value!r}.")
        self.initial_accumulator_value, self.epsilon = float(initial_accumulator_value), float(epsilon)

    def build(self, variables) -> None:
        super().build(variables)
        for variable in variables:
            self.add_variable_from_reference(variable, "accumulator", initializer=self.initial_accumulator_value)

    def update_step(self, gradient, variable, learning_rate) -> None:
        w = variable.value()
        acc = self.get_slot(variable, "accumulator").value()
        acc.add_(gradient * gradient)
        w.sub_((gradient * learning_rate) / (acc + self.epsilon).sqrt())

    def _update_many(self, params, grads, slots, learning_rate) -> None:
        acc = slots["accumulator"]
        foreach.add_(acc, foreach.mul(grads, grads))
        update = foreach.mul(grads, learning_rate)
        foreach.div_(update, foreach.sqrt(foreach.add(acc, self.epsilon)))
        foreach.sub_(params, update)

    def get_config(self) -> dict:
        return super().get_config() | {
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
        }
