"""Registries: names a recipe can use, each mapped to a factory with a description.

One registry per kind: strategies, models, datasets, optimizers, schedules, losses,
metrics, callbacks. A name is registered once (a duplicate is refused). A user's
package registers its own models and datasets with the decorators, or a recipe names
any factory as ``"package.module:attribute"``.

Example::

    from replicafit.recipes.registry import register_model

    @register_model("tiny_mlp", "two-layer perceptron for smoke tests")
    def tiny_mlp(inputs: int, outputs: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(inputs, 8), torch.nn.ReLU(), torch.nn.Linear(8, outputs))
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from replicafit.trainer.spelling import did_you_mean

__all__ = [
    "Registry",
    "REGISTRIES",
    "register_model",
    "register_dataset",
    "register_callback",
    "resolve",
]


class Registry:
    """Names of one kind, each with a factory and a one-line description."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict = {}

    def register(self, name: str, factory=None, description: str = ""):
        """Registers ``factory`` under ``name``; as a decorator when ``factory`` is omitted."""
        if factory is None:
            return lambda fn: self.register(name, fn, description) or fn
        if not isinstance(name, str) or not name:
            raise ValueError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if name in self._entries:
            raise ValueError(
                f"The {self.kind} name {name!r} is already registered ({self._entries[name][0]!r}); pick another name."
            )
        if not description:
            doc = (getattr(factory, "__doc__", None) or "").strip()
            description = doc.splitlines()[0] if doc else ""
        self._entries[name] = (factory, description)
        return factory

    def get(self, name: str):
        return self._entries[name][0]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def names(self) -> list:
        return sorted(self._entries)

    def describe(self) -> list:
        """``[(name, description), ...]`` sorted by name."""
        return [(name, self._entries[name][1]) for name in self.names()]

    def suggestion(self, name: str) -> str:
        return did_you_mean(name, self.names())


REGISTRIES = {
    kind: Registry(kind)
    for kind in ("strategy", "model", "dataset", "optimizer", "schedule", "loss", "metric", "callback")
}


def register_model(name: str, description: str = ""):
    """Decorator: makes a model factory available to recipes as ``model: {type: name, ...}``."""
    return REGISTRIES["model"].register(name, description=description)


def register_dataset(name: str, description: str = ""):
    """Decorator: makes a dataset factory available as ``data: {type: name, ...}``.

    The factory returns a dict with ``train`` (anything ``Trainer.fit`` accepts) and
    optionally ``validation``, ``task`` (``"classification"``/``"regression"``),
    ``inputs`` and ``classes``.
    """
    return REGISTRIES["dataset"].register(name, description=description)


def register_callback(name: str, description: str = ""):
    """Decorator: makes a callback class available as ``callbacks: [{type: name, ...}]``."""
    return REGISTRIES["callback"].register(name, description=description)


def resolve(kind: str, name: str):
    """The factory for ``name`` in registry ``kind``, or ``"module:attr"`` imported.

    Raises ``KeyError`` with a did-you-mean hint for an unknown name, ``ValueError`` for a
    ``module:attr`` that is relative (``".foo:bar"``) or has an empty part, and
    ``ImportError``/``AttributeError`` for one that does not import. Importing the module runs its
    top-level code; nothing named is called.
    """
    registry = REGISTRIES[kind]
    if name in registry:
        return registry.get(name)
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        if module_name.startswith("."):
            raise ValueError(
                "relative module names are not allowed (there is no package to be relative to): "
                "write the full module path, 'package.module:attr'"
            )
        if not module_name or not attribute:
            raise ValueError("both parts of 'package.module:attr' are needed")
        moved = _moved_spelling(module_name, attribute)
        if moved:
            raise ImportError(
                f"replicafit's packages live under the `replicafit` import root: write {moved!r} instead of {name!r}"
            )
        try:
            module = importlib.import_module(module_name)
            return getattr(module, attribute)
        except (ImportError, AttributeError) as error:
            # a folder of one's own named data/ (or trainer/, ...) shadows the old spelling: say it if ours has it
            moved = _ours_has(module_name, attribute)
            if moved:
                raise ImportError(
                    f"{error}; replicafit's packages live under the `replicafit` import root: did you mean {moved!r}?"
                ) from error
            now = _current_module(module_name)
            if now != module_name:
                raise ImportError(f"{error}; {module_name} is now {now}: write '{now}:{attribute}'") from error
            raise
    raise KeyError(f"unknown {kind} {name!r}{registry.suggestion(name)}; `replicafit list {kind}` shows the names")


_MOVED_PACKAGES = ("strategies", "data", "optimizers", "trainer")

# Modules that moved out of replicafit.trainer: the recipe system up into replicafit.recipes, the command
# and its launcher into replicafit.cli, TensorBoard into the callbacks package. A recipe that names one by
# its old path is told the new one.
_MOVED_MODULES = {
    "replicafit.trainer.recipes": "replicafit.recipes",
    **{
        f"replicafit.trainer.{old}": f"replicafit.recipes.{new}"
        for old, new in (
            ("recipe_source", "source"),
            ("recipe_loader", "loader"),
            ("recipe_entries", "entries"),
            ("recipe_calls", "calls"),
            ("recipe_monitors", "monitors"),
            ("recipe_validation", "validation"),
            ("recipe_build", "builder"),
            ("registry", "registry"),
            ("kinds", "kinds"),
            ("builtins", "builtins"),
            ("models", "models"),
            ("datasets", "datasets"),
        )
    },
    "replicafit.trainer.tensorboard": "replicafit.trainer.callbacks.tensorboard",
    "replicafit.trainer.cli": "replicafit.cli",
    "replicafit.trainer.launch": "replicafit.cli.launch",
}


def _current_module(module_name: str) -> str:
    """Where ``module_name`` lives now: its new name if it moved out of ``replicafit.trainer``, else itself."""
    return _MOVED_MODULES.get(module_name, module_name)


def _moved_spelling(module_name: str, attribute: str):
    """``"replicafit.strategies:X"`` for the old top-level spelling ``"strategies:X"``, else None.

    A user's own top-level ``data`` (or ``trainer``, ...) module is theirs to name: only a name
    that is missing, or that would load replicafit's own source folder a second time under a
    top-level name (from a checkout's root), is the old spelling.
    """
    top = module_name.partition(".")[0]
    if top not in _MOVED_PACKAGES:
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    ours = importlib.import_module(f"replicafit.{top}")
    if spec is not None and not _same_file(spec.origin, ours.__file__):
        return None
    return f"{_current_module(f'replicafit.{module_name}')}:{attribute}"


def _same_file(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _ours_has(module_name: str, attribute: str):
    """``"replicafit.data.sources:X"`` where ``module_name`` failed to give ``attribute`` because its top level
    is a folder without ``__init__.py`` (a namespace package: a project's ``data/`` of files, say) and our
    module of that name has it; else None. A module of one's own of that name keeps its own errors."""
    top = module_name.partition(".")[0]
    if top not in _MOVED_PACKAGES:
        return None
    try:
        spec = importlib.util.find_spec(top)
        if spec is None or spec.origin is not None:
            return None
        name = _current_module(f"replicafit.{module_name}")
        ours = importlib.import_module(name)
    except (ImportError, ValueError):
        return None
    return f"{name}:{attribute}" if hasattr(ours, attribute) else None
