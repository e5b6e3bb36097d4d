"""The checks at the trainer's entry: precision and the plain arguments of fit, evaluate and predict.

One place says what each accepts; ``Trainer`` raises with these words at its entry and a recipe
(``replicafit.recipes.validation``) reports the same problems at the recipe's line, before anything is built.

Example::

    >>> resolve_precision("32-true"), resolve_precision("fp8")
    ('32', None)
    >>> argument_problem(0, "size")
    (<class 'ValueError'>, 'must be None or an int >= 1')
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "AUTOCAST",
    "EVALUATE_ARGUMENTS",
    "FIT_ARGUMENTS",
    "PRECISIONS",
    "argument_problem",
    "check_arguments",
    "check_precision",
    "resolve_precision",
]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")  # Lightning's names
AUTOCAST = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_PRECISION_ALIASES = {32: "32", "32": "32", "32-true": "32", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}

# What each plain argument is: "count" (an int >= 0), "size" (None or an int >= 1), "fraction"
# (a number in [0, 1)), "flag" (a bool).
FIT_ARGUMENTS = {
    "epochs": "count",
    "batch_size": "size",
    "validation_split": "fraction",
    "steps_per_epoch": "size",
    "initial_epoch": "count",
    "shuffle": "flag",
}
EVALUATE_ARGUMENTS = {"batch_size": "size", "steps": "size"}
_WANT = {"count": "an int >= 0", "size": "None or an int >= 1"}


def resolve_precision(precision) -> str | None:
    """The canonical name of ``precision`` (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``; also ``32`` and
    ``"32-true"``), or None when it names none of them."""
    if not isinstance(precision, (str, int)) or isinstance(precision, bool):
        return None
    return _PRECISION_ALIASES.get(precision)


def check_precision(precision) -> str:
    """``resolve_precision``, or a ``ValueError`` that lists the names."""
    name = resolve_precision(precision)
    if name is None:
        raise ValueError(
            f"precision must be one of '32', 'bf16-mixed', '16-mixed' (Lightning's names), got {precision!r}."
        )
    return name


def _is_array(value) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray)) or (
        isinstance(value, (list, tuple)) and len(value) > 1 and all(isinstance(v, (int, float)) for v in value)
    )


def argument_problem(value, kind: str) -> tuple[type, str] | None:
    """What is wrong with ``value`` as an argument of ``kind`` (see ``FIT_ARGUMENTS``): ``(TypeError or
    ValueError, "must be ...")``, or None when it is fine."""
    if kind == "flag":
        return None if isinstance(value, (bool, np.bool_)) else (TypeError, "must be True or False")
    if kind == "fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            return TypeError, "must be a number in [0, 1) (e.g. 0.2)"
        return None if 0 <= value < 1 else (ValueError, "must be in [0, 1)")
    if value is None and kind == "size":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return TypeError, f"must be {_WANT[kind]}"
    return None if value >= (0 if kind == "count" else 1) else (ValueError, f"must be {_WANT[kind]}")


def check_arguments(caller: str, kinds: dict, **values) -> None:
    """Checks the plain arguments of ``fit``/``evaluate``/``predict`` at the entry, each ``name=value``
    as ``kinds[name]`` says. An array where a number belongs is Keras' ``fit(x, y)`` habit, and gets its
    own message."""
    for name, value in values.items():
        kind = kinds[name]
        if _is_array(value):
            raise TypeError(
                f"{caller}() got an array for `{name}`: this looks like Keras' {caller}(x, y, ...) call. Pass the "
                f"data as one argument: {caller}(model, (x, y), batch_size=...) (or (x, y, sample_weight))."
            )
        problem = argument_problem(value, kind)
        if problem is not None:
            error, text = problem
            shown = f"{value!r} ({type(value).__name__})" if error is TypeError else repr(value)
            raise error(f"{caller}(): `{name}` {text}, got {shown}.")
