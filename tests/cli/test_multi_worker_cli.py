"""``replicafit fit RECIPE --workers 2``: the shipped recipe across two processes equals Mirrored(2); a worker
killed mid-run is restarted with the others and the run ends as the uninterrupted one did; ``fully_sharded``
runs the same recipe with its parameters sharded over the two workers and ends where it does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

# The workers import the recipe's mw_fit_scenarios:... callbacks from tests/trainer/, where the module lives
# beside the trainer's multi-worker tests that share it.
SCENARIOS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer")
SHORT = ["--set", "fit.epochs=2", "--set", "callbacks=[]", "--set", "fit.verbose=0"]
MULTI = ["--set", "strategy={type: multi_worker_mirrored, timeout_seconds: 20}"]
SHARDED = ["--set", "strategy={type: fully_sharded, timeout_seconds: 60}"]


def replicafit(*argv, timeout=120):
    # One intra-op thread everywhere (the launcher's choice for 2 workers on 2 cores): a matmul's
    # result can differ in the last bit with the thread count, which is not what is compared here.
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([SCENARIOS, os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "replicafit", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def final(run_dir) -> dict:
    with open(os.path.join(run_dir, "metrics.json")) as file:
        return json.load(file)["final"]


def weights(run_dir) -> dict:
    return torch.load(os.path.join(run_dir, "checkpoints", "last.pt"), weights_only=True)["model"]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("workers") / "run"
    done = replicafit("fit", "digits_mlp", *SHORT, *MULTI, "--workers", "2", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir, done


@pytest.mark.timeout(180)
def test_two_workers_reach_what_mirrored_two_reaches(two_workers, tmp_path):
    run_dir, done = two_workers
    mirrored = replicafit("fit", "digits_mlp", *SHORT, "--run-dir", str(tmp_path / "mirrored"))
    assert mirrored.returncode == 0, mirrored.stderr
    assert final(run_dir) == final(tmp_path / "mirrored")  # bit for bit: 2 workers sum like 2 replicas
    assert done.stdout.count("validation accuracy:") == 1  # the chief's output only
    files = sorted(os.listdir(run_dir))
    assert files == ["checkpoints", "history.csv", "metrics.json", "recipe.yaml"] or "history.png" in files
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["best.pt", "last.pt"]


@pytest.mark.timeout(180)
def test_the_recipe_key_shard_optimizer_states_gives_the_same_run_and_checkpoint(two_workers, tmp_path):
    run_dir, _ = two_workers
    sharded = ["--set", "strategy={type: multi_worker_mirrored, timeout_seconds: 20, shard_optimizer_states: true}"]
    done = replicafit("fit", "digits_mlp", *SHORT, *sharded, "--workers", "2", "--run-dir", str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr
    assert final(tmp_path / "s") == final(run_dir)  # element-wise updates of each part: bit for bit on 2 workers
    ours = torch.load(tmp_path / "s" / "checkpoints" / "last.pt", weights_only=True)
    theirs = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    for position, slots in theirs["optimizer"]["slots"].items():  # gathered into the unsharded layout
        for name, value in slots.items():
            assert torch.equal(ours["optimizer"]["slots"][position][name], value), (position, name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "strategy",
    [
        SHARDED,
        # every key of the entry: the Linear layers are units of their own, kept gathered from forward to
        # backward, their activations recomputed
        [
            "--set",
            "strategy={type: fully_sharded, timeout_seconds: 60, shard_units: [Linear], "
            "reshard_after_forward: false, activation_checkpointing: true}",
        ],
    ],
    ids=["plain", "every_key"],
)
def test_fully_sharded_on_two_workers_ends_where_multi_worker_mirrored_does(two_workers, tmp_path, strategy):
    """The two workers' gradients are summed (a reduce-scatter of two values, as the all-reduce adds them) and
    the updates are element-wise: bit for bit the run of multi_worker_mirrored, whose shards are the halves."""
    run_dir = tmp_path / "sharded"
    done = replicafit("fit", "digits_mlp", *SHORT, *strategy, "--workers", "2", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("validation accuracy:") == 1  # the chief's output only
    assert final(run_dir) == final(two_workers[0])
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["best.pt", "last.pt"]
    ours, theirs = weights(run_dir), weights(two_workers[0])
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # last.pt is consolidated: whole plain tensors, as torch.load reads them
        assert type(ours[key]) is torch.Tensor and torch.equal(ours[key], value), key


@pytest.mark.timeout(120)
def test_fully_sharded_units_naming_no_class_of_the_model_fail_every_worker_before_training(tmp_path):
    bad = ["--set", "strategy={type: fully_sharded, timeout_seconds: 60, shard_units: [GPT2Block]}"]
    done = replicafit("fit", "digits_mlp", *SHORT, *bad, "--workers", "2", "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "strategy.shard_units: shard_units=['GPT2Block'] names no submodule of Sequential" in done.stderr
    assert re.search(r"worker [01] failed first \(exit code 2\)", done.stderr)  # whichever exits first
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(240)
def test_a_killed_worker_is_restarted_with_the_others_and_the_run_ends_bit_identical(tmp_path):
    backup = ["--set", f"callbacks=[{{type: backup_and_restore, backup_dir: '{tmp_path / 'backup'}', save_freq: 1}}]"]
    straight = replicafit(
        "fit", "digits_mlp", *SHORT, *MULTI, *backup, "--workers", "2", "--run-dir", str(tmp_path / "a")
    )
    assert straight.returncode == 0, straight.stderr
    marker = tmp_path / "killed"
    killing = [
        "--set",
        # (the periodic backups alone: a survivor's backup after the kill lacks the dead worker's metric accumulators)
        f"callbacks=[{{type: backup_and_restore, backup_dir: '{tmp_path / 'backup2'}', save_freq: 1, "
        "save_on_peer_failure: false}, "
        f"{{type: 'mw_fit_scenarios:KillAt', worker: 1, step: 30, marker: '{marker}'}}]",
    ]
    run_dir = tmp_path / "b"
    restarted = replicafit(
        "fit",
        "digits_mlp",
        *SHORT,
        *MULTI,
        *killing,
        "--workers",
        "2",
        "--max-restarts",
        "1",
        "--run-dir",
        str(run_dir),
    )
    assert restarted.returncode == 0, restarted.stderr
    assert marker.exists()
    assert "worker 1 failed first" in restarted.stderr and "SIGKILL" in restarted.stderr
    assert "restarting all 2 workers" in restarted.stderr
    assert final(run_dir) == final(tmp_path / "a")
    for key, value in weights(tmp_path / "a").items():
        assert torch.equal(weights(run_dir)[key], value), key


@pytest.mark.timeout(120)
def test_without_restarts_a_killed_worker_fails_the_launch(tmp_path):
    marker = tmp_path / "killed"
    killing = ["--set", f"callbacks=[{{type: 'mw_fit_scenarios:KillAt', worker: 1, step: 3, marker: '{marker}'}}]"]
    done = replicafit("fit", "digits_mlp", *SHORT, *MULTI, *killing, "--workers", "2", "--run-dir", str(tmp_path / "r"))
    assert done.returncode != 0
    assert "worker 1 failed first" in done.stderr


@pytest.mark.timeout(180)
def test_the_same_recipe_runs_unchanged_under_torchrun(two_workers, tmp_path):
    run_dir = tmp_path / "torchrun"
    # TMPDIR: torchrun's agent leaves a torchelastic_* log folder in the temporary folder; keep it in tmp_path.
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "replicafit", "fit", "digits_mlp", *SHORT, *MULTI, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert final(run_dir) == final(two_workers[0])  # the same cluster, however it was started
