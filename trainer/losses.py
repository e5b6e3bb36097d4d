"""Losses: ``loss(y_true, y_pred) -> per-example loss`` (shape ``(batch,)``), and the terms the trainer
reduces over the whole global batch (``Loss.terms``).

**The reduction rule.** The loss of a step is the loss of its whole global batch, across replicas,
workers and an accumulation window, so every strategy takes the same steps as one device:

* a *per-example* loss (one value per example, or per element with every element counting alike):
  the sum of the per-example losses (times ``sample_weight``) divided by the global batch size;
* an *element-level* loss, whose mean has a denominator that depends on the data (a prediction per
  token or pixel, some of them ignored or weighted): the sum of the element losses over the global
  batch (times ``sample_weight``, per example or per element) divided by the global total of the
  elements' weights: the count of real elements, or torch's sum of class weights. That is exactly
  the loss's own ``mean`` over the whole global batch.

+--------------------------------------------------------+----------------------------------------------+
| loss                                                   | denominator of the global batch              |
+========================================================+==============================================+
| ``nn.CrossEntropyLoss``, ``nn.NLLLoss`` (and ``F.``),  | Σ ``weight[label]`` over labels that are not |
| class-index targets, any rank: ``(N, C)``,             | ``ignore_index`` (the count of real labels   |
| ``(N, C, L)``                                          | without ``weight``): element-level           |
+--------------------------------------------------------+----------------------------------------------+
| the same with probability targets                      | the count of elements: element-level         |
+--------------------------------------------------------+----------------------------------------------+
| ``SparseCategoricalCrossentropy(ignore_class=k)``      | the count of labels that are not ``k``       |
| (classes last)                                         | (Keras 3's rule): element-level              |
+--------------------------------------------------------+----------------------------------------------+
| a callable or ``Loss`` returning ``ElementLosses``     | Σ of its ``weights``: element-level          |
+--------------------------------------------------------+----------------------------------------------+
| every other loss (``"mse"``, ``nn.BCEWithLogitsLoss``, | the global batch size (the per-example mean  |
| ``"cross_entropy"`` without ``ignore_class``, ...)     | of the element mean): per-example            |
+--------------------------------------------------------+----------------------------------------------+

``sample_weight`` multiplies the losses and never enters a denominator (Keras 3's
``sum_over_batch_size``). A global batch with no real element (every label ignored) contributes
a zero gradient and logs no loss, where torch's ``mean`` would give NaN. Torch loss modules take
classes in dimension 1 (torch's convention), our losses take them last (Keras').

A loss of one's own says "these are element losses, and this is each one's weight" by returning
``ElementLosses(values, weights)`` (Keras' ``Loss`` with a mask is the model): the loss of the global
batch is then Σ ``weights * values`` / Σ ``weights``; a weight of 0 drops an element (its value is
not used, even if NaN).

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
    >>> padded = get(SparseCategoricalCrossentropy(ignore_class=-100))
    >>> terms = padded.terms(torch.tensor([[1, -100]]), torch.zeros(1, 2, 4))  # one real token of two
    >>> round(float(terms.total), 4), int(terms.count)
    (1.3863, 1)
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .spelling import did_you_mean

# torch's private ``torch.nn.modules.loss._Loss`` is the base class of every torch loss module
# (``nn.CrossEntropyLoss()`` ...): the only way to recognise one that a user passes.

__all__ = [
    "ElementLosses",
    "Loss",
    "LossTerms",
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


class ElementLosses(NamedTuple):
    """What an element-level loss returns: the loss of each element (batch first: ``(batch, ...)``) and the
    weight of each element in the mean's denominator (broadcastable to ``values``; 0 drops an element,
    ``None``: every element weighs 1). The loss of a global batch is Σ ``weights * values`` / Σ ``weights``.

    Example (a token loss of one's own that skips padding)::

        def token_loss(y_true, y_pred):                       # y_pred (batch, length, classes)
            real = y_true != PAD
            values = F.cross_entropy(y_pred.movedim(-1, 1), y_true.where(real, 0), reduction="none")
            return ElementLosses(values, weights=real)

        Trainer(loss=token_loss)   # the mean over the real tokens of every global batch
    """

    values: torch.Tensor
    weights: torch.Tensor | None = None


class LossTerms(NamedTuple):
    """One replica's share of a loss: ``total`` (the sum of its weighted losses, a float32 scalar) and
    ``count`` (its part of the denominator: the rows of a per-example loss, the summed element weights of
    an element-level one). The loss of the global batch is Σ ``total`` / Σ ``count`` over every replica.
    ``per_example``: the per-example losses (per-example losses only, else None)."""

    total: torch.Tensor
    count: object
    per_example: torch.Tensor | None = None


def _broadcast_weight(sample_weight, values: torch.Tensor) -> torch.Tensor:
    """``sample_weight`` (per example ``(batch,)`` or per element) shaped to multiply ``values``."""
    weight = torch.as_tensor(sample_weight, device=values.device).to(values.dtype)
    if weight.dim() == 2 and weight.shape[-1] == 1 and values.dim() != 2:
        weight = weight.reshape(-1)  # (batch, 1): one weight per example
    while weight.dim() < values.dim():
        weight = weight.unsqueeze(-1)
    try:
        return torch.broadcast_to(weight, values.shape)
    except RuntimeError:
        raise ValueError(
            f"sample_weight of shape {list(weight.shape)} does not fit the losses of shape {list(values.shape)}: give "
            "one weight per example (batch,) or one per element of the loss (batch, ...)."
        ) from None


def _numerator(elements: ElementLosses) -> tuple:
    """``(weighted values, weights broadcast to them or None)``: 0 where a weight is 0, whatever the value."""
    values, weights = elements.values, elements.weights
    if weights is None:
        return values, None
    if isinstance(elements, _Weighted) and weights.dtype == torch.bool:
        return values, weights  # torch's output: 0 where ignored already
    weights = torch.broadcast_to(torch.as_tensor(weights, device=values.device), values.shape)
    weighted = values if isinstance(elements, _Weighted) else values * weights.to(values.dtype)
    return torch.where(weights != 0, weighted, torch.zeros_like(values)), weights


def element_terms(elements: ElementLosses, sample_weight=None) -> LossTerms:
    """The terms of element losses: Σ ``weights * values`` (times ``sample_weight``) and Σ ``weights``."""
    numerator, weights = _numerator(elements)
    if weights is None:
        count = numerator.numel()
    else:
        count = weights.sum()  # a bool or integer sum is an int64 tensor
    if sample_weight is not None:
        numerator = numerator * _broadcast_weight(sample_weight, numerator)
    return LossTerms(_sum(numerator), count)


def _sum(values: torch.Tensor) -> torch.Tensor:
    """The sum of ``values``, in float32 where they are half precision (autocast): never in float16."""
    return values.sum(dtype=torch.float32) if values.dtype in (torch.float16, torch.bfloat16) else values.sum()


def _example_means(elements: ElementLosses) -> torch.Tensor:
    """Each example's own weighted mean over its elements (0 for an example with none)."""
    numerator, weights = _numerator(elements)
    if weights is None:
        return _per_example(numerator)
    totals = numerator.reshape(numerator.shape[0], -1).sum(1)
    counts = weights.reshape(weights.shape[0], -1).to(numerator.dtype).sum(1)
    return torch.where(counts != 0, totals / counts.clamp_min(1e-12), torch.zeros_like(totals))


class _Weighted(ElementLosses):
    """Element losses already multiplied by their weights (torch's ``reduction="none"`` output)."""


class Loss:
    """Base class: ``__call__(y_true, y_pred)`` returns one loss per example; ``terms(y_true, y_pred,
    sample_weight)`` the replica's share of the global batch's loss (the module docstring's rule).

    Subclasses implement ``call``, which returns the losses (per example, or per element: the
    trainer averages an example's elements) or, for an element-level loss, ``ElementLosses``;
    ``name`` is used in logs of multi-output models.
    """

    #: what "accuracy" means with this loss ("sparse_categorical", "categorical", "binary" or None)
    accuracy_kind: str | None = None
    #: The dimension of the predictions that holds the classes (-1, Keras' layout; 1 for torch's losses).
    class_axis: int = -1
    #: Whether the loss's mean has a denominator of its own (``ElementLosses``), or None until its first call
    #: tells.
    element_level: bool | None = None
    #: Whether that denominator is a sum of floating weights (class weights) rather than a count (carried
    #: exactly, as an integer), or None until its first call tells.
    count_floating: bool | None = None

    def __init__(self, name: str | None = None):
        self.name = name or type(self).__name__

    def __call__(self, y_true, y_pred) -> torch.Tensor:
        values = self.call(y_true, y_pred)
        self._saw(isinstance(values, ElementLosses), getattr(values, "weights", None))
        return _example_means(values) if isinstance(values, ElementLosses) else _per_example(values)

    def call(self, y_true, y_pred):
        """The losses of one replica's batch, for subclasses to implement (Keras' ``Loss.call``).

        Returns one loss per example (shape ``(batch,)``), one per element (``(batch, ...)``: ``__call__`` and
        ``terms`` average each example's elements), or ``ElementLosses(values, weights)`` for an
        element-level loss. Not reduced over the batch: the trainer does that (the module docstring's rule).
        """
        raise NotImplementedError

    def terms(self, y_true, y_pred, sample_weight=None, per_example: bool = False) -> LossTerms:
        """This replica's share of the loss of the global batch: ``LossTerms(total, count, per_example)``.

        ``per_example=True`` reduces every loss per example (the rule of a model with several outputs).
        """
        values = self.call(y_true, y_pred)
        self._saw(isinstance(values, ElementLosses), getattr(values, "weights", None))
        if isinstance(values, ElementLosses):
            if not per_example:
                return element_terms(values, sample_weight)
            examples = _example_means(values)
        else:
            examples = _per_example(values) if sample_weight is None or _per_row(sample_weight, values) else None
            if examples is None:  # weights per element: they multiply the elements before each example's mean
                examples = _per_example(values * _broadcast_weight(sample_weight, values))
                sample_weight = None
        if sample_weight is not None:
            examples = examples * _broadcast_weight(sample_weight, examples)
        return LossTerms(_sum(examples), examples.shape[0] if examples.dim() else 1, examples)

    def _saw(self, element_level: bool, weights=None) -> None:
        if self.element_level is None:
            self.element_level = element_level
        if element_level and self.count_floating is None:
            self.count_floating = weights is not None and torch.as_tensor(weights).is_floating_point()

    def get_config(self) -> dict:
        """``{"name": ...}``, which a subclass extends with its own arguments (Keras' ``get_config``; there is no
        ``from_config``)."""
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _per_row(sample_weight, values: torch.Tensor) -> bool:
    """Whether ``sample_weight`` has one weight per example (``(batch,)`` or ``(batch, 1)``)."""
    shape = tuple(torch.as_tensor(sample_weight).shape)
    return len(shape) <= 1 or (len(shape) == 2 and shape[1] == 1)


class SparseCategoricalCrossentropy(Loss):
    """Cross entropy of integer labels against scores with the classes last (``from_logits=False``:
    probabilities), Keras 3's loss.

    ``ignore_class``: a label (``-100``, say, for padding) whose elements are left out: they add no loss
    and are not counted, so the loss of a global batch is the mean over its real elements (an
    element-level loss). With ``None`` every label must be a class, ``0 ... classes - 1``: a negative
    label is an error, as in Keras (torch's ``F.cross_entropy`` would silently skip ``-100``).

    Example::

        >>> import torch
        >>> loss = SparseCategoricalCrossentropy(ignore_class=-100)
        >>> labels = torch.tensor([[2, 0, -100]])               # (batch, length): padding last
        >>> logits = torch.zeros(1, 3, 4)                       # (batch, length, classes)
        >>> terms = loss.terms(labels, logits)
        >>> int(terms.count)                                    # real tokens
        2
    """

    accuracy_kind = "sparse_categorical"

    def __init__(self, from_logits: bool = True, ignore_class: int | None = None, name: str | None = None):
        super().__init__(name)
        if ignore_class is not None and (isinstance(ignore_class, bool) or not isinstance(ignore_class, int)):
            raise TypeError(f"ignore_class must be None or an int (a label to leave out), got {ignore_class!r}.")
        self.from_logits = from_logits
        self.ignore_class = ignore_class
        self.element_level = ignore_class is not None
        self.count_floating = False

    def call(self, y_true, y_pred):
        """Each element's cross entropy (labels ``(batch, ...)`` or ``(batch, ..., 1)``, scores with the classes
        last); with ``ignore_class``, ``ElementLosses`` whose weights leave that label out. A label outside
        ``0 ... classes - 1`` (other than ``ignore_class``) is a ``ValueError``."""
        target = y_true.long()
        if target.dim() == y_pred.dim():  # (batch, 1) labels, as Keras allows
            target = target.squeeze(-1)
        real = None
        if self.ignore_class is not None:
            real = target != self.ignore_class
            target = torch.where(real, target, torch.zeros_like(target))
        try:
            if self.from_logits:
                values = F.cross_entropy(_classes_second(y_pred), target, reduction="none", ignore_index=_NO_LABEL)
            else:
                log_probs = torch.log(y_pred.clamp_min(1e-7))
                values = F.nll_loss(_classes_second(log_probs), target, reduction="none", ignore_index=_NO_LABEL)
        except IndexError:
            raise labels_out_of_range(self.name, y_true, y_pred.shape[-1], self.ignore_class) from None
        return values if real is None else ElementLosses(values, real)

    def get_config(self) -> dict:
        """``{"name", "from_logits", "ignore_class"}``."""
        return {**super().get_config(), "from_logits": self.from_logits, "ignore_class": self.ignore_class}


# torch's cross entropy skips -100 unless told another label to skip: one no label can be.
_NO_LABEL = -(2**62)


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
        """``-Σ y_true * log(p)`` over the last dimension (``p``: the softmax of the logits, or the clipped
        probabilities), the labels smoothed towards uniform by ``label_smoothing``."""
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
        """Each element's binary cross entropy, the labels reshaped to the predictions' shape (probabilities are
        clipped to ``[1e-7, 1 - 1e-7]``)."""
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
        """Each element's squared error (labels with as many elements as the predictions take their shape)."""
        return (y_pred - _as_prediction_shape(y_true, y_pred)) ** 2


class MeanAbsoluteError(Loss):
    """Mean of ``|y_pred - y_true|`` over each example's elements."""

    def call(self, y_true, y_pred):
        """Each element's absolute error (labels with as many elements as the predictions take their shape)."""
        return (y_pred - _as_prediction_shape(y_true, y_pred)).abs()


class Huber(Loss):
    """Huber loss: quadratic within ``delta`` of the target, linear beyond."""

    def __init__(self, delta: float = 1.0, name: str | None = None):
        super().__init__(name)
        self.delta = delta

    def call(self, y_true, y_pred):
        """Each element's Huber loss with ``delta`` (torch's ``F.huber_loss``, unreduced)."""
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
        if isinstance(out, ElementLosses):
            return out
        if not isinstance(out, torch.Tensor) or out.dim() == 0:
            raise ValueError(
                f"The loss {self.name} returned a scalar: a loss must return one value per example (shape (batch,)), "
                "or per element, or ElementLosses(values, weights) for a mean over real elements; the trainer sums "
                "them and divides by the global batch size (the total weight) itself."
            )
        return out

    def __repr__(self) -> str:
        return f"Loss({self.name})"


class _TorchModule(Loss):
    class_axis = 1

    def __init__(self, module: torch.nn.Module):
        super().__init__(type(module).__name__)
        self.accuracy_kind, self.from_logits = _torch_kind(type(module))
        self.module = copy.copy(module)
        self.module.reduction = "none"  # per-example values; the trainer does the reduction
        self.element_level = isinstance(module, _CLASS_INDEX_MODULES)
        self.count_floating = getattr(module, "weight", None) is not None  # Σ weight[label], else a count

    def call(self, y_true, y_pred):
        module = self._module_on(y_pred.device)
        try:
            values = module(y_pred, y_true)
        except IndexError:
            if self.accuracy_kind != "sparse_categorical":
                raise
            ignore = getattr(module, "ignore_index", None)
            raise labels_out_of_range(self.name, y_true, y_pred.shape[1], ignore) from None
        if not self.element_level:
            return values
        return _torch_mean_weights(values, y_true, y_pred, getattr(module, "weight", None), module.ignore_index)

    def _module_on(self, device: torch.device) -> torch.nn.Module:
        """The module with its buffers (a class ``weight``, a ``pos_weight``) on ``device``, where the predictions
        are: a copy per other device (a weight given on the host meets a replica on a GPU; the replicas of
        Mirrored on several GPUs each need their own), made again when the user's buffers change: another tensor,
        or one written in place (its version counter). A write the counter does not see (through ``.data`` or a
        NumPy view) does not reach the copies: assign a new tensor, or put the loss module on the device.
        Parameters (a loss that learns) are not copied: a module with parameters on another device is refused,
        since its gradients would go to the copy."""
        module = self.module
        held = [*module.buffers(), *module.parameters()]
        if all(t.device == device for t in held):
            return module
        if any(isinstance(t, torch.nn.Parameter) for t in held):  # (a copy would learn in its place)
            where = ", ".join(sorted({str(t.device) for t in held}))
            raise ValueError(
                f"The loss {self.name} has parameters, and its tensors are on {where} while the predictions are on "
                f"{device}: a loss module that learns must have all its tensors on the replicas' device (move it "
                f"with .to({str(device)!r}) before passing it), so that its gradients reach its own parameters."
            )
        stamp = [(t, None if t.is_inference() else t._version) for t in held]  # private: the in-place write counter
        copies = self.__dict__.setdefault("_copies", {})
        found = copies.get(device)
        if found is None or not _same_stamp(found[0], stamp):
            with torch.inference_mode(False):  # (made during evaluate under inference mode, used in fit later)
                found = copies[device] = (stamp, copy.deepcopy(module).to(device))
        return found[1]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_copies", None)  # (device copies: made again where needed)
        return state


def _same_stamp(old: list, new: list) -> bool:
    """Whether two ``(tensor, version)`` lists name the very same tensors at the same versions."""
    return len(old) == len(new) and all(a is b and u == v for (a, u), (b, v) in zip(old, new))


# Whose ``mean`` divides by Σ weight[label] over the labels not ignored (class-index targets).
_CLASS_INDEX_MODULES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)


def _torch_mean_weights(values, y_true, y_pred, weight, ignore_index) -> ElementLosses:
    """torch's ``reduction="none"`` output of a cross entropy or NLL loss (already times ``weight[label]``,
    0 where ignored) and the weights of its ``mean``'s denominator: ``weight[label]`` (1 without ``weight``)
    where the label is not ``ignore_index``; with probability targets, every element counts 1."""
    if y_true.is_floating_point() and y_true.shape == y_pred.shape:  # probabilities: the count of elements
        return ElementLosses(values, None)
    target = y_true.long()
    real = target != ignore_index
    if weight is None:
        return _Weighted(values, real)
    safe = torch.where(real, target, torch.zeros_like(target))
    weights = torch.where(real, weight.to(values.device, values.dtype)[safe], torch.zeros_like(values))
    return _Weighted(values, weights)


def class_count(loss, y_pred: torch.Tensor):
    """The number of classes ``loss`` reads from ``y_pred`` when it takes class-index labels, else None."""
    if loss.accuracy_kind != "sparse_categorical" or y_pred.dim() < 2:
        return None
    return int(y_pred.shape[loss.class_axis])


def ignore_index(loss):
    """The label a class-index loss skips (torch's ``ignore_index``, -100 by default; our ``ignore_class``),
    or None."""
    if isinstance(loss, _TorchModule):
        return getattr(loss.module, "ignore_index", None)
    if isinstance(loss, _TorchFunctional):
        return -100 if loss.element_level else None
    return getattr(loss, "ignore_class", None)


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

    class_axis = 1

    def __init__(self, fn):
        super().__init__(fn.__name__)
        self.fn = fn
        self.accuracy_kind, self.from_logits = _torch_kind(fn)
        self.element_level = fn in (F.cross_entropy, F.nll_loss)
        self.count_floating = False

    def call(self, y_true, y_pred):
        try:
            values = self.fn(y_pred, y_true, reduction="none")
        except IndexError:
            if self.accuracy_kind != "sparse_categorical":
                raise
            raise labels_out_of_range(self.name, y_true, y_pred.shape[1], -100) from None
        return _torch_mean_weights(values, y_true, y_pred, None, -100) if self.element_level else values

    def __repr__(self) -> str:
        return f"Loss(torch.nn.functional.{self.name})"


#: The losss by the names ``get`` (and a recipe) takes: name -> class.
BY_NAME = {
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
        cls = BY_NAME.get(identifier.lower())
        if cls is None:
            hint = did_you_mean(identifier.lower(), BY_NAME)
            raise ValueError(f"Unknown loss {identifier!r}{hint}; known: {sorted(BY_NAME)}.")
        return cls()
    if isinstance(identifier, torch.nn.modules.loss._Loss):  # private: the one base class of torch's losses
        return _TorchModule(identifier)
    if is_torch_functional_loss(identifier):
        return _TorchFunctional(identifier)
    if callable(identifier):
        return _Callable(identifier)
    raise TypeError(f"Cannot make a loss from {type(identifier).__name__}: pass a name, a callable or a torch loss.")
