"""``replicafit fit RECIPE --workers 2 --max-restarts K``: a worker SIGKILLed or SIGSTOPped mid-epoch, a backup per
epoch only. A survivor writes the backup of the last step every worker finished, the launcher restarts both, and
the run ends with the uninterrupted run's weights (within 1e-6), each training example read once per epoch
across the two starts (none of the failed start's finished steps read again). ``--min-workers 1``: a worker that
fails in two starts in a row is left out, and the run ends on one worker, alike."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
import torch

TRAINER_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer")
TRAIN_ROWS, BATCH = 1438, 64  # digits after the 0.2 validation split; the recipe's global batch


def replicafit(*argv, timeout=240):
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([TRAINER_TESTS, os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "replicafit", "fit", "digits_mlp", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def recipe(folder, fault=None, timeout=20) -> list:
    """``--set`` arguments: 3 epochs, counted reads, a backup per epoch, and ``fault`` (FaultAt's arguments)."""
    entries = [
        f"{{type: 'mw_peer_failure_scenarios:EpochLog', log_dir: '{folder / 'reads'}'}}",
        f"{{type: backup_and_restore, backup_dir: '{folder / 'backup'}'}}",
    ]
    if fault is not None:
        args = ", ".join(f"{key}: {value!r}" for key, value in fault.items())
        entries.append(f"{{type: 'mw_peer_failure_scenarios:FaultAt', marker_dir: '{folder / 'fired'}', {args}}}")
    reads = folder / "reads"
    return [
        "--set", "fit.epochs=3", "--set", "fit.verbose=0",
        "--set", f"data={{type: 'mw_peer_failure_scenarios:counted_digits', log_dir: '{reads}', batch_size: 64}}",
        "--set", f"strategy={{type: multi_worker_mirrored, timeout_seconds: {timeout}}}",
        "--set", f"callbacks=[{', '.join(entries)}]",
        "--run-dir", str(folder / "run"),
    ]  # fmt: skip


def weights(folder) -> dict:
    return torch.load(folder / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]


def reads(folder) -> dict:
    """``{(attempt, epoch): Counter(example -> reads)}`` over every worker process. A process reads example 0
    first, for the recipe's sizes (``epoch`` ``"sizes"``); then, before its first epoch begins, the entry checks'
    look at the data's first step (``"look"``: trained on in a fresh start; in a restarted one read before the
    backup's restore, for nothing)."""
    counts: dict = collections.defaultdict(collections.Counter)
    for name in os.listdir(folder / "reads"):
        with open(folder / "reads" / name) as file:
            attempt, epoch = None, "sizes"
            for line in file:
                if line.startswith("attempt"):
                    attempt = int(line.split()[1])
                elif line.startswith("epoch"):
                    epoch = int(line.split()[1])
                else:
                    counts[attempt, epoch][int(line)] += 1
                    epoch = "look" if epoch == "sizes" else epoch
    return counts


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    done = replicafit(*recipe(folder), "--workers", "2")
    assert done.returncode == 0, done.stderr
    return weights(folder)


def _close(mine, reference):
    for key, value in reference.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_worker_lost_mid_epoch_costs_no_step_and_the_run_ends_as_the_uninterrupted_one(tmp_path, straight, how):
    fault = {"worker": 1, "step": 30, "signal": how}  # epoch 1 (23 steps an epoch), after its 7th step
    done = replicafit(*recipe(tmp_path, fault, timeout=5), "--workers", "2", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    assert "restarting all 2 workers" in done.stderr
    said = "Worker 0 wrote the backup of the last step every worker finished (epoch 1 after step 7)"
    assert said in done.stderr, done.stderr
    _close(weights(tmp_path), straight)
    counts = reads(tmp_path)
    assert counts[1, "sizes"] == {0: 2}  # each restarted worker read example 0 for the recipe's sizes
    assert sum(counts[1, "look"].values()) == BATCH  # the restart's entry checks, before the backup's restore
    first, second = counts[0, 1], counts[1, 1]
    assert sum(second.values()) == TRAIN_ROWS - 7 * BATCH and max(second.values()) == 1  # no finished step again
    assert set(first) | set(second) == set(range(TRAIN_ROWS))
    epoch0 = counts[0, 0] + counts[0, "look"]  # the other epochs: each example once, in one start
    assert sum(epoch0.values()) == TRAIN_ROWS and max(epoch0.values()) == 1
    assert sum(counts[1, 2].values()) == TRAIN_ROWS and max(counts[1, 2].values()) == 1


@pytest.mark.timeout(300)
def test_a_worker_that_fails_in_two_starts_in_a_row_is_left_out_with_min_workers(tmp_path, straight):
    fault = {"worker": 1, "step": 30, "times": 2}
    done = replicafit(*recipe(tmp_path, fault), "--workers", "2", "--max-restarts", "2", "--min-workers", "1")
    assert done.returncode == 0, done.stderr
    assert "worker 1 failed in two attempts in a row: going on with 1 worker(s)" in done.stderr, done.stderr
    assert len(os.listdir(tmp_path / "fired")) == 2
    _close(weights(tmp_path), straight)


def test_min_workers_is_checked_before_anything_runs(tmp_path):
    done = replicafit(*recipe(tmp_path), "--workers", "2", "--min-workers", "1", timeout=60)
    assert done.returncode == 2 and "--min-workers goes with --max-restarts" in done.stderr
    done = replicafit(*recipe(tmp_path), "--workers", "2", "--max-restarts", "1", "--min-workers", "3", timeout=60)
    assert done.returncode == 2 and "--min-workers must be between 1 and --workers (2), got 3" in done.stderr
