"""The code blocks of the documentation: found, classified and run.

Every fenced code block of ``README.md`` and of the pages under ``docs/`` either runs here or
is marked as not runnable with a reason, in an HTML comment on the line right above its
fence (invisible on GitHub and on the site)::

    <!-- not-run: a SLURM batch script; it needs a cluster -->
    ```bash
    #SBATCH ...
    ```

What runs, and how:

- ``python`` blocks run in order, in one namespace per page (a later block uses what an
  earlier one defined), in a fresh process whose working directory is an empty temporary
  folder, with one intra-op thread;
- ``bash``/``sh`` blocks run with ``bash -euo pipefail`` in that same folder, in
  their turn among the page's blocks (a ``$ `` prompt at the start of a line is dropped;
  a ``console`` block, which mixes commands and output, needs a ``not-run`` reason);
- ``yaml`` blocks are recipes, checked as ``replicafit validate`` checks one (which never calls
  code outside replicafit); a block with some sections only (no ``model`` or no ``data``) is
  checked in the place of those sections of the shipped ``digits_mlp`` recipe.

Blocks inside MyST directives (a ``{tab-item}``, a ``{grid-item}``, an ``{admonition}``, fenced
with more backticks than the blocks inside, or with colons: ``:::{grid-item}``) count like any
other; directives that are not code (``{autoclass}``, ``{toctree}``) are not blocks, and a
directive this file does not know is an error (so that no code hides in one). Indented code
blocks are switched off in ``docs/conf.py`` (``myst_disable_syntax``): every block is fenced.
Every Python block compiles, marked or not.

Run one page by hand: ``python tests/doc_snippets.py docs/guides/fit.md`` (``--list`` shows how
every block of every page is classified).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNABLE = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "yaml": "yaml"}
# directives whose body is Markdown that may hold code blocks
CONTAINERS = {
    "admonition",
    "note",
    "tip",
    "warning",
    "important",
    "seealso",
    "attention",
    "caution",
    "danger",
    "error",
    "hint",
    "grid",
    "grid-item",
    "grid-item-card",
    "tab-set",
    "tab-item",
    "card",
    "dropdown",
}
CODE = {"code-block", "code", "sourcecode"}  # directives that are code blocks
# directives that hold no code block of a page (the reference's autodoc entries are checked elsewhere)
NOT_CODE = {"eval-rst", "toctree", "automodule", "autoclass", "autofunction", "autodata", "autoexception", "math"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,}|:{3,})\s*(?P<info>.*)$")
_QUOTED_FENCE = re.compile(r"^\s*>.*(```|~~~)")
_NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    """One fenced code block of a page: where it starts (1-based line of its first code line)."""

    path: str
    line: int
    language: str
    code: str
    not_run: str | None  # the reason, where the block is marked

    @property
    def kind(self) -> str | None:
        """``"python"``, ``"shell"`` or ``"yaml"`` for a block that runs, else ``None``."""
        return None if self.not_run is not None else RUNNABLE.get(self.language)

    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def pages() -> list[str]:
    """README.md and every Markdown page of the site, sorted."""
    found = [os.path.join(ROOT, "README.md")]
    for folder, dirs, files in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")]
    return found


def blocks(path: str) -> list[Block]:
    """Every code block of the page at ``path``, in order; ``ValueError`` for what it cannot read
    for sure (an unclosed fence, an unknown directive, a fence inside a blockquote)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    found: list[Block] = []
    containers: list[str] = []  # the fences of the directives whose Markdown body we are in
    i = 0
    while i < len(lines):
        if _QUOTED_FENCE.match(lines[i]):
            raise ValueError(f"{path}:{i + 1}: a code fence inside a blockquote is not read here: unquote it")
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match["fence"], match["info"].strip()
        if not info and containers and fence[0] == containers[-1][0] and len(fence) >= len(containers[-1]):
            containers.pop()  # the end of a container directive
            i += 1
            continue
        directive = re.match(r"^\{([\w-]+)\}\s*(.*)$", info)
        if fence[0] == ":" and not directive:
            raise ValueError(f"{path}:{i + 1}: a colon fence opens a directive: '{fence}{{name}}'")
        if directive and directive[1] in CONTAINERS:
            containers.append(fence)  # its body is Markdown: keep scanning inside
            i += 1
            continue
        if directive and directive[1] not in CODE | NOT_CODE:
            raise ValueError(
                f"{path}:{i + 1}: the directive {{{directive[1]}}} is unknown to tests/doc_snippets.py: add it to "
                "CONTAINERS (its body is Markdown), CODE or NOT_CODE"
            )
        end = i + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence):
                if not closing["info"].strip():
                    break
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: a code fence is never closed")
        if directive and directive[1] in NOT_CODE:
            i = end + 1
            continue
        words = (directive[2] if directive else info).split()
        language = words[0].lower() if words else ""
        body = lines[i + 1 : end]
        if directive:  # a {code-block} may start with :option: lines
            while body and body[0].strip().startswith(":"):
                body = body[1:]
        marker = _NOT_RUN.match(lines[i - 1]) if i else None
        code = textwrap.dedent("\n".join(body)) + "\n"
        found.append(Block(path, i + 2, language, code, marker["reason"] if marker else None))
        i = end + 1
    return found


def problems(page_blocks: list[Block]) -> list[str]:
    """What is wrong with a page's blocks: a block that neither runs nor says why, an empty reason."""
    wrong = []
    for block in page_blocks:
        if RUNNABLE.get(block.language) == "python":  # marked or not, Python must at least compile
            try:
                compile(block.code, block.where(), "exec")
            except SyntaxError as error:
                wrong.append(f"{block.where()}: does not compile: {error.msg} (line {error.lineno} of the block)")
        if block.not_run is not None and not block.not_run:
            wrong.append(f"{block.where()}: 'not-run:' needs a reason")
        elif block.not_run is None and block.kind is None:
            wrong.append(
                f"{block.where()}: a {block.language or 'plain'} block neither runs nor is marked; "
                "mark it with '<!-- not-run: reason -->' on the line above its fence "
                f"(runnable languages: {', '.join(sorted(RUNNABLE))})"
            )
    return wrong


def _validate_recipe(block: Block, folder: str) -> None:
    import yaml

    from replicafit import recipes

    text = block.code
    sections = yaml.safe_load(text)
    if not isinstance(sections, dict):
        raise ValueError("a yaml block must be a recipe, or sections of one")
    if not {"model", "data"} <= set(sections):  # sections of a recipe: checked in digits_mlp's place
        with open(recipes.locate("digits_mlp"), encoding="utf-8") as f:
            whole = yaml.safe_load(f)
        whole.update(sections)
        text = yaml.safe_dump(whole, sort_keys=False)
    path = os.path.join(folder, f"recipe_line{block.line}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    recipes.validate(recipes.load(path))


def _run_shell(block: Block, folder: str) -> None:
    script = re.sub(r"(?m)^\$ ", "", block.code)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=240,
        # this interpreter's replicafit and python, not whatever comes first on PATH
        env=dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        ),
    )
    if done.returncode:
        raise RuntimeError(f"exit status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def run_page(path: str) -> tuple[int, int]:
    """Runs the page's runnable blocks in order here (call it in a fresh process); returns (ran, not run)."""
    page_blocks = blocks(path)
    wrong = problems(page_blocks)
    if wrong:
        raise SystemExit("\n".join(wrong))
    # the blocks run as the __main__ module, as a script's code does, so that pickle finds a class or
    # function a block defines (by reference: __main__.Name)
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    namespace = main.__dict__
    ran = 0
    with tempfile.TemporaryDirectory(prefix="replicafit-docs-") as folder:
        os.chdir(folder)
        for block in page_blocks:
            if block.kind is None:
                continue
            try:
                if block.kind == "python":
                    # padded so that a traceback names the page's own line numbers
                    exec(compile("\n" * (block.line - 1) + block.code, block.path, "exec"), namespace)
                elif block.kind == "shell":
                    _run_shell(block, folder)
                else:
                    _validate_recipe(block, folder)
            except BaseException:  # noqa: BLE001 - reported with the block's place, then the run fails
                print(f"FAILED: the {block.language} block at {block.where()}", file=sys.stderr)
                traceback.print_exc()
                raise SystemExit(1) from None
            ran += 1
        os.chdir(ROOT)
    return ran, len(page_blocks) - ran


def main(argv: list[str]) -> None:
    if argv[:1] == ["--list"]:
        for page in pages():
            for block in blocks(page):
                print(f"{block.where():40} {block.language or '-':8} {block.kind or 'not run: ' + str(block.not_run)}")
        return
    torch_threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(torch_threads))
    for page in argv:
        ran, not_run = run_page(os.path.abspath(page))
        print(f"{os.path.relpath(os.path.abspath(page), ROOT)}: {ran} blocks ran, {not_run} marked not runnable")


if __name__ == "__main__":
    main(sys.argv[1:])
