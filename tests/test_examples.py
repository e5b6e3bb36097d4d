"""The multi-worker example runs as a user would start it (it launches its own two workers)."""

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
