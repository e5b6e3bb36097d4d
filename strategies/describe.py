"""How an error message names a value: one phrasing for every package.

A message says what it found as well as what it expected. Three phrasings cover them all:
``brief`` (the value itself where it is short, else its type), ``describe_value`` (what a
user's function returned: "the int 3", "a mymodule.Net object") and ``describe_structure``
(a batch or a nest: "a dict with keys ['x', 'y']", "a tuple of 2 (Tensor of shape [4, 3], int)").

Example::

    >>> brief([1, 2]), describe_value(3), describe_structure({"x": 1, "y": 2})
    ('[1, 2]', 'the int 3', "a dict with keys ['x', 'y']")
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["brief", "describe_structure", "describe_value", "qualified_name"]


def brief(value, limit: int = 80) -> str:
    """``repr(value)`` where it is one short line, else "a TypeName"."""
    text = repr(value)
    return text if len(text) <= limit and "\n" not in text else f"a {type(value).__name__}"


def qualified_name(cls) -> str:
    """``module.QualName`` of a class or function (the bare name for builtins)."""
    module = getattr(cls, "__module__", "")
    name = getattr(cls, "__qualname__", getattr(cls, "__name__", repr(cls)))
    return name if module in ("builtins", "") else f"{module}.{name}"


def describe_value(value) -> str:
    """What a value is, for "returned ..., not ...": "None", "the str 'x'" (a short builtin), "a list"
    (a long one), "a package.Class object"."""
    if value is None:
        return "None"
    kind = type(value)
    if kind.__module__ == "builtins":
        text = repr(value)
        return f"the {kind.__name__} {text}" if len(text) <= 40 else f"a {kind.__name__}"
    return f"a {qualified_name(kind)} object"


def describe_structure(value) -> str:
    """What a batch (or a nest) is, briefly: "a Tensor of shape [64, 8]", "a dict with keys ['a', 'b']",
    "a tuple of 2 (Tensor of shape [4], list of 0 ())"."""
    if isinstance(value, Mapping):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        parts = ", ".join(describe_structure(v).removeprefix("a ").removeprefix("an ") for v in value)
        return f"a {type(value).__name__} of {len(value)} ({parts})"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {list(shape)}"
    return f"a {type(value).__name__}"
