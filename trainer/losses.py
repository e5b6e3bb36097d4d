"""Losses: ``loss(y_true, y_pred) -> per-example loss`` (shape ``(batch,)``).

The trainer sums a replica's per-example losses (times sample weights) and divides by
the global batch size of the step, so every strategy takes the same steps as one device.

Names: ``"cross_entropy"`` / ``"sparse_categorical_crossentropy"`` (integer labels,
logits), ``"categorical_crossentropy"`` (one-hot labels, logits),
``"binary_crossentropy"`` (probabilities; ``BinaryCrossentropy(from_logits=True)`` for
logits), ``"mse"``, ``"mae"``, ``"huber"``. Any callable ``(y_true, y_pred) -> tensor``
works, and so does a torch loss module (``torch.nn.CrossEntropyLoss()``, called as
torch calls it, ``module(y_pred, y_true)``, with ``reduction="none"``).

Example::

    >>> import torch
    >>> loss = get("mse")
    >>> loss(torch.zeros(2, 3), torch.ones(2, 3))
    tensor([1., 1.])
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from .registry import did_you_mean

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
        if self.from_logits:
            return F.cross_entropy(_classes_second(y_pred), target, reduction="none")
        log_probs = torch.log(y_pred.clamp_min(1e-7))
        return F.nll_loss(_classes_second(log_probs), target, reduction="none")


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
        return self.module(y_pred, y_true)


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
    if callable(identifier):
        return _Callable(identifier)
    raise TypeError(f"Cannot make a loss from {type(identifier).__name__}: pass a name, a callable or a torch loss.")
