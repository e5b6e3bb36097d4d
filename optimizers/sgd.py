"""Stochastic gradient descent, with Keras 3's momentum and Nesterov formulas."""

from __future__ import annotations

from replicafit.strategies import foreach

from .base import Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    """Gradient descent with optional momentum (Keras 3's ``SGD``).

    Update rule, with ``m`` starting at 0::

        m = momentum * m - learning_rate * g          # momentum > 0
        w = w + m                                     # or, Nesterov:
        w = w + momentum * m - learning_rate * g
        w = w - learning_rate * g                     # momentum == 0

    ``momentum`` may change between updates, from 0 too, as ``torch.optim.SGD``'s ``momentum`` may
    (``TorchLRScheduler`` with ``OneCycleLR`` cycles it): the momentum slots are made at the first
    update that uses them, under any strategy, and kept from then on (in ``state_dict()``, and
    left alone while ``momentum`` is 0). With a learning rate that changes, Keras' rule keeps each
    past gradient at the rate it was taken with, where torch's (``buf = momentum * buf + g; w -=
    learning_rate * buf``) multiplies the whole buffer by the current rate: the two agree while the
    rate stays the same. ``from_torch(torch.optim.SGD, ...)`` gives torch's rule.

    Example::

        optimizer = SGD(learning_rate=0.1, momentum=0.9, nesterov=True)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        plain = SGD(0.1)                 # no momentum slots ...
        plain.momentum = 0.9             # ... made at the next update
    """

    _multi_tensor = True
    _optional_slots = ("momentum",)

    def __init__(self, learning_rate=0.01, momentum: float = 0.0, nesterov: bool = False, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self._momentum = 0.0
        self.momentum = momentum
        self.nesterov = bool(nesterov)

    @property
    def momentum(self) -> float:
        """The momentum of the next update, in [0, 1]; set above 0, it makes the momentum slots at that update."""
        return self._momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"`momentum` must be a number in [0, 1], got {value!r}.")
        if value and not self._momentum:
            self._slots_changed()
        self._momentum = float(value)

    def build(self, variables) -> None:
        super().build(variables)
        if self.momentum:
            for variable in variables:
                self.add_variable_from_reference(variable, "momentum")

    def update_step(self, gradient, variable, learning_rate) -> None:
        w = variable.value()
        if not self.momentum:
            w.sub_(gradient, alpha=learning_rate)
            return
        m = self.get_slot(variable, "momentum").value()
        m.mul_(self.momentum).sub_(gradient, alpha=learning_rate)
        if self.nesterov:
            w.add_(m, alpha=self.momentum).sub_(gradient, alpha=learning_rate)
        else:
            w.add_(m)

    def _update_many(self, params, grads, slots, learning_rate) -> None:
        # The same elementwise operations as update_step, one kernel per list.
        if not self.momentum:
            foreach.sub_(params, grads, alpha=learning_rate)
            return
        m = slots["momentum"]
        foreach.mul_(m, self.momentum)
        foreach.sub_(m, grads, alpha=learning_rate)
        if self.nesterov:
            foreach.add_(params, m, alpha=self.momentum)
            foreach.sub_(params, grads, alpha=learning_rate)
        else:
            foreach.add_(params, m)

    def get_config(self) -> dict:
        return super().get_config() | {"momentum": self.momentum, "nesterov": self.nesterov}
