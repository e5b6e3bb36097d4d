"""The examples in the docstrings: every ``>>>`` example of every module runs and prints what it
shows; every other example that the API reference renders (a ``::`` literal block or a
``.. code-block:: python``) at least compiles. A block in another language says so with
``.. code-block:: yaml`` (or ``text``, ``bash``, ...)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
import re
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

from api_coverage import PACKAGES, members_to_document, public_names  # noqa: E402 - the reference's own list of public names

# modules whose docstrings are known to hold >>> examples (so that losing them all is noticed)
MODULES_WITH_EXAMPLES = [
    "replicafit.strategies",
    "replicafit.strategies.cluster",
    "replicafit.strategies.step_values",
    "replicafit.strategies.describe",
    "replicafit.strategies.module",
    "replicafit.strategies.sync_batchnorm",
    "replicafit.strategies.slurm",
    "replicafit.strategies.devices",
    "replicafit.data.sources",
    "replicafit.data.sharding",
    "replicafit.optimizers.schedules",
    "replicafit.trainer.arguments",
    "replicafit.trainer.model_io",
    "replicafit.trainer.losses",
    "replicafit.trainer.metrics",
    "replicafit.recipes.models",
]


def all_modules() -> list[str]:
    """Every module of the installed package (``__main__`` modules run the command, so not those)."""
    names = {"replicafit"}
    for package in PACKAGES[1:]:  # the root's own modules are not walked: its packages are
        names.add(package)
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, f"{package}."):
            names.add(info.name)
    return sorted(name for name in names if not name.endswith("__main__"))


@pytest.mark.parametrize("name", all_modules())
def test_every_doctest_runs(name):
    module = importlib.import_module(name)
    failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=False)
    if name in MODULES_WITH_EXAMPLES:
        assert tried > 0, f"{name} has no >>> examples"
    assert failures == 0, f"{failures} of {tried} examples in {name} failed (run: python -m doctest -v)"


def test_every_module_is_walked():
    found = all_modules()
    assert set(MODULES_WITH_EXAMPLES) <= set(found) and len(found) > 90


_CODE_BLOCK = re.compile(r"^\s*\.\. (?:code-block|code|sourcecode)::\s*(\w*)\s*$")
PYTHON = {"python", "py", "python3", "pycon"}


def literal_blocks(doc: str) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of the docstring's literal blocks: ``::`` paragraphs are Python."""
    lines = doc.splitlines()
    found = []
    i = 0
    while i < len(lines):
        directive = _CODE_BLOCK.match(lines[i])
        opens = directive or (lines[i].rstrip().endswith("::") and not lines[i].lstrip().startswith(".."))
        if not opens:
            i += 1
            continue
        language = (directive[1] or "python") if directive else "python"
        base = len(lines[i]) - len(lines[i].lstrip())
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j].lstrip().startswith(":")):
            j += 1  # blank lines and a code-block's options
        if j == len(lines) or len(lines[j]) - len(lines[j].lstrip()) <= base:
            i += 1
            continue
        indent = len(lines[j]) - len(lines[j].lstrip())
        k = j
        while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) >= indent):
            k += 1
        found.append((i + 1, language, textwrap.dedent("\n".join(lines[j:k])).rstrip()))
        i = k
    return found


def rendered_docstrings() -> list[tuple[str, str]]:
    """``(name, docstring)`` of everything the API reference renders: the public names, the
    members their classes define, and the modules it documents."""
    found = {}
    names = public_names()
    public = {id(value) for value in names.values()}
    for name, value in names.items():
        doc = value.__doc__ if inspect.ismodule(value) else inspect.getdoc(value)
        found.setdefault(name, doc or "")
        if inspect.isclass(value) and value.__module__.startswith("replicafit."):
            for member in members_to_document(value, public):
                found.setdefault(f"{name}.{member}", inspect.getdoc(getattr(value, member)) or "")
    for module in PACKAGES:
        found.setdefault(module, importlib.import_module(module).__doc__ or "")
    return sorted(found.items())


def test_every_rendered_example_compiles():
    broken, compiled = [], 0
    for name, doc in rendered_docstrings():
        for line, language, code in literal_blocks(doc):
            if language not in PYTHON or ">>>" in code:
                continue  # the >>> ones run above
            try:
                compile(code, f"{name} (docstring line {line})", "exec")
                compiled += 1
            except SyntaxError as error:
                broken.append(
                    f"{name}, docstring line {line}: {error.msg}; "
                    "fix the example, or mark a block in another language with '.. code-block:: LANG'"
                )
    assert not broken, "\n".join(broken)
    assert compiled > 50  # the reference does have examples


def test_the_block_finder_sees_literal_blocks_and_code_block_languages():
    doc = "Text.\n\nExample::\n\n    x = 1\n      y(\n\nMore.\n\n.. code-block:: yaml\n\n    a: 1\n"
    assert literal_blocks(doc) == [(3, "python", "x = 1\n  y("), (10, "yaml", "a: 1")]
