"""Examples run as a user would start them (the multi-worker one launches its own two workers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_the_multiworker_example_trains_two_workers_to_95_percent():
    done = subprocess.run(
        [sys.executable, os.path.join("examples", "multiworker.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("best validation accuracy") == 1  # the chief's line only
    assert "worker 0 of 2" in done.stdout


@pytest.mark.timeout(120)
def test_the_coming_from_pytorch_example_trains_the_users_own_module():
    done = subprocess.run(
        [sys.executable, os.path.join("examples", "from_pytorch.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = float(done.stdout.split("last validation accuracy: ")[1].split()[0])
    own = float(done.stdout.split("your module on the validation rows: ")[1].split()[0])
    assert last >= 0.95 and own == last  # the user's module holds what fit validated
    assert "learning_rate: " in done.stdout
