"""A backup resumes on another number of workers or replicas with the same global batch size: the data position,
the optimizer (slots, iterations, an open accumulation window), the metric accumulators, the callbacks' states and
the random streams carry over, and the run goes on with the same global batches. For a model without per-replica
state (no dropout, no BatchNorm) the resumed run equals the uninterrupted one up to float rounding (the order of
sums differs with the number of replicas): ``TOLERANCE``. Another *global* batch size is refused.

Measured (max |difference| over weights, Adam's slots and every history value, against the uninterrupted run of
the saving strategy): about 1e-7 for every transition here; same-count resumes are bit-identical.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import mw_resume_scenarios as scenarios
import pytest
import torch
from multiworker_harness import results, run_workers

import replicafit.strategies as ds
from replicafit.strategies.rng import replica_seed
from replicafit.trainer import BackupAndRestore, Callback, CheckpointError, Trainer, checkpoint

SCENARIOS = scenarios.__file__
TOLERANCE = 1e-5
CRASH_AT = 23  # 10 steps an epoch: the last backup is after global step 21 (epoch 2, 1 step in, mid-window)


# --- comparing runs -----------------------------------------------------------------------------------------------


def max_difference(got: dict, want: dict) -> float:
    """The largest |difference| between two runs' weights, optimizer slots, history values and callback states;
    what must match exactly (iterations, epochs, history keys and lengths) is asserted."""
    assert not got["crashed"] and not want["crashed"]
    assert got["iterations"] == want["iterations"]
    assert got["epoch"] == want["epoch"]
    assert got["history"].keys() == want["history"].keys()
    worst = 0.0
    for key, value in want["weights"].items():
        worst = max(worst, float((got["weights"][key] - value).abs().max()))
    assert got["slots"].keys() == want["slots"].keys()
    for position, slots in want["slots"].items():
        assert got["slots"][position].keys() == slots.keys()
        for name, value in slots.items():
            worst = max(worst, float((got["slots"][position][name] - value).abs().max()))
    for key, values in want["history"].items():
        assert len(got["history"][key]) == len(values), key
        worst = max([worst, *(abs(a - b) for a, b in zip(got["history"][key], values))])
    worst = max(worst, abs(got["learning_rate"] - want["learning_rate"]))
    for name, state in want["callbacks"].items():
        for key, value in state.items():
            other = got["callbacks"][name][key]
            if isinstance(value, float) and math.isfinite(value):
                worst = max(worst, abs(other - value))
            else:
                assert other == value, (name, key)
    return worst


def assert_same_run(got: dict, want: dict, what: str) -> float:
    worst = max_difference(got, want)
    assert worst <= TOLERANCE, f"{what}: max |difference| {worst:.3g}"
    return worst


def interrupted(strategy, backup, **settings) -> None:
    """A run interrupted at ``CRASH_AT``; its backup is kept, mid-epoch."""
    assert scenarios.resume_run(strategy, backup, crash_at=CRASH_AT, **settings)["crashed"]
    state = torch.load(os.path.join(backup, "backup.pt"), weights_only=True)
    assert (state["epoch"], state["step"]) == (2, 1)


# --- one process: Mirrored(3) <-> the default strategy ------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulating"])
@pytest.mark.parametrize("source", ["arrays", "loader"])
@pytest.mark.parametrize("saved_under, resumed_under", [("mirrored3", "default"), ("default", "mirrored3")])
def test_a_backup_resumes_in_one_process_on_another_number_of_replicas(
    tmp_path, saved_under, resumed_under, source, accumulate
):
    settings = {"source": source, "accumulate": accumulate}
    straight = scenarios.resume_run(scenarios.strategy_of(saved_under), str(tmp_path / "straight"), **settings)
    backup = str(tmp_path / "backup")
    interrupted(scenarios.strategy_of(saved_under), backup, **settings)
    if accumulate:  # the window of the saving run is open: 1 step of 4
        assert torch.load(os.path.join(backup, "backup.pt"), weights_only=True)["optimizer"]["accumulation"]["count"]
    resumed = scenarios.resume_run(scenarios.strategy_of(resumed_under), backup, init_seed=9, **settings)
    assert_same_run(resumed, straight, f"{saved_under} -> {resumed_under}")
    assert resumed["learning_rate"] < 0.02  # ReduceLROnPlateau lowered it (before the interruption)
    assert resumed["callbacks"]["stopping"]["wait"] == 1  # EarlyStopping's best of epoch 1 carried over


# --- several workers ------------------------------------------------------------------------------------------------


def run_side(side: str, backup: str, **settings) -> list:
    """``"w<N>"``: N worker processes (one replica each), every worker's result; else one in-process strategy."""
    if side.startswith("w"):
        kwargs = {"backup_dir": backup, **settings}
        return results(run_workers(SCENARIOS, "worker", int(side[1:]), timeout=90, kwargs=kwargs))
    return [scenarios.resume_run(scenarios.strategy_of(side), backup, **settings)]


# The uninterrupted run of the saving side, in this process: N workers of one replica train as Mirrored(N).
STRAIGHT = {"w1": "default", "w2": "mirrored2"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "saved_by, resumed_by, source, accumulate",
    [
        ("w2", "mirrored2", "arrays", False),
        ("w2", "mirrored2", "loader", True),
        ("w2", "w3", "arrays", True),
        ("w2", "w3", "loader", False),
        ("w1", "w2", "arrays", True),  # regression: the window's sums were added on both workers (twice)
        ("w1", "w2", "loader", False),
    ],
)
def test_a_backup_of_workers_resumes_on_another_number_of_workers(tmp_path, saved_by, resumed_by, source, accumulate):
    settings = {"source": source, "accumulate": accumulate}
    straight = scenarios.resume_run(scenarios.strategy_of(STRAIGHT[saved_by]), str(tmp_path / "straight"), **settings)
    backup = str(tmp_path / "backup")
    crashed = run_side(saved_by, backup, crash_at=CRASH_AT, **settings)
    assert all(result["crashed"] for result in crashed)
    state = torch.load(os.path.join(backup, "backup.pt"), weights_only=True)
    assert (state["epoch"], state["step"]) == (2, 1)
    resumed = run_side(resumed_by, backup, init_seed=9, **settings)
    for index, result in enumerate(resumed):
        assert_same_run(result, straight, f"{saved_by} -> {resumed_by}, worker {index}")
    for result in resumed[1:]:  # the workers end alike
        assert all(torch.equal(result["weights"][k], v) for k, v in resumed[0]["weights"].items())


# --- a shuffled DataLoader resumes mid-epoch with its order (regression) ---------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("own_generator", [False, True], ids=["torch_generator", "loader_generator"])
@pytest.mark.parametrize("save_freq, crash_at", [(3, 23), (10, 15)], ids=["mid_epoch", "at_the_epochs_end"])
def test_a_shuffled_dataloader_resumes_mid_epoch_bit_identical(tmp_path, own_generator, save_freq, crash_at):
    """Before: the resumed pass drew a new order (from torch's generator as restored, or from the loader's own
    generator as created), so other rows were trained on twice or never (0.04 apart). At the epoch's end
    (``(10, 15)``: a backup after the last step) no new pass may be drawn for the finished epoch either."""
    x, y = scenarios.data()

    def run(callbacks, init_seed=0):
        torch.manual_seed(init_seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        generator = torch.Generator().manual_seed(5) if own_generator else None
        dataset = torch.utils.data.TensorDataset(x[:114], y[:114])
        loader = torch.utils.data.DataLoader(dataset, batch_size=12, shuffle=True, generator=generator)
        trainer = Trainer(strategy=ds.get_strategy(), optimizer="adam", metrics=["accuracy"], seed=3)
        history = trainer.fit(model, loader, epochs=3, verbose=0, callbacks=callbacks)
        return history.history, model.state_dict()

    straight = run([])
    backup = BackupAndRestore(tmp_path, save_freq=save_freq)
    with pytest.raises(scenarios.Crash):
        run([backup, scenarios.CrashAt(crash_at)])
    history, weights = run([BackupAndRestore(tmp_path, save_freq=save_freq)], init_seed=9)
    assert history == straight[0]
    assert all(torch.equal(weights[k], v) for k, v in straight[1].items())


PERSISTENT_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
import mw_resume_scenarios as scenarios
import replicafit.strategies as ds
from replicafit.trainer import BackupAndRestore, Trainer

x, y = scenarios.data()

def run(callbacks, init_seed=0):
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    dataset = torch.utils.data.TensorDataset(x[:114], y[:114])
    loader = torch.utils.data.DataLoader(dataset, batch_size=12, shuffle=True, num_workers=1, persistent_workers=True)
    trainer = Trainer(strategy=ds.get_strategy(), optimizer="adam", metrics=["accuracy"], seed=3)
    history = trainer.fit(model, loader, epochs=2, verbose=0, callbacks=callbacks)
    return history.history, model.state_dict()

straight = run([])
for crash_at in (5, 15):  # mid-epoch 0 (the loader's first pass), mid-epoch 1
    folder = f"{sys.argv[1]}/{crash_at}"
    try:
        run([BackupAndRestore(folder, save_freq=3), scenarios.CrashAt(crash_at)])
    except scenarios.Crash:
        pass
    history, weights = run([BackupAndRestore(folder, save_freq=3)], init_seed=9)
    same = history == straight[0] and all(torch.equal(weights[k], v) for k, v in straight[1].items())
    print(crash_at, "same" if same else "differs")
"""


@pytest.mark.timeout(120)
def test_a_shuffled_dataloader_with_persistent_workers_resumes_bit_identical(tmp_path):
    """Regression (mid-epoch 0): a loader with persistent worker processes draws their base seed only as its first
    pass begins; the resumed run's first look had made that iterator before the restore, so the replayed pass
    drew its order from another point of the random stream (other rows trained twice or never). In a fresh
    process: its loader's worker processes are forked, which a multi-threaded test process does not do safely."""
    script = tmp_path / "persistent.py"
    script.write_text(PERSISTENT_SCRIPT)
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), here],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["5", "same", "15", "same"]


# --- another global batch size is refused ---------------------------------------------------------------------------


def test_another_global_batch_size_is_refused_before_anything_is_restored(tmp_path):
    backup = str(tmp_path)
    interrupted(scenarios.strategy_of("mirrored3"), backup)
    state = torch.load(os.path.join(backup, "backup.pt"), weights_only=True)
    assert state["global_batch_size"] == scenarios.BATCH

    steps = []

    class Steps(Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps.append(batch)

    strategy = scenarios.strategy_of("mirrored2")
    with pytest.raises(CheckpointError) as info:
        scenarios.resume_run(strategy, backup, batch_size=2 * scenarios.BATCH, extra_callbacks=[Steps()])
    message = str(info.value)
    for part in ("global batch size of 12", "this fit's is 24", "global batches", "batch_size", "backup_dir"):
        assert part in message, part
    assert "\n" not in message
    assert steps == []
    # the same global batch size on another number of replicas resumes (here 3 replicas -> 2)
    assert not scenarios.resume_run(strategy, backup)["crashed"]


def test_a_backup_without_the_global_batch_size_of_an_earlier_version_still_resumes(tmp_path):
    straight = scenarios.resume_run(scenarios.strategy_of("default"), str(tmp_path / "straight"))
    backup = str(tmp_path / "backup")
    interrupted(scenarios.strategy_of("default"), backup)
    path = os.path.join(backup, "backup.pt")
    state = torch.load(path, weights_only=True)
    del state["global_batch_size"], state["data_rng"]
    torch.save(state, path)
    resumed = scenarios.resume_run(scenarios.strategy_of("mirrored3"), backup, batch_size=scenarios.BATCH)
    assert_same_run(resumed, straight, "an earlier version's backup")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(global_batch_size=0), "global_batch_size must be an int >= 1"),
        (lambda s: s.update(global_batch_size="12"), "global_batch_size must be an int >= 1"),
        (lambda s: s.update(data_rng={"pass": None}), "data_rng must be"),
        (lambda s: s["data_rng"].update(generators=[3]), r"data_rng\['generators'\] must be a list"),
        (lambda s: s["data_rng"]["pass"].update(torch=torch.zeros(3)), r"data_rng\['pass'\]\['torch'\] must be"),
    ],
)
def test_damaged_new_entries_are_a_checkpoint_error(tmp_path, edit, message):
    interrupted(scenarios.strategy_of("default"), str(tmp_path), source="loader")
    path = tmp_path / "backup.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(path, kind="backup")


# --- per-replica random streams: the rule for replicas that did not exist before ------------------------------------


class StreamsAtStart(Callback):
    """Records the replicas' streams once the backup is restored (it runs after BackupAndRestore's hook)."""

    def on_train_begin(self, logs=None):
        self.state = self.trainer.strategy.extended.replica_streams.state_dict()


def _dropout_fit(strategy, backup, callbacks):
    torch.manual_seed(0)
    x, y = scenarios.data()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    trainer = Trainer(strategy=strategy, optimizer="adam", metrics=(), seed=3)
    trainer.fit(model, (x, y), batch_size=12, epochs=3, verbose=0, callbacks=[BackupAndRestore(backup, 3), *callbacks])


@pytest.mark.parametrize("saved_under", ["mirrored2", "default"])
def test_replicas_keep_their_streams_and_new_replicas_get_fresh_ones(tmp_path, saved_under):
    """On Mirrored(3): the replicas the saver had (global ids 0 and 1 of Mirrored(2)) continue their streams; a
    replica it did not have (id 2, or all three after the default strategy, whose one replica drew from torch's
    generator) is seeded from (seed, its id, epoch, step). Before: every stream was seeded anew on another count,
    and after the default strategy the streams started again from the run's first draws."""
    backup = str(tmp_path)
    with pytest.raises(scenarios.Crash):
        _dropout_fit(scenarios.strategy_of(saved_under), backup, [scenarios.CrashAt(CRASH_AT)])
    saved = torch.load(os.path.join(backup, "backup.pt"), weights_only=True)
    probe = StreamsAtStart()
    _dropout_fit(scenarios.strategy_of("mirrored3"), backup, [probe])
    kept = len(saved["replica_rng"]["cpu"]) if "replica_rng" in saved else 0
    assert kept == (2 if saved_under == "mirrored2" else 0)
    for replica in range(3):
        if replica < kept:
            expected = saved["replica_rng"]["cpu"][replica]
        else:
            value = replica_seed(saved["data_seed"], replica, saved["epoch"], saved["step"])
            expected = torch.Generator().manual_seed(value).get_state()
        assert torch.equal(probe.state["cpu"][replica], expected), replica
    fresh = torch.Generator().manual_seed(replica_seed(saved["data_seed"], 0)).get_state()
    assert not torch.equal(probe.state["cpu"][0], fresh)  # never the run's first draws again


# --- BatchNorm: per-replica statistics -------------------------------------------------------------------------------


def _batch_norm_fit(strategy, backup, sync: bool, callbacks=()):
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model
    x, y = scenarios.data()
    trainer = Trainer(strategy=strategy, optimizer="adam", metrics=["accuracy"], seed=3)
    history = trainer.fit(
        model,
        (x[:114], y[:114]),
        batch_size=scenarios.BATCH,
        epochs=3,
        validation_data=(x[114:], y[114:]),
        verbose=0,
        callbacks=[BackupAndRestore(backup, scenarios.SAVE_FREQ), *callbacks],
    )
    weights = model.state_dict()
    return history.history, {k: v for k, v in weights.items() if v.is_floating_point()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", [True, False], ids=["SyncBatchNorm", "BatchNorm"])
def test_batch_norm_resumes_on_another_number_of_replicas_as_documented(tmp_path, sync):
    """``nn.SyncBatchNorm`` normalizes with the global batch's statistics: the resumed run equals the uninterrupted
    one up to rounding (normalization amplifies it: Mirrored(3) and the default strategy are ~6e-5 apart uninterrupted,
    the resumed run ~3e-5 from the saver's). Plain ``BatchNorm`` normalizes each replica's rows alone: on another
    number of replicas the steps are others (docs/guides/resume.md), as they would be uninterrupted."""
    straight = _batch_norm_fit(scenarios.strategy_of("mirrored3"), str(tmp_path / "straight"), sync)
    backup = str(tmp_path / "backup")
    with pytest.raises(scenarios.Crash):
        _batch_norm_fit(scenarios.strategy_of("mirrored3"), backup, sync, [scenarios.CrashAt(CRASH_AT)])
    history, weights = _batch_norm_fit(scenarios.strategy_of("default"), backup, sync)
    worst = max(float((weights[k] - v).abs().max()) for k, v in straight[1].items())
    worst = max([worst, *(abs(a - b) for key in history for a, b in zip(history[key], straight[0][key]))])
    if sync:
        assert worst <= 5e-4
    else:
        assert worst > 1e-3


@pytest.mark.timeout(120)
def test_an_earlier_versions_open_window_is_not_gathered_again_when_saved_before_a_step(tmp_path):
    """Regression: without the layout entries a loaded window looked like this worker's part and was gathered
    again (2 workers: 4 sums per variable), which the next resume added up to twice the window's total."""
    workers = results(run_workers(SCENARIOS, "old_window_saved_again", 2, timeout=90, kwargs={"folder": str(tmp_path)}))
    for sums in workers:
        assert set(sums.values()) == {2}, sums  # the 2 replicas' sums, once
