"""Metrics that accumulate in ``SyncOnRead`` variables: every replica adds to its own copy,
and ``result()`` in cross-replica context reads the aggregate, so the value is global
and the same under every strategy.

Keras-style: ``update_state(y_true, y_pred, sample_weight=None)``, ``result()``,
``reset_state()``. The variables are made in the strategy's scope the first time the
metric is used there (``build``).

Example::

    >>> import torch
    >>> m = SparseCategoricalAccuracy()
    >>> m.update_state(torch.tensor([0, 1]), torch.tensor([[2.0, 1.0], [3.0, 0.0]]))
    >>> float(m.result())
    0.5
"""

from __future__ import annotations

import math

import torch

import replicafit.strategies as ds
from replicafit.strategies import context

from . import losses
from .spelling import did_you_mean

__all__ = [
    "Metric",
    "Mean",
    "Sum",
    "Accuracy",
    "SparseCategoricalAccuracy",
    "CategoricalAccuracy",
    "BinaryAccuracy",
    "TopKCategoricalAccuracy",
    "MeanSquaredError",
    "MeanAbsoluteError",
    "AUC",
    "get",
]


class Metric:
    """Base class of streaming metrics.

    Subclasses declare their state in ``build_state()`` with ``add_state(name, shape)``
    (SUM-aggregated, per-replica accumulators) and implement ``update_state`` and
    ``result``. ``result()`` inside a replica gives that replica's own value; outside,
    the global one.
    """

    def __init__(self, name: str | None = None, dtype=torch.float32):
        self.name = name or _snake(type(self).__name__)
        self.dtype = dtype
        self._states: dict = {}
        self._strategy = None

    # --- state --------------------------------------------------------------------------
    def build(self, strategy=None) -> None:
        """Creates the accumulators in ``strategy``'s scope (again if built for another strategy)."""
        strategy = strategy or context.get_strategy()
        if self._strategy is strategy and self._states:
            return
        self._strategy = strategy
        self._states = {}
        with context.enter_or_assert_strategy(strategy):
            self.build_state()

    def build_state(self) -> None:
        """Declares the accumulators with ``add_state``, for subclasses to implement. ``build`` calls it in the
        strategy's scope (the first time the metric is used there)."""
        raise NotImplementedError

    def add_state(self, name: str, shape=(), dtype=None) -> None:
        """Adds the accumulator ``name``: zeros of ``shape`` (and ``dtype``, else the metric's), a ``SyncOnRead``
        variable with ``SUM`` aggregation named ``"<metric name>/<name>"``; a replica adds to its own copy.
        Call it from ``build_state``."""
        self._states[name] = ds.Variable(
            torch.zeros(shape, dtype=dtype or self.dtype),
            trainable=False,
            name=f"{self.name}/{name}",
            synchronization=ds.VariableSynchronization.ON_READ,
            aggregation=ds.VariableAggregation.SUM,
        )

    def _state(self, name: str):
        if not self._states:
            self.build()
        return self._states[name]

    def _add(self, name: str, value) -> None:
        variable = self._states.get(name)
        if variable is None:
            variable = self._state(name)
        if context.current_mode().cross_replica is None:
            # In a replica (or with one copy) a SyncOnRead write is local by definition: add in place.
            # Accumulators never require grad, and values are detached, so no autograd is involved.
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value = value.detach()
            variable.value().add_(value)
        else:
            variable.assign_add(value)

    def reset_state(self) -> None:
        """Zeroes every accumulator (on every replica)."""
        if not self._states:
            return
        with context.enter_or_assert_strategy(self._strategy):
            for variable in self._states.values():
                variable.assign(torch.zeros_like(variable.value()))

    @property
    def variables(self) -> list:
        """The accumulators (``SyncOnRead`` variables), in the order ``build_state`` added them; empty before
        ``build``. Keras' ``metric.variables``.

        Example::

            with aggregated_reads([v for m in metrics for v in m.variables]):  # one reduction for them all
                logs = {m.name: float(m.result()) for m in metrics}
        """
        return list(self._states.values())

    def state_variables(self) -> dict:
        """``{name: variable}`` of the accumulators, by the names ``add_state`` gave them (the keys of
        ``state_dict()``); empty before ``build``. Each variable has one component per replica.

        Example::

            m = Mean()
            m.build(strategy)
            sorted(m.state_variables())  # ["count", "total"]
            per_replica = [c.value() for c in strategy.experimental_local_results(m.state_variables()["total"])]
        """
        return dict(self._states)

    def state_dict(self) -> dict:
        """The aggregated accumulators (restoring divides SUM totals among the replicas)."""
        if not self._states:
            return {}
        with context.enter_or_assert_strategy(self._strategy):
            return {name: v.read_value().detach().clone() for name, v in self._states.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()`` (building the accumulators first where needed): each aggregated total is
        divided among the replicas, so ``result()`` gives the saved value again, under any strategy."""
        if not self._states:
            self.build()
        with context.enter_or_assert_strategy(self._strategy):
            for name, value in state.items():
                self._states[name].assign(value)

    def saved_layout(self, state: dict) -> dict:
        """``{accumulator name: its shape}`` of a ``state_dict()``: what a backup's metric state must match
        (``CompileMetrics.check_state_dict``); None where the shape may change with the data."""
        return {name: list(value.shape) for name, value in state.items()}

    def local_values(self) -> list:
        """This worker's replicas' accumulators, copied (no communication): what ``load_local_values`` puts
        back (a preemption during validation rewinds the training epoch's to them).

        Example::

            point = metric.local_values()
            ...
            metric.load_local_values(point)
        """
        local = self._strategy.experimental_local_results
        return [[c.value().detach().clone() for c in local(v)] for v in self.variables]

    def load_local_values(self, values: list) -> None:
        """Gives this worker's replicas' accumulators the values of ``local_values``."""
        for variable, components in zip(self.variables, values):
            for index, value in enumerate(components):
                variable.assign_component(index, value)

    # --- the metric ----------------------------------------------------------------------
    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds one batch to the accumulators, for subclasses to implement. Inside ``strategy.run`` (the
        trainer's steps) each replica adds its slice to its own copy. ``sample_weight``: one weight per
        example, or per element where the metric says so."""
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The metric's value from the accumulators, for subclasses to implement: inside a replica that
        replica's own, outside (cross-replica context) the global one over every replica and worker."""
        raise NotImplementedError

    def get_config(self) -> dict:
        """``{"name": ...}`` (Keras' ``get_config``; there is no ``from_config``)."""
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def _rows(values: torch.Tensor) -> torch.Tensor:
    """``(batch, everything else)``; well defined for an empty replica's 0 rows too."""
    return values.reshape(values.shape[0], math.prod(values.shape[1:]))


def _weights(values: torch.Tensor, sample_weight, mask=None):
    """``(values times their weights, the weights' sum)``: ``sample_weight`` per example or per element (it
    is broadcast to ``values``), ``mask`` (True: a real element) leaving the others out."""
    if sample_weight is None and mask is None:
        return values, float(values.numel()) if values.dim() else 1.0
    weight = torch.ones_like(values) if sample_weight is None else losses._broadcast_weight(sample_weight, values)
    if mask is not None:
        weight = torch.where(mask, weight, torch.zeros_like(weight))
    return torch.where(weight != 0, values * weight, torch.zeros_like(values)), weight.sum()


def _as_value(value, dtype):
    """A number as it is (no tensor made per step); a tensor detached (an integer or a wider one is added in
    place to the ``dtype`` accumulator as it is: no conversion kernel per step)."""
    if isinstance(value, (int, float)):
        return float(value)
    return value.detach()


class _MeanOfValues(Metric):
    """total / count of per-example (or per-element) values (weighted)."""

    def build_state(self) -> None:
        self.add_state("total")
        self.add_state("count")

    def _update(self, values: torch.Tensor, sample_weight, mask=None) -> None:
        values = values.detach().to(self.dtype)
        weighted, count = _weights(values, sample_weight, mask)
        self._add("total", weighted.sum())
        self._add("count", count)

    def update_totals(self, total, count) -> None:
        """Adds a sum of values and their count (a loss's ``LossTerms``: the loss trackers of ``fit``)."""
        self._add("total", _as_value(total, self.dtype))
        self._add("count", _as_value(count, self.dtype))

    def result(self) -> torch.Tensor:
        total, count = self._state("total").value(), self._state("count").value()
        return torch.where(count > 0, total / count.clamp_min(1e-12), torch.zeros_like(total))


class Mean(_MeanOfValues):
    """The (weighted) mean of the values given to ``update_state(values, sample_weight=None)``."""

    def update_state(self, values, sample_weight=None) -> None:
        """Adds ``values`` (a number or a tensor of any shape: every element counts), each weighted by
        ``sample_weight`` (per example, or per element)."""
        self._update(torch.as_tensor(values), sample_weight)


class Sum(Metric):
    """The (weighted) sum of the values given to ``update_state(values, sample_weight=None)``."""

    def build_state(self) -> None:
        """One accumulator, ``total``."""
        self.add_state("total")

    def update_state(self, values, sample_weight=None) -> None:
        """Adds the sum of ``values`` (a number or a tensor, flattened), each times its ``sample_weight``
        (which must broadcast to the flattened values)."""
        values = torch.as_tensor(values).detach().to(self.dtype).reshape(-1)
        weighted, _ = _weights(values, sample_weight)
        self._add("total", weighted.sum())

    def result(self) -> torch.Tensor:
        """The weighted sum so far (a copy)."""
        return self._state("total").value().clone()


class Accuracy(_MeanOfValues):
    """How often ``y_pred`` equals ``y_true`` exactly (Keras' ``Accuracy``): each example counts the fraction
    of its elements that are equal. Named ``"exact_match"`` (in ``Trainer(metrics=...)`` and recipes), since
    ``"accuracy"`` names the accuracy resolved from the shapes of labels and predictions (see ``get``).

    Example::

        >>> import torch
        >>> m = Accuracy()
        >>> m.update_state(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0]))
        >>> round(float(m.result()), 4)
        0.6667
    """

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds each example's fraction of elements where ``y_pred`` equals ``y_true`` (reshaped to it);
        ``ValueError`` where their numbers of elements differ (scores against labels)."""
        if y_true.numel() != y_pred.numel():
            raise ValueError(
                f"{self.name}: the exact-match accuracy compares predictions with labels element by element, but "
                f"got labels of shape {list(y_true.shape)} and predictions of shape {list(y_pred.shape)}; for "
                "scores or logits use 'accuracy' (resolved from the shapes) or 'sparse_categorical_accuracy'"
            )
        self._update(_rows((y_pred == y_true.reshape(y_pred.shape)).float()).mean(-1), sample_weight)


class SparseCategoricalAccuracy(_MeanOfValues):
    """How often the arg-max of ``y_pred`` (scores per class) equals the integer label.

    ``class_axis``: the dimension of ``y_pred`` that holds the classes: -1 (Keras' layout, the default)
    or 1 (torch's: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``). ``ignore_class``: a label whose elements
    are not counted (padding), so the result is the share of real elements predicted right.

    Example::

        >>> import torch
        >>> m = SparseCategoricalAccuracy(class_axis=1, ignore_class=-100)
        >>> scores = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]]])   # (N=1, C=2, L=3)
        >>> m.update_state(torch.tensor([[0, 0, -100]]), scores)
        >>> float(m.result())                                             # 1 of 2 real tokens
        0.5
    """

    def __init__(self, name: str | None = None, class_axis: int = -1, ignore_class: int | None = None):
        super().__init__(name)
        self.class_axis = class_axis
        self.ignore_class = ignore_class

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds whether the arg-max over ``class_axis`` equals the label, for every element (every token of a
        sequence counts), leaving out the elements labelled ``ignore_class``."""
        predicted = y_pred.argmax(dim=self.class_axis)
        labels = y_true.reshape(predicted.shape).long()
        mask = None if self.ignore_class is None else labels != self.ignore_class
        self._update((predicted == labels).float(), sample_weight, mask)


class CategoricalAccuracy(_MeanOfValues):
    """How often the arg-max of ``y_pred`` equals the arg-max of one-hot ``y_true``."""

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds whether the arg-maxes over the last dimension agree, for every position before it."""
        self._update((y_pred.argmax(dim=-1) == y_true.argmax(dim=-1)).float(), sample_weight)


class BinaryAccuracy(_MeanOfValues):
    """How often ``y_pred > threshold`` matches the 0/1 label (use ``threshold=0.0`` for logits)."""

    def __init__(self, threshold: float = 0.5, name: str | None = None):
        super().__init__(name)
        self.threshold = threshold

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds each example's fraction of elements where ``y_pred > threshold`` matches the label."""
        hits = ((y_pred > self.threshold).float() == y_true.reshape(y_pred.shape).float()).float()
        self._update(_rows(hits).mean(-1), sample_weight)


class TopKCategoricalAccuracy(_MeanOfValues):
    """How often the true class (one-hot ``y_true``) is among the ``k`` highest scores."""

    def __init__(self, k: int = 5, name: str | None = None):
        super().__init__(name)
        self.k = k

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds whether the true class is among the ``k`` highest scores; ``y_true`` one-hot, or integer labels
        (of lower rank than ``y_pred``)."""
        labels = y_true.argmax(dim=-1) if y_true.dim() == y_pred.dim() else y_true.long()
        top = y_pred.topk(min(self.k, y_pred.shape[-1]), dim=-1).indices
        self._update((top == labels.unsqueeze(-1)).any(dim=-1).float(), sample_weight)


class MeanSquaredError(_MeanOfValues):
    """The mean over examples of each example's mean squared error."""

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds each example's mean squared error over its elements."""
        diff = (y_pred - y_true.to(y_pred.dtype).reshape(y_pred.shape)) ** 2
        self._update(_rows(diff).mean(-1), sample_weight)


class MeanAbsoluteError(_MeanOfValues):
    """The mean over examples of each example's mean absolute error."""

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds each example's mean absolute error over its elements."""
        diff = (y_pred - y_true.to(y_pred.dtype).reshape(y_pred.shape)).abs()
        self._update(_rows(diff).mean(-1), sample_weight)


class AUC(Metric):
    """Area under the ROC (or precision-recall) curve of binary scores, from confusion
    counts at ``num_thresholds`` thresholds (Keras' method).

    ``from_logits=True`` applies a sigmoid to the scores first.
    """

    def __init__(
        self, num_thresholds: int = 200, curve: str = "ROC", from_logits: bool = False, name: str | None = None
    ):
        super().__init__(name or "auc")
        if num_thresholds < 2 or curve.upper() not in ("ROC", "PR"):
            raise ValueError(f"AUC needs num_thresholds > 1 and curve 'ROC' or 'PR', got {num_thresholds}, {curve!r}.")
        self.num_thresholds, self.curve, self.from_logits = num_thresholds, curve.upper(), from_logits
        epsilon = 1e-7
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.thresholds = torch.tensor([0.0 - epsilon] + inner + [1.0 + epsilon], dtype=torch.float32)

    def build_state(self) -> None:
        """Four accumulators of shape ``(num_thresholds,)``: the true and false positives and negatives at
        each threshold."""
        for name in ("true_positives", "false_positives", "true_negatives", "false_negatives"):
            self.add_state(name, (self.num_thresholds,))

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Adds the (weighted) confusion counts of every score (flattened; a sigmoid first with
        ``from_logits``) against its 0/1 label at each threshold; ``sample_weight``: one weight per score."""
        scores = y_pred.detach().float().reshape(-1)
        if self.from_logits:
            scores = torch.sigmoid(scores)
        labels = y_true.detach().float().reshape(-1)
        weight = (
            torch.ones_like(scores)
            if sample_weight is None
            else (
                torch.as_tensor(sample_weight, dtype=torch.float32, device=scores.device).reshape(-1).expand_as(scores)
            )
        )
        above = scores.unsqueeze(0) > self.thresholds.to(scores.device).unsqueeze(1)  # (thresholds, n)
        positive = (labels * weight).unsqueeze(0)
        negative = ((1 - labels) * weight).unsqueeze(0)
        self._add("true_positives", (above * positive).sum(1))
        self._add("false_positives", (above * negative).sum(1))
        self._add("true_negatives", (~above * negative).sum(1))
        self._add("false_negatives", (~above * positive).sum(1))

    def result(self) -> torch.Tensor:
        """The area by the trapezoidal rule between thresholds: under the ROC curve (recall against the false
        positive rate) or the PR curve (precision against recall; precision 1 where nothing is predicted
        positive). For PR, Keras' default interpolates the counts between thresholds instead (Davis &
        Goadrich), so its values can differ slightly."""
        tp, fp = self._state("true_positives").value(), self._state("false_positives").value()
        tn, fn = self._state("true_negatives").value(), self._state("false_negatives").value()
        recall = tp / (tp + fn).clamp_min(1e-12)
        if self.curve == "ROC":
            fpr = fp / (fp + tn).clamp_min(1e-12)
            x, y = fpr, recall
        else:
            precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1e-12), torch.ones_like(tp))
            x, y = recall, precision
        # thresholds ascend, so x descends: trapezoids between neighbours
        return ((x[:-1] - x[1:]) * (y[:-1] + y[1:]) / 2).sum()


class _Crossentropy(_MeanOfValues):
    """The mean over examples of a cross entropy (the loss of the same name, as a metric)."""

    _loss_class = None

    def __init__(self, from_logits: bool = True, name: str | None = None):
        super().__init__(name)
        self.from_logits = from_logits
        self._loss = self._loss_class(from_logits=from_logits)

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        self._update(self._loss(y_true, y_pred.float()), sample_weight)


class SparseCategoricalCrossentropy(_Crossentropy):
    """Cross entropy of integer labels against logits (``from_logits=False``: probabilities), as a metric."""

    _loss_class = losses.SparseCategoricalCrossentropy


class CategoricalCrossentropy(_Crossentropy):
    """Cross entropy of one-hot labels against logits (``from_logits=False``: probabilities), as a metric."""

    _loss_class = losses.CategoricalCrossentropy


class BinaryCrossentropy(_Crossentropy):
    """Binary cross entropy of 0/1 labels against probabilities (``from_logits=True``: logits), as a metric."""

    _loss_class = losses.BinaryCrossentropy

    def __init__(self, from_logits: bool = False, name: str | None = None):
        super().__init__(from_logits, name)


#: The metrics by the names ``get`` (and a recipe) takes: name -> class.
BY_NAME = {
    "mean": Mean,
    "sum": Sum,
    "exact_match": Accuracy,  # Keras' Accuracy class: "accuracy" is resolved from the shapes (_RESOLVED)
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "binary_accuracy": BinaryAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
    "auc": AUC,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
}
_RESOLVED = ("accuracy", "acc", "crossentropy", "ce")  # names whose metric the data's shapes decide
_ACCURACY_FOR_LOSS = {
    "sparse_categorical": SparseCategoricalAccuracy,
    "categorical": CategoricalAccuracy,
    "binary": BinaryAccuracy,
}


def get(identifier, loss=None, y_true=None, y_pred=None) -> Metric:
    """A metric from a name or a ``Metric`` (returned as is).

    ``"accuracy"``/``"acc"`` and ``"crossentropy"``/``"ce"`` (logged as ``accuracy`` and
    ``crossentropy``, whichever alias is used) are resolved as Keras 3 does, from the
    shapes of ``y_true`` and ``y_pred`` (one output's first batch), whatever the loss is: one score
    per example (``y_pred`` of rank 1, or a last dimension of 1) is binary; labels of lower rank than
    the predictions, or a last dimension of 1 against several scores, are sparse categorical; equal
    shapes with several scores are categorical (one-hot), unless the loss is a binary cross entropy
    (``nn.BCEWithLogitsLoss``, ``"binary_crossentropy"``, ...): multi-label binary, which shapes
    alone cannot tell. Sparse labels of -100 are left out where there is no loss of the trainer's
    (``Trainer(loss=None)``: the model's own loss ignores them, as Hugging Face's and torch's do).
    Binary accuracy thresholds at 0 where the loss takes logits
    (``nn.BCEWithLogitsLoss``, ``BinaryCrossentropy(from_logits=True)``), else at 0.5 (Keras');
    categorical cross entropy takes logits (torch models end in logits), binary follows the loss.
    Without shapes (no labels), the loss decides alone: sparse categorical for ``cross_entropy``
    and ``nn.CrossEntropyLoss``, categorical for ``categorical_crossentropy``, binary for the binary
    losses, exact-match ``Accuracy`` otherwise. A recipe's ``accuracy`` (a name or ``{type: accuracy}``)
    is resolved the same way. Keras' ``Accuracy`` class itself (predictions equal to labels as they
    are, without arg-max or threshold) is named ``"exact_match"``.

    Example::

        get("accuracy", loss, y_true=torch.tensor([3, 1]), y_pred=torch.randn(2, 10))  # sparse categorical
    """
    if isinstance(identifier, Metric):
        return identifier
    if not isinstance(identifier, str):
        raise TypeError(
            f"Cannot make a metric from {type(identifier).__name__}: pass a name, a Metric, or (to the Trainer's "
            "metrics) a torchmetrics Metric."
        )
    key = identifier.lower()
    if key in _RESOLVED:
        kind = _kind(loss, y_true, y_pred)
        logits = bool(getattr(loss, "from_logits", False)) if getattr(loss, "accuracy_kind", None) == "binary" else None
        if key in ("accuracy", "acc"):
            if kind == "binary":
                return BinaryAccuracy(threshold=0.0 if logits else 0.5, name="accuracy")
            if kind == "sparse_categorical":
                axis = getattr(loss, "class_axis", -1) if getattr(loss, "accuracy_kind", None) else -1
                # Trainer(loss=None): the model's own loss, whose labels ignore -100 (Hugging Face's and torch's)
                ignore = (
                    losses.ignore_index(loss) if isinstance(loss, losses.Loss) else (-100 if loss is None else None)
                )
                return SparseCategoricalAccuracy(name="accuracy", class_axis=axis, ignore_class=ignore)
            return _ACCURACY_FOR_LOSS.get(kind, Accuracy)(name="accuracy")
        if kind == "binary":
            return BinaryCrossentropy(from_logits=bool(logits), name="crossentropy")
        if kind == "categorical":
            return CategoricalCrossentropy(name="crossentropy")
        return SparseCategoricalCrossentropy(name="crossentropy")
    cls = BY_NAME.get(key)
    if cls is None:
        hint = did_you_mean(key, list(BY_NAME) + list(_RESOLVED))
        raise ValueError(f"Unknown metric {identifier!r}{hint}; known: {sorted(BY_NAME) + list(_RESOLVED)}.")
    return cls(name=key)


def _kind(loss, y_true, y_pred) -> str | None:
    """``"binary"``, ``"sparse_categorical"``, ``"categorical"`` from the shapes (Keras 3's rule), the loss
    deciding where they cannot; None when there is nothing to go by."""
    by_loss = getattr(loss, "accuracy_kind", None)
    if not isinstance(y_true, torch.Tensor) or not isinstance(y_pred, torch.Tensor) or y_pred.dim() == 0:
        return by_loss
    if y_pred.dim() == 1 or y_pred.shape[-1] == 1:
        return "binary"
    if y_true.dim() < y_pred.dim() or (y_true.dim() > 0 and y_true.shape[-1] == 1):
        return "sparse_categorical"
    return "binary" if by_loss == "binary" else "categorical"


def resolved_by_shapes(identifier) -> bool:
    """Whether ``identifier`` names a metric that the data's shapes resolve (``"accuracy"``, ...)."""
    return isinstance(identifier, str) and identifier.lower() in _RESOLVED
