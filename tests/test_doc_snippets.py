"""Every code block of README.md and of the documentation site runs, or is marked not runnable
with a reason (``tests/doc_snippets.py`` says how). A snippet that drifts from the code fails here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from doc_snippets import ROOT, Block, blocks, pages, problems

PAGES = [os.path.relpath(page, ROOT) for page in pages()]


def test_every_block_of_every_page_runs_or_says_why_not():
    wrong = [problem for page in pages() for problem in problems(blocks(page))]
    assert not wrong, "\n".join(wrong)


def test_the_site_has_its_pages_and_most_blocks_run():
    for page in ("docs/index.md", "docs/getting-started.md", "docs/porting/tensorflow.md", "docs/porting/pytorch.md"):
        assert page in PAGES
    every = [block for page in pages() for block in blocks(page)]
    ran = [block for block in every if block.kind is not None]
    assert len(ran) > len(every) / 2, f"only {len(ran)} of {len(every)} blocks run"


RUNNABLE_PAGES = [page for page in PAGES if any(block.kind for block in blocks(os.path.join(ROOT, page)))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_pages_blocks_run(page):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "doc_snippets.py"), page],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "blocks ran" in done.stdout


def write(tmp_path, text: str) -> str:
    path = tmp_path / "page.md"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_block_finder_reads_markers_directives_and_nesting(tmp_path):
    page = write(
        tmp_path,
        "# Title\n\n"
        "```python\nx = 1\n```\n\n"
        "<!-- not-run: needs a cluster -->\n```bash\nsrun replicafit fit r.yaml\n```\n\n"
        "`````{grid} 1 1 2 2\n````{grid-item}\n<!-- not-run: TensorFlow code, for comparison -->\n"
        "```python\nimport tensorflow\n```\n````\n`````\n\n"
        "::::{grid} 2\n:::{grid-item}\n```python\nz = 3\n```\n:::\n::::\n\n"
        "```{eval-rst}\n.. autoclass:: replicafit.trainer.Trainer\n```\n\n"
        "```{code-block} python\n:caption: a caption\ny = 2\n```\n\n"
        "```text\noutput\n```\n",
    )
    found = blocks(page)
    assert [(b.language, b.kind, b.not_run) for b in found] == [
        ("python", "python", None),
        ("bash", None, "needs a cluster"),
        ("python", None, "TensorFlow code, for comparison"),
        ("python", "python", None),
        ("python", "python", None),
        ("text", None, None),
    ]
    assert found[0].line == 4 and found[3].code == "z = 3\n" and found[4].code == "y = 2\n"
    wrong = problems(found)
    assert len(wrong) == 1 and "a text block neither runs nor is marked" in wrong[0]


def test_what_the_finder_cannot_read_for_sure_is_an_error(tmp_path):
    """A directive it does not know could hold code that neither runs nor says why: it must be told."""
    with pytest.raises(ValueError, match=r"the directive \{sidebar\} is unknown"):
        blocks(write(tmp_path, "```{sidebar}\n```python\nx = 1\n```\n```\n"))
    with pytest.raises(ValueError, match="inside a blockquote"):
        blocks(write(tmp_path, "> ```python\n> x = 1\n> ```\n"))
    page = write(tmp_path, ":::{code-block} python\nx = 1\n:::\n\n```{code-block}\nplain\n```\n")
    assert [(b.language, b.code) for b in blocks(page)] == [("python", "x = 1\n"), ("", "plain\n")]


def test_every_python_block_compiles_even_one_marked_not_run():
    broken = Block("p.md", 3, "python", "strategy = rf.MirroredStrategy(\n", "needs GPUs")
    assert problems([broken]) == ["p.md:3: does not compile: '(' was never closed (line 1 of the block)"]


def test_indented_code_blocks_are_switched_off_on_the_site():
    """The finder reads fenced blocks only; an indented block would render as code and never run."""
    with open(os.path.join(ROOT, "docs", "conf.py"), encoding="utf-8") as f:
        assert 'myst_disable_syntax = ["code"]' in f.read()


def test_the_api_pages_have_an_entry_for_every_public_name():
    """Without Sphinx: the autodoc entries of docs/api/*.md name every public name (by identity, so
    that a re-export counts once), and the build's own check (docs/_ext/api_coverage.py) does the rest."""
    import importlib
    import re

    sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))
    from api_coverage import public_names

    targets = []
    for name in sorted(os.listdir(os.path.join(ROOT, "docs", "api"))):
        with open(os.path.join(ROOT, "docs", "api", name), encoding="utf-8") as f:
            targets += re.findall(r"^\.\. auto(?:class|function|data|exception|module):: (\S+)", f.read(), re.M)

    def resolve(target):
        module, _, attribute = target.rpartition(".")
        try:
            return importlib.import_module(target)
        except ImportError:
            return getattr(importlib.import_module(module), attribute)

    documented = {id(resolve(target)) for target in targets}
    # a constant (a small int is one shared object) by its name; the rest by identity: a re-export counts once
    missing = [
        name
        for name, value in public_names().items()
        if (name not in targets if isinstance(value, (int, float, str)) else id(value) not in documented)
    ]
    assert missing == [], f"no autodoc entry in docs/api/*.md for {missing}"


def test_the_snippets_are_formatted_to_the_sites_width():
    """docs/ruff.toml formats the pages' Python blocks to 88 columns, what the site shows without a scroll."""
    try:
        version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = ""
    numbers = tuple(int(part) for part in version.split()[-1].split(".")[:2]) if version else ()
    if numbers < (0, 16):  # ruff formats the code blocks of Markdown from 0.16 on
        pytest.skip(f"needs ruff >= 0.16 (the test extra's), found {version.strip() or 'none'}")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "README.md", "docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_empty_reason_and_an_unclosed_fence_are_errors(tmp_path):
    assert problems([Block("p.md", 3, "bash", "ls\n", "")]) == ["p.md:3: 'not-run:' needs a reason"]
    with pytest.raises(ValueError, match="never closed"):
        blocks(write(tmp_path, "```python\nx = 1\n"))


def test_a_failing_block_fails_its_page_and_names_its_line(tmp_path):
    page = write(tmp_path, "```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2\n```\n")
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "doc_snippets.py"), page],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"FAILED: the python block at {os.path.relpath(page, ROOT)}:8" in done.stderr
    assert "AssertionError" in done.stderr


def test_a_recipe_block_is_validated(tmp_path):
    page = write(tmp_path, "```yaml\noptimizer: {type: sgd, learning_rat: 0.1}\n```\n")  # digits_mlp's, misspelt
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "doc_snippets.py"), page],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "learning_rat" in done.stderr


def test_the_readmes_links_lead_to_files():
    """The README is not a page of the site (whose build checks its own links): its links are checked here."""
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read())
    local = [target for target in targets if "://" not in target]
    assert len(local) >= 10
    missing = [target for target in local if not os.path.exists(os.path.join(ROOT, target))]
    assert not missing, f"README.md links to files that do not exist: {missing}"
