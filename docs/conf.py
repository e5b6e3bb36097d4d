"""Sphinx configuration of replicafit's documentation site (``docs/``).

Build it with ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``
(``pip install -e ".[docs]"`` first). Pages are Markdown (MyST); the API reference is generated
from the docstrings by autodoc, and ``_ext/api_coverage.py`` fails the build when a public name
has no reference entry or no docstring.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import replicafit  # noqa: E402

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if not os.path.realpath(replicafit.__file__).startswith(os.path.join(_CHECKOUT, "")):
    raise RuntimeError(
        f"the documentation of {_CHECKOUT} would be built from the replicafit installed at "
        f'{os.path.dirname(replicafit.__file__)}: run `pip install -e ".[docs]"` in {_CHECKOUT} first'
    )

project = "replicafit"
author = "the replicafit authors"
copyright = "2026, the replicafit authors"  # noqa: A001 - Sphinx's name
release = version = replicafit.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_design",
    "api_coverage",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_*", ".*"]  # as tests/doc_snippets.py reads them
myst_enable_extensions = ["colon_fence", "deflist"]
# no indented code blocks: every code block is fenced, so tests/doc_snippets.py sees it and runs it
myst_disable_syntax = ["code"]
myst_heading_anchors = 3

default_role = "literal"  # `name` in a docstring is code, as in Markdown
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"replicafit {release}"
html_static_path = []

nitpicky = True
# The names outside the public reference that signatures and bases mention: torch's, NumPy's and the
# standard library's (there is no network at build time for intersphinx), and internal classes named by
# a return annotation. Exact names, so that a misspelt reference still fails the build.
nitpick_ignore = [
    ("py:class", name)
    for name in (
        "torch.Tensor",
        "torch.dtype",
        "torch.Size",
        "torch.device",
        "torch.nn.modules.module.Module",
        "torch.utils.data.dataset.Dataset",
        "numpy.ndarray",
        "collections.abc.Mapping",
        "collections.abc.Sequence",
        "collections.OrderedDict",
        "enum.Enum",
        "replicafit.strategies.rng.ReplicaStreams",
        "replicafit.strategies.variables.VariableSpec",
        "replicafit.data.input_lib._V1Iterator",
        "replicafit.data.input_lib._Placer",
    )
]
