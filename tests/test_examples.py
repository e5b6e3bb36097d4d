"""Examples run as a user would start them (the multi-worker one launches its own two workers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str) -> subprocess.CompletedProcess:
    """``python examples/<name>`` from the repository root, one intra-op thread; it must succeed."""
    done = subprocess.run(
        [sys.executable, os.path.join("examples", name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.timeout(120)
def test_the_multiworker_example_trains_two_workers_to_95_percent():
    done = run_example("multiworker.py")
    assert done.stdout.count("best validation accuracy") == 1  # the chief's line only
    assert "worker 0 of 2" in done.stdout


@pytest.mark.timeout(120)
def test_the_coming_from_pytorch_example_trains_the_users_own_module():
    done = run_example("from_pytorch.py")
    last = float(done.stdout.split("last validation accuracy: ")[1].split()[0])
    own = float(done.stdout.split("your module on the validation rows: ")[1].split()[0])
    assert last >= 0.95 and own == last  # the user's module holds what fit validated
    assert "learning_rate: " in done.stdout


@pytest.mark.timeout(120)
def test_the_token_classification_example_equals_a_plain_torch_loop():
    done = run_example("token_classification.py")
    difference = float(done.stdout.split("largest weight difference from a plain torch loop: ")[1].split()[0])
    accuracy = float(done.stdout.split("token accuracy after 6 epochs: ")[1].split()[0])
    assert difference <= 2e-6 and accuracy >= 0.95


@pytest.mark.timeout(120)
def test_the_sync_batchnorm_example_takes_one_devices_steps_on_mirrored_and_two_workers():
    done = run_example("digits_cnn_sync_batchnorm.py")  # it asserts the distances itself
    lines = dict(line.split("loss per epoch ") for line in done.stdout.splitlines())
    assert len(lines) == 4 and "2 workers, SyncBatchNorm       " in lines
