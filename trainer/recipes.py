"""YAML recipes: a whole training run in one file, checked before anything runs.

Top-level keys: ``seed``, ``precision``, ``strategy``, ``model``, ``data``, ``optimizer``,
``loss``, ``metrics``, ``callbacks``, ``fit``, ``evaluate``. Every entry is
``{type: registered-name or "package.module:attr", ...constructor arguments}`` (a plain
string for the simple cases: ``optimizer: adam``), mapping one-to-one onto the Python
constructors. ``${VAR}`` and ``${VAR:-default}`` are replaced from the environment when
the file is read (only here, never deeper in the library).

The optimizer entry takes the optimizer's arguments (``use_ema: true``, ``ema_momentum``,
``weight_decay``, ...) and one key that is a method call in Python:
``exclude_from_weight_decay: [bias, norm]`` (``optimizer.exclude_from_weight_decay(var_names=...)``).
With ``use_ema`` the averaged model is the run's result: unless the recipe lists
``swap_ema_weights`` itself, ``SwapEMAWeights(swap_on_epoch=True)`` comes first among the
callbacks, so validation, best checkpoints and early stopping judge and keep the averages.

A bad recipe gives one message naming the file, the line and the key path::

    recipe.yaml:7: optimizer.learning_rat: unknown argument of 'sgd' (did you mean 'learning_rate'?)

A recipe names code to run (``module:attr``), so it is trusted like a script; ``validate``
never calls code outside replicafit (see ``kinds``): it imports what a recipe names, checks
its kind and that the arguments bind, and constructs only replicafit's own built-ins (the
strategy, to check its devices; the data, to check its arguments; a built-in model on the
``meta`` device, to check its sizes). ``build`` calls the rest and checks what each returns.

Example::

    recipe = load("recipes/digits_mlp.yaml", overrides=["fit.epochs=1"])
    run = build(recipe)
    run.trainer.fit(run.model, run.train, **run.fit_kwargs)
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

from . import builtins, kinds  # noqa: F401 - importing builtins registers the built-in names
from .arguments import EVALUATE_ARGUMENTS, FIT_ARGUMENTS, PRECISIONS, argument_problem, resolve_precision
from .recipe_calls import _built, _call, _dataset_info, _model_inputs, _named, _type_at
from .recipe_entries import _default, _entry_name, _parameters, _type_problem, check_entry
from .recipe_loader import RecipeError
from .recipe_monitors import _check_monitors
from .recipe_source import SECTIONS, Recipe, _short, describe, load, locate, shipped
from .registry import did_you_mean

__all__ = ["RecipeError", "Recipe", "load", "locate", "shipped", "describe", "validate", "build", "Run", "SECTIONS"]

# The trainer's arguments, as the trainer checks them (arguments.py), and fit's verbose.
FIT_KEYS = {**FIT_ARGUMENTS, "verbose": "verbose"}
EVALUATE_KEYS = EVALUATE_ARGUMENTS
_YAML_TYPE = {"count": int, "size": int, "fraction": float, "flag": bool}
MAX_SEED = 2**64 - 1  # torch.manual_seed takes up to this; NumPy's seeds (the data order) must not be negative


# --- the whole recipe ---------------------------------------------------------------------------

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
        checked["strategy_instance"] = _call(recipe, ("strategy",), *checked["strategy"], ours=True)
    data_entry = data["data"]
    batch_keys = {}
    if isinstance(data_entry, dict):
        batch_keys = {k: data_entry[k] for k in ("batch_size",) if k in data_entry}
        data_entry = {k: v for k, v in data_entry.items() if k not in batch_keys}
    checked["data"] = check_entry(recipe, ("data",), data_entry, "dataset")
    if kinds.is_builtin("dataset", checked["data"][0]):  # loads now: bad values fail here
        checked["data_instance"] = _dataset_info(recipe, _call(recipe, ("data",), *checked["data"], ours=True))
    for name, value in batch_keys.items():
        problem = _type_problem(value, (int,), False)
        if problem or value < 1:
            raise recipe.error(("data", name), problem or "must be a positive integer")
    checked["data_batch"] = batch_keys
    checked["model"] = check_entry(
        recipe, ("model",), data["model"], "model", provided=("inputs", "outputs", "in_channels")
    )
    if kinds.is_builtin("model", checked["model"][0]):
        _check_builtin_model(recipe, checked)
    optimizer = data.get("optimizer", "adam")
    optimizer, checked["decay_exclusions"] = _decay_exclusions(recipe, optimizer)
    checked["optimizer"] = check_entry(recipe, ("optimizer",), optimizer, "optimizer")
    rate = optimizer.get("learning_rate") if isinstance(optimizer, dict) else None
    if isinstance(rate, dict):
        checked["schedule"] = check_entry(recipe, ("optimizer", "learning_rate"), rate, "schedule")
    elif kinds.is_builtin("optimizer", checked["optimizer"][0]):  # bad values (accumulation steps, ...) fail now
        _call(recipe, ("optimizer",), *checked["optimizer"], ours=True)
    checked["loss"] = check_entry(recipe, ("loss",), data.get("loss", "cross_entropy"), "loss")
    metrics = data.get("metrics", [])
    if not isinstance(metrics, list):
        raise recipe.error(("metrics",), f"expected a list of metrics, got {type(metrics).__name__}")
    checked["metrics"] = [_check_metric(recipe, i, m) for i, m in enumerate(metrics)]
    callbacks = data.get("callbacks", [])
    if not isinstance(callbacks, list):
        raise recipe.error(("callbacks",), f"expected a list of callbacks, got {type(callbacks).__name__}")
    checked["callbacks"] = [check_entry(recipe, ("callbacks", i), c, "callback") for i, c in enumerate(callbacks)]
    checked["fit"] = _check_plain(recipe, "fit", FIT_KEYS)
    checked["evaluate"] = _check_plain(recipe, "evaluate", EVALUATE_KEYS)
    if "batch_size" in batch_keys and "batch_size" in checked["fit"]:
        raise recipe.error(("fit", "batch_size"), "batch_size is set in data too: set it in one place")
    _check_task(recipe, checked)
    _check_monitors(recipe, checked)
    return checked


def _check_precision(recipe: Recipe, precision) -> None:
    if resolve_precision(precision) is None:
        hint = did_you_mean(str(precision), PRECISIONS)
        raise recipe.error(("precision",), f"expected one of {', '.join(PRECISIONS)}{hint}, got {_short(precision)}")


def _check_seed(recipe: Recipe, seed) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise recipe.error(("seed",), f"expected an integer, got {type(seed).__name__} {_short(seed)}")
    if not 0 <= seed <= MAX_SEED:
        raise recipe.error(("seed",), f"must be in [0, 2**64 - 1] (what torch.manual_seed takes), got {seed}")


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
    extra = _model_inputs(factory, args, info)
    params, _ = _parameters(factory)
    for name in ("inputs", "outputs"):  # the data is not known yet: any valid size stands in
        if name in params and name not in args and name not in extra:
            extra[name] = 1
    with torch.device("meta"):
        _call(recipe, ("model",), factory, args, ours=True, **extra)


def _check_metric(recipe, index, value):
    if isinstance(value, str) and value.lower() in ("accuracy", "acc"):
        return ("accuracy", {})  # resolved by the trainer from the data's shapes
    if isinstance(value, str) and value.lower() in ("crossentropy", "ce"):
        return ("crossentropy", {})
    return check_entry(recipe, ("metrics", index), value, "metric")


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
        problem = _type_problem(value, (_YAML_TYPE[kind],), kind == "size")
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
    task = args.get("task") or _default(factory, "task") or _task_of(factory)
    if task not in ("classification", "regression"):
        return
    loss = _entry_name(recipe.data.get("loss", "cross_entropy"))
    if task == "regression" and loss in CLASSIFICATION_LOSSES:
        raise recipe.error(
            ("loss",), f"{loss!r} is a classification loss but the data is a regression task (use mse, mae or huber)"
        )
    if task == "classification" and loss in REGRESSION_LOSSES:
        raise recipe.error(
            ("loss",), f"{loss!r} is a regression loss but the data is a classification task (use cross_entropy)"
        )
    for index, metric in enumerate(recipe.data.get("metrics", []) or []):
        name = str(_entry_name(metric) or "").lower()
        if task == "regression" and name in CLASSIFICATION_ONLY_METRICS:
            raise recipe.error(("metrics", index), f"{name!r} cannot be computed for a regression task")
        if task == "classification" and name in REGRESSION_ONLY_METRICS:
            raise recipe.error(
                ("metrics", index), f"{name!r} cannot be computed on class labels: the task is classification"
            )


def _task_of(factory):
    return getattr(factory, "task", None)


# --- building -----------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything a recipe builds."""

    recipe: Recipe
    strategy: object
    model: object
    info: dict
    trainer: object
    callbacks: list
    fit_kwargs: dict
    evaluate_kwargs: dict

    @property
    def train(self):
        return self.info["train"]

    @property
    def validation(self):
        return self.info.get("validation")


TENSORBOARD_DIR = "tensorboard"


def build(recipe: Recipe, checked: dict | None = None, run_dir=None) -> Run:
    """Validates (unless given the result) and constructs the strategy, data, model, trainer and callbacks.

    This calls the code the recipe names, and refuses what a factory returns unless it is of its
    section's kind (see ``kinds``). With ``run_dir``, a callback whose ``log_dir`` the recipe leaves
    out (``{type: tensorboard}``) logs into ``run_dir/tensorboard``.
    """
    import torch

    from .callbacks import SwapEMAWeights
    from .trainer import Trainer

    checked = checked or validate(recipe)
    data = recipe.data
    seed = data.get("seed")
    strategy = checked.get("strategy_instance")
    if strategy is None:
        strategy = _built(recipe, ("strategy",), "strategy", *checked["strategy"])
    info = checked.get("data_instance")
    if info is None:
        info = _dataset_info(recipe, _built(recipe, ("data",), "dataset", *checked["data"]))
    model_factory, model_args = checked["model"]
    extra = _model_inputs(model_factory, model_args, info)
    _check_model_inputs(recipe, model_factory, model_args, extra)
    if seed is not None:
        torch.manual_seed(seed)
    model = _built(recipe, ("model",), "model", model_factory, model_args, **extra)
    with strategy.scope():
        optimizer_factory, optimizer_args = checked["optimizer"]
        if "schedule" in checked:
            schedule = _built(recipe, ("optimizer", "learning_rate"), "schedule", *checked["schedule"])
            optimizer_args = dict(optimizer_args, learning_rate=schedule)
        optimizer = _built(recipe, ("optimizer",), "optimizer", optimizer_factory, optimizer_args)
        if checked["decay_exclusions"]:
            optimizer.exclude_from_weight_decay(var_names=checked["decay_exclusions"])
    loss = _built(recipe, ("loss",), "loss", *checked["loss"])
    metric_names = [_entry_name(m) for m in data.get("metrics", []) or []]
    metrics = [
        factory
        if factory in ("accuracy", "crossentropy")
        else _built(recipe, ("metrics", i), "metric", factory, _named(args, factory, metric_names[i]))
        for i, (factory, args) in enumerate(checked["metrics"])
    ]
    callbacks = [
        _built(recipe, ("callbacks", i), "callback", f, _in_run_dir(f, a, run_dir))
        for i, (f, a) in enumerate(checked["callbacks"])
    ]
    if getattr(optimizer, "use_ema", False) and not any(isinstance(c, SwapEMAWeights) for c in callbacks):
        # With use_ema the averaged model is the result: validation, best checkpoints and early stopping
        # judge (and keep) the averages. A recipe that lists swap_ema_weights itself decides.
        callbacks.insert(0, SwapEMAWeights(swap_on_epoch=True))
    precision = str(data.get("precision", "32"))
    trainer = Trainer(
        strategy=strategy, optimizer=optimizer, loss=loss, metrics=metrics, seed=seed, precision=precision
    )
    fit_kwargs = dict(checked["fit"])
    fit_kwargs.update(checked["data_batch"])
    _check_training_data(recipe, info, fit_kwargs, checked["data_batch"])
    if info.get("validation") is not None and "validation_split" not in fit_kwargs:
        fit_kwargs["validation_data"] = info["validation"]
    return Run(recipe, strategy, model, info, trainer, callbacks, fit_kwargs, dict(checked["evaluate"]))


def _check_model_inputs(recipe: Recipe, factory, args: dict, extra: dict) -> None:
    """A model size the recipe leaves out and the data does not give: refused here, with the fix."""
    params, _ = _parameters(factory)
    for name, entry in (("inputs", "inputs"), ("outputs", "classes")):
        param = params.get(name)
        if param is None or param.default is not inspect.Parameter.empty or name in args or name in extra:
            continue
        raise recipe.error(
            ("model",),
            f"the model needs {name!r} and the data does not tell it: write `{name}: N` in the model section "
            f"(or have the dataset factory return {{'train': ..., '{entry}': N}})",
        )


def _check_training_data(recipe: Recipe, info: dict, fit_kwargs: dict, data_batch: dict) -> None:
    """What ``fit`` would refuse mid-call about the data's form and the batch size, refused now at its key."""
    from .datasets import training_data_form

    form = training_data_form(info["train"])
    batch_key = ("data", "batch_size") if "batch_size" in data_batch else ("fit", "batch_size")
    type_key, type_name = _type_at(recipe, ("data",))
    if form == "dataset" and fit_kwargs.get("batch_size") is None:
        raise recipe.error(
            type_key,
            f"{type_name!r} gives a torch Dataset of single examples: set data.batch_size (or fit.batch_size) "
            "to cut it into batches",
        )
    if form == "batches" and fit_kwargs.get("batch_size") is not None:
        raise recipe.error(
            batch_key,
            f"{type_name!r} gives batches already (a DataLoader or another iterable of batches): remove "
            "batch_size here and set it where the batches are made",
        )
    if form == "batches" and fit_kwargs.get("validation_split"):
        raise recipe.error(
            ("fit", "validation_split"),
            f"validation_split needs arrays or a torch Dataset, and {type_name!r} gives batches: have the "
            "dataset factory return {'train': ..., 'validation': ...} instead",
        )


def _in_run_dir(factory, args: dict, run_dir) -> dict:
    if run_dir is not None and "log_dir" in _parameters(factory)[0] and "log_dir" not in args:
        return dict(args, log_dir=os.path.join(run_dir, TENSORBOARD_DIR))
    return args
