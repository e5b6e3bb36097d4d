"""Trainer checkpoints (save/load across strategies, atomic writes, bad files) and
BackupAndRestore (an interrupted fit, resumed, ends bit-identical to an uninterrupted one)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import make_strategy
from mw_resume_scenarios import Crash, CrashAt

from replicafit import optimizers
from replicafit.optimizers import schedules
from replicafit.trainer import BackupAndRestore, Callback, CheckpointError, LambdaCallback, Trainer, checkpoint

REPO = Path(__file__).resolve().parents[2]

# --- helpers ------------------------------------------------------------------------------------


def make_data(n: int = 36, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def make_model(seed: int = 1, dropout: bool = False) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(4, 8), torch.nn.ReLU()]
        if dropout:
            layers.append(torch.nn.Dropout(0.3))
        return torch.nn.Sequential(*layers, torch.nn.Linear(8, 2))


def make_trainer(strategy="default", learning_rate=0.01) -> Trainer:
    return Trainer(
        strategy=make_strategy(strategy),
        optimizer=optimizers.Adam(learning_rate),
        loss="cross_entropy",
        metrics=["accuracy"],
        seed=0,
    )


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["iterations"] == b["iterations"]
    assert a["slots"].keys() == b["slots"].keys()
    for name in a["slots"]:
        assert_same_state(a["slots"][name], b["slots"][name])


class Probe(Callback):
    """Records, per (epoch, batch): iterations, learning rate and RNG state at the batch's start,
    and the batch's logs at its end."""

    def __init__(self):
        super().__init__()
        self.begin, self.end, self.epoch = {}, {}, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        optimizer = self.trainer.optimizer
        self.begin[(self.epoch, batch)] = (
            int(optimizer.iterations),
            float(optimizer.learning_rate),
            torch.get_rng_state(),
        )

    def on_train_batch_end(self, batch, logs=None):
        self.end[(self.epoch, batch)] = dict(logs)


FIT = {"batch_size": 8, "epochs": 4, "shuffle": True, "verbose": 0}  # 36 examples: 5 steps, the last partial


def fit(trainer, model, callbacks, **overrides):
    x, y = make_data()
    vx, vy = make_data(10, seed=3)
    return trainer.fit(model, (x, y), validation_data=(vx, vy), callbacks=callbacks, **{**FIT, **overrides})


# --- save_checkpoint / load_checkpoint -------------------------------------------------------------------


@pytest.mark.parametrize(
    "saved_under, loaded_under",
    [
        ("mirrored2", "default"),
        ("mirrored2", "central_storage2"),
        ("default", "mirrored2"),
        ("central_storage2", "mirrored2"),
    ],
)
def test_checkpoint_restores_under_another_strategy(tmp_path, saved_under, loaded_under):
    path = tmp_path / "ckpt.pt"
    first = make_trainer(saved_under)
    fit(first, make_model(), None, epochs=2)
    first.save_checkpoint(path)
    saved_model = {k: v.clone() for k, v in first.model_state_dict().items()}
    saved_optimizer = first.optimizer.state_dict()
    assert saved_optimizer["iterations"] == 10

    state = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "epoch", "step", "rng"} <= set(state)
    assert_same_state(state["model"], saved_model)
    assert_same_optimizer_state(state["optimizer"], saved_optimizer)

    second = make_trainer(loaded_under)
    model = make_model(seed=42)  # different initial weights: all must come from the file
    second.load_checkpoint(path, model=model)
    assert_same_state(second.model_state_dict(), saved_model)
    assert_same_optimizer_state(second.optimizer.state_dict(), saved_optimizer)
    assert int(second.optimizer.iterations) == 10

    resumed = fit(second, model, None, epochs=4, initial_epoch=2)
    reference = make_trainer(loaded_under)
    reference_history = fit(reference, make_model(), None, epochs=4)

    assert int(second.optimizer.iterations) == int(reference.optimizer.iterations) == 20
    expected = reference.model_state_dict()
    for key, value in second.model_state_dict().items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=0)
    expected_slots = reference.optimizer.state_dict()["slots"]
    for name, slots in second.optimizer.state_dict()["slots"].items():
        for slot, value in slots.items():
            torch.testing.assert_close(value, expected_slots[name][slot], atol=1e-6, rtol=0)
    assert resumed.history["loss"] == pytest.approx(reference_history.history["loss"][2:], abs=1e-6)


def test_load_checkpoint_uses_the_last_model_and_needs_one(tmp_path):
    path = tmp_path / "ckpt.pt"
    trainer = make_trainer()
    model = make_model()
    fit(trainer, model, None, epochs=1)
    trainer.save_checkpoint(path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fit(trainer, model, None, epochs=1)
    assert not torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
    trainer.load_checkpoint(path)  # into the model last used
    assert_same_state(trainer.model_state_dict(), saved)

    with pytest.raises(ValueError, match="model"):
        make_trainer().load_checkpoint(path)


def test_a_checkpoint_replaces_an_optimizer_state_loaded_before_the_build(tmp_path):
    """The optimizer is built for the model before the checkpoint's state is checked; a state loaded earlier and
    still waiting for its variables is not applied first (it is replaced, and the file is not blamed for it)."""
    path = tmp_path / "ckpt.pt"
    trainer = make_trainer()
    fit(trainer, make_model(), None, epochs=1)
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["optimizer"]
    other = make_trainer()
    stale = {key: value for key, value in saved.items() if key != "slots"}
    stale["slots"] = {0: {name: torch.zeros(3) for name in saved["slots"][0]}}  # no longer fits variable 0
    other.optimizer.load_state_dict(stale)  # waits for the variables (not checked yet)
    other.load_checkpoint(path, make_model())
    loaded = other.optimizer.state_dict()
    for position, slots in saved["slots"].items():
        for name, value in slots.items():
            assert torch.equal(loaded["slots"][position][name], value), (position, name)


def test_checkpoint_restores_rng_state(tmp_path):
    path = tmp_path / "ckpt.pt"
    trainer = make_trainer()
    fit(trainer, make_model(), None, epochs=1)
    trainer.save_checkpoint(path)
    expected = torch.rand(5)
    torch.manual_seed(12345)
    make_trainer().load_checkpoint(path, model=make_model())
    assert torch.equal(torch.rand(5), expected)


# --- atomic writes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_save_checkpoint_is_atomic(tmp_path, monkeypatch, error):
    path = tmp_path / "ckpt.pt"
    trainer = make_trainer()
    model = make_model()
    fit(trainer, model, None, epochs=1)
    trainer.save_checkpoint(path)
    good_bytes = path.read_bytes()
    good_model = {k: v.clone() for k, v in trainer.model_state_dict().items()}
    fit(trainer, model, None, epochs=1)  # the next save would hold other weights

    real_save = torch.save

    def broken_save(obj, file, *args, **kwargs):
        real_save(obj, file, *args, **kwargs)  # writes everything ...
        if hasattr(file, "truncate"):
            file.truncate(100)  # ... then leaves a partial file
        raise error

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(type(error)):
        trainer.save_checkpoint(path)
    monkeypatch.undo()

    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left behind
    assert path.read_bytes() == good_bytes
    assert_same_state(torch.load(path, weights_only=True)["model"], good_model)

    trainer.save_checkpoint(path)  # a good save replaces it
    assert_same_state(torch.load(path, weights_only=True)["model"], trainer.model_state_dict())
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_save_checkpoint_writes_a_temporary_file_beside_the_target(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    trainer, model = make_trainer(), make_model()
    fit(trainer, model, None, epochs=1)
    trainer.save_checkpoint(path)
    old = path.read_bytes()
    fit(trainer, model, None, epochs=1)
    during = []
    real_save = torch.save

    def spy(obj, file, *args, **kwargs):
        real_save(obj, file, *args, **kwargs)
        file.flush()
        during.append((path.read_bytes(), sorted(os.listdir(tmp_path))))

    monkeypatch.setattr(torch, "save", spy)
    trainer.save_checkpoint(path)
    monkeypatch.undo()
    assert len(during) == 1
    assert during[0][0] == old  # the target is untouched while the new file is written ...
    assert len(during[0][1]) == 2 and "ckpt.pt" in during[0][1]  # ... to a file in the same folder
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    assert path.read_bytes() != old
    assert_same_state(torch.load(path, weights_only=True)["model"], trainer.model_state_dict())


# --- damaged files ------------------------------------------------------------------------------------------


def good_checkpoint(folder: Path) -> Path:
    trainer = make_trainer()
    fit(trainer, make_model(), None, epochs=1)
    return Path(trainer.save_checkpoint(folder / "good.pt"))


@pytest.mark.parametrize("kind", ["truncated", "random_bytes", "empty", "missing", "foreign_dict", "tensor", "pickle"])
def test_bad_checkpoint_files_raise_checkpoint_error(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    if kind == "truncated":
        data = good_checkpoint(tmp_path).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random_bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign_dict":
        torch.save({"weight": torch.ones(3)}, path)  # a torch file, not a trainer checkpoint
    elif kind == "tensor":
        torch.save(torch.ones(3), path)
    elif kind == "pickle":
        torch.save({"format": "replicafit-checkpoint-v1", "model": Crash("x")}, path)  # unsafe to unpickle
    trainer = make_trainer()
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(path, model=model)
    message = str(info.value)
    assert str(path) in message
    assert len(message) < 600  # one clear sentence, not a wall of text
    assert_same_state(model.state_dict(), before)  # nothing was half-loaded


def test_checkpoint_error_is_a_runtime_error():
    assert issubclass(CheckpointError, RuntimeError)


# --- BackupAndRestore: in-process interruption ------------------------------------------------------------------


def reference_run(strategy, **overrides):
    trainer = make_trainer(strategy)
    probe = Probe()
    history = fit(trainer, make_model(), [probe], **overrides)
    return trainer, history, probe


def assert_same_run(trainer, history, reference_trainer, reference_history):
    assert_same_state(trainer.model_state_dict(), reference_trainer.model_state_dict())
    assert_same_optimizer_state(trainer.optimizer.state_dict(), reference_trainer.optimizer.state_dict())
    assert history.history == reference_history.history
    assert history.epoch == reference_history.epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuse", [False, True], ids=["fresh_trainer", "same_trainer"])
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_backup_resumes_mid_epoch_bit_identical(tmp_path, strategy, reuse):
    backup = tmp_path / "backup"
    ref_trainer, ref_history, _ = reference_run(strategy)

    trainer, model = make_trainer(strategy), make_model()
    # 5 steps per epoch; backups after global steps 3, 6, 9, 12; the crash comes before step 14
    # (epoch 2, batch 3): the resumed run starts at epoch 2, batch 2 and redoes one step.
    with pytest.raises(Crash):
        fit(trainer, model, [BackupAndRestore(backup, save_freq=3), CrashAt(13)])
    assert (backup / "backup.pt").exists()  # kept after an interruption
    assert int(trainer.optimizer.iterations) == 13

    if not reuse:
        trainer, model = make_trainer(strategy), make_model(seed=77)
    seen = []
    marker = LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(epoch))
    history = fit(trainer, model, [BackupAndRestore(backup, save_freq=3), marker])
    assert seen == [2, 3]  # it went on from the backup's epoch
    assert_same_run(trainer, history, ref_trainer, ref_history)
    assert_same_state(model.state_dict(), ref_trainer.model_state_dict())
    assert not (backup / "backup.pt").exists()  # deleted after a normal finish


class OwnBackup(Callback):
    """A backup of one's own through the trainer's public state methods (as their docstrings show)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = str(path)

    def on_train_begin(self, logs=None):
        if os.path.exists(self.path):
            self.trainer.restore_training_state(checkpoint.load(self.path, kind="backup"), self.path)

    def on_epoch_end(self, epoch, logs=None):
        state = self.trainer.training_state(epoch + 1, 0, (epoch, dict(logs)))
        self.trainer.write_on_chief("OwnBackup", lambda: checkpoint.save(state, self.path))


@pytest.mark.timeout(120)
def test_a_callback_of_ones_own_backs_up_and_resumes_with_the_public_state_methods(tmp_path):
    path = tmp_path / "own.pt"
    ref_trainer, ref_history, _ = reference_run("mirrored2")
    with pytest.raises(Crash):
        fit(make_trainer("mirrored2"), make_model(), [OwnBackup(path), CrashAt(13)])
    assert torch.load(path, weights_only=True)["epoch"] == 2
    trainer = make_trainer("mirrored2")
    history = fit(trainer, make_model(seed=5), [OwnBackup(path)])
    assert_same_run(trainer, history, ref_trainer, ref_history)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_backup_per_epoch_resumes_after_interruption_in_epoch_3(tmp_path, strategy):
    backup = tmp_path / "backup"
    ref_trainer, ref_history, _ = reference_run(strategy)

    trainer = make_trainer(strategy)
    with pytest.raises(Crash):
        fit(trainer, make_model(), [BackupAndRestore(backup), CrashAt(13)])  # epoch 3 (index 2), batch 3
    state = torch.load(backup / "backup.pt", weights_only=True)
    assert state["epoch"] == 2 and state["step"] == 0  # the end of epoch 2

    trainer = make_trainer(strategy)
    history = fit(trainer, make_model(seed=5), [BackupAndRestore(backup)])
    assert_same_run(trainer, history, ref_trainer, ref_history)
    assert not (backup / "backup.pt").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save_freq, crash_at", [(4, 7), ("epoch", 13)])
def test_backup_resumes_with_steps_per_epoch(tmp_path, save_freq, crash_at):
    # 3 steps per epoch over 5-batch passes: epochs and passes over the data do not line up.
    backup = tmp_path / "backup"
    ref_trainer, ref_history, _ = reference_run("default", steps_per_epoch=3, epochs=5)
    with pytest.raises(Crash):
        fit(
            make_trainer(),
            make_model(),
            [BackupAndRestore(backup, save_freq=save_freq), CrashAt(crash_at)],
            steps_per_epoch=3,
            epochs=5,
        )
    trainer = make_trainer()
    history = fit(
        trainer, make_model(seed=6), [BackupAndRestore(backup, save_freq=save_freq)], steps_per_epoch=3, epochs=5
    )
    assert_same_run(trainer, history, ref_trainer, ref_history)


@pytest.mark.timeout(120)
def test_backup_restores_iterations_schedule_metrics_and_rng(tmp_path):
    """Dropout makes the RNG matter; an ExponentialDecay schedule makes iterations matter."""
    backup = tmp_path / "backup"

    def trainer_and_model(seed=1):
        schedule = schedules.ExponentialDecay(0.02, decay_steps=4, decay_rate=0.5)
        trainer = Trainer(optimizer=optimizers.Adam(schedule), metrics=["accuracy"], seed=0)
        return trainer, make_model(seed=seed, dropout=True)

    ref_trainer, ref_model = trainer_and_model()
    ref_probe = Probe()
    ref_history = fit(ref_trainer, ref_model, [ref_probe])

    trainer, model = trainer_and_model()
    with pytest.raises(Crash):
        fit(trainer, model, [BackupAndRestore(backup, save_freq=3), CrashAt(13)])

    trainer, model = trainer_and_model(seed=8)
    probe = Probe()
    history = fit(trainer, model, [BackupAndRestore(backup, save_freq=3), probe])

    first = min(probe.begin)
    assert first == (2, 2)
    iterations, rate, rng = probe.begin[first]
    ref_iterations, ref_rate, ref_rng = ref_probe.begin[first]
    assert iterations == ref_iterations == 12
    assert rate == ref_rate and rate != 0.02  # the schedule's position
    assert torch.equal(rng, ref_rng)
    assert probe.end[first] == ref_probe.end[first]  # the epoch's metrics went on from the backup's
    for key in probe.begin:
        assert torch.equal(probe.begin[key][2], ref_probe.begin[key][2]), key
        assert probe.end[key] == ref_probe.end[key], key
    assert_same_run(trainer, history, ref_trainer, ref_history)


@pytest.mark.timeout(120)
def test_backup_restores_a_learning_rate_set_by_a_callback(tmp_path):
    # Keras 3 keeps the learning rate in the optimizer's variables, which the backup holds:
    # a rate lowered by a callback (e.g. ReduceLROnPlateau) is still lowered after resuming.
    backup = tmp_path / "backup"
    lower = LambdaCallback(
        on_epoch_end=lambda epoch, logs: setattr(trainer.optimizer, "learning_rate", 0.004) if epoch == 1 else None
    )
    trainer = make_trainer(learning_rate=0.01)
    with pytest.raises(Crash):
        fit(trainer, make_model(), [lower, BackupAndRestore(backup, save_freq=3), CrashAt(13)])
    assert float(trainer.optimizer.learning_rate) == 0.004

    resumed = make_trainer(learning_rate=0.01)
    probe = Probe()
    fit(resumed, make_model(), [BackupAndRestore(backup, save_freq=3), probe])
    assert probe.begin[(2, 2)][1] == pytest.approx(0.004)


@pytest.mark.timeout(120)
def test_backup_kept_when_delete_checkpoint_is_false_and_a_finished_backup_resumes_nothing(tmp_path):
    backup = tmp_path / "backup"
    exists_at_begin = []  # the backup writes after the other callbacks' on_epoch_end: seen at the next epoch
    watcher = LambdaCallback(on_epoch_begin=lambda epoch, logs: exists_at_begin.append((backup / "backup.pt").exists()))
    trainer = make_trainer()
    history = fit(trainer, make_model(), [BackupAndRestore(backup, delete_checkpoint=False), watcher], epochs=2)
    assert exists_at_begin == [False, True]
    assert (backup / "backup.pt").exists()
    final = {k: v.clone() for k, v in trainer.model_state_dict().items()}

    again = make_trainer()
    seen = []
    marker = LambdaCallback(on_train_batch_begin=lambda batch, logs: seen.append(batch))
    history_again = fit(
        again, make_model(seed=3), [BackupAndRestore(backup, delete_checkpoint=False), marker], epochs=2
    )
    assert seen == []  # every epoch was already done
    assert_same_state(again.model_state_dict(), final)
    assert history_again.history == history.history and history_again.epoch == [0, 1]
    assert int(again.optimizer.iterations) == 10


def test_backup_deleted_after_a_normal_finish(tmp_path):
    backup = tmp_path / "backup"
    exists_during = []
    watcher = LambdaCallback(
        on_train_batch_end=lambda batch, logs: exists_during.append((backup / "backup.pt").exists())
    )
    fit(make_trainer(), make_model(), [BackupAndRestore(backup, save_freq=2), watcher], epochs=1)
    assert exists_during == [False, False, True, True, True]  # written after the watcher's hook of step 2
    assert not (backup / "backup.pt").exists()


def test_backup_file_loads_with_weights_only(tmp_path):
    backup = tmp_path / "backup"
    trainer = make_trainer()
    with pytest.raises(Crash):
        fit(trainer, make_model(), [BackupAndRestore(backup, save_freq=4), CrashAt(6)])
    state = torch.load(backup / "backup.pt", weights_only=True)
    assert state["epoch"] == 0 and state["step"] == 4
    assert state["optimizer"]["iterations"] == 4


def test_damaged_backup_gives_checkpoint_error(tmp_path):
    backup = tmp_path / "backup"
    backup.mkdir()
    (backup / "backup.pt").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="backup"):
        fit(make_trainer(), make_model(), [BackupAndRestore(backup)])


@pytest.mark.parametrize("save_freq", [0, "batch", 2.0])
def test_backup_rejects_bad_save_freq(tmp_path, save_freq):
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(tmp_path, save_freq=save_freq)


# --- BackupAndRestore: a process killed with SIGKILL ----------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys

    import torch

    from replicafit import optimizers
    import replicafit.strategies as ds
    from replicafit.trainer import BackupAndRestore, Callback, Trainer

    mode, backup_dir, out = sys.argv[1:4]
    KILL_AT = 13  # global step: epoch 2, batch 3 of 5

    class Kill(Callback):
        seen = 0

        def on_train_batch_begin(self, batch, logs=None):
            if self.seen == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            self.seen += 1

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(36, 4, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(1 if mode != "resume" else 99)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(0.01), metrics=["accuracy"], seed=0)
    callbacks = [] if mode == "plain" else [BackupAndRestore(backup_dir, save_freq=3)]
    if mode == "kill":
        callbacks.append(Kill())
    history = trainer.fit(model, (x, y), batch_size=8, epochs=4, shuffle=True, callbacks=callbacks, verbose=0)
    torch.save(
        {
            "model": trainer.model_state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "history": history.history,
            "epoch": history.epoch,
        },
        out,
    )
    """
)


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=str(REPO), capture_output=True, text=True, timeout=100
    )


@pytest.mark.timeout(120)
def test_backup_resumes_a_process_killed_with_sigkill_dropout_included(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    backup = tmp_path / "backup"

    killed = run_script(script, "kill", str(backup), str(tmp_path / "killed.pt"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "killed.pt").exists()
    assert (backup / "backup.pt").exists()
    assert not [name for name in os.listdir(backup) if name != "backup.pt"]  # no stray temporary file

    resumed = run_script(script, "resume", str(backup), str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr
    assert not (backup / "backup.pt").exists()
    plain = run_script(script, "plain", str(tmp_path / "unused"), str(tmp_path / "plain.pt"))
    assert plain.returncode == 0, plain.stderr

    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert_same_state(got["model"], want["model"])
    assert_same_optimizer_state(got["optimizer"], want["optimizer"])
    assert got["optimizer"]["iterations"] == 20
    assert got["history"] == want["history"]
    assert got["epoch"] == want["epoch"] == [0, 1, 2, 3]


# --- damaged entries: a clear CheckpointError, nothing restored (hardening item 9) --------------------------------


def rewritten(source: Path, target: Path, edit) -> Path:
    """``source`` loaded, changed by ``edit`` and saved as ``target`` (a file that still reads fine)."""
    state = torch.load(source, weights_only=True)
    edit(state)
    torch.save(state, target)
    return target


def first_slots(state: dict) -> dict:
    return next(iter(state["optimizer"]["slots"].values()))


ENTRY_DAMAGE = {
    "no-model": (lambda s: s.pop("model"), "no 'model'"),
    "no-optimizer": (lambda s: s.pop("optimizer"), "no 'optimizer'"),
    "no-rng": (lambda s: s.pop("rng"), "no 'rng'"),
    "no-epoch-and-step": (lambda s: (s.pop("epoch"), s.pop("step")), "no 'epoch', 'step'"),
    "model-a-list": (lambda s: s.update(model=[1, 2]), "model must be a model state dict"),
    "model-entry-a-string": (lambda s: s["model"].update({"0.weight": "w"}), r"model\['0.weight'\] must be a tensor"),
    "optimizer-a-string": (lambda s: s.update(optimizer="adam"), "optimizer must be an optimizer state dict"),
    "optimizer-without-iterations": (lambda s: s["optimizer"].pop("iterations"), "optimizer has no 'iterations'"),
    "rng-a-list": (lambda s: s.update(rng=[1, 2, 3]), "rng must be torch's CPU random state"),
    "rng-of-floats": (lambda s: s.update(rng=s["rng"].float()), "rng must be torch's CPU random state"),
    "rng-too-short": (lambda s: s.update(rng=s["rng"][:100]), "rng must be torch's CPU random state"),
    "epoch-a-word": (lambda s: s.update(epoch="three"), "epoch must be an int >= 0, found 'three'"),
    "step-negative": (lambda s: s.update(step=-1), "step must be an int >= 0"),
    "step-a-bool": (lambda s: s.update(step=True), "step must be an int >= 0"),
}

OPTIMIZER_DAMAGE = {
    "slots-garbage": (lambda s: s["optimizer"].update(slots="garbage"), "'slots' must be a dict"),
    "slot-of-another-shape": (lambda s: first_slots(s).update(momentum=torch.ones(7)), "slot 'momentum' of variable"),
    "slot-a-string": (lambda s: first_slots(s).update(velocity="v"), "slot 'velocity' of variable"),
    "slot-missing": (lambda s: first_slots(s).pop("velocity"), "has slots"),
    "iterations-a-word": (lambda s: s["optimizer"].update(iterations="ten"), r"iterations'\] must be an int"),
    "learning-rate-negative": (lambda s: s["optimizer"].update(learning_rate=-0.5), "learning_rate"),
}


def assert_nothing_loaded(trainer, model, before) -> None:
    assert_same_state(model.state_dict(), before)
    assert int(trainer.optimizer.iterations) == 0
    for slots in trainer.optimizer.state_dict()["slots"].values():
        for value in slots.values():
            assert not value.any()  # fresh slots: nothing half-restored


@pytest.mark.parametrize("case", list(ENTRY_DAMAGE))
def test_checkpoint_with_a_missing_or_mistyped_entry_raises_checkpoint_error_naming_it(tmp_path, case):
    edit, message = ENTRY_DAMAGE[case]
    path = rewritten(good_checkpoint(tmp_path), tmp_path / f"{case}.pt", edit)
    trainer, model = make_trainer(), make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message) as info:
        trainer.load_checkpoint(path, model=model)
    assert str(path) in str(info.value) and len(str(info.value)) < 600
    assert_nothing_loaded(trainer, model, before)


@pytest.mark.parametrize("case", list(OPTIMIZER_DAMAGE))
def test_checkpoint_with_a_garbage_optimizer_state_says_it_is_the_optimizer_state(tmp_path, case):
    edit, message = OPTIMIZER_DAMAGE[case]
    path = rewritten(good_checkpoint(tmp_path), tmp_path / f"{case}.pt", edit)
    trainer, model = make_trainer(), make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message) as info:
        trainer.load_checkpoint(path, model=model)
    text = str(info.value)
    assert "optimizer" in text and str(path) in text and "model" not in text.split("optimizer")[0]
    assert_nothing_loaded(trainer, model, before)


def test_checkpoint_of_another_model_still_raises_torchs_error_and_loads_nothing(tmp_path):
    path = good_checkpoint(tmp_path)
    trainer = make_trainer()
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))  # 3 classes
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises((RuntimeError, ValueError)) as info:
        trainer.load_checkpoint(path, model=other)
    assert not isinstance(info.value, CheckpointError)  # the CLI reports "does not match the recipe's model"
    assert_same_state(trainer.model_state_dict(), before)


def test_weights_files_are_checked_as_weights(tmp_path):
    from replicafit.trainer import ModelCheckpoint, checkpoint

    trainer, model = make_trainer(), make_model()
    fit(trainer, model, [ModelCheckpoint(tmp_path / "w.pt", save_weights_only=True)], epochs=1)
    assert_same_state(checkpoint.load(tmp_path / "w.pt", kind="weights"), trainer.model_state_dict())
    bad = rewritten(tmp_path / "w.pt", tmp_path / "bad.pt", lambda s: s.update({"0.bias": [0.0] * 8}))
    with pytest.raises(CheckpointError, match=r"'0.bias'\] must be a tensor"):
        checkpoint.load(bad, kind="weights")
    with pytest.raises(CheckpointError, match="no format tag"):
        checkpoint.load(tmp_path / "w.pt", kind="checkpoint")


# The CLI: `replicafit evaluate/predict --checkpoint` prints one message, exit status 2, no traceback.
CLI_RECIPE = REPO / "recipes" / "digits_onedevice.yaml"
CLI_SMALL = ["--set", "model.hidden=[16]", "--set", "fit.verbose=0"]


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    from replicafit import cli

    run_dir = tmp_path_factory.mktemp("cli") / "run"
    status = cli.main(["fit", str(CLI_RECIPE), *CLI_SMALL, "--set", "fit.epochs=1", "--run-dir", str(run_dir)])
    assert status == 0
    return run_dir / "checkpoints" / "last.pt"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["evaluate", "predict"])
@pytest.mark.parametrize(
    "case, message",
    [
        ("no-model", "no 'model'"),
        ("no-optimizer", "no 'optimizer'"),
        ("rng-a-list", "rng must be"),
        ("epoch-a-word", "epoch must be an int"),
        ("slots-garbage", "optimizer"),
        ("slot-of-another-shape", "optimizer"),
    ],
)
def test_cli_reports_a_damaged_checkpoint_in_one_message(cli_checkpoint, tmp_path, capsys, command, case, message):
    from replicafit import cli

    edit = {**ENTRY_DAMAGE, **OPTIMIZER_DAMAGE}[case][0]
    bad = rewritten(cli_checkpoint, tmp_path / f"{case}.pt", edit)
    argv = [command, str(CLI_RECIPE), "--checkpoint", str(bad), *CLI_SMALL]
    if command == "predict":
        argv += ["--output", str(tmp_path / "out.npy")]
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in err and str(bad) in err and message in err
    if case.startswith("slot"):
        assert "optimizer state" in err and "does not match the recipe's model" not in err


# --- damaged backups: CheckpointError before anything is trained -------------------------------------------------

BACKUP_DAMAGE = {
    "no-cursor": (lambda s: s.pop("cursor"), "no 'cursor'"),
    "cursor-a-word": (lambda s: s.update(cursor="start"), "cursor must be"),
    "history-garbage": (lambda s: s.update(history={"history": 3}), "history must be"),
    "no-metrics": (lambda s: s.pop("metrics"), "no 'metrics'"),
    "metric-of-other-accumulators": (
        lambda s: s["metrics"].update(loss={"other": torch.zeros(2)}),
        "metric 'loss' with accumulators",
    ),
    "optimizer-slot-garbage": (
        lambda s: first_slots(s).update(momentum=torch.ones(3)),
        "backup .* holds an optimizer state that does not fit",
    ),
    "another-model": (
        lambda s: s["model"].update({"2.weight": torch.zeros(3, 8), "2.bias": torch.zeros(3)}),
        "does not fit this model",
    ),
    "epoch-a-float": (lambda s: s.update(epoch=2.0), "epoch must be an int"),
    "callbacks-garbage": (lambda s: s.update(callbacks={"TorchLRScheduler_0": 3}), "callbacks must be a dict"),
}


@pytest.mark.parametrize("case", list(BACKUP_DAMAGE))
def test_backup_with_a_damaged_entry_raises_checkpoint_error_before_training(tmp_path, case):
    edit, message = BACKUP_DAMAGE[case]
    backup = tmp_path / "backup"
    with pytest.raises(Crash):
        fit(make_trainer(), make_model(), [BackupAndRestore(backup, save_freq=3), CrashAt(4)])
    rewritten(backup / "backup.pt", backup / "backup.pt", edit)
    damaged = (backup / "backup.pt").read_bytes()

    trainer, model = make_trainer(), make_model(seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = []
    marker = LambdaCallback(on_train_batch_begin=lambda batch, logs: steps.append(batch))
    with pytest.raises(CheckpointError, match=message) as info:
        fit(trainer, model, [BackupAndRestore(backup, save_freq=3), marker])
    assert "backup" in str(info.value) and len(str(info.value)) < 600
    assert steps == []
    assert_nothing_loaded(trainer, model, before)
    assert (backup / "backup.pt").read_bytes() == damaged  # kept for the user to inspect


# --- temporary files of interrupted saves; permissions (hardening item 10) -----------------------------------------

KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys

    import torch

    from replicafit.trainer import checkpoint

    def killed_midway(obj, file, *args, **kwargs):
        file.write(b"half a checkpoint")
        file.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = killed_midway
    checkpoint.save({"weight": torch.ones(3)}, sys.argv[1])
    """
)


def leftovers(folder: Path) -> list:
    return sorted(name for name in os.listdir(folder) if name.startswith("."))


@pytest.mark.timeout(120)
def test_the_next_save_removes_the_temporary_file_of_a_save_killed_midway(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(KILLED_SAVE)
    folder = tmp_path / "ckpt"
    killed = run_script(script, str(folder / "last.pt"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(leftovers(folder)) == 1 and not (folder / "last.pt").exists()

    trainer = make_trainer()
    fit(trainer, make_model(), None, epochs=1)
    trainer.save_checkpoint(folder / "last.pt")
    assert sorted(os.listdir(folder)) == ["last.pt"]


def our_temporary_name(pid: int, host: str | None = None) -> str:
    from replicafit.trainer import checkpoint

    return f".replicafit-tmp-{pid}-{host or checkpoint._host_tag()}-0123abcd.pt"


@pytest.mark.timeout(60)
def test_the_next_save_keeps_the_temporary_file_of_a_live_writer_and_foreign_files(tmp_path):
    from replicafit.trainer import checkpoint

    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = [our_temporary_name(writer.pid), our_temporary_name(os.getpid())]
        foreign = [".tmp-notes.txt", "notes.pt", ".replicafit-tmp-x.pt", ".tmp-ABCDEFGH.pt"]
        for name in kept + foreign:
            (tmp_path / name).write_bytes(b"being written")
        two_hours_ago = time.time() - 7200
        for name in kept + foreign:  # old: a live writer's (stopped for long) and files of other naming stay
            os.utime(tmp_path / name, (two_hours_ago, two_hours_ago))
        checkpoint.save({"weight": torch.ones(3)}, tmp_path / "ckpt.pt")
        assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", *kept, *foreign])
    finally:
        writer.kill()
        writer.wait(timeout=30)
    checkpoint.save({"weight": torch.ones(3)}, tmp_path / "ckpt.pt")  # the writer is gone now
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", kept[1], *foreign])


def test_the_next_save_removes_temporary_files_untouched_for_an_hour(tmp_path):
    from replicafit.trainer import checkpoint

    old = [".tmp-abcd_123.pt", our_temporary_name(1, host="0badc0de")]  # an earlier version's; another host's
    fresh = [".tmp-efgh_456.pt", our_temporary_name(2, host="0badc0de")]
    for name in old + fresh:
        (tmp_path / name).write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    for name in old:
        os.utime(tmp_path / name, (two_hours_ago, two_hours_ago))
    checkpoint.save({"weight": torch.ones(3)}, tmp_path / "ckpt.pt")
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", *fresh])
    assert checkpoint.STALE_AFTER_SECONDS <= 3600


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_checkpoints_get_the_permissions_the_umask_gives_any_new_file(tmp_path, umask):
    from replicafit.trainer import checkpoint

    previous = os.umask(umask)
    try:
        trainer = make_trainer()
        fit(trainer, make_model(), [BackupAndRestore(tmp_path / "backup", save_freq=2), CrashAt(3)][:1], epochs=1)
        trainer.save_checkpoint(tmp_path / "full.pt")
        checkpoint.save({"weight": torch.ones(3)}, tmp_path / "plain.pt")
        with pytest.raises(Crash):
            fit(make_trainer(), make_model(), [BackupAndRestore(tmp_path / "backup", save_freq=2), CrashAt(3)])
        (tmp_path / "other.txt").write_text("a file the user creates")
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    assert (tmp_path / "other.txt").stat().st_mode & 0o777 == expected
    for path in (tmp_path / "full.pt", tmp_path / "plain.pt", tmp_path / "backup" / "backup.pt"):
        assert path.stat().st_mode & 0o777 == expected, path


# --- old checkpoints: optimizer state keyed by variable name (hardening item 13) ------------------------------------


def test_a_checkpoint_with_a_name_keyed_optimizer_state_still_loads(tmp_path):
    path = good_checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    optimizer = state["optimizer"]
    names = [record["name"] for record in optimizer.pop("variables")]
    optimizer["slots"] = {names[position]: slots for position, slots in optimizer["slots"].items()}
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy)

    current, old = make_trainer(), make_trainer()
    current.load_checkpoint(path, model=make_model(seed=3))
    old.load_checkpoint(legacy, model=make_model(seed=4))
    assert_same_optimizer_state(old.optimizer.state_dict(), current.optimizer.state_dict())


# --- a learning rate of 0 survives a backup (hardening item 12) ---------------------------------------------------


@pytest.mark.timeout(120)
def test_backup_restores_a_learning_rate_of_0(tmp_path):
    backup = tmp_path / "backup"
    freeze = LambdaCallback(
        on_epoch_end=lambda epoch, logs: setattr(trainer.optimizer, "learning_rate", 0.0) if epoch == 1 else None
    )
    trainer = make_trainer(learning_rate=0.01)
    with pytest.raises(Crash):
        fit(trainer, make_model(), [freeze, BackupAndRestore(backup, save_freq=3), CrashAt(13)])
    resumed = make_trainer(learning_rate=0.01)
    probe = Probe()
    fit(resumed, make_model(), [BackupAndRestore(backup, save_freq=3), probe])
    assert probe.begin[(2, 2)][1] == 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["default", "mirrored2", "central_storage2"])
def test_backup_of_a_from_torch_optimizer_resumes_with_the_same_weights(tmp_path, strategy):
    """Each copy of a from_torch optimizer gets its own restored state (torch updates it in place)."""

    def torch_trainer():
        optimizer = optimizers.from_torch(torch.optim.Adam, lr=0.01)
        return Trainer(strategy=make_strategy(strategy), optimizer=optimizer, metrics=["accuracy"], seed=0)

    reference = torch_trainer()
    reference_history = fit(reference, make_model(), None)
    with pytest.raises(Crash):
        fit(torch_trainer(), make_model(), [BackupAndRestore(tmp_path, save_freq=3), CrashAt(13)])
    trainer = torch_trainer()
    history = fit(trainer, make_model(seed=7), [BackupAndRestore(tmp_path, save_freq=3)])
    assert_same_state(trainer.model_state_dict(), reference.model_state_dict())
    got, want = trainer.optimizer.state_dict(), reference.optimizer.state_dict()
    assert got["variables"] == want["variables"] and got["iterations"] == want["iterations"] == 20
    for position, entry in want["torch_state"].items():
        assert_same_state(got["torch_state"][position], entry)
    # The resumed epoch's loss is a sum restored across replicas: equal up to float rounding.
    assert history.history["loss"] == pytest.approx(reference_history.history["loss"], abs=1e-6)


def _stateful_callbacks(folder: Path) -> list:
    from replicafit.trainer import callbacks as cbs

    return [
        cbs.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True, min_delta=1e-3),
        cbs.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5, min_delta=1e-3),
        cbs.ModelCheckpoint(str(folder / "best.pt"), monitor="val_loss", save_best_only=True, save_weights_only=True),
        cbs.CSVLogger(str(folder / "history.csv")),
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save_freq, crash_at", [("epoch", 27), (3, 22)])
def test_a_resumed_run_keeps_every_callbacks_state_and_files(tmp_path, save_freq, crash_at):
    """EarlyStopping's best value, wait and best weights, ReduceLROnPlateau's, ModelCheckpoint's best and
    CSVLogger's rows resume with the backup (regression: only TorchLRScheduler's did; a resumed run stopped
    later, restored other weights and kept 3 history rows of 20)."""
    full, split, backup = tmp_path / "full", tmp_path / "split", tmp_path / "backup"
    full.mkdir(), split.mkdir()
    settings = {"epochs": 12, "batch_size": 4}  # 9 steps an epoch
    reference_trainer = make_trainer(learning_rate=0.05)
    reference_callbacks = _stateful_callbacks(full)
    reference = fit(reference_trainer, make_model(), reference_callbacks, **settings)
    with pytest.raises(Crash):
        fit(
            make_trainer(learning_rate=0.05),
            make_model(),
            [BackupAndRestore(backup, save_freq=save_freq), *_stateful_callbacks(split), CrashAt(crash_at)],
            **settings,
        )
    trainer, callbacks = make_trainer(learning_rate=0.05), _stateful_callbacks(split)
    history = fit(trainer, make_model(seed=6), [BackupAndRestore(backup, save_freq=save_freq), *callbacks], **settings)
    assert reference_callbacks[0].stopped_epoch > 0  # it did stop early, at the same epoch
    assert history.history == reference.history and history.epoch == reference.epoch
    assert_same_state(trainer.model_state_dict(), reference_trainer.model_state_dict())
    for got, want in zip(callbacks, reference_callbacks):
        for name in getattr(want, "_STATE", ()):
            if name != "best_weights":
                assert getattr(got, name) == getattr(want, name), (type(want).__name__, name)
    assert_same_state(torch.load(split / "best.pt", weights_only=True), torch.load(full / "best.pt", weights_only=True))
    assert (split / "history.csv").read_text() == (full / "history.csv").read_text()
    assert float(trainer.optimizer.learning_rate) == float(reference_trainer.optimizer.learning_rate)
