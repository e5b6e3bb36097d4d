"""Losses: ``loss(y_true, y_pred) -> per-example loss`` (shape ``(batch,)``).

The trainer sums a replica's per-example losses (times sample weights) and divides by
the global batch size of the step, so every strategy takes the same steps as one device.

Names: ``"cross_entropy"`` / ``"sparse_categorical_crossentropy"`` (integer labels,
logits), ``"categorical_crossentropy"`` (one-hot labels, logits),
``"binary_crossentropy"`` (probabilities; ``BinaryCrossentropy(from_logits=True)`` for
logits), ``"mse"``, ``"mae"``, ``"huber"``. Any callable ``(y_true, y_pred) -> tensor``
works, and so do a torch loss module (``torch.nn.CrossEntropyLoss()``) and torch's functional
losses (``torch.nn.functional.cross_entropy``), called as torch calls them, ``fn(y_pred, y_true)``,
with ``reduction="none"``. Labels out of range for a class-index loss are a ``ValueError`` that
says how many classes the model outputs and which label was seen.

Example::

    >>> import torch
    >>> loss = get("mse")
    >>> loss(torch.zeros(2, 3), torch.ones(2, 3))
    tensor([1., 1.])
"""

from __future__ import annotations

import copy
import inspect
import math

import torch
import torch.nn.functional as F

from .registry import did_you_mean

# torch's private ``torch.nn.modules.loss._Loss`` is the base class of every torch loss module
# (``nn.CrossEntropyLoss()`` ...): the only way to recognise one that a user passes.

__all__ = [
    "Loss",
    "SparseCategoricalCrossentropy",
    "CategoricalCrossentropy",
    "BinaryCrossentropy",
    "MeanSquaredError",
    "MeanAbsoluteError",
    "Huber",
    "get",
]


def _per_example(values: torch.Tensor) -> torch.Tensor:
    """Averages every dimension but the first (the batch)."""
    if values.dim() <= 1:
        return values
    return values.reshape(values.shape[0], math.prod(values.shape[1:])).mean(dim=1)


class Loss:
    """Base class: ``__call__(y_true, y_pred)`` returns one loss per example.

    Subclasses implement ``call``; ``name`` is used in logs of multi-output models.
    """

    #: what "accuracy" means with this loss ("sparse_categorical", "categorical", "binary" or None)
    accuracy_kind: str | None = None

    def __init__(self, name: str | None = None):
        self.name = name or type(self).__name__

    def __call__(self, y_true, y_pred) -> torch.Tensor:
        return _per_example(self.call(y_true, y_pred))

    def call(self, y_true, y_pred) -> torch.Tensor:
        raise NotImplementedError

    def get_config(self) -> dict:
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SparseCategoricalCrossentropy(Loss):
    """Cross entropy of integer labels against logits (``from_logits=False``: probabilities)."""

    accuracy_kind = "sparse_categorical"

    def __init__(self, from_logits: bool = True, name: str | None = None):
        super().__init__(name)
        self.from_logits = from_logits

    def call(self, y_true, y_pred):
        target = y_true.long()
        if target.dim() == y_pred.dim():  # (batch, 1) labels, as Keras allows
            target = target.squeeze(-1)
        try:
            if self.from_logits:
                return F.cross_entropy(_classes_second(y_pred), target, reduction="none")
            log_probs = torch.log(y_pred.clamp_min(1e-7))
            return F.nll_loss(_classes_second(log_probs), target, reduction="none")
        except IndexError:
            raise labels_out_of_range(self.name, target, y_pred.shape[-1]) from None


def labels_out_of_range(name: str, labels: torch.Tensor, classes: int, ignore_index=None) -> ValueError:
    """The error for class-index labels outside ``0..classes-1`` (``ignore_index`` allowed)."""
    labels = labels.detach().reshape(-1).cpu()
    outside = (labels < 0) | (labels >= classes)
    if ignore_index is not None:
        outside &= labels != ignore_index
    bad = labels[outside]
    seen = f"the label {int(bad[0])}" if bad.numel() else "a label outside that range"
    low, high = (int(labels.min()), int(labels.max())) if labels.numel() else (0, 0)
    shift = " (1-based labels? subtract 1)" if bad.numel() and low >= 1 and high == classes else ""
    return ValueError(
        f"Labels out of range for the loss {name}: the model outputs {classes} classes, so labels must be "
        f"0..{classes - 1}; found {seen} (labels from {low} to {high}){shift}. Fix the labels, or give the "
        f"model's last layer as many outputs as there are classes (the largest label + 1)."
    )


def _classes_second(scores):
    """torch wants classes in dimension 1; Keras models put them last."""
    return scores if scores.dim() <= 2 else scores.movedim(-1, 1)


class CategoricalCrossentropy(Loss):
    """Cross entropy of one-hot (or soft) labels against logits (``from_logits=False``: probabilities)."""

    accuracy_kind = "categorical"

    def __init__(self, from_logits: bool = True, label_smoothing: float = 0.0, name: str | None = None):
        super().__init__(name)
        self.from_logits = from_logits
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        target = y_true.to(y_pred.dtype)
        if self.label_smoothing:
            classes = target.shape[-1]
            target = target * (1 - self.label_smoothing) + self.label_smoothing / classes
        log_probs = F.log_softmax(y_pred, dim=-1) if self.from_logits else torch.log(y_pred.clamp_min(1e-7))
        return -(target * log_probs).sum(dim=-1)


class BinaryCrossentropy(Loss):
    """Binary cross entropy of 0/1 labels against probabilities (``from_logits=True``: logits)."""

    accuracy_kind = "binary"

    def __init__(self, from_logits: bool = False, name: str | None = None):
        super().__init__(name)
        self.from_logits = from_logits

    def call(self, y_true, y_pred):
        target = y_true.to(y_pred.dtype).reshape(y_pred.shape)
        if self.from_logits:
            return F.binary_cross_entropy_with_logits(y_pred, target, reduction="none")
        return F.binary_cross_entropy(y_pred.clamp(1e-7, 1 - 1e-7), target, reduction="none")


def _as_prediction_shape(y_true, y_pred):
    target = y_true.to(y_pred.dtype)
    return target.reshape(y_pred.shape) if target.numel() == y_pred.numel() else target


class MeanSquaredError(Loss):
    """Mean of ``(y_pred - y_true) ** 2`` over each example's elements."""

    def call(self, y_true, y_pred):
        return (y_pred - _as_prediction_shape(y_true, y_pred)) ** 2


class MeanAbsoluteError(Loss):
    """Mean of ``|y_pred - y_true|`` over each example's elements."""

    def call(self, y_true, y_pred):
        return (y_pred - _as_prediction_shape(y_true, y_pred)).abs()


class Huber(Loss):
    """Huber loss: quadratic within ``delta`` of the target, linear beyond."""

    def __init__(self, delta: float = 1.0, name: str | None = None):
        super().__init__(name)
        self.delta = delta

    def call(self, y_true, y_pred):
        return F.huber_loss(y_pred, _as_prediction_shape(y_true, y_pred), reduction="none", delta=self.delta)


# What torch's own cross-entropy losses mean for "accuracy" where shapes cannot tell (kind, logits?).
_TORCH_KINDS = {
    torch.nn.CrossEntropyLoss: ("sparse_categorical", True),
    torch.nn.NLLLoss: ("sparse_categorical", True),
    torch.nn.BCEWithLogitsLoss: ("binary", True),
    torch.nn.BCELoss: ("binary", False),
    F.cross_entropy: ("sparse_categorical", True),
    F.nll_loss: ("sparse_categorical", True),
    F.binary_cross_entropy_with_logits: ("binary", True),
    F.binary_cross_entropy: ("binary", False),
}


def _torch_kind(key) -> tuple:
    try:
        return _TORCH_KINDS.get(key, (None, False))
    except TypeError:  # an unhashable callable
        return None, False


class _Callable(Loss):
    def __init__(self, fn, name=None):
        super().__init__(name or getattr(fn, "__name__", type(fn).__name__))
        self.fn = fn
        self.accuracy_kind, self.from_logits = _torch_kind(fn)

    def call(self, y_true, y_pred):
        out = self.fn(y_true, y_pred)
        if not isinstance(out, torch.Tensor) or out.dim() == 0:
            raise ValueError(
                f"The loss {self.name} returned a scalar: a loss must return one value per example (shape (batch,)); "
                "the trainer sums them and divides by the global batch size itself."
            )
        return out

    def __repr__(self) -> str:
        return f"Loss({self.name})"


class _TorchModule(Loss):
    def __init__(self, module: torch.nn.modules.loss._Loss):
        super().__init__(type(module).__name__)
        self.accuracy_kind, self.from_logits = _torch_kind(type(module))
        self.module = copy.copy(module)
        self.module.reduction = "none"  # per-example values; the trainer does the reduction

    def call(self, y_true, y_pred):
        try:
            return self.module(y_pred, y_true)
        except IndexError:
            if self.accuracy_kind != "sparse_categorical":
                raise
            ignore = getattr(self.module, "ignore_index", None)
            raise labels_out_of_range(self.name, y_true, y_pred.shape[1], ignore) from None


def class_count(loss, y_pred: torch.Tensor):
    """The number of classes ``loss`` reads from ``y_pred`` when it takes class-index labels, else None."""
    if loss.accuracy_kind != "sparse_categorical" or y_pred.dim() < 2:
        return None
    ours = isinstance(loss, SparseCategoricalCrossentropy)  # Keras' layout: classes last
    return int(y_pred.shape[-1] if ours else y_pred.shape[1])


def ignore_index(loss):
    """The label a class-index loss skips (torch's ``ignore_index``, -100 by default), or None."""
    if isinstance(loss, _TorchModule):
        return getattr(loss.module, "ignore_index", None)
    if isinstance(loss, _TorchFunctional):
        return -100
    return None


def is_torch_functional_loss(fn) -> bool:
    """Whether ``fn`` is one of torch's functional losses (``F.cross_entropy``, ``F.mse_loss``...): torch's
    ``(input, target, ..., reduction=...)`` signature."""
    if getattr(fn, "__module__", None) != "torch.nn.functional":
        return False
    try:
        parameters = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return parameters[:2] == ["input", "target"] and "reduction" in parameters


class _TorchFunctional(Loss):
    """One of torch's functional losses, called as torch calls it: ``fn(y_pred, y_true, reduction="none")``."""

    def __init__(self, fn):
        super().__init__(fn.__name__)
        self.fn = fn
        self.accuracy_kind, self.from_logits = _torch_kind(fn)

    def call(self, y_true, y_pred):
        try:
            return self.fn(y_pred, y_true, reduction="none")
        except IndexError:
            if self.accuracy_kind != "sparse_categorical":
                raise
            raise labels_out_of_range(self.name, y_true, y_pred.shape[1], -100) from None

    def __repr__(self) -> str:
        return f"Loss(torch.nn.functional.{self.name})"


_NAMES = {
    "cross_entropy": SparseCategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
    "huber": Huber,
}


def get(identifier) -> Loss:
    """A ``Loss`` from a name, a callable, a torch loss module, or a ``Loss`` (returned as is).

    Example::

        get("cross_entropy"); get(torch.nn.SmoothL1Loss()); get(lambda y, p: (p - y).abs().sum(-1))
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, str):
        cls = _NAMES.get(identifier.lower())
        if cls is None:
            hint = did_you_mean(identifier.lower(), _NAMES)
            raise ValueError(f"Unknown loss {identifier!r}{hint}; known: {sorted(_NAMES)}.")
        return cls()
    if isinstance(identifier, torch.nn.modules.loss._Loss):
        return _TorchModule(identifier)
    if is_torch_functional_loss(identifier):
        return _TorchFunctional(identifier)
    if callable(identifier):
        return _Callable(identifier)
    raise TypeError(f"Cannot make a loss from {type(identifier).__name__}: pass a name, a callable or a torch loss.")
