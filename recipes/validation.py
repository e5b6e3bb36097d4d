"""A whole recipe validated before anything runs; ``validate`` returns the factories and arguments ``build`` uses.

The sections, the seed and the precision; each entry against its factory (``entries``); replicafit's own
built-ins constructed with the recipe's values (the strategy, the data, a built-in model on the ``meta``
device, and a ``fully_sharded`` strategy's ``shard_units`` against that model); the optimizer's
``exclude_from_weight_decay``; fit's and evaluate's arguments as the trainer checks them
(``replicafit.trainer.arguments``); the data's task against the loss and the metrics; and the monitors
(``monitors``). The first problem found is raised as a ``RecipeError`` at its key.
"""

from __future__ import annotations

from replicafit.trainer.arguments import (
    EVALUATE_ARGUMENTS,
    FIT_ARGUMENTS,
    PRECISIONS,
    argument_problem,
    resolve_precision,
)
from replicafit.trainer.metrics import resolved_by_shapes
from replicafit.trainer.spelling import did_you_mean

from . import kinds
from .calls import call_factory, dataset_info, model_inputs
from .entries import check_entry, entry_name, factory_parameters, first_line, parameter_default, type_problem
from .monitors import check_monitors
from .source import SECTIONS, Recipe, short_repr

__all__ = ["validate", "check_batchnorm_to_sync", "check_shard_units"]

# The trainer's arguments, as the trainer checks them (arguments.py), and fit's verbose.
FIT_KEYS = {**FIT_ARGUMENTS, "verbose": "verbose"}
EVALUATE_KEYS = EVALUATE_ARGUMENTS
_YAML_TYPE = {"count": int, "size": int, "fraction": float, "flag": bool}
MAX_SEED = 2**64 - 1  # torch.manual_seed takes up to this; NumPy's seeds (the data order) must not be negative


CLASSIFICATION_ONLY_METRICS = {
    "accuracy",
    "acc",
    "crossentropy",
    "ce",
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "sparse_categorical_accuracy",
    "categorical_accuracy",
    "binary_accuracy",
    "top_k_categorical_accuracy",
    "auc",
}
REGRESSION_ONLY_METRICS = {"mse", "mae", "mean_squared_error", "mean_absolute_error"}
CLASSIFICATION_LOSSES = {
    "cross_entropy",
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
}
REGRESSION_LOSSES = {"mse", "mae", "huber", "mean_squared_error", "mean_absolute_error"}


def validate(recipe: Recipe) -> dict:
    """Checks everything that can be checked without training or calling code outside replicafit;
    returns the factories and args (and the built-in strategy and data, constructed).

    Raises ``RecipeError`` for the first problem found.
    """
    data = recipe.data
    for key in data:
        if key not in SECTIONS:
            raise recipe.error((key,), f"unknown section{did_you_mean(key, SECTIONS)}; sections: {', '.join(SECTIONS)}")
    for required in ("model", "data"):
        if required not in data:
            raise recipe.error((), f"missing section {required!r}")
    _check_seed(recipe, data.get("seed"))
    _check_precision(recipe, data.get("precision", "32"))
    checked: dict = {}
    checked["strategy"] = check_entry(recipe, ("strategy",), data.get("strategy", "default"), "strategy")
    if kinds.is_builtin("strategy", checked["strategy"][0]):  # bad devices are found now
        checked["strategy_instance"] = call_factory(recipe, ("strategy",), *checked["strategy"], ours=True)
    data_entry = data["data"]
    batch_keys = {}
    checked["auto_shard_policy"] = None
    if isinstance(data_entry, dict):
        batch_keys = {k: data_entry[k] for k in ("batch_size",) if k in data_entry}
        if "auto_shard_policy" in data_entry:  # how the trainer distributes the data, not a dataset argument
            checked["auto_shard_policy"] = _shard_policy(recipe, data_entry["auto_shard_policy"])
        data_entry = {k: v for k, v in data_entry.items() if k not in batch_keys and k != "auto_shard_policy"}
    checked["data"] = check_entry(recipe, ("data",), data_entry, "dataset")
    if kinds.is_builtin("dataset", checked["data"][0]):  # loads now: bad values fail here
        checked["data_instance"] = dataset_info(recipe, call_factory(recipe, ("data",), *checked["data"], ours=True))
    for name, value in batch_keys.items():
        problem = type_problem(value, (int,), False)
        if problem or value < 1:
            raise recipe.error(("data", name), problem or "must be a positive integer")
    checked["data_batch"] = batch_keys
    model, checked["sync_batchnorm"] = _sync_batchnorm(recipe, data["model"])
    checked["model"] = check_entry(recipe, ("model",), model, "model", provided=("inputs", "outputs", "in_channels"))
    if kinds.is_builtin("model", checked["model"][0]):
        _check_builtin_model(recipe, checked)
    optimizer = data.get("optimizer", "adam")
    optimizer, checked["decay_exclusions"] = _decay_exclusions(recipe, optimizer)
    checked["optimizer"] = check_entry(recipe, ("optimizer",), optimizer, "optimizer")
    rate = optimizer.get("learning_rate") if isinstance(optimizer, dict) else None
    if isinstance(rate, dict):
        checked["schedule"] = check_entry(recipe, ("optimizer", "learning_rate"), rate, "schedule")
    elif kinds.is_builtin("optimizer", checked["optimizer"][0]):  # bad values (accumulation steps, ...) fail now
        call_factory(recipe, ("optimizer",), *checked["optimizer"], ours=True)
    checked["loss"] = check_entry(recipe, ("loss",), data.get("loss", "cross_entropy"), "loss")
    metrics = data.get("metrics", [])
    if not isinstance(metrics, list):
        raise recipe.error(("metrics",), f"expected a list of metrics, got {type(metrics).__name__}")
    checked["metrics"] = [_check_metric(recipe, i, m) for i, m in enumerate(metrics)]
    callbacks = data.get("callbacks", [])
    if not isinstance(callbacks, list):
        raise recipe.error(("callbacks",), f"expected a list of callbacks, got {type(callbacks).__name__}")
    checked["callbacks"] = [check_entry(recipe, ("callbacks", i), c, "callback") for i, c in enumerate(callbacks)]
    for index, entry in enumerate(checked["callbacks"]):
        if kinds.is_builtin("callback", entry[0]):  # bad values (save_freq, a signal's name...) fail now
            call_factory(recipe, ("callbacks", index), *entry, ours=True)  # (ours construct without touching files)
    checked["fit"] = _check_plain(recipe, "fit", FIT_KEYS)
    checked["evaluate"] = _check_plain(recipe, "evaluate", EVALUATE_KEYS)
    if "batch_size" in batch_keys and "batch_size" in checked["fit"]:
        raise recipe.error(("fit", "batch_size"), "batch_size is set in data too: set it in one place")
    _check_task(recipe, checked)
    check_monitors(recipe, checked)
    return checked


def _check_precision(recipe: Recipe, precision) -> None:
    if resolve_precision(precision) is None:
        hint = did_you_mean(str(precision), PRECISIONS)
        raise recipe.error(
            ("precision",), f"expected one of {', '.join(PRECISIONS)}{hint}, got {short_repr(precision)}"
        )


def _check_seed(recipe: Recipe, seed) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise recipe.error(("seed",), f"expected an integer, got {type(seed).__name__} {short_repr(seed)}")
    if not 0 <= seed <= MAX_SEED:
        raise recipe.error(("seed",), f"must be in [0, 2**64 - 1] (what torch.manual_seed takes), got {seed}")


def _shard_policy(recipe: Recipe, value):
    """``data.auto_shard_policy``: a ``data.AutoShardPolicy`` name (what each worker reads)."""
    from replicafit.data import AutoShardPolicy

    names = list(AutoShardPolicy.__members__)
    if value is False:  # YAML reads an unquoted `off` as false
        return AutoShardPolicy.OFF
    if not isinstance(value, str) or value.upper() not in names:
        got = f"{type(value).__name__} {short_repr(value)}"
        hint = did_you_mean(value.upper(), names) if isinstance(value, str) else ""
        raise recipe.error(("data", "auto_shard_policy"), f"expected one of {', '.join(names)}{hint}, got {got}")
    return AutoShardPolicy[value.upper()]


def _sync_batchnorm(recipe: Recipe, model) -> tuple:
    """``(the model entry without it, its sync_batchnorm flag)``: the recipe key that converts the built
    model's BatchNorm layers with ``nn.SyncBatchNorm.convert_sync_batchnorm`` (not a model argument)."""
    if not isinstance(model, dict) or "sync_batchnorm" not in model:
        return model, False
    flag = model["sync_batchnorm"]
    if not isinstance(flag, bool):
        raise recipe.error(
            ("model", "sync_batchnorm"), f"expected true or false, got {type(flag).__name__} {short_repr(flag)}"
        )
    return {k: v for k, v in model.items() if k != "sync_batchnorm"}, flag


def _decay_exclusions(recipe: Recipe, optimizer) -> tuple:
    """``(the optimizer entry without it, its exclude_from_weight_decay list)``: the recipe key that calls
    ``optimizer.exclude_from_weight_decay(var_names=[...])`` (a method in Python, not an argument)."""
    if not isinstance(optimizer, dict) or "exclude_from_weight_decay" not in optimizer:
        return optimizer, []
    names = optimizer["exclude_from_weight_decay"]
    key = ("optimizer", "exclude_from_weight_decay")
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list):
        raise recipe.error(key, f"expected a list of name parts (e.g. [bias, norm]), got {type(names).__name__}")
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise recipe.error(key + (index,), f"expected a non-empty string (a part of variable names), got {name!r}")
    return {k: v for k, v in optimizer.items() if k != "exclude_from_weight_decay"}, list(names)


def _check_builtin_model(recipe: Recipe, checked: dict) -> None:
    """Builds a built-in model on the ``meta`` device (no memory, no time): its sizes and names are checked."""
    import torch

    factory, args = checked["model"]
    info = checked.get("data_instance") or {}
    extra = model_inputs(factory, args, info)
    params, _ = factory_parameters(factory)
    for name in ("inputs", "outputs"):  # the data is not known yet: any valid size stands in
        if name in params and name not in args and name not in extra:
            extra[name] = 1
    with torch.device("meta"):
        model = call_factory(recipe, ("model",), factory, args, ours=True, **extra)
    if checked["sync_batchnorm"]:
        check_batchnorm_to_sync(recipe, model)
    check_shard_units(recipe, checked.get("strategy_instance"), model)


def check_shard_units(recipe: Recipe, strategy, model) -> None:
    """``strategy.shard_units`` of a ``fully_sharded`` strategy must name classes of the model's submodules:
    refused at that key otherwise, with the classes the model has. (The strategy itself only shards, and so
    only checks, with more than one worker: a recipe that runs with one must not fail with two.)

    Example::

        check_shard_units(recipe, strategy, model)  # once the model is built, before anything trains
    """
    from replicafit.strategies import FullyShardedStrategy
    from replicafit.strategies.fully_sharded import select_units

    if not isinstance(strategy, FullyShardedStrategy):
        return
    shard_units = strategy.extended.shard_units
    if shard_units is None or (callable(shard_units) and not isinstance(shard_units, (list, tuple, type))):
        return  # chosen by the model's declaration or by size, or by a function: nothing to check by name
    try:
        select_units(model, shard_units)
    except (TypeError, ValueError) as error:
        raise recipe.error(("strategy", "shard_units"), first_line(error)) from None


def check_batchnorm_to_sync(recipe: Recipe, model) -> None:
    """``model.sync_batchnorm: true`` needs a model with BatchNorm layers: refused at that key otherwise.

    Example::

        check_batchnorm_to_sync(recipe, model)  # before nn.SyncBatchNorm.convert_sync_batchnorm(model)
    """
    from torch import nn

    batch_norm = nn.modules.batchnorm._BatchNorm  # private: torch's one base class of every batch norm
    if any(isinstance(m, batch_norm) for m in model.modules()):
        return
    builtin = entry_name(recipe.data["model"]) in ("cnn", "mlp")
    hint = "; the built-in cnn and mlp have them with `batch_norm: true`" if builtin else ""
    raise recipe.error(
        ("model", "sync_batchnorm"), f"the model has no BatchNorm layer to synchronize{hint} (or remove the key)"
    )


def _check_metric(recipe, index, value):
    """``accuracy`` and ``crossentropy`` (and ``acc``, ``ce``), as a name or ``{type: ...}``, are the names the
    trainer resolves from the data's shapes, as in ``Trainer(metrics=["accuracy"])``: ``(name, {})``."""
    name = entry_name(value)
    if not (isinstance(name, str) and resolved_by_shapes(name)):
        return check_entry(recipe, ("metrics", index), value, "metric")
    resolved = "accuracy" if name.lower() in ("accuracy", "acc") else "crossentropy"
    extra = [key for key in value if key != "type"] if isinstance(value, dict) else []
    if extra:
        fixed = (
            "binary_accuracy (threshold), sparse_categorical_accuracy, categorical_accuracy, exact_match"
            if resolved == "accuracy"
            else "binary_crossentropy, sparse_categorical_crossentropy, categorical_crossentropy (from_logits)"
        )
        raise recipe.error(
            ("metrics", index, extra[0]),
            f"{name!r} takes no arguments: its kind is resolved from the shapes of labels and predictions (and "
            f"logged as {resolved!r}); to fix the kind or pass arguments, name it: {fixed}",
        )
    return (resolved, {})  # resolved by the trainer from the data's shapes


def _check_plain(recipe: Recipe, section: str, keys: dict) -> dict:
    values = recipe.data.get(section) or {}
    if not isinstance(values, dict):
        raise recipe.error((section,), f"expected a mapping of {', '.join(keys)}, got {type(values).__name__}")
    for name, value in values.items():
        if name not in keys:
            raise recipe.error(
                (section, name), f"unknown {section} argument{did_you_mean(name, keys)}; known: {', '.join(keys)}"
            )
        kind = keys[name]
        if kind == "verbose":
            if value not in (0, 1, 2, "auto") or isinstance(value, bool):
                raise recipe.error((section, name), f"expected 0, 1, 2 or 'auto', got {value!r}")
            continue
        # YAML's types first (a quoted number is a string), then the trainer's own rule.
        problem = type_problem(value, (_YAML_TYPE[kind],), kind == "size")
        if problem:
            raise recipe.error((section, name), problem)
        rule = argument_problem(value, kind)
        if rule is not None:
            raise recipe.error((section, name), f"{rule[1]}, got {value!r}")
        if name == "epochs" and value < 1:  # a recipe is for training: fit(epochs=0) would train nothing
            raise recipe.error((section, name), "must be a positive integer")
    return values


def _check_task(recipe: Recipe, checked: dict) -> None:
    factory, args = checked["data"]
    task = args.get("task") or parameter_default(factory, "task") or _task_of(factory)
    if task not in ("classification", "regression"):
        return
    loss = entry_name(recipe.data.get("loss", "cross_entropy"))
    if task == "regression" and loss in CLASSIFICATION_LOSSES:
        raise recipe.error(
            ("loss",), f"{loss!r} is a classification loss but the data is a regression task (use mse, mae or huber)"
        )
    if task == "classification" and loss in REGRESSION_LOSSES:
        raise recipe.error(
            ("loss",), f"{loss!r} is a regression loss but the data is a classification task (use cross_entropy)"
        )
    for index, metric in enumerate(recipe.data.get("metrics", []) or []):
        name = str(entry_name(metric) or "").lower()
        if task == "regression" and name in CLASSIFICATION_ONLY_METRICS:
            raise recipe.error(("metrics", index), f"{name!r} cannot be computed for a regression task")
        if task == "classification" and name in REGRESSION_ONLY_METRICS:
            raise recipe.error(
                ("metrics", index), f"{name!r} cannot be computed on class labels: the task is classification"
            )


def _task_of(factory):
    return getattr(factory, "task", None)
