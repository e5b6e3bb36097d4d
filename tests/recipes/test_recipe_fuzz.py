"""A small seeded share of benchmarks/fuzz_recipes.py, in-process: every mutated shipped recipe through
``replicafit validate`` ends in ``ok`` or one ``error:`` line (exit 0 or 2) and touches no file.

The whole fuzz (hundreds of mutations, child processes, a memory cap, datasets larger than memory):
``python benchmarks/fuzz_recipes.py``. This test runs without a memory cap, so it leaves those out.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from replicafit import cli

FUZZ = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_recipes.py"


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_recipes", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = load_fuzz()
CASES = fuzz.mutations(seed=20240601, count=120, heavy=False)


def test_the_mutations_are_seeded_and_varied():
    again = fuzz.mutations(seed=20240601, count=120, heavy=False)
    assert [(name, data, argv) for name, data, argv in again] == CASES
    kinds = {part for name, _, _ in CASES for part in name.split("-", 2)[2].split("+")}
    assert {"type", "scalar", "anchor", "nesting"} <= kinds, kinds


@pytest.mark.timeout(60)
def test_mutated_recipes_validate_to_ok_or_one_error_line(tmp_path, capsys, monkeypatch):
    failures = []
    for index, (name, data, argv) in enumerate(CASES):
        folder = tmp_path / f"case{index}"
        folder.mkdir()
        (folder / "recipe.yaml").write_bytes(data)
        (folder / fuzz.KEEP).write_text("")
        monkeypatch.chdir(folder)
        try:
            status = cli.main(["validate", "recipe.yaml", *argv])
        except BaseException as error:  # noqa: BLE001 - what this test looks for
            failures.append(f"{name}: {type(error).__name__}: {error}")
            continue
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        if status not in (0, 2) or "Traceback" in err:
            failures.append(f"{name}: exit {status}: {err[-500:]}")
        elif status == 2 and not (len(lines) == 1 and lines[0].startswith("error: ")):
            failures.append(f"{name}: not one error line: {err[-500:]}")
        changed = fuzz._files_changed(str(folder))
        if changed:
            failures.append(f"{name}: files created or removed: {changed}")
    assert not failures, "\n".join(failures)
