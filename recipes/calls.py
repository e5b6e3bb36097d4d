"""Calling what a recipe names, with the recipe's values.

An error about those values is reported at the argument it names, in one line (``call_factory``); what a
factory returns is refused unless it is of its section's kind, at the entry's ``type`` (``build_entry``); and
the arguments a run fills in itself are worked out here: a model's ``inputs``/``outputs`` from the data
(``model_inputs``), a metric's ``name`` as the recipe wrote it (``with_written_name``). ``validate`` calls
replicafit's own built-ins through these, ``build`` every factory.
"""

from __future__ import annotations

import re

from replicafit.strategies import WorkerFailedError

from . import kinds
from .entries import entry_name, factory_parameters, first_line
from .source import Recipe

__all__ = ["call_factory", "build_entry", "type_at", "dataset_info", "model_inputs", "with_written_name"]


def call_factory(recipe: Recipe, key: tuple, factory, args, *, ours: bool = False, **extra):
    """Calls the factory of the entry at ``key`` with the recipe's values; an error about those values (a
    ``ValueError``, ``TypeError``...) is reported at the argument it names, in one line. ``ours``: one of
    replicafit's own built-ins, called during validation, where whatever it raises is about the recipe's
    values (a device that does not exist, a split out of range); a user's factory's other errors keep their
    traceback.

    Example::

        strategy = call_factory(recipe, ("strategy",), *checked["strategy"], ours=True)
    """
    try:
        return factory(**args, **extra)
    except WorkerFailedError:
        raise  # a worker failed while the cluster was joined: not the recipe's values (the CLI says so)
    except Exception as error:  # noqa: BLE001 - ours, called with the recipe's values: one line, no traceback
        known = isinstance(error, (ValueError, TypeError, RuntimeError, OverflowError, MemoryError))
        if not known and not ours:
            raise
        message = first_line(error)
        message = message if known and message else f"{type(error).__name__}: {message}".rstrip(": ")
        raise recipe.error(_blame(key, args, message), message) from None


def _blame(key: tuple, args: dict, message: str) -> tuple:
    """The argument an error message is about: the one whose quoted value comes first in it,
    else one it names."""
    quoted = []
    for name, value in args.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            position = message.find(f"'{item}'") if isinstance(item, str) else -1
            if position >= 0:
                quoted.append((position, name))
    if quoted:
        return key + (min(quoted)[1],)
    for name in args:
        if not isinstance(name, str):
            continue
        item = re.search(rf"\b{re.escape(name)}\[(\d+)\]", message)  # "hidden[1] must be ...": that item
        if item and isinstance(args[name], (list, tuple)) and int(item.group(1)) < len(args[name]):
            return key + (name, int(item.group(1)))
        if re.search(rf"\b{re.escape(name)}\b", message):
            return key + (name,)
    return key


def build_entry(recipe: Recipe, key: tuple, section: str, factory, args, **extra):
    """Calls the factory of the entry at ``key`` and refuses what it returns unless it is of ``section``'s kind.

    Example::

        model = build_entry(recipe, ("model",), "model", factory, args, inputs=64, outputs=10)
    """
    value = call_factory(recipe, key, factory, args, **extra)
    problem = kinds.result_problem(section, value)
    if problem:
        type_key, type_name = type_at(recipe, key)
        raise recipe.error(type_key, f"{type_name!r} {problem}")
    return value


_DEFAULT_ENTRIES = {("strategy",): "default", ("optimizer",): "adam", ("loss",): "cross_entropy"}


def type_at(recipe: Recipe, key: tuple) -> tuple:
    """``(key of the type, type name)`` of the entry at ``key`` (``("model", "type"), "mypkg:make"``).

    An entry the recipe leaves out is its default (``strategy: default``, ``optimizer: adam``, ``loss:
    cross_entropy``).

    Example::

        type_key, type_name = type_at(recipe, ("data",))
        raise recipe.error(type_key, f"{type_name!r} gives batches already")
    """
    entry = recipe.data
    for part in key:
        try:
            entry = entry[part]
        except (KeyError, IndexError, TypeError):
            entry = _DEFAULT_ENTRIES.get(key)
            break
    return (key + ("type",) if isinstance(entry, dict) else key), entry_name(entry)


def dataset_info(recipe: Recipe, value) -> dict:
    """What the dataset factory returned as ``{"train": ..., "validation": ..., "inputs": ..., ...}``.

    A value that is not training data is refused at the data entry's ``type`` (``datasets.as_info``).

    Example::

        info = dataset_info(recipe, factory(**args))
        x, y = info["train"]
    """
    from . import datasets

    try:
        return datasets.as_info(value)
    except ValueError as error:
        type_key, type_name = type_at(recipe, ("data",))
        raise recipe.error(type_key, f"{type_name!r} {error}") from None


def model_inputs(factory, args: dict, info: dict) -> dict:
    """The model's ``inputs``/``outputs`` taken from the data, where the recipe leaves them out.

    Example::

        >>> from replicafit.recipes.models import mlp
        >>> model_inputs(mlp, {"hidden": [8]}, {"inputs": 64, "classes": 10})
        {'inputs': 64, 'outputs': 10}
    """
    params, _ = factory_parameters(factory)
    extra = {}
    if "inputs" in params and "inputs" not in args and info.get("inputs"):
        extra["inputs"] = info["inputs"]
    if "outputs" in params and "outputs" not in args:
        outputs = info.get("classes") or _target_width(info)
        if outputs:
            extra["outputs"] = outputs
    return extra


def _target_width(info):
    from . import datasets

    return datasets.target_width(info["train"]) if info.get("train") is not None else None


def with_written_name(args: dict, factory, name) -> dict:
    """``args`` with the metric's ``name`` as the recipe wrote it (``mae``), where the metric takes a name
    and the recipe gives none: logs use it, as ``Trainer(metrics=["mae"])`` does.

    Example::

        >>> from replicafit.trainer.metrics import MeanAbsoluteError
        >>> with_written_name({}, MeanAbsoluteError, "mae")
        {'name': 'mae'}
    """
    params, _ = factory_parameters(factory)
    if "name" in params and "name" not in args and isinstance(name, str):
        return dict(args, name=name)
    return args
