"""One import root: ``replicafit`` and nothing else at the top level.

The packages import as ``replicafit.strategies``/``.data``/``.optimizers``/``.trainer``;
``import replicafit`` is cheap and lazy; a user's own ``data/``, ``trainer.py``,
``optimizers.py`` or ``strategies.py`` never shadows ours. (``.ci/packaging`` proves the
same with a built wheel in a fresh virtual environment.)
"""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import importlib.resources
import pathlib
import re
import subprocess
import sys

import pytest

import replicafit

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_NAMES = ("strategies", "data", "optimizers", "trainer")
MAPPED = {"replicafit.strategies": "strategies", "replicafit.data": "data", "replicafit.optimizers": "optimizers",
          "replicafit.trainer": "trainer", "replicafit.recipes": "recipes", "replicafit.cli": "cli"}  # fmt: skip


def python(code: str, cwd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout)


# --- the root package -------------------------------------------------------------------------
def test_version_is_the_distribution_version():
    assert replicafit.__version__ == importlib.metadata.version("replicafit")


def test_import_replicafit_loads_nothing_heavy(tmp_path):
    result = python(
        "import sys, replicafit as rf\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('replicafit.')))\n"
        "rf.MirroredStrategy\n"
        "print('torch' in sys.modules)\n",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.splitlines()
    assert before == "[]"  # neither torch nor any of our packages until a name is used
    assert after == "True"


@pytest.mark.parametrize(
    "name,module",
    [
        ("Trainer", "replicafit.trainer"),
        ("MirroredStrategy", "replicafit.strategies"),
        ("OneDeviceStrategy", "replicafit.strategies"),
        ("CentralStorageStrategy", "replicafit.strategies"),
        ("ReduceOp", "replicafit.strategies"),
        ("TensorBoard", "replicafit.trainer"),
        ("summary", "replicafit.trainer"),
        ("EarlyStopping", "replicafit.trainer"),
    ],
)
def test_everyday_names_are_the_packages_objects(name, module):
    assert getattr(replicafit, name) is getattr(importlib.import_module(module), name)


def test_subpackages_are_attributes():
    import replicafit.data
    import replicafit.optimizers

    assert replicafit.optimizers.Adam is importlib.import_module("replicafit.optimizers").Adam
    assert replicafit.data.__name__ == "replicafit.data"
    for name in OLD_NAMES:
        assert getattr(replicafit, name).__name__ == f"replicafit.{name}"


def test_all_and_dir_list_every_lazy_name():
    tables = {"__version__", *replicafit._SUBPACKAGES, *replicafit._EXPORTS}
    assert set(replicafit.__all__) == tables and len(replicafit.__all__) == len(tables)
    assert tables <= set(dir(replicafit))
    for name in replicafit.__all__:
        assert getattr(replicafit, name) is not None


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'"):
        replicafit.Trainr  # noqa: B018
    assert not hasattr(replicafit, "numpy")


def test_py_typed_ships():
    assert (importlib.resources.files("replicafit") / "py.typed").is_file()


def test_python_dash_m_replicafit_is_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "replicafit", "list", "recipes"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "recipes:" and "digits_mlp" in result.stdout


# --- nothing at the top level -------------------------------------------------------------------
def _all_modules() -> list:
    names = []
    for package, folder in MAPPED.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if parts and parts[-1] == "__main__":
                continue  # importing it would run the command
            names.append(".".join((package, *parts)))
    return sorted(names)


def test_importing_everything_loads_no_top_level_package(tmp_path):
    modules = _all_modules()
    assert "replicafit.cli.command" in modules and "replicafit.strategies.runner" in modules
    result = python(
        f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {OLD_NAMES + ('recipes', 'cli')!r}))\n",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


_OLD_IMPORT = re.compile(
    r"^\s*(?:>>> |\.\.\. )?(?:from\s+(?:strategies|data|optimizers|trainer)(?:\.\w+)*\s+import\b"
    r"|import\s+(?:[\w.]+\s*,\s*)*(?:strategies|data|optimizers|trainer)\b(?!\.\w+\s+as\s+\w+\s*$)(?!\s*=))",
    re.M,
)


def _tracked(*patterns) -> list:
    listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in listed.stdout.splitlines()]


def test_no_top_level_import_remains_anywhere():
    offenders = []
    for path in _tracked("*.py", "*.md", "*.yaml"):
        if path == pathlib.Path(__file__):
            continue
        for match in _OLD_IMPORT.finditer(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []


def test_the_old_import_pattern_catches_what_it_should():
    for text in ("import strategies as ds", "from data import datasets", ">>> import torch, strategies as ds",
                 "    from trainer.callbacks import Callback", "import optimizers"):  # fmt: skip
        assert _OLD_IMPORT.search(text), text
    for text in ("import replicafit.strategies as ds", "from replicafit.data import datasets",
                 "from replicafit import optimizers", "from . import data"):  # fmt: skip
        assert not _OLD_IMPORT.search(text), text


# --- what the distribution installs ---------------------------------------------------------------
def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_every_source_package_is_installed_under_the_root():
    config = _setup_cfg()
    listed = set(config["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in config["options"]["package_dir"].strip().splitlines())
    assert mapping == {"replicafit": "src/replicafit", **MAPPED}
    found = {"replicafit"}
    for package, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert listed == found  # a new subpackage must be listed in setup.cfg, and nothing else is


def test_package_data_ships_the_data_files():
    data = _setup_cfg()["options.package_data"]
    assert "py.typed" in data["replicafit"]
    assert "*.npz" in data["replicafit.data.datasets"]
    assert "*.yaml" in data["replicafit.recipes"]
    scripts = _setup_cfg()["options.entry_points"]["console_scripts"].split()
    assert scripts == ["replicafit", "=", "replicafit.cli:main"]


# --- a user's own modules beside replicafit ---------------------------------------------------------
SHADOWS = ("data/__init__.py", "trainer.py", "optimizers.py", "strategies.py")


@pytest.fixture
def shadowing_project(tmp_path):
    """A project directory with the generic module names a user's project often has."""
    (tmp_path / "data").mkdir()
    for name in SHADOWS:
        (tmp_path / name).write_text('OWNER = "user"\n')
    return tmp_path


@pytest.mark.timeout(120)
def test_a_users_own_modules_do_not_shadow_replicafit(shadowing_project):
    result = python(
        "import data, optimizers, strategies, trainer\n"  # the user's own: the script's directory comes first
        "import torch\n"
        "import replicafit as rf\n"
        "assert trainer.OWNER == data.OWNER == optimizers.OWNER == strategies.OWNER == 'user'\n"
        "x, y = rf.data.datasets.load_digits(normalize=True)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))\n"
        "trainer_ = rf.Trainer(strategy=rf.MirroredStrategy(['cpu:0', 'cpu:1']), seed=0)\n"
        "history = trainer_.fit(model, (x[:256], y[:256]), batch_size=64, epochs=1, verbose=0)\n"
        "print(len(history.history['loss']), rf.trainer.__name__)\n",
        cwd=shadowing_project,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "replicafit.trainer"]


@pytest.mark.timeout(120)
def test_python_dash_m_replicafit_fit_beside_shadowing_modules(shadowing_project):
    result = subprocess.run(
        [sys.executable, "-m", "replicafit", "fit", "digits_mlp", "--set", "fit.epochs=1", "--set", "fit.verbose=0",
         "--run-dir", "run"],
        cwd=shadowing_project, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "validation accuracy:" in result.stdout
    assert (shadowing_project / "run" / "checkpoints" / "last.pt").is_file()
