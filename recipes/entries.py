"""One recipe entry checked against its factory's signature, calling nothing.

``check_entry`` takes ``{type: name, ...args}`` (or a plain name), resolves the name (a registered one, or
``package.module:attr``, imported), checks the factory's kind (``kinds``) and that every argument binds its
signature with a value of the type its annotation or default says. Each problem is a ``RecipeError`` at the
entry's key, or the argument's.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap

from replicafit.trainer.callbacks import Callback
from replicafit.trainer.spelling import did_you_mean

from . import kinds
from .registry import REGISTRIES, resolve
from .source import Recipe, short_repr

__all__ = ["check_entry", "factory_parameters", "parameter_default", "type_problem", "first_line", "entry_name"]

_SIMPLE_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "tuple": list, "dict": dict}


#: The default ``factory_parameters`` gives a base class's required argument reached through a subclass's
#: ``**kwargs`` that the subclass passes itself: a recipe need not.
class SUPPLIED_BY_SUBCLASS:  # a marker (named as inspect.Parameter.empty is a class of its own)
    """The marker ``factory_parameters`` puts as such an argument's default."""


def factory_parameters(factory) -> tuple:
    """``(parameters by name, accepts **kwargs)`` of a function or class, following ``**kwargs`` to bases.

    A class's ``self`` and ``*args`` are left out; a class whose ``**kwargs`` go elsewhere
    (``forwards_kwargs``: ``TorchLRScheduler``'s go to the scheduler) keeps them open.

    Example::

        >>> from replicafit.optimizers import SGD
        >>> params, open_kwargs = factory_parameters(SGD)  # SGD(**kwargs) passes them on to Optimizer
        >>> "momentum" in params, "weight_decay" in params, open_kwargs
        (True, True, False)
    """
    params: dict = {}
    target = factory.__init__ if inspect.isclass(factory) else factory
    classes = inspect.getmro(factory) if inspect.isclass(factory) else ()
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return {}, True
    var_keyword = False
    if inspect.isclass(factory) and issubclass(factory, Callback) and factory.forwards_kwargs:  # TorchLRScheduler
        return {n: p for n, p in signature.parameters.items() if n != "self" and p.kind is not p.VAR_KEYWORD}, True
    for name, param in signature.parameters.items():
        if name == "self" or param.kind is param.VAR_POSITIONAL:
            continue
        if param.kind is param.VAR_KEYWORD:
            var_keyword = True
            continue
        params[name] = param
    if var_keyword and classes:  # e.g. SGD(**kwargs) -> Optimizer.__init__
        passed = _passed_up(factory)
        for base in classes[1:]:
            if "__init__" in vars(base) and base is not object:
                more, still_open = factory_parameters(base)
                for name, param in more.items():
                    # A base's required argument that the subclass passes itself (torchmetrics' MulticlassF1Score
                    # passes beta=1.0 to MulticlassFBetaScore) is not required of the recipe.
                    if param.default is inspect.Parameter.empty and (passed is None or name in passed):
                        param = param.replace(default=SUPPLIED_BY_SUBCLASS)
                    params.setdefault(name, param)
                if not still_open:
                    return params, False
    return params, var_keyword


def _passed_up(cls) -> set | None:
    """The keyword arguments ``cls.__init__`` passes by name to an ``__init__`` above it (``super().__init__(beta=1.0,
    **kwargs)``), read from its source; None where the source cannot be read (then any may be)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return None
    return {
        keyword.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"
        for keyword in node.keywords
        if keyword.arg is not None
    }


def parameter_default(factory, name):
    """The default value of ``factory``'s parameter ``name``; None where it has none, or no such parameter.

    Example::

        >>> from replicafit.trainer import EarlyStopping
        >>> parameter_default(EarlyStopping, "monitor")
        'val_loss'
    """
    params, _ = factory_parameters(factory)
    param = params.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def _expected(param) -> tuple:
    """``(types, allow_none, item_type)`` a parameter accepts, from its annotation or default (no types:
    anything). ``item_type`` is the type of a list's items (``list[int]``), or None."""
    annotation = param.annotation
    names = []
    if isinstance(annotation, str):
        names = [part.strip() for part in annotation.split("|")]
    elif isinstance(annotation, type):
        names = [annotation.__name__]
    allow_none = "None" in names or param.default is None
    types, item_type = [], None
    for name in names:
        generic = re.fullmatch(r"(list|tuple)\[\s*(\w+)\s*(?:,\s*\.\.\.\s*)?\]", name)
        if generic:
            types.append(list)
            item_type = _SIMPLE_TYPES.get(generic.group(2))
        elif name in _SIMPLE_TYPES:
            types.append(_SIMPLE_TYPES[name])
    if not types and param.default not in (inspect.Parameter.empty, None):
        default = param.default
        types = [list if isinstance(default, (list, tuple)) else type(default)]
        if types[0] not in _SIMPLE_TYPES.values():
            types = []
    return tuple(types), allow_none, item_type


def type_problem(value, types: tuple, allow_none: bool):
    """What is wrong with ``value`` where a parameter takes ``types`` (empty: anything), or None.

    ``allow_none``: whether null is a value there. A boolean is no number, a string is never converted
    to one (YAML reads ``"3"`` as a string), an integer is a float, a tuple a list, and NaN is refused.

    Example::

        >>> type_problem(3, (float,), False) is None
        True
        >>> type_problem(True, (int,), False)
        'expected an integer, got the boolean True'
    """
    if value is None:
        return None if allow_none or not types else "must not be null"
    if isinstance(value, float) and math.isnan(value):
        return "NaN is not a usable value: write a number"
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
    return f"expected {_names(types)}, got {type(value).__name__} {short_repr(value)}"


def first_line(error: BaseException, limit: int = 400) -> str:
    """The first line of an error's message, cut to ``limit`` characters (a message may quote a huge value).

    Example::

        >>> first_line(ValueError("x" * 500), limit=10)
        'xxxxxxx...'
    """
    text = str(error)
    line = text.splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _argument_problem(name, value, param):
    """What is wrong with the value of argument ``name`` (None if nothing): its type, NaN, a learning rate
    that is infinite or negative. Returns ``(key suffix, message)``."""
    types, allow_none, item_type = _expected(param)
    problem = type_problem(value, types, allow_none)
    if problem:
        return (), problem
    if item_type is not None and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = type_problem(item, (item_type,), False)
            if problem:
                return (index,), problem
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if str(name).endswith("learning_rate") and is_number and not (math.isfinite(value) and value >= 0):
        return (), f"a learning rate must be a finite number >= 0, got {value!r}"
    return None


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

    Imports a ``module:attr`` and checks its kind (``kinds.factory_problem``) and that ``args`` bind
    its signature; calls nothing. ``provided``: arguments the runner fills in itself (a model's ``inputs``).
    """
    type_name, args = _type_and_args(recipe, key, value, kind)
    type_key = key + ("type",) if isinstance(value, dict) else key
    factory = _resolve(recipe, type_key, kind, type_name)
    if type_name not in REGISTRIES[kind]:  # registering a name declares its kind
        problem = kinds.factory_problem(kind, factory)
        if problem:
            spec = kinds.kind(kind)
            raise recipe.error(type_key, f"{type_name!r} is not {spec.noun} (expected {spec.expected}): {problem}")
    elif not callable(factory):
        raise recipe.error(type_key, f"{type_name!r} is not callable")
    params, open_kwargs = factory_parameters(factory)
    for name, arg in args.items():
        if name not in params:
            if open_kwargs and isinstance(name, str):
                continue
            raise recipe.error(key + (name,), f"unknown argument of {type_name!r}{did_you_mean(name, params)}")
        if params[name].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise recipe.error(key + (name,), f"positional-only in {type_name!r}: a recipe passes arguments by name")
        if isinstance(arg, dict) and "type" in arg and name == "learning_rate":
            continue  # a schedule: checked by the caller
        problem = _argument_problem(name, arg, params[name])
        if problem:
            raise recipe.error(key + (name, *problem[0]), problem[1])
    for name, param in params.items():
        if param.default is inspect.Parameter.empty and name not in args and name not in provided:
            if param.kind is inspect.Parameter.POSITIONAL_ONLY:
                raise recipe.error(
                    key, f"{type_name!r} takes {name!r} positionally only: a recipe passes arguments by name"
                )
            raise recipe.error(key, f"missing required argument {name!r} of {type_name!r}")
    return factory, args


def _type_and_args(recipe: Recipe, key: tuple, value, kind: str) -> tuple:
    if isinstance(value, str):
        return value, {}
    if isinstance(value, dict):
        if "type" not in value:
            raise recipe.error(
                key, f"missing 'type': name a registered {kind} (`replicafit list {kind}`) or 'package.module:attr'"
            )
        type_name = value["type"]
        if not isinstance(type_name, str):
            got = f"{type(type_name).__name__} {short_repr(type_name)}"
            raise recipe.error(key + ("type",), f"expected a string, got {got}")
        return type_name, {k: v for k, v in value.items() if k != "type"}
    got = f"{type(value).__name__} {short_repr(value)}"
    raise recipe.error(key, f"expected a {kind} name or a mapping with 'type', got {got}")


def entry_name(value):
    """The name an entry gives: a plain name itself, a mapping's ``type``; None for anything else.

    Example::

        >>> entry_name("adam"), entry_name({"type": "sgd", "learning_rate": 0.1}), entry_name(3)
        ('adam', 'sgd', None)
    """
    return value if isinstance(value, str) else value.get("type") if isinstance(value, dict) else None


def _resolve(recipe: Recipe, type_key: tuple, kind: str, type_name: str):
    try:
        return resolve(kind, type_name)
    except KeyError as error:
        if ":" not in type_name:  # not registered: resolve's own message, with a did-you-mean
            raise recipe.error(type_key, str(error.args[0])) from None
        raise recipe.error(type_key, f"importing {type_name!r} failed: {_exception_line(error)}") from None
    except (ImportError, AttributeError, ValueError) as error:
        raise recipe.error(type_key, f"cannot import {type_name!r}: {error}") from None
    except Exception as error:  # noqa: BLE001 - the module's own code raised while it was imported
        raise recipe.error(type_key, f"importing {type_name!r} failed: {_exception_line(error)}") from None


def _exception_line(error: BaseException) -> str:
    """``Type: message (file:line)``, where the line is the innermost frame that raised."""
    message = first_line(error)
    where = ""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    return f"{type(error).__name__}: {message}{where}" if message else f"{type(error).__name__}{where}"
