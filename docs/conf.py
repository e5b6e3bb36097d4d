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
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
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
# names outside replicafit that signatures mention; there is no network at build time for intersphinx
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|numpy|np|collections|typing|types|os|pathlib|enum|abc|threading|contextlib|datetime)(\..*)?",
    ),
    (r"py:.*", r"replicafit\.[\w.]*\._\w+"),  # private bases of public classes
    # internal bases and return types, named by their module path (public names resolve as replicafit.<package>.Name)
    (
        r"py:.*",
        r"replicafit\.(strategies|data|optimizers|trainer)\.[a-z_]+(\.[a-z_]+)*\.[A-Z]\w*",
    ),
    (
        r"py:.*",
        r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Optional|Union|Tensor|Module)",
    ),
]
