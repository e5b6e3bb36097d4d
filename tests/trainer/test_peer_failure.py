"""A worker dies or stops mid-fit: a survivor writes the backup of the last step every worker finished, and the
run resumed from it equals the uninterrupted one, reading each example once (``trainer.peer_failure``)."""

from __future__ import annotations

import collections
import os

import pytest
import torch
from multiworker_harness import results, run_workers

from replicafit.trainer import peer_failure

SCENARIOS = os.path.join(os.path.dirname(__file__), "mw_peer_failure_scenarios.py")
ROWS, BATCH = 96, 8
STEPS = ROWS // BATCH


def _reads(folder, name, workers, resumed=False) -> dict:
    """``{epoch: Counter(example -> reads)}`` over every worker's log of the run ``name``. What a worker reads
    before its first epoch begins is the entry checks' look at the first step of epoch 0: trained on in a fresh
    run; in a ``resumed`` one read before the backup is restored, and dropped (``"look"``: one step's rows; the
    restored data order and random state are read anew)."""
    counts: dict = collections.defaultdict(collections.Counter)
    for rank in range(workers):
        path = os.path.join(folder, f"reads-{name}-{rank}.txt")
        epoch = "look" if resumed else 0
        with open(path) as file:
            for line in file:
                if line.startswith("epoch"):
                    epoch = int(line.split()[1])
                else:
                    counts[epoch][int(line)] += 1
    return counts


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    return results(run_workers(SCENARIOS, "run", 2, timeout=90, kwargs={"outdir": str(folder)}))[0]


def _backup(folder) -> dict:
    return torch.load(os.path.join(folder, "backup", "backup.pt"), weights_only=True)


def _fault_then_resume(folder, fault, workers=2, both=None, **kwargs) -> tuple:
    """The faulty run's outcomes, the backup it left, and the resumed run's results (``both``: arguments of both
    runs, ``kwargs``: of the faulty one)."""
    both = {"outdir": str(folder), **(both or {})}
    first = run_workers(
        SCENARIOS, "run", workers, timeout=90, kwargs={**both, "name": "first", "fault": fault, **kwargs}
    )
    saved = _backup(folder)
    again = results(run_workers(SCENARIOS, "run", workers, timeout=90, kwargs={**both, "name": "again"}))
    return first, saved, again


def _same_weights(run, reference):
    for key, value in reference["weights"].items():
        torch.testing.assert_close(run["weights"][key], value, rtol=0, atol=1e-6)


def _read_once_from(folder, saved, workers=2):
    """The resumed run read every example of the interrupted epoch's remaining steps once, and each example of
    the later epochs once; with the first run's reads of that epoch, every example was read."""
    first, again = _reads(folder, "first", workers), _reads(folder, "again", workers, resumed=True)
    assert sum(again["look"].values()) == BATCH
    epoch, step = saved["epoch"], saved["step"]
    resumed = again[epoch]
    assert sum(resumed.values()) == ROWS - step * BATCH
    assert max(resumed.values()) == 1
    assert set(resumed) | set(first[epoch]) == set(range(ROWS))
    for later in range(epoch + 1, 3):
        assert sum(again[later].values()) == ROWS and max(again[later].values()) == 1


@pytest.mark.timeout(240)
def test_a_worker_killed_after_a_step_loses_no_step_and_the_resumed_run_equals_the_straight_one(tmp_path, straight):
    first, saved, again = _fault_then_resume(tmp_path, (1, 6, "batch_end", "SIGKILL"))
    assert first[1]["exitcode"] == -9
    assert "WorkerFailedError" in first[0]["error"]
    assert (
        "Worker 0 wrote the backup of the last step every worker finished (epoch 0 after step 6)" in first[0]["error"]
    )
    assert (saved["epoch"], saved["step"]) == (0, 6)  # no periodic backup was due: save_freq="epoch"
    _same_weights(again[0], straight)
    _same_weights(again[1], straight)
    _read_once_from(tmp_path, saved)
    assert again[0]["history"]["loss"][1:] == pytest.approx(straight["history"]["loss"][1:], abs=1e-6)


@pytest.mark.timeout(240)
def test_the_chief_killed_mid_step_the_other_writes_the_backup_of_the_step_before(tmp_path, straight):
    # Killed inside the forward of the step after iteration 15: the survivor fails in that step's reduction.
    first, saved, again = _fault_then_resume(tmp_path, (0, 15, "forward", "SIGKILL"))
    assert first[0]["exitcode"] == -9
    assert "Worker 1 wrote the backup" in first[1]["error"] and "(epoch 1 after step 3)" in first[1]["error"]
    assert (saved["epoch"], saved["step"]) == (1, 3)
    _same_weights(again[0], straight)
    _read_once_from(tmp_path, saved)


@pytest.mark.timeout(240)
def test_the_dead_workers_dropout_streams_are_drawn_again_and_the_resumed_run_equals_the_straight_one(tmp_path):
    """The chief, killed inside a step, takes replica 0's stream with it; the survivor's backup holds only its own.
    fit keys every replica's stream by (seed, global replica id, epoch, step), so the resumed run draws the masks
    the straight run drew. Before: replica 0 started a fresh stream and the weights went elsewhere."""
    os.makedirs(tmp_path / "a"), os.makedirs(tmp_path / "b")
    straight = results(
        run_workers(SCENARIOS, "run", 2, timeout=90, kwargs={"outdir": str(tmp_path / "a"), "dropout": 0.3})
    )[0]
    first, saved, again = _fault_then_resume(tmp_path / "b", (0, 15, "forward", "SIGKILL"), both={"dropout": 0.3})
    assert "Worker 1 wrote the backup" in first[1]["error"] and "(epoch 1 after step 3)" in first[1]["error"]
    assert saved["replica_rng"]["cpu"][0] is None  # (the dead worker's stream: not in the backup)
    _same_weights(again[0], straight)
    _same_weights(again[1], straight)
    assert again[0]["history"]["loss"][2:] == pytest.approx(straight["history"]["loss"][2:], abs=1e-6)


@pytest.mark.timeout(240)
def test_a_stopped_worker_is_found_by_the_timeout_and_the_survivor_saves(tmp_path, straight):
    first, saved, again = _fault_then_resume(tmp_path, (1, 4, "batch_end", "SIGSTOP"), timeout=5.0)
    assert "Worker 0 wrote the backup" in first[0]["error"] and "(epoch 0 after step 4)" in first[0]["error"]
    _same_weights(again[0], straight)
    _read_once_from(tmp_path, saved)


@pytest.mark.timeout(240)
def test_a_failure_in_validation_saves_the_epochs_training_steps(tmp_path, straight):
    first, saved, again = _fault_then_resume(tmp_path, (1, 12, "validation", "SIGKILL"))
    assert "(epoch 0 after step 12)" in first[0]["error"]
    assert (saved["epoch"], saved["step"]) == (0, STEPS)
    _same_weights(again[0], straight)
    assert again[0]["history"]["val_loss"] == pytest.approx(straight["history"]["val_loss"], abs=1e-6)


@pytest.mark.timeout(240)
def test_of_three_workers_one_survivor_writes_and_both_say_so(tmp_path):
    folder = tmp_path
    first = run_workers(
        SCENARIOS,
        "run",
        3,
        timeout=90,
        kwargs={"outdir": str(folder), "name": "first", "fault": (2, 5, "batch_end", "SIGKILL")},
    )
    assert first[2]["exitcode"] == -9
    errors = [first[0]["error"], first[1]["error"]]
    writers = [e for e in errors if "wrote the backup" in e]
    assert len(writers) == 1  # (the same progress: the lower rank, unless it noticed the failure past the settle time)
    assert any("Another surviving worker writes the backup" in e for e in errors)
    assert (_backup(folder)["epoch"], _backup(folder)["step"]) == (0, 5)


@pytest.mark.timeout(240)
def test_no_backup_before_the_first_step_inside_an_accumulation_window_or_under_sharding(tmp_path):
    cases = {
        "first_step": ({"fault": (1, 0, "first_step", "SIGKILL")}, "before the first training step"),
        "window": ({"fault": (1, 3, "batch_index", "SIGKILL"), "accumulate": 3}, "inside a gradient accumulation"),
        "sharded": ({"fault": (1, 4, "batch_end", "SIGKILL"), "fully_sharded": True}, "sharded across the workers"),
        "states": ({"fault": (1, 4, "batch_end", "SIGKILL"), "shard_states": True}, "sharded across the workers"),
    }
    for case, (kwargs, said) in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        first = run_workers(SCENARIOS, "run", 2, timeout=90, kwargs={"outdir": str(folder), "name": "first", **kwargs})
        assert f"No backup was written on this failure: it came {said}" in first[0]["error"] or (
            said in first[0]["error"]
        ), first[0]["error"]
        assert not os.path.exists(folder / "backup" / "backup.pt")


@pytest.mark.timeout(240)
def test_switched_off_the_last_periodic_backup_stands(tmp_path):
    first = run_workers(
        SCENARIOS,
        "run",
        2,
        timeout=90,
        kwargs={"outdir": str(tmp_path), "name": "first", "fault": (1, 6, "batch_end", "SIGKILL"), "save_freq": 4},
    )
    assert (_backup(tmp_path)["epoch"], _backup(tmp_path)["step"]) == (0, 6)  # a periodic one is due at 4: the newer
    off = tmp_path / "off"
    off.mkdir()
    first = run_workers(
        SCENARIOS,
        "run",
        2,
        timeout=90,
        kwargs={
            "outdir": str(off),
            "name": "first",
            "fault": (1, 6, "batch_end", "SIGKILL"),
            "save_freq": 4,
            "save_on_peer_failure": False,
        },
    )
    assert "wrote the backup" not in first[0]["error"]
    assert (_backup(off)["epoch"], _backup(off)["step"]) == (0, 4)


def test_the_survivors_choose_the_furthest_then_the_lowest_rank(tmp_path):
    def noted(folder, rank, progress):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"worker-{rank}.json"), "w") as file:
            file.write(f'{{"rank": {rank}, "progress": {list(progress)}}}')

    # Worker 2 got one step further (its reduction completed as the peer died): it writes, worker 1 does not.
    further = str(tmp_path / "further")
    noted(further, 2, (0, 6, 0))
    assert not peer_failure.claim(further, 1, (0, 5, 0), survivors=2, settle_seconds=5.0)
    assert peer_failure.claim(further, 2, (0, 6, 0), survivors=2, settle_seconds=5.0)
    assert not peer_failure.claim(further, 2, (0, 6, 0), survivors=2, settle_seconds=5.0)  # decided once
    tie = str(tmp_path / "tie")
    noted(tie, 1, (1, 0, 1))
    assert peer_failure.claim(tie, 0, (1, 0, 1), survivors=2, settle_seconds=5.0)
    alone = str(tmp_path / "alone")  # the other survivor never comes: the wait ends at the settle time
    assert peer_failure.claim(alone, 3, (0, 2, 0), survivors=2, settle_seconds=0.2)


@pytest.mark.timeout(240)
def test_a_periodic_backup_of_that_very_step_stands(tmp_path, straight):
    # A backup every step: the one of step 6 holds every worker's part; the failure in step 7's reduction keeps it.
    first, saved, again = _fault_then_resume(tmp_path, (1, 6, "forward", "SIGKILL"), save_freq=1)
    assert (
        "The backup of the last step every worker finished (epoch 0 after step 6) was written before"
        in (first[0]["error"])
    )
    assert (saved["epoch"], saved["step"]) == (0, 6)
    assert len(saved["replica_rng"]["cpu"]) == 2 and saved["replica_rng"]["cpu"][1] is not None
    _same_weights(again[0], straight)


@pytest.mark.timeout(240)
def test_two_workers_lost_at_once_the_last_one_writes_alone(tmp_path, straight):
    first, saved, again = _fault_then_resume(tmp_path, ([1, 2], 6, "batch_end", "SIGKILL"), workers=3)
    assert first[1]["exitcode"] == first[2]["exitcode"] == -9
    said = "Worker 0 wrote the backup of the last step every worker finished (epoch 0 after step 6)"
    assert said in first[0]["error"]  # (after waiting for the notes of two survivors that never came)
    _same_weights(again[0], straight)
    _read_once_from(tmp_path, saved, workers=3)


@pytest.mark.timeout(240)
def test_a_survivor_lost_while_it_writes_leaves_the_last_periodic_backup_whole(tmp_path, straight):
    first, saved, again = _fault_then_resume(
        tmp_path, (2, 6, "batch_end", "SIGKILL"), workers=3, save_freq=4, die_in_save=True
    )
    writers = [rank for rank in (0, 1) if first[rank]["exitcode"] == -9]
    assert len(writers) == 1  # the one that took the decision died in its write
    other = 1 - writers[0]
    assert "Another surviving worker writes the backup" in first[other]["error"]
    assert (saved["epoch"], saved["step"]) == (0, 4)  # the periodic one, whole (the half-written file was aside)
    _same_weights(again[0], straight)


@pytest.mark.timeout(240)
def test_a_run_that_finished_stays_finished_when_a_worker_dies_at_its_end(tmp_path, straight):
    # Worker 1 dies in on_train_end, as the chief deletes the backup: the survivor writes the finished run's.
    first, saved, again = _fault_then_resume(tmp_path, (1, 0, "train_end", "SIGKILL"), timeout=5.0)
    assert "(epoch 3 at its start)" in first[0]["error"]
    assert (saved["epoch"], saved["step"]) == (3, 0)
    assert again[0]["iterations"] == straight["iterations"]  # the restart trained nothing again
    assert set(_reads(tmp_path, "again", 2, resumed=True)) <= {"look"}  # no epoch began
    _same_weights(again[0], straight)
    assert again[0]["history"]["loss"] == pytest.approx(straight["history"]["loss"], abs=1e-6)


@pytest.mark.timeout(240)
def test_a_failure_in_the_reduction_that_ends_an_accumulation_window_writes_nothing(tmp_path):
    # Steps 3, 4, 5 make a window; worker 1 dies in step 5's forward, worker 0 in that step's reduction, which
    # closes the window before it reduces: a backup "after step 5" would hold neither the update nor the window.
    kwargs = {"outdir": str(tmp_path), "name": "first", "fault": (1, 5, "forward_index", "SIGKILL"), "accumulate": 3}
    first = run_workers(SCENARIOS, "run", 2, timeout=90, kwargs=kwargs)
    assert (
        "No backup was written on this failure: it came inside a gradient accumulation window" in (first[0]["error"])
    ), first[0]["error"]
    assert not os.path.exists(tmp_path / "backup" / "backup.pt")


@pytest.mark.timeout(240)
def test_the_failed_steps_forward_is_undone_in_the_backup_batchnorm_statistics_included(tmp_path):
    # The chief dies in step 5's forward; worker 1 ran that forward (its statistics moved) and fails in the reduction.
    kwargs = {"fault": (0, 5, "forward_index", "SIGKILL"), "batchnorm": True, "watch_stats": True}
    first = run_workers(SCENARIOS, "run", 2, timeout=90, kwargs={"outdir": str(tmp_path), "name": "first", **kwargs})
    assert "Worker 1 wrote the backup" in first[1]["error"] and "(epoch 0 after step 5)" in first[1]["error"]
    with open(tmp_path / "watch-stats-1") as file:
        after_step = [[float(v) for v in line.split()] for line in file]
    saved = _backup(tmp_path)["model"]["1.running_mean"]
    assert saved.tolist() == pytest.approx(after_step[4], abs=1e-6)  # after step 5, not after the failed forward


@pytest.mark.timeout(240)
def test_a_survivor_that_writes_for_a_lost_chief_keeps_the_chiefs_csv_rows(tmp_path):
    with open(tmp_path / "history.csv", "w") as file:
        file.write("epoch,loss\n0,1.0\n")  # an earlier fit's rows: append=True keeps them
    earlier = os.path.getsize(tmp_path / "history.csv")
    kwargs = {"outdir": str(tmp_path), "name": "first", "fault": (0, 15, "forward", "SIGKILL"), "csv": True}
    first = run_workers(SCENARIOS, "run", 2, timeout=90, kwargs=kwargs)
    assert "Worker 1 wrote the backup" in first[1]["error"]
    state = _backup(tmp_path)["callbacks"]["CSVLogger_0"]  # the chief's, from its backup of epoch 1's start
    assert state["offset"] == earlier and len(state["rows"]) == 1


@pytest.mark.timeout(120)
def test_a_peer_lost_after_fit_returned_leaves_the_survivor_to_write_last_pt_alone(tmp_path):
    outcomes = run_workers(SCENARIOS, "last_after_fit", 2, timeout=90, kwargs={"outdir": str(tmp_path)})
    assert outcomes[1]["exitcode"] == -9
    assert outcomes[0]["ok"], outcomes[0]["error"]
    assert outcomes[0]["result"] == (True, STEPS)
