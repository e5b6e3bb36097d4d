"""Where a recipe comes from and what it is once read: ``locate`` finds the file (a path, or the name of a
shipped recipe: ``shipped``, ``describe``), ``load`` reads it (``loader``: text, ``${VAR}``, YAML) and
applies the ``--set`` overrides, and returns a ``Recipe``: its data, the line of each key path, and the error
to raise at a key.

Example::

    recipe = load("digits_mlp", overrides=["fit.epochs=1"])
    recipe.data["fit"]["epochs"]  # -> 1
    recipe.error(("fit", "epochs"), "must be a positive integer")  # a RecipeError at that key's line
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from replicafit.trainer.spelling import did_you_mean

from . import loader
from .loader import RecipeError, format_key

__all__ = ["SECTIONS", "Recipe", "load", "locate", "shipped", "describe", "short_repr"]

#: The top-level keys a recipe may have, in the order a recipe usually lists them.
SECTIONS = (
    "seed",
    "precision",
    "strategy",
    "model",
    "data",
    "optimizer",
    "loss",
    "metrics",
    "callbacks",
    "fit",
    "evaluate",
)


@dataclass
class Recipe:
    """A loaded recipe: its data, where each key path sits in the file, and its source path.

    ``data`` is the YAML document with the ``--set`` overrides applied; ``lines`` maps each key path
    (``("optimizer", "learning_rate")``, ``("callbacks", 0)``) to its line in the file.

    Example::

        recipe = load("digits_mlp")
        recipe.name, recipe.data["fit"]["epochs"]   # ('digits_mlp', 20)
        raise recipe.error(("fit", "epochs"), "must be a positive integer")
    """

    path: str
    data: dict
    lines: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The file's name without its folder or extension (``digits_mlp``); run directories carry it."""
        return os.path.splitext(os.path.basename(self.path))[0]

    def error(self, key: tuple, message: str) -> RecipeError:
        """A ``RecipeError`` about the value at key path ``key``: ``file:line: key.path: message``.

        The line is the key's own, or that of the nearest enclosing key the file has (a key that an
        override added, or that the recipe leaves out, points at its section).
        """
        return RecipeError(self.path, self.line(key), format_key(key), message)

    def line(self, key: tuple):
        """The line of key path ``key`` in the file, or of its nearest enclosing key there; None for none."""
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:-1]
        return None


# --- reading -----------------------------------------------------------------------------------


def _parse_override(text: str, path: str):
    if "=" not in text:
        raise RecipeError(path, None, "--set", f"{text!r} is not key.path=value")
    key, _, raw = text.partition("=")
    parts = []
    for part in key.strip().split("."):
        if not part:
            raise RecipeError(path, None, "--set", f"{key!r} is not a key path (write e.g. fit.epochs=3)")
        parts.append(int(part) if part.isascii() and part.isdigit() else part)
    return tuple(parts), loader.parse_value(raw, path, key)


def _apply_override(data: dict, key: tuple, value, path: str) -> None:
    target = data
    for depth, part in enumerate(key[:-1]):
        nxt = target[part] if isinstance(target, (dict, list)) and _has(target, part) else None
        if nxt is None:
            if isinstance(target, dict):
                nxt = target[part] = {}
            elif isinstance(target, list):
                raise RecipeError(path, None, format_key(key[: depth + 1]), "--set cannot create an item of a list")
            else:
                raise RecipeError(
                    path, None, format_key(key[:depth]), f"--set: {target!r} is not a mapping, it has no {part!r}"
                )
        if isinstance(nxt, str) and isinstance(key[depth + 1], str):  # `optimizer: adam` -> {type: adam}
            nxt = target[part] = {"type": nxt}
        target = nxt
    last = key[-1]
    if isinstance(target, list) and (not isinstance(last, int) or last >= len(target)):
        raise RecipeError(path, None, format_key(key), f"--set: no item {last} in that list")
    if not isinstance(target, (dict, list)):  # `--set seed.x=1` with `seed: 0`
        raise RecipeError(
            path, None, format_key(key[:-1]), f"--set: {short_repr(target)} is not a mapping, it has no {last!r}"
        )
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
    """Reads a recipe: UTF-8 text, environment interpolation, YAML (safe, bounded: see ``loader``),
    then ``--set`` overrides.

    ``path`` is a file, or the name of a shipped recipe (``"digits_mlp"``, see ``locate``).
    """
    path = locate(path)
    text = loader.interpolate(loader.read_text(path), path)
    loader.check_characters(text, path)
    data, lines = loader.parse(text, path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            path, 1, "", f"a recipe is a mapping of sections ({', '.join(SECTIONS)}), not {_a(type(data).__name__)}"
        )
    for override in overrides:
        key, value = _parse_override(override, path)
        _apply_override(data, key, value, path)
    return Recipe(path, data, lines)


# --- the words of messages ---------------------------------------------------------------------


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def short_repr(value) -> str:
    """``repr(value)`` cut to 80 characters: how a message quotes a value of the recipe's.

    Example::

        >>> short_repr([1, 2])
        '[1, 2]'
        >>> text = short_repr(list(range(100)))
        >>> len(text), text[-5:]
        (80, '21...')
    """
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
