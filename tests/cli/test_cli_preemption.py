"""``replicafit fit`` with ``save_before_preemption`` in the recipe: a SIGTERM (to the process, or to the
``--workers`` launcher) ends the run with status 75 and one line, no traceback; rerunning the same command
resumes, and the run's reports and files equal the uninterrupted run's (EarlyStopping's state included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# The workers import the recipe's mw_preemption_scenarios:... callbacks from tests/trainer/, where the module lives
# beside the trainer's multi-worker tests that share it.
SCENARIOS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer")
MULTI = ["--set", "strategy={type: multi_worker_mirrored, timeout_seconds: 20}"]


def replicafit(*argv, timeout=150):
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([SCENARIOS, os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "replicafit", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def recipe_args(backup_dir, signal_at=None) -> list:
    """digits_mlp for 3 epochs (23 steps each) with EarlyStopping, a backup that saves before preemption and,
    with ``signal_at`` (``{iteration, worker, to}``), a SIGTERM at that step."""
    entries = [
        "{type: early_stopping, monitor: val_accuracy, patience: 1, restore_best_weights: true}",
        f"{{type: backup_and_restore, backup_dir: '{backup_dir}', save_before_preemption: true}}",
    ]
    if signal_at:
        fields = ", ".join(f"{key}: {value}" for key, value in signal_at.items())
        entries.append(f"{{type: 'mw_preemption_scenarios:SignalAtIteration', {fields}}}")
    return ["--set", "fit.epochs=3", "--set", "fit.verbose=0", "--set", f"callbacks=[{', '.join(entries)}]"]


def outcome(run_dir) -> tuple:
    """What a run reports and leaves: metrics.json (but the path), history.csv, last.pt's and best.pt's weights."""
    with open(os.path.join(run_dir, "metrics.json")) as file:
        metrics = {k: v for k, v in json.load(file).items() if k != "checkpoint"}
    with open(os.path.join(run_dir, "history.csv")) as file:
        history = file.read()
    files = [
        torch.load(os.path.join(run_dir, "checkpoints", name), weights_only=True)["model"]
        for name in ("last.pt", "best.pt")
    ]
    return metrics, history, files


def assert_same_outcome(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    for saved_a, saved_b in zip(a[2], b[2]):
        assert saved_a.keys() == saved_b.keys() and all(torch.equal(saved_a[k], saved_b[k]) for k in saved_a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [None, 2], ids=["one_process", "two_workers"])
def test_a_preempted_cli_run_exits_75_and_the_same_command_resumes_to_the_uninterrupted_run(tmp_path, workers):
    launch = [*MULTI, "--workers", "2"] if workers else []
    full = replicafit("fit", "digits_mlp", *recipe_args(tmp_path / "b0"), *launch, "--run-dir", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr

    signal_at = {"iteration": 30, "worker": 0, "to": "launcher" if workers else "self"}
    command = ["fit", "digits_mlp", *recipe_args(tmp_path / "b1", signal_at), *launch, "--run-dir", str(tmp_path / "r")]
    stopped = replicafit(*command)
    assert stopped.returncode == 75, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert "replicafit: fit stopped on SIGTERM at epoch 1, after step" in stopped.stderr
    if workers:
        assert "SIGTERM received; the workers stopped at an agreed step and wrote their backup" in stopped.stderr
        assert "restarting" not in stopped.stderr
    assert os.path.exists(tmp_path / "b1" / "backup.pt")

    resumed = replicafit(*command)  # the same command
    assert resumed.returncode == 0, resumed.stderr
    assert not os.path.exists(tmp_path / "b1" / "backup.pt")
    assert_same_outcome(outcome(tmp_path / "r"), outcome(tmp_path / "full"))
