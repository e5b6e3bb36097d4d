"""What a recipe section's ``type`` may name, and what its factory must return.

A recipe names code to run (``"package.module:attr"``), so it is trusted like a script; but
``replicafit validate`` never calls code outside replicafit. It imports the named attribute
and checks that it is of the section's kind *without calling it*; ``fit`` calls it and checks
the object it returns. Only replicafit's own built-ins are constructed during validation.

- ``strategy``: a ``replicafit.strategies.Strategy`` subclass, or a function annotated ``-> Strategy``;
  returns a ``Strategy``.
- ``optimizer``, ``metric``, ``callback``: likewise with ``replicafit.optimizers.Optimizer``,
  ``replicafit.trainer.metrics.Metric`` (or a torchmetrics ``Metric``) and ``replicafit.trainer.callbacks.Callback``.
- ``model``: a ``torch.nn.Module`` subclass or any Python function; returns an ``nn.Module``.
- ``dataset``: a torch ``Dataset``/``DataLoader`` class (or a class of iterables) or any Python
  function; returns what ``fit`` takes (``(x, y)`` arrays, a torch ``Dataset``, a ``DataLoader``)
  or a dict with ``train`` (and ``validation``, ``inputs``, ``classes``, ``task``).
- ``schedule``: a ``LearningRateSchedule`` subclass (or a class of callables) or any Python
  function; returns a schedule or a callable ``step -> learning rate``.
- ``loss``: a ``Loss`` or ``torch.nn.Module`` subclass (or a class of callables) or any Python
  function; returns a callable ``loss(y_true, y_pred)``.

A function's return annotation, where it names a class, must agree with the section.

Why the difference: strategies, optimizers, metrics and callbacks are classes in replicafit,
and a function that stands for one says so in its return annotation, so that a callable that
builds something else (``os:system``, ``subprocess:run``) is refused before anything runs.
Models, datasets, schedules and losses are usually written as plain functions; any Python
function is accepted there (its arguments must still bind), and ``fit`` checks what it returns.
Built-in and C functions (``os:system``, ``builtins:eval``) are never factories. A name that
a package registered (``register_model``, ...) declares its kind by registering.
"""

from __future__ import annotations

import builtins as builtins_module
import functools
import inspect
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from replicafit.strategies.describe import describe_value, qualified_name

from .datasets import training_data_form

__all__ = ["Kind", "kind", "factory_problem", "result_problem", "is_builtin"]


@dataclass(frozen=True)
class Kind:
    """One section's kind: what a class must be, whether functions need an annotation, what to return."""

    noun: str  # "a strategy"
    expected: str  # what the message says is expected
    is_class: typing.Callable  # predicate on a class (also on a function's return annotation)
    is_result: typing.Callable  # predicate on what the factory returned
    annotation_required: bool


def _defines(cls, name: str) -> bool:
    return any(name in vars(klass) for klass in cls.__mro__ if klass is not object)


def _subclass(*bases):
    return lambda cls: issubclass(cls, bases)


def _kinds() -> dict:
    from replicafit.optimizers import Optimizer
    from replicafit.optimizers.schedules import LearningRateSchedule
    from replicafit.strategies import Strategy
    from replicafit.trainer.callbacks import Callback
    from replicafit.trainer.losses import Loss
    from replicafit.trainer.metrics import Metric
    from replicafit.trainer.torch_metrics import is_torchmetrics_class, is_torchmetrics_metric

    def data_class(cls):
        return issubclass(cls, (torch.utils.data.Dataset, torch.utils.data.DataLoader, np.ndarray, torch.Tensor)) or (
            _defines(cls, "__iter__") and not issubclass(cls, (str, bytes))
        )

    def callable_class(*bases):
        return lambda cls: issubclass(cls, bases) or _defines(cls, "__call__")

    return {
        "strategy": Kind(
            "a strategy",
            "a replicafit.strategies.Strategy subclass, or a function annotated to return one",
            _subclass(Strategy),
            lambda obj: isinstance(obj, Strategy),
            True,
        ),
        "optimizer": Kind(
            "an optimizer",
            "a replicafit.optimizers.Optimizer subclass, or a function annotated to return one",
            _subclass(Optimizer),
            lambda obj: isinstance(obj, Optimizer),
            True,
        ),
        "metric": Kind(
            "a metric",
            "a replicafit.trainer.metrics.Metric or torchmetrics.Metric subclass, or a function annotated to "
            "return one",
            lambda cls: issubclass(cls, Metric) or is_torchmetrics_class(cls),
            lambda obj: isinstance(obj, Metric) or is_torchmetrics_metric(obj),
            True,
        ),
        "callback": Kind(
            "a callback",
            "a replicafit.trainer.callbacks.Callback subclass, or a function annotated to return one",
            _subclass(Callback),
            lambda obj: isinstance(obj, Callback),
            True,
        ),
        "model": Kind(
            "a model",
            "a torch.nn.Module subclass, a registered model or a function that returns a torch.nn.Module",
            _subclass(torch.nn.Module),
            lambda obj: isinstance(obj, torch.nn.Module),
            False,
        ),
        "dataset": Kind(
            "a dataset",
            "a torch Dataset or DataLoader class, a registered dataset, or a function that returns what fit "
            "takes ((x, y) arrays, a torch Dataset, a DataLoader) or a dict with 'train' (and 'validation')",
            data_class,
            lambda obj: (isinstance(obj, Mapping) and "train" in obj) or training_data_form(obj) is not None,
            False,
        ),
        "schedule": Kind(
            "a learning-rate schedule",
            "a replicafit.optimizers.schedules.LearningRateSchedule subclass, or a function that returns a "
            "schedule or a callable step -> learning rate",
            callable_class(LearningRateSchedule),
            lambda obj: isinstance(obj, LearningRateSchedule) or callable(obj),
            False,
        ),
        "loss": Kind(
            "a loss",
            "a replicafit.trainer.losses.Loss or torch.nn.Module subclass, or a function that returns a "
            "callable loss(y_true, y_pred)",
            callable_class(Loss, torch.nn.Module),
            callable,
            False,
        ),
    }


_KINDS: dict = {}  # filled on first use: importing every section's base class costs time


def kind(name: str) -> Kind:
    """The ``Kind`` of registry ``name`` (``"strategy"``, ``"model"``, ...)."""
    if not _KINDS:
        _KINDS.update(_kinds())
    return _KINDS[name]


def _function(factory):
    """The Python function behind ``factory`` (a function, a bound method, a partial), else None."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    if inspect.ismethod(factory):
        factory = factory.__func__
    return factory if inspect.isfunction(factory) else None


def factory_problem(section: str, factory) -> str | None:
    """Why ``factory`` (a ``module:attr`` the recipe names) cannot stand for ``section``'s kind, else None.

    Never calls ``factory``.
    """
    spec = kind(section)
    if inspect.isclass(factory):
        if spec.is_class(factory):
            return None
        return f"it is the class {qualified_name(factory)}, not {spec.noun}"
    function = _function(factory)
    if function is None:
        if inspect.isbuiltin(factory) or isinstance(factory, (types.BuiltinFunctionType, types.MethodWrapperType)):
            return "it is a built-in function, which is not a factory of anything a recipe builds"
        name = type(factory).__name__
        article = "an" if name[:1].lower() in "aeiou" else "a"
        return f"it is {article} {name} object, not a class or a function"
    returns = _return_class(function)
    if returns is _UNREADABLE:
        if spec.annotation_required:
            return (
                f"it is a function whose return annotation {_annotation_text(function)!r} does not name a class; "
                f"annotate it with the class it returns"
            )
        return None
    if returns is None:
        if spec.annotation_required:
            return f"it is a function without a return annotation: annotate it to say it returns {spec.noun}"
        return None
    if returns is typing.Any or returns is object:
        if spec.annotation_required:
            return f"its return annotation {_annotation_text(function)!r} does not say it returns {spec.noun}"
        return None
    if spec.is_class(returns):
        return None
    return f"it is annotated to return {qualified_name(returns)}, not {spec.noun}"


def result_problem(section: str, value) -> str | None:
    """Why ``value``, returned by the factory of ``section``, is not of its kind (``"returned ..."``), else None."""
    spec = kind(section)
    if spec.is_result(value):
        return None
    return f"returned {describe_value(value)}, not {spec.noun} (expected {spec.expected})"


def is_builtin(section: str, factory) -> bool:
    """Whether ``factory`` is replicafit's own: a built-in registered name, or a replicafit class of the kind.

    Only these are constructed during validation (to catch bad devices and data arguments early).
    """
    from .builtins import BUILTINS

    if any(factory is builtin for builtin in BUILTINS.get(section, ())):
        return True
    module = getattr(factory, "__module__", None) or ""
    return inspect.isclass(factory) and module.startswith("replicafit.") and kind(section).is_class(factory)


_UNREADABLE = object()


def _return_class(function):
    """The class ``function`` is annotated to return; None without an annotation, ``_UNREADABLE`` when the
    annotation does not name a class. String annotations are looked up by name, never evaluated."""
    annotation = inspect.signature(function, eval_str=False).return_annotation
    if annotation is inspect.Signature.empty:
        return None
    if isinstance(annotation, str):
        annotation = _lookup(annotation.strip(), function)
        if annotation is None:
            return _UNREADABLE
    if annotation is typing.Any:
        return annotation
    origin = typing.get_origin(annotation)
    if origin is not None and origin not in (typing.Union, types.UnionType):
        annotation = origin  # dict[str, object] -> dict
    return annotation if inspect.isclass(annotation) else _UNREADABLE


def _lookup(text: str, function):
    """The object a dotted name such as ``"nn.Module"`` means in ``function``'s module, or None."""
    parts = text.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    namespace = getattr(function, "__globals__", {})
    if parts[0] in namespace:
        value = namespace[parts[0]]
    elif hasattr(builtins_module, parts[0]):
        value = getattr(builtins_module, parts[0])
    elif parts[0] == "typing" or text == "Any":
        value = typing if parts[0] == "typing" else typing.Any
    else:
        return None
    for part in parts[1:]:
        if isinstance(value, types.ModuleType):
            value = getattr(value, part, None)  # a lazy module attribute is an import, not a call of user code
        elif inspect.isclass(value):
            try:
                value = inspect.getattr_static(value, part)
            except AttributeError:
                return None
        else:
            return None
        if value is None:
            return None
    return value


def _annotation_text(function) -> str:
    annotation = inspect.signature(function, eval_str=False).return_annotation
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
