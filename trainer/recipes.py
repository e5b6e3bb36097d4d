"""YAML recipes: a whole training run in one file, checked before anything runs.

Top-level keys: ``seed``, ``strategy``, ``model``, ``data``, ``optimizer``, ``loss``,
``metrics``, ``callbacks``, ``fit``, ``evaluate``. Every entry is
``{type: registered-name or "package.module:attr", ...constructor arguments}`` (a plain
string for the simple cases: ``optimizer: adam``), mapping one-to-one onto the Python
constructors. ``${VAR}`` and ``${VAR:-default}`` are replaced from the environment when
the file is read (only here, never deeper in the library).

A bad recipe gives one message naming the file, the line and the key path::

    recipe.yaml:7: optimizer.learning_rat: unknown argument of 'sgd' (did you mean 'learning_rate'?)

Example::

    recipe = load("recipes/digits_mlp.yaml", overrides=["fit.epochs=1"])
    run = build(recipe)
    run.trainer.fit(run.model, run.train, **run.fit_kwargs)
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, field

import yaml

from . import builtins  # noqa: F401 - registers the built-in names
from .registry import did_you_mean, resolve

__all__ = ["RecipeError", "Recipe", "load", "locate", "shipped", "describe", "validate", "build", "Run", "SECTIONS"]

SECTIONS = ("seed", "strategy", "model", "data", "optimizer", "loss", "metrics", "callbacks", "fit", "evaluate")
FIT_KEYS = {
    "epochs": int,
    "batch_size": int,
    "validation_split": float,
    "steps_per_epoch": int,
    "initial_epoch": int,
    "shuffle": bool,
    "verbose": "verbose",
}
EVALUATE_KEYS = {"batch_size": int, "steps": int}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RecipeError(Exception):
    """A recipe problem: ``file:line: key.path: what is wrong``."""

    def __init__(self, file: str, line, key: str, message: str):
        self.file, self.line, self.key, self.message = file, line, key, message
        location = f"{file}:{line}" if line else file
        super().__init__(f"{location}: {key}: {message}" if key else f"{location}: {message}")


@dataclass
class Recipe:
    """A loaded recipe: its data, where each key path sits in the file, and its source path."""

    path: str
    data: dict
    lines: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]

    def error(self, key: tuple, message: str) -> RecipeError:
        return RecipeError(self.path, self.line(key), format_key(key), message)

    def line(self, key: tuple):
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:-1]
        return None


def format_key(key: tuple) -> str:
    out = ""
    for part in key:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# --- reading -----------------------------------------------------------------------------------


def _interpolate(text: str, path: str) -> str:
    def replace(match, line_number):
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is None:
            if default is None:
                raise RecipeError(
                    path,
                    line_number,
                    "",
                    f"environment variable ${{{name}}} is not set (write ${{{name}:-default}} to give a default)",
                )
            value = default
        return value

    out = []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        cut = _comment_start(line)
        out.append(_ENV.sub(lambda m, n=number: replace(m, n), line[:cut]) + line[cut:])
    return "".join(out)


def _comment_start(line: str) -> int:
    """Where a YAML comment starts on ``line`` (``#`` at the start or after a space, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1] in " \t"):
            return index
    return len(line)


def _record_lines(node, key: tuple, lines: dict) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = key + (key_node.value,)
            lines[child] = key_node.start_mark.line + 1
            _record_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = key + (index,)
            lines[child] = item.start_mark.line + 1
            _record_lines(item, child, lines)


def _parse_override(text: str, path: str):
    if "=" not in text:
        raise RecipeError(path, None, "--set", f"{text!r} is not key.path=value")
    key, _, raw = text.partition("=")
    parts = []
    for part in key.strip().split("."):
        if not part:
            raise RecipeError(path, None, "--set", f"{key!r} is not a key path (write e.g. fit.epochs=3)")
        parts.append(int(part) if part.isdigit() else part)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise RecipeError(path, None, "--set " + key, f"cannot parse the value {raw!r}: {error}") from None
    return tuple(parts), value


def _apply_override(data: dict, key: tuple, value, path: str) -> None:
    target = data
    for depth, part in enumerate(key[:-1]):
        nxt = target[part] if isinstance(target, (dict, list)) and _has(target, part) else None
        if nxt is None:
            if isinstance(target, dict):
                nxt = target[part] = {}
            else:
                raise RecipeError(path, None, format_key(key[: depth + 1]), "--set cannot create an item of a list")
        if isinstance(nxt, str) and isinstance(key[depth + 1], str):  # `optimizer: adam` -> {type: adam}
            nxt = target[part] = {"type": nxt}
        target = nxt
    last = key[-1]
    if isinstance(target, list) and (not isinstance(last, int) or last >= len(target)):
        raise RecipeError(path, None, format_key(key), f"--set: no item {last} in that list")
    target[last] = value


def _has(container, part) -> bool:
    if isinstance(container, dict):
        return part in container
    return isinstance(part, int) and part < len(container)


def shipped() -> dict:
    """``{name: path}`` of the recipes that ship with replicafit (the ``replicafit.recipes`` package)."""
    from importlib import resources

    folder = resources.files("replicafit.recipes")
    found = {
        entry.name[: -len(".yaml")]: os.fspath(entry) for entry in folder.iterdir() if entry.name.endswith(".yaml")
    }
    return dict(sorted(found.items()))


def describe(path) -> str:
    """A recipe's one-line description: the text of its first comment line."""
    with open(path) as file:
        for line in file:
            if line.startswith("#"):
                return line.lstrip("#").strip()
            if line.strip():
                break
    return ""


def locate(name_or_path) -> str:
    """The file a recipe argument means: an existing path as given, else a shipped recipe's name.

    ``"recipes/digits_mlp.yaml"`` is a path; ``"digits_mlp"`` (or ``"digits_mlp.yaml"``, with no
    directory) names the shipped recipe wherever replicafit is installed. Anything else is a
    ``RecipeError`` that lists the shipped names.
    """
    path = os.fspath(name_or_path)
    if os.path.exists(path) or os.path.dirname(path):
        return path
    stem, extension = os.path.splitext(path)
    name = stem if extension in (".yaml", ".yml") else path
    recipes = shipped()
    if name in recipes:
        return recipes[name]
    raise RecipeError(
        path,
        None,
        "",
        f"no such recipe file, and no shipped recipe of that name{did_you_mean(name, recipes)}; "
        f"shipped recipes: {', '.join(recipes)} (`replicafit list recipes`)",
    )


def load(path, overrides=()) -> Recipe:
    """Reads a recipe: environment interpolation, YAML (``safe_load``), then ``--set`` overrides.

    ``path`` is a file, or the name of a shipped recipe (``"digits_mlp"``, see ``locate``).
    """
    path = locate(path)
    try:
        with open(path) as file:
            text = file.read()
    except OSError as error:
        raise RecipeError(path, None, "", f"cannot read the recipe ({error.strerror})") from None
    text = _interpolate(text, path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise RecipeError(where, None, "", f"YAML syntax error: {error.problem or error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            path, 1, "", f"a recipe is a mapping of sections ({', '.join(SECTIONS)}), not a {type(data).__name__}"
        )
    lines: dict = {}
    if root is not None:
        _record_lines(root, (), lines)
    for override in overrides:
        key, value = _parse_override(override, path)
        _apply_override(data, key, value, path)
    return Recipe(path, data, lines)


# --- checking arguments against constructors ------------------------------------------------------

_SIMPLE_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "tuple": list, "dict": dict}


def _parameters(factory) -> tuple:
    """``(parameters by name, accepts **kwargs)`` of a function or class, following ``**kwargs`` to bases."""
    params: dict = {}
    target = factory.__init__ if inspect.isclass(factory) else factory
    classes = inspect.getmro(factory) if inspect.isclass(factory) else ()
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return {}, True
    var_keyword = False
    for name, param in signature.parameters.items():
        if name == "self" or param.kind is param.VAR_POSITIONAL:
            continue
        if param.kind is param.VAR_KEYWORD:
            var_keyword = True
            continue
        params[name] = param
    if var_keyword and classes:  # e.g. SGD(**kwargs) -> Optimizer.__init__
        for base in classes[1:]:
            if "__init__" in vars(base) and base is not object:
                more, still_open = _parameters(base)
                for name, param in more.items():
                    params.setdefault(name, param)
                if not still_open:
                    return params, False
    return params, var_keyword


def _expected(param) -> tuple:
    """The Python types a parameter accepts, from its annotation or default (empty: anything)."""
    annotation = param.annotation
    names = []
    if isinstance(annotation, str):
        names = [part.strip() for part in annotation.split("|")]
    elif isinstance(annotation, type):
        names = [annotation.__name__]
    allow_none = "None" in names or param.default is None
    types = [_SIMPLE_TYPES[n] for n in names if n in _SIMPLE_TYPES]
    if not types and param.default not in (inspect.Parameter.empty, None):
        default = param.default
        types = [list if isinstance(default, (list, tuple)) else type(default)]
        if types[0] not in _SIMPLE_TYPES.values():
            types = []
    return tuple(types), allow_none


def _type_problem(value, types: tuple, allow_none: bool):
    if value is None:
        return None if allow_none or not types else "must not be null"
    if not types:
        return None
    if isinstance(value, bool):
        return None if bool in types else f"expected {_names(types)}, got the boolean {value}"
    if isinstance(value, int) and (int in types or float in types):
        return None
    if isinstance(value, float) and float in types:
        return None
    if isinstance(value, str) and str not in types and (int in types or float in types):
        return f"expected a number, got the string {value!r} (strings are not converted to numbers: write it unquoted)"
    if isinstance(value, (list, tuple)) and list in types:
        return None
    if isinstance(value, dict) and dict in types:
        return None
    if isinstance(value, str) and str in types:
        return None
    return f"expected {_names(types)}, got {type(value).__name__} {value!r}"


def _names(types) -> str:
    words = {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return " or ".join(words.get(t, t.__name__) for t in types)


def check_entry(recipe: Recipe, key: tuple, value, kind: str, provided=()):
    """Validates ``{type: name, ...args}`` (or a name) of registry ``kind``; returns ``(factory, args)``.

    ``provided``: arguments the runner fills in itself (e.g. a model's ``inputs``).
    """
    if isinstance(value, str):
        type_name, args = value, {}
    elif isinstance(value, dict):
        if "type" not in value:
            raise recipe.error(
                key, f"missing 'type': name a registered {kind} (`replicafit list {kind}`) or 'package.module:attr'"
            )
        type_name, args = value["type"], {k: v for k, v in value.items() if k != "type"}
        if not isinstance(type_name, str):
            raise recipe.error(key + ("type",), f"expected a string, got {type(type_name).__name__} {type_name!r}")
    else:
        raise recipe.error(
            key, f"expected a {kind} name or a mapping with 'type', got {type(value).__name__} {value!r}"
        )
    type_key = key + ("type",) if isinstance(value, dict) else key
    try:
        factory = resolve(kind, type_name)
    except KeyError as error:
        raise recipe.error(type_key, str(error.args[0])) from None
    except (ImportError, AttributeError, ValueError) as error:
        raise recipe.error(type_key, f"cannot import {type_name!r}: {error}") from None
    if not callable(factory):
        raise recipe.error(type_key, f"{type_name!r} is not callable")
    params, open_kwargs = _parameters(factory)
    for name, arg in args.items():
        if name not in params:
            if open_kwargs:
                continue
            raise recipe.error(key + (name,), f"unknown argument of {type_name!r}{did_you_mean(name, params)}")
        if isinstance(arg, dict) and "type" in arg and name == "learning_rate":
            continue  # a schedule: checked by the caller
        types, allow_none = _expected(params[name])
        problem = _type_problem(arg, types, allow_none)
        if problem:
            raise recipe.error(key + (name,), problem)
    for name, param in params.items():
        if param.default is inspect.Parameter.empty and name not in args and name not in provided:
            raise recipe.error(key, f"missing required argument {name!r} of {type_name!r}")
    return factory, args


# --- the whole recipe ---------------------------------------------------------------------------

CLASSIFICATION_ONLY_METRICS = {
    "accuracy",
    "acc",
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


def _entry_name(value):
    return value if isinstance(value, str) else value.get("type") if isinstance(value, dict) else None


def validate(recipe: Recipe) -> dict:
    """Checks everything that can be checked without training; returns the factories and args.

    Raises ``RecipeError`` for the first problem found.
    """
    data = recipe.data
    for key in data:
        if key not in SECTIONS:
            raise recipe.error((key,), f"unknown section{did_you_mean(key, SECTIONS)}; sections: {', '.join(SECTIONS)}")
    for required in ("model", "data"):
        if required not in data:
            raise recipe.error((), f"missing section {required!r}")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise recipe.error(("seed",), f"expected an integer, got {type(seed).__name__} {seed!r}")
    checked: dict = {}
    checked["strategy"] = check_entry(recipe, ("strategy",), data.get("strategy", "default"), "strategy")
    checked["strategy_instance"] = _make_strategy(recipe, *checked["strategy"])
    data_entry = data["data"]
    batch_keys = {}
    if isinstance(data_entry, dict):
        batch_keys = {k: data_entry[k] for k in ("batch_size",) if k in data_entry}
        data_entry = {k: v for k, v in data_entry.items() if k not in batch_keys}
    checked["data"] = check_entry(recipe, ("data",), data_entry, "dataset")
    checked["data_instance"] = _call(recipe, ("data",), *checked["data"])  # loads now: bad values fail here
    if not isinstance(checked["data_instance"], dict) or "train" not in checked["data_instance"]:
        raise recipe.error(("data",), "a dataset factory must return a dict with a 'train' entry")
    for name, value in batch_keys.items():
        problem = _type_problem(value, (int,), False)
        if problem or value < 1:
            raise recipe.error(("data", name), problem or "must be a positive integer")
    checked["data_batch"] = batch_keys
    checked["model"] = check_entry(
        recipe, ("model",), data["model"], "model", provided=("inputs", "outputs", "in_channels")
    )
    optimizer = data.get("optimizer", "adam")
    checked["optimizer"] = check_entry(recipe, ("optimizer",), optimizer, "optimizer")
    rate = optimizer.get("learning_rate") if isinstance(optimizer, dict) else None
    if isinstance(rate, dict):
        checked["schedule"] = check_entry(recipe, ("optimizer", "learning_rate"), rate, "schedule")
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
    return checked


def _make_strategy(recipe: Recipe, factory, args):
    """Builds the strategy now: devices that do not exist are a recipe error, before anything runs."""
    try:
        return factory(**args)
    except (ValueError, TypeError, RuntimeError) as error:
        raise recipe.error(_blame(("strategy",), args, str(error)), str(error).splitlines()[0]) from None


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
        if re.search(rf"\b{re.escape(name)}\b", message):
            return key + (name,)
    return key


def _check_metric(recipe, index, value):
    if isinstance(value, str) and value.lower() in ("accuracy", "acc"):
        return ("accuracy", {})
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
        expected = keys[name]
        if expected == "verbose":
            if value not in (0, 1, 2, "auto") or isinstance(value, bool):
                raise recipe.error((section, name), f"expected 0, 1, 2 or 'auto', got {value!r}")
            continue
        problem = _type_problem(value, (expected,), name == "steps_per_epoch")
        if problem:
            raise recipe.error((section, name), problem)
        if expected is int and value is not None and value < (0 if name == "initial_epoch" else 1):
            raise recipe.error((section, name), "must be a positive integer")
        if name == "validation_split" and not 0 <= value < 1:
            raise recipe.error((section, name), f"must be in [0, 1), got {value}")
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


def _default(factory, name):
    params, _ = _parameters(factory)
    param = params.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


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


def _call(recipe, key, factory, args, **extra):
    try:
        return factory(**args, **extra)
    except (ValueError, TypeError, RuntimeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise recipe.error(_blame(key, args, message), message) from None


TENSORBOARD_DIR = "tensorboard"


def build(recipe: Recipe, checked: dict | None = None, run_dir=None) -> Run:
    """Validates (unless given the result) and constructs the strategy, data, model, trainer and callbacks.

    With ``run_dir``, a callback whose ``log_dir`` the recipe leaves out (``{type: tensorboard}``)
    logs into ``run_dir/tensorboard``.
    """
    import torch

    from .trainer import Trainer

    checked = checked or validate(recipe)
    data = recipe.data
    seed = data.get("seed")
    strategy = checked["strategy_instance"]
    info = checked["data_instance"]
    model_factory, model_args = checked["model"]
    params, _ = _parameters(model_factory)
    extra = {}
    if "inputs" in params and "inputs" not in model_args and info.get("inputs"):
        extra["inputs"] = info["inputs"]
    if "outputs" in params and "outputs" not in model_args:
        outputs = info.get("classes") or _target_width(info)
        if outputs:
            extra["outputs"] = outputs
    if seed is not None:
        torch.manual_seed(seed)
    model = _call(recipe, ("model",), model_factory, model_args, **extra)
    with_strategy = strategy.scope()
    with with_strategy:
        optimizer_factory, optimizer_args = checked["optimizer"]
        if "schedule" in checked:
            optimizer_args = dict(
                optimizer_args, learning_rate=_call(recipe, ("optimizer", "learning_rate"), *checked["schedule"])
            )
        optimizer = _call(recipe, ("optimizer",), optimizer_factory, optimizer_args)
    loss = _call(recipe, ("loss",), *checked["loss"])
    metric_names = [_entry_name(m) for m in data.get("metrics", []) or []]
    metrics = [
        name if name == "accuracy" else _call(recipe, ("metrics", i), name, _named(args, name, metric_names[i]))
        for i, (name, args) in enumerate(checked["metrics"])
    ]
    callbacks = [
        _call(recipe, ("callbacks", i), f, _in_run_dir(f, a, run_dir)) for i, (f, a) in enumerate(checked["callbacks"])
    ]
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss=loss, metrics=metrics, seed=seed)
    fit_kwargs = dict(checked["fit"])
    fit_kwargs.update(checked["data_batch"])
    if info.get("validation") is not None and "validation_split" not in fit_kwargs:
        fit_kwargs["validation_data"] = info["validation"]
    return Run(recipe, strategy, model, info, trainer, callbacks, fit_kwargs, dict(checked["evaluate"]))


def _in_run_dir(factory, args: dict, run_dir) -> dict:
    if run_dir is not None and "log_dir" in _parameters(factory)[0] and "log_dir" not in args:
        return dict(args, log_dir=os.path.join(run_dir, TENSORBOARD_DIR))
    return args


def _named(args: dict, factory, name) -> dict:
    """Logs use the name the recipe wrote (``mae``), as ``Trainer(metrics=["mae"])`` does."""
    params, _ = _parameters(factory)
    if "name" in params and "name" not in args and isinstance(name, str):
        return dict(args, name=name)
    return args


def _target_width(info):
    train = info["train"]
    if isinstance(train, tuple) and len(train) >= 2 and getattr(train[1], "ndim", 1) == 2:
        return int(train[1].shape[1])
    return None
