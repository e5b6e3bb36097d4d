"""A Sphinx extension that fails the build when a public name has no API reference entry.

The public names are those of ``replicafit.__all__``, of the packages' ``__all__`` (``PACKAGES``) and
of the submodules those list (``replicafit.trainer.losses``, ``replicafit.optimizers.schedules``, ...).
Every one must be documented by an autodoc entry of the reference (re-exports count once: the
root's ``replicafit.Trainer`` is ``replicafit.trainer.Trainer``), with a docstring; so must every
public method and property a public class defines itself or inherits from an internal class
(an override that inherits its base's docstring counts, as autodoc shows it; ``docs/api/*.md``
give such classes ``:inherited-members:`` with their public bases excluded). autodoc leaves out a member without a
docstring silently; this is what makes that loud. Each miss is one warning, which ``-W`` turns
into a failed build.
"""

from __future__ import annotations

import importlib
import inspect
import types

try:
    from sphinx.util import logging
except (
    ImportError
):  # the test suite imports the list of public names without Sphinx installed
    import logging

logger = logging.getLogger(__name__)

PACKAGES = (
    "replicafit",
    "replicafit.strategies",
    "replicafit.data",
    "replicafit.optimizers",
    "replicafit.trainer",
    "replicafit.recipes",
    "replicafit.cli",
)


def public_names() -> dict[str, object]:
    """Every public name, under the module that exports it: ``{"replicafit.data.InputContext": obj}``."""
    names: dict[str, object] = {}
    modules = list(PACKAGES)
    while modules:
        module = importlib.import_module(modules.pop(0))
        for name in module.__all__:
            if name == "__version__":
                continue
            value = getattr(module, name)
            if isinstance(value, types.ModuleType):
                if value.__name__.startswith(
                    "replicafit."
                ) and value.__name__ not in modules + list(names):
                    modules.append(value.__name__)
                    names[value.__name__] = value
                continue
            names[f"{module.__name__}.{name}"] = value
    return names


def _own_members(cls: type) -> list[str]:
    """The public members ``cls`` defines itself (functions, properties, class/static methods)."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (property, classmethod, staticmethod, types.FunctionType)):
            found.append(name)
    return found


def private_bases(cls: type, public: set[int]) -> list[type]:
    """The internal replicafit classes ``cls`` inherits from before its first public base (or the
    end of replicafit's classes): their members are ``cls``'s to document, as nobody else does."""
    found = []
    for base in cls.__mro__[1:]:
        if id(base) in public or not base.__module__.startswith("replicafit."):
            break
        found.append(base)
    return found


def members_to_document(cls: type, public: set[int]) -> list[str]:
    """The public members the reference shows under ``cls``: its own, and those it inherits from
    internal classes (a method of an internal base class of a public one)."""
    found = []
    for owner in (cls, *private_bases(cls, public)):
        found += [name for name in _own_members(owner) if name not in found]
    return found


def own_docstring(value) -> bool:
    """Whether a public class or function has a docstring of its own (not one inherited from an
    internal base, as ``inspect.getdoc`` would find); constants are checked as they render."""
    if inspect.isclass(value):
        return bool((value.__dict__.get("__doc__") or "").strip())
    if inspect.isroutine(value):
        return bool((value.__doc__ or "").strip())
    return True


def _documented(env) -> dict[str, object]:
    """Every object the reference documents, by its full name."""
    return {name: entry for name, entry in env.get_domain("py").objects.items()}


def _resolve(name: str):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                value = getattr(value, part)
        except AttributeError:
            return None
        return value
    return None


def check(app, env) -> None:
    documented = _documented(env)
    by_identity: dict[int, str] = {}
    for name in documented:
        value = _resolve(name)
        if value is not None and not isinstance(value, (int, float, str, bool)):
            by_identity.setdefault(id(value), name)
    names = public_names()
    public = {id(value) for value in names.values()}
    missing = []
    for name, value in names.items():
        if isinstance(value, types.ModuleType):
            if name not in documented:
                missing.append(f"{name} (module: add an automodule entry)")
            continue
        where = name if name in documented else by_identity.get(id(value))
        if where is None:
            missing.append(f"{name} (no reference entry)")
            continue
        if not own_docstring(value):
            missing.append(f"{name} (no docstring of its own)")
        if inspect.isclass(value) and value.__module__.startswith("replicafit."):
            for member in members_to_document(value, public):
                doc = inspect.getdoc(getattr(value, member)) or ""
                if f"{where}.{member}" not in documented or not doc.strip():
                    missing.append(
                        f"{where}.{member} (a public member without a docstring, or not documented)"
                    )
    for entry in sorted(set(missing)):
        logger.warning(
            "API reference: %s", entry, type="api_coverage", subtype="missing"
        )
    if not missing:
        logger.info("API reference: every public name documented")


def public_bases(app, name, obj, options, bases: list) -> None:
    """``Bases:`` names public classes only: an internal base (of a public class) is
    replaced by its own bases, recursively (its members are shown under the class itself)."""
    public = {id(value) for value in public_names().values()}
    shown: list = []

    def add(base) -> None:
        if base.__module__.startswith("replicafit.") and id(base) not in public:
            for above in base.__bases__:
                add(above)
        elif base not in shown:
            shown.append(base)

    for base in list(bases):
        add(base)
    if len(shown) > 1 and object in shown:
        shown.remove(object)
    bases[:] = shown or [object]


def constants_say_what_they_are(app, what, name, obj, options, lines) -> None:
    """A public constant documents itself with a ``#:`` comment above its assignment; without
    one, autodoc renders its type's docstring (``int([x]) -> integer ...``) as the constant's."""
    if what not in ("data", "attribute") or not name.startswith("replicafit."):
        return
    own_type = type(obj).__doc__
    borrowed = own_type.strip().splitlines()[:1] if isinstance(own_type, str) else []
    text = "".join(lines).strip()
    if not text or (borrowed and lines[0].strip() == borrowed[0].strip()):
        logger.warning(
            "API reference: %s has no doc comment ('#: what it is' above its assignment)",
            name,
            type="api_coverage",
            subtype="missing",
        )


def setup(app):
    app.connect("env-check-consistency", check)
    app.connect("autodoc-process-docstring", constants_say_what_they_are)
    app.connect("autodoc-process-bases", public_bases)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
