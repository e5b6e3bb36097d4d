"""The stages of the update pipeline that work on the reduced gradients, and weight decay.

Optax's ``chain`` is the model: each stage is a small object with its own settings, and the optimizer runs
them in one documented order (``base.py``'s module docstring). The gradient stages take the reduced
gradients (one tensor per target of the state layout: whole variables, or this worker's slices of them)
and return the gradients to go on with, or ``None`` to skip the update:

* ``divide``: an accumulation window's sums divided by its weight, or by the global count of real elements
  of an element-level loss (``GradientDenominator``); not a stage object, the window says when;
* ``LossScaleOptimizer``'s unscaling and finite check (``loss_scale.py``), when wrapped;
* clipping: ``ClipByValue``, ``ClipByNorm`` (each gradient) or ``ClipByGlobalNorm`` (all of them), on the
  gradient aggregated over every replica. Norms of whole tensors where the targets are whole variables;
  where they are slices, from the squares of every worker's parts (one small sum over the workers).

``WeightDecay`` runs inside the update, before the rule, on every copy of every variable it was not told
to leave alone (``exclude_from_weight_decay``).

Example::

    stage = clipping(clipnorm=None, clipvalue=None, global_clipnorm=1.0)   # ClipByGlobalNorm(1.0)
    grads = stage(grads, layout)
"""

from __future__ import annotations

import torch

import replicafit.strategies as ds
from replicafit.strategies import foreach
from replicafit.strategies.step_values import wide_float
from replicafit.strategies.values import local_results, value_container

from .tensors import _no_grad

__all__ = [
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "GradientStage",
    "WeightDecay",
    "check_decay",
    "check_one_clipping",
    "check_positive",
    "clipping",
    "divide",
    "divisor",
]


def check_positive(name: str, value, allow_none: bool = True):
    """``value`` as a float when it is a positive number (``None`` passes where allowed), else ``ValueError``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{name}` must be a positive number{' or None' if allow_none else ''}, got {value!r}.")
    return float(value)


def divide(grads: list, divisor) -> list:
    """``grads`` divided by ``divisor``: a float (an accumulation window's weight; 1 and ``None`` leave them as
    they are) or a scalar tensor (the gradient denominator's total: one factor for every gradient, one kernel
    per device, no read back to the host)."""
    if isinstance(divisor, torch.Tensor):
        with _no_grad():
            factor = divisor.reciprocal().to(torch.float32)
            by_device: dict = {}
            for index, grad in enumerate(grads):
                by_device.setdefault(grad.device, []).append(index)
            scaled = list(grads)
            for device, indices in by_device.items():
                on_device = factor.to(device)
                for index, value in zip(indices, foreach.mul([grads[i] for i in indices], on_device)):
                    scaled[index] = value
            return scaled
    if divisor is not None and divisor != 1:
        with _no_grad():
            return foreach.div(grads, float(divisor))
    return grads


def divisor(strategy, window_weight, denominator):
    """What an update divides the reduced gradients by: an accumulation window's weight (``None``: a lone
    step), or, with a ``GradientDenominator``, ``total / prescale`` of its step value (a tensor: no read back to
    the host)."""
    if denominator is None:
        return window_weight
    total = strategy.cluster.step_total(denominator.step_value)
    # Nothing real in the window: its gradients are zeros, which a finite divisor keeps at zero (not NaN).
    total = total.to(wide_float(total.device))
    return total.clamp_min(denominator.prescale * 1e-30) / denominator.prescale


class GradientStage:
    """A stage on the reduced gradients: ``stage(grads, layout)`` returns the gradients to go on with (new
    tensors: the inputs are never changed), or ``None`` to skip this update (it still counts in ``iterations``).

    ``grads`` holds one tensor per target of ``layout`` (``StateLayout``), in cross-replica context, once per
    update; a stage that needs every worker's view (a norm over slices, a decision) asks the layout.

    Example::

        class Halve(GradientStage):
            name = "halve"

            def __call__(self, grads, layout):
                return [g * 0.5 for g in grads]
    """

    name = "stage"

    def __call__(self, grads: list, layout) -> list | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ClipByValue(GradientStage):
    """Each entry of each gradient clipped to ``[-value, value]`` (Keras' ``clipvalue``)."""

    name = "clipvalue"

    def __init__(self, value: float):
        self.value = value

    def __call__(self, grads: list, layout) -> list:
        return [g.clamp(-self.value, self.value) for g in grads]

    def __repr__(self) -> str:
        return f"ClipByValue({self.value!r})"


class ClipByNorm(GradientStage):
    """Each gradient scaled to an L2 norm of at most ``norm`` (Keras' ``clipnorm``): ``g * norm / max(|g|, norm)``."""

    name = "clipnorm"

    def __init__(self, norm: float):
        self.norm = norm

    def __call__(self, grads: list, layout) -> list:
        clip = self.norm
        if not layout.slices_variables:
            return [g * (clip / torch.clamp(torch.linalg.vector_norm(g), min=clip)) for g in grads]
        with _no_grad():
            norms = layout.sum_over_workers(_squares_per_variable(grads, layout), "clipnorm (the norms' parts)").sqrt()
            factors = clip / torch.clamp(norms, min=clip)
            where = torch.tensor([layout.position_of(t) for t in layout.targets], device=layout.device)
            per_target = factors[where]
            return list(foreach.mul(grads, list(per_target.unbind()))) if grads else []

    def __repr__(self) -> str:
        return f"ClipByNorm({self.norm!r})"


class ClipByGlobalNorm(GradientStage):
    """Every gradient scaled by ``norm / max(n, norm)``, ``n`` the L2 norm of all of them together (Keras'
    ``global_clipnorm``)."""

    name = "global_clipnorm"

    def __init__(self, norm: float):
        self.norm = norm

    def __call__(self, grads: list, layout) -> list:
        clip = self.norm
        if not layout.slices_variables:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            scale = clip / torch.clamp(norm, min=clip)
            return [g * scale for g in grads]
        with _no_grad():
            squares = _squares_per_variable(grads, layout).sum().reshape(1)
            norm = layout.sum_over_workers(squares, "global_clipnorm (the norm's parts)").sqrt()[0]
            scale = (clip / torch.clamp(norm, min=clip)).to(torch.float32)
            return list(foreach.mul(grads, scale)) if grads else []

    def __repr__(self) -> str:
        return f"ClipByGlobalNorm({self.norm!r})"


def _squares_per_variable(grads: list, layout) -> torch.Tensor:
    """The sum of squares of each variable's parts on this worker (float64, one entry per variable of the
    layout): one multi-tensor norm over the targets this worker counts (float32 at least, as whole norms)."""
    device = layout.device
    squares = torch.zeros(len(layout.variables), dtype=torch.float64, device=device)
    targets = layout.targets
    counted = [i for i in range(len(targets)) if layout.counts(i)]
    if counted:
        wide = [grads[i] if grads[i].dtype in (torch.float32, torch.float64) else grads[i].float() for i in counted]
        parts = torch.stack([n.to(device, torch.float64) for n in foreach.norm(wide)]).square()
        where = torch.tensor([layout.position_of(targets[i]) for i in counted], device=device)
        squares.index_add_(0, where, parts)
    return squares


def check_one_clipping(clipnorm=None, clipvalue=None, global_clipnorm=None) -> None:
    """At most one of ``clipnorm``, ``clipvalue`` and ``global_clipnorm`` may be set, as in Keras."""
    if sum(x is not None for x in (clipnorm, clipvalue, global_clipnorm)) > 1:
        raise ValueError(
            "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, got "
            f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}."
        )


def clipping(clipnorm=None, clipvalue=None, global_clipnorm=None) -> GradientStage | None:
    """The clipping stage the options ask for (at most one of them may be set, as in Keras), or ``None``."""
    check_one_clipping(clipnorm, clipvalue, global_clipnorm)
    clipnorm = check_positive("clipnorm", clipnorm)
    clipvalue = check_positive("clipvalue", clipvalue)
    global_clipnorm = check_positive("global_clipnorm", global_clipnorm)
    if clipvalue is not None:
        return ClipByValue(clipvalue)
    if clipnorm is not None:
        return ClipByNorm(clipnorm)
    if global_clipnorm is not None:
        return ClipByGlobalNorm(global_clipnorm)
    return None


def check_decay(rate):
    """``weight_decay`` checked: ``None`` (no decay) or a number >= 0, as a float."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
        raise ValueError(f"`weight_decay` must be >= 0, got {rate!r}.")
    return float(rate)


class WeightDecay:
    """Decoupled weight decay (Keras 3, AdamW): before the update rule, ``w -= w * rate * learning_rate`` on
    every copy of every variable not excluded.

    Which variables are excluded (``exclude``, Keras 3's ``exclude_from_weight_decay``) is decided when the
    optimizer builds for a variable (``decide``), and kept as the ids of the variable and of its targets.

    Example::

        decay = WeightDecay(0.01)
        decay.exclude(var_names=["bias"])
    """

    def __init__(self, rate):
        self.rate = check_decay(rate)
        self._exclusions: tuple = ((), ())  # (variables or tensors, name substrings) not decayed
        self.excluded: set = set()  # ids of the built variables (and their targets) excluded

    def exclude(self, var_list=None, var_names=None) -> None:
        """Keeps ``var_list`` (variables or a module's parameters) and variables whose name contains one of
        ``var_names`` out of the decay; a new call replaces the previous exclusions."""
        objects = tuple(var_list or ())
        for item in objects:
            if not isinstance(item, (ds.Variable, torch.Tensor)):
                raise TypeError(
                    f"exclude_from_weight_decay(var_list=...) takes variables or parameters, got "
                    f"{type(item).__name__} {item!r}; pass names as var_names=[...]."
                )
        if isinstance(var_names, str):
            raise TypeError(f"var_names must be a list of strings, got the string {var_names!r}: write [{var_names!r}]")
        names = tuple(var_names or ())
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"var_names must hold non-empty strings, got {name!r}.")
        self._exclusions = (objects, names)

    def decide(self, variable, targets=()) -> bool:
        """Decides whether ``variable`` (being built for) is excluded, and remembers it for the variable and its
        ``targets``; returns the decision."""
        excluded = self._is_excluded(variable)
        if excluded:
            self.excluded.add(id(variable))
            self.excluded.update(id(t) for t in targets)
        return excluded

    def rate_for(self, target):
        """The decay rate of ``target`` (``None``: it is not decayed)."""
        return None if id(target) in self.excluded else self.rate

    def excludes(self, target) -> bool:
        """Whether ``target`` (a variable or one of its targets) was excluded when it was built for."""
        return id(target) in self.excluded

    def _is_excluded(self, variable) -> bool:
        objects, names = self._exclusions
        if not objects and not names:
            return False
        name = getattr(variable, "name", None) or ""
        if any(part in name for part in names):
            return True
        # The variable itself, or one of its copies' tensors (a module's parameter is replica 0's copy).
        candidates = {id(variable), id(value_container(variable))}
        for component in local_results(value_container(variable)):
            candidates.add(id(component))
            if isinstance(component, ds.Variable):
                candidates.add(id(component.value()))
        return any(id(item) in candidates for item in objects)

    def apply(self, variable, rate: float, learning_rate: float) -> None:
        """One copy's decay (the per-variable path; grad mode off)."""
        variable.assign_sub(variable.value() * (rate * learning_rate))

    def apply_many(self, params: list, learning_rate: float) -> None:
        """The decay of a list of same-device, same-dtype tensors (the multi-tensor path; grad mode off)."""
        foreach.sub_(params, foreach.mul(params, self.rate * learning_rate))
