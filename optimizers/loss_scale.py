"""``LossScaleOptimizer``: dynamic loss scaling for float16 training, inside the optimizer pipeline.

Keras 3's rule: the loss is multiplied by ``scale`` before backward (``scale_loss``), so small
float16 gradients do not underflow; the wrapped optimizer then runs its own pipeline with one
step added after the cross-replica reduction (the scaler's stage, installed in the inner
optimizer's gradient stages as ``"loss_scale"``: the inner optimizer knows its wrapper only as
that stage):

    aggregate across replicas (one batched SUM; an accumulation window's sums once per window)
    → divide by the window's weight (when accumulating)
    → unscale (divide by ``scale``) → finite check → clipping → update

A step whose reduced gradients hold an infinity or a NaN (checked after unscaling, so a scale
below 1 cannot turn large finite values into an infinite update; a gradient whose L2 norm
exceeds float32's range counts as well) is skipped (no variable, slot or learning rate
changes), ``scale`` is halved and the growth counter restarts; after
``dynamic_growth_steps`` finite steps in a row ``scale`` doubles. The reduced gradients are the
same on every replica and, after the all-reduce, on every worker, so every replica and worker
takes the same decision from the gradient reduction itself, with no second collective: one
replica's overflow (an infinite loss on its rows only) makes the sum non-finite everywhere.
With sharded optimizer states (``MultiWorkerMirroredStrategy(shard_optimizer_states=True)``) each
worker holds its part of the reduced gradients only, and the decision is agreed by one small
collective.

Where we differ from Keras 3: a skipped step still counts in ``iterations`` (as tf.keras'
LossScaleOptimizer counted it; Keras 3 leaves the inner optimizer's count alone), so a
learning-rate schedule advances with the steps taken; and clipping applies to the unscaled,
aggregated gradient (Keras clips per replica).

Example::

    optimizer = optimizers.LossScaleOptimizer(optimizers.SGD(0.1, momentum=0.9))

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y).float().sum() / global_batch_size
        grads = torch.autograd.grad(optimizer.scale_loss(loss), params)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))   # unscaled inside

    strategy.run(step, args=(x, y))

``Trainer(precision="16-mixed")`` wraps the trainer's optimizer in one and scales the loss.
"""

from __future__ import annotations

import math

import torch

from replicafit.strategies import foreach

from .base import Optimizer
from .stages import GradientStage
from .tensors import _no_grad

__all__ = ["DynamicLossScale", "LossScaleOptimizer"]

_STAGE = "loss_scale"  # the name of the scaler's stage in the inner optimizer's pipeline


def _inner(name: str, settable: bool = False) -> property:
    """A property of ``LossScaleOptimizer`` that is its inner optimizer's ``name``."""

    def get(self):
        return getattr(self.inner_optimizer, name)

    def set_(self, value) -> None:
        setattr(self.inner_optimizer, name, value)

    return property(get, set_ if settable else None, doc=f"The inner optimizer's ``{name}``.")


class DynamicLossScale(GradientStage):
    """The loss scaler's stage of the inner optimizer's pipeline (optax's ``apply_if_finite`` with Keras 3's
    dynamic scale): the reduced, still scaled gradients unscaled, or ``None`` (the update skipped, the scale
    halved) when any value is infinite or NaN; after ``growth_steps`` finite steps in a row the scale doubles.
    Runs once per update, in cross-replica context.

    Example::

        stage = DynamicLossScale(2.0**15, growth_steps=2000)
        grads = stage(grads, layout)   # None: skip this update
    """

    name = _STAGE

    def __init__(self, initial_scale: float, growth_steps: int):
        self.scale = initial_scale
        self.step_counter = 0
        self.growth_steps = growth_steps

    def __call__(self, grads: list, layout) -> list | None:
        with _no_grad():
            unscaled = foreach.div(grads, self.scale)
            # An infinity or NaN anywhere makes its tensor's L2 norm non-finite (one fused kernel,
            # 6x faster here than the max-norm); so does a norm beyond float32's range, an update no
            # one wants applied either.
            wide = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in unscaled]
            norms = foreach.norm(wide, ord=2)
            finite = all(bool(torch.isfinite(torch.stack(group)).all()) for group in _by_device(norms))
            # Where each worker holds a part of the gradients (sharded states), every worker must agree.
            finite = layout.all_agree(finite, "the loss scaler's finite check")
            if not finite:
                self.scale /= 2.0
                self.step_counter = 0
                return None
        if self.step_counter == self.growth_steps - 1:
            self.step_counter = 0
            self.scale *= 2.0
        else:
            self.step_counter += 1
        return unscaled

    def __repr__(self) -> str:
        return f"DynamicLossScale(scale={self.scale!r}, step_counter={self.step_counter!r})"


class LossScaleOptimizer(Optimizer):
    """Wraps ``inner_optimizer`` (any ``Optimizer``: built-in, subclass or ``from_torch``) with
    dynamic loss scaling (see the module docstring for the rule and the order of operations).

    Args:
      inner_optimizer: the optimizer that updates the variables; its learning rate,
        clipping and ``gradient_accumulation_steps`` are used as they are.
      initial_scale: the first loss scale (Keras' default ``2**15``).
      dynamic_growth_steps: finite steps in a row after which the scale doubles.
      name: defaults to ``"loss_scale_optimizer"``.

    ``iterations``, ``learning_rate`` and ``variables`` are the inner optimizer's;
    ``dynamic_scale`` and ``step_counter`` are the scaler's state, kept in ``state_dict()``
    under ``"loss_scale"`` beside the inner optimizer's own entries.
    """

    def __init__(self, inner_optimizer, initial_scale=2.0**15, dynamic_growth_steps=2000, name=None):
        if not isinstance(inner_optimizer, Optimizer):
            raise TypeError(
                "LossScaleOptimizer wraps one of our optimizers (optimizers.get('adam'), optimizers.SGD(...), "
                f"optimizers.from_torch(torch.optim.AdamW, lr=...)), got {type(inner_optimizer).__name__}."
            )
        if isinstance(inner_optimizer, LossScaleOptimizer) or _STAGE in inner_optimizer._gradient_stages:
            raise ValueError(f"{inner_optimizer!r} already has a LossScaleOptimizer: wrap an optimizer only once.")
        if isinstance(initial_scale, bool) or not isinstance(initial_scale, (int, float)):
            raise TypeError(f"`initial_scale` must be a number, got {initial_scale!r}.")
        if not (math.isfinite(initial_scale) and initial_scale > 0):
            raise ValueError(f"`initial_scale` must be a positive finite number, got {initial_scale!r}.")
        if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, int):
            raise TypeError(f"`dynamic_growth_steps` must be an int, got {dynamic_growth_steps!r}.")
        if dynamic_growth_steps < 1:
            raise ValueError(f"`dynamic_growth_steps` must be >= 1, got {dynamic_growth_steps!r}.")
        self.inner_optimizer = inner_optimizer
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = dynamic_growth_steps
        self.name = name or "loss_scale_optimizer"
        self._loss_scale = DynamicLossScale(self.initial_scale, dynamic_growth_steps)
        # The scaler is a stage of the inner optimizer's pipeline, after the reduction, before clipping.
        inner_optimizer._gradient_stages[_STAGE] = self._loss_scale

    def __getattr__(self, name):
        # What the scaler does not define is the inner optimizer's (slots, plans, build state).
        if name == "inner_optimizer":
            raise AttributeError(name)
        return getattr(self.inner_optimizer, name)

    # --- the scale ---------------------------------------------------------------------------
    @property
    def dynamic_scale(self) -> float:
        """The current loss scale."""
        return self._loss_scale.scale

    @property
    def step_counter(self) -> int:
        """Finite steps since the scale last changed."""
        return self._loss_scale.step_counter

    def scale_loss(self, loss):
        """``loss * dynamic_scale``: differentiate this, and give the gradients to ``apply_gradients``."""
        return loss * self._loss_scale.scale

    # --- the inner optimizer's pipeline ----------------------------------------------------------
    def apply_gradients(self, grads_and_vars):
        """The inner optimizer's ``apply_gradients`` with the gradients of a scaled loss."""
        return self.inner_optimizer.apply_gradients(grads_and_vars)

    def apply(self, grads, variables=None):
        return self.inner_optimizer.apply(grads, variables)

    def apply_accumulated_gradients(self):
        return self.inner_optimizer.apply_accumulated_gradients()

    def minimize(self, loss, var_list):
        """Scales ``loss``, differentiates it and applies the gradients (unscaled inside)."""
        if callable(loss):
            loss = loss()
        return self.inner_optimizer.minimize(self.scale_loss(loss), var_list)

    def build(self, variables) -> None:
        self.inner_optimizer.build(variables)

    def torch_hyperparameters(self) -> dict:
        return self.inner_optimizer.torch_hyperparameters()

    def set_torch_hyperparameters(self, **values) -> None:
        self.inner_optimizer.set_torch_hyperparameters(**values)

    def build_for(self, variables) -> None:
        self.inner_optimizer.build_for(variables)

    # The inner optimizer keeps the exclusions and the averages: methods inherited from Optimizer would
    # set their state on this wrapper instead (``__getattr__`` only forwards what is missing).
    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        self.inner_optimizer.exclude_from_weight_decay(var_list, var_names)

    def finalize_variable_values(self, var_list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def averaged_weights(self, var_list=None):
        return self.inner_optimizer.averaged_weights(var_list)

    def swap_in_averages(self, var_list=None, caller: str = "swap_in_averages()") -> None:
        self.inner_optimizer.swap_in_averages(var_list, caller)

    def swap_out_averages(self) -> None:
        self.inner_optimizer.swap_out_averages()

    def keep_averages(self) -> None:
        self.inner_optimizer.keep_averages()

    def trained_values(self) -> dict:
        return self.inner_optimizer.trained_values()

    # The inner optimizer's state, read and written through the wrapper (properties of Optimizer would otherwise
    # answer with the wrapper's own attributes: ``__getattr__`` only forwards what is missing).
    iterations = _inner("iterations")
    learning_rate = _inner("learning_rate", settable=True)
    learning_rate_schedule = _inner("learning_rate_schedule")
    # The shared arguments are the inner optimizer's: read and set there (its stages are made again).
    weight_decay = _inner("weight_decay", settable=True)
    clipnorm = _inner("clipnorm", settable=True)
    clipvalue = _inner("clipvalue", settable=True)
    global_clipnorm = _inner("global_clipnorm", settable=True)
    use_ema = _inner("use_ema", settable=True)
    ema_momentum = _inner("ema_momentum", settable=True)
    ema_overwrite_frequency = _inner("ema_overwrite_frequency", settable=True)
    gradient_accumulation_steps = _inner("gradient_accumulation_steps", settable=True)
    step_weight = _inner("step_weight", settable=True)
    gradient_denominator = _inner("gradient_denominator", settable=True)
    accumulated_steps = _inner("accumulated_steps")
    averages_swapped_in = _inner("averages_swapped_in")

    @property
    def variables(self) -> list:
        """The inner optimizer's ``variables``; the loss scale is not a variable (it is in ``state_dict()``)."""
        return self.inner_optimizer.variables

    # --- state and configuration ------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner optimizer's state plus ``"loss_scale": {"scale", "step_counter"}``."""
        scaler = self._loss_scale
        return self.inner_optimizer.state_dict() | {
            "loss_scale": {"scale": scaler.scale, "step_counter": scaler.step_counter}
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output; a state without ``"loss_scale"`` (saved without loss
        scaling) restores the inner optimizer and starts from ``initial_scale``."""
        entry = state.get("loss_scale") if isinstance(state, dict) else None
        scale, counter = self.initial_scale, 0
        if entry is not None:
            try:
                scale, counter = float(entry["scale"]), entry["step_counter"]
            except (KeyError, TypeError, ValueError):
                raise ValueError(
                    "The optimizer state's 'loss_scale' must be {'scale': float, 'step_counter': int}, "
                    f"got {entry!r}."
                ) from None
            if not (math.isfinite(scale) and scale > 0) or isinstance(counter, bool) or not isinstance(counter, int):
                raise ValueError(f"The optimizer state's 'loss_scale' holds invalid values: {entry!r}.")
            if not 0 <= counter < self.dynamic_growth_steps:
                raise ValueError(
                    f"The optimizer state's loss-scale step_counter {counter} does not fit dynamic_growth_steps="
                    f"{self.dynamic_growth_steps}."
                )
        self.inner_optimizer.load_state_dict(state)
        self._loss_scale.scale, self._loss_scale.step_counter = scale, counter

    def get_config(self) -> dict:
        """``name``, ``initial_scale``, ``dynamic_growth_steps`` and the inner optimizer as
        ``{"class_name": type name, "config": its get_config()}`` (not the current scale)."""
        inner = self.inner_optimizer
        return {
            "name": self.name,
            "inner_optimizer": {"class_name": type(inner).__name__, "config": inner.get_config()},
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }

    @classmethod
    def from_config(cls, config: dict):
        """A ``LossScaleOptimizer`` from ``get_config()``'s output, its inner optimizer made by ``optimizers.get``.

        ``get`` knows the built-in classes and ``TorchOptimizer`` only: an inner optimizer of a class of
        your own raises ``ValueError``; rebuild that one yourself and wrap it.
        """
        from . import get

        config = dict(config)
        return cls(get(config.pop("inner_optimizer")), **config)

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.inner_optimizer!r}, dynamic_scale={self._loss_scale.scale!r})"


def _by_device(tensors: list) -> list:
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return list(groups.values())
