"""The experiment trackers ``MLflowLogger`` and ``WandbLogger`` (and their base, ``callbacks/tracker.py``): what a
fit sends, read back with the trackers' own readers; a resumed fit continues its run; a tracker that fails or
stalls warns once and never stops nor holds the fit; only the chief sends.

MLflow writes to SQLite stores in ``tmp_path``; W&B runs offline (its files in ``tmp_path``); no network.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import struct
import threading
import time
import types
import warnings

import pytest
import torch

import replicafit.strategies as ds
from replicafit.trainer import (
    BackupAndRestore,
    CSVLogger,
    LambdaCallback,
    MLflowLogger,
    ModelCheckpoint,
    Trainer,
    WandbLogger,
)
from replicafit.trainer.callbacks import tracker as tracker_module
from replicafit.trainer.callbacks.tracker import Tracker
from replicafit.trainer.callbacks.wandb_logger import default_mode

EPOCHS = 3


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No server, no telemetry, W&B offline and quiet, its caches in tmp_path."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def data(n: int = 96):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


def fit(callbacks, strategy=None, epochs: int = EPOCHS):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    trainer = Trainer(strategy=strategy, optimizer="adam", loss="cross_entropy", metrics=["accuracy"], seed=0)
    return trainer.fit(
        model, data(), batch_size=16, epochs=epochs, validation_split=0.25, callbacks=callbacks, verbose=0
    )


def ours(record, name: str) -> list:
    return [str(w.message) for w in record if str(w.message).startswith(name)]


def mlflow_client(run_dir):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{run_dir}/mlflow.db")


def only_run(client):
    experiment = client.get_experiment_by_name("replicafit")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def series(client, run_id, key) -> list:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)]


# --- MLflow -------------------------------------------------------------------------------------------------------
def test_mlflow_records_params_epoch_and_step_metrics_and_files(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    best = run_dir / "checkpoints" / "best.pt"
    logger = MLflowLogger(run_dir=run_dir, tags={"team": "tests"}, log_every_n_steps=2, log_checkpoint=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit([CSVLogger(run_dir / "history.csv"), ModelCheckpoint(best, save_best_only=True), logger])
    assert ours(record, "MLflowLogger") == []
    assert logger.store_uri() == f"sqlite:///{run_dir}/mlflow.db"  # the default store: the run directory's

    client = mlflow_client(run_dir)
    run = only_run(client)
    assert run.info.status == "FINISHED" and run.info.run_name == "run" and run.data.tags["team"] == "tests"
    for key, values in history.history.items():  # the History's own keys, the epoch as the step
        assert series(client, run.info.run_id, key) == [(e, pytest.approx(v)) for e, v in enumerate(values)]
    steps = [step for step, _ in series(client, run.info.run_id, "batch/loss")]
    assert steps == list(range(2, EPOCHS * 5 + 1, 2))  # 72 rows / 16: 5 updates an epoch, every 2nd one
    params = run.data.params
    assert params["optimizer"] == "adam" and params["learning_rate"] == "0.001"
    assert params["loss"] == "SparseCategoricalCrossentropy" and params["batch_size"] == "16"
    assert (params["epochs"], params["replicas"], params["workers"], params["seed"]) == (str(EPOCHS), "1", "1", "0")
    assert params["optimizer_config.beta_1"] == "0.9" and params["precision"] == "32"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"history.csv", "checkpoints"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/best.pt"]
    assert (run_dir / "mlartifacts").is_dir()  # the artifacts stay in the run directory


def test_mlflow_resumed_fit_continues_the_same_run_each_epoch_once(tmp_path):
    run_dir = tmp_path / "run"

    def interrupt(epoch, logs):
        if epoch == 1:
            raise KeyboardInterrupt  # after the logger sent epoch 1, before the backup kept it

    def callbacks(*extra):
        return [MLflowLogger(run_dir=run_dir), *extra, BackupAndRestore(tmp_path / "backup")]

    with pytest.raises(KeyboardInterrupt):
        fit(callbacks(LambdaCallback(on_epoch_end=interrupt)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit(callbacks())
    assert ours(record, "MLflowLogger") == []  # the parameters it has already are not sent again

    client = mlflow_client(run_dir)
    run = only_run(client)  # the same run, not a second one
    assert run.info.status == "FINISHED" and run.data.params["optimizer"] == "adam"
    assert series(client, run.info.run_id, "loss") == [
        (e, pytest.approx(v)) for e, v in enumerate(history.history["loss"])
    ]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server_warns_once_and_the_fit_finishes(tmp_path):
    logger = MLflowLogger(f"http://127.0.0.1:{closed_port()}", run_dir=tmp_path / "run", log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit([logger])
    assert len(history.history["loss"]) == EPOCHS
    (message,) = ours(record, "MLflowLogger")
    assert "cannot reach the tracking server" in message and "Training goes on" in message


# --- what the base does with any tracker -----------------------------------------------------------------------------
class Recorder(Tracker):
    """A tracker whose library is a list of calls; ``fail`` or ``stall`` (seconds) at one of its methods."""

    _library, _module, _extra = "Fake", "json", "fake"

    def __init__(self, fail=None, stall=None, **kwargs):
        super().__init__(**kwargs)
        self.fail, self.stall, self.calls, self.runs, self.saved = fail, stall, [], 0, []

    def _new_run(self, saved):
        self.runs += 1
        self.saved.append(saved)
        return FakeRun(self)


class FakeRun:
    key = "fake"

    def __init__(self, owner):
        self.owner = owner

    def state(self):
        return {"run_id": "fake"}

    def __getattr__(self, method):
        def call(*args):
            if self.owner.stall and self.owner.stall[0] == method:
                time.sleep(self.owner.stall[1])
            if self.owner.fail == method:
                raise OSError(28, "No space left on device")
            self.owner.calls.append((method, *args))

        return call


def test_a_failing_tracker_warns_once_and_training_goes_on():
    tracker = Recorder(fail="log_metrics")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit([tracker])
    assert len(history.history["loss"]) == EPOCHS
    (message,) = ours(record, "Recorder")
    assert "Fake failed while sending the epoch's logs (OSError: [Errno 28] No space left on device)" in message
    assert [c[0] for c in tracker.calls] == ["open", "log_params"]  # nothing after the failure


def test_a_stalled_tracker_is_waited_for_flush_timeout_at_most():
    tracker = Recorder(stall=("open", 3.0), flush_timeout=0.2)  # a server that does not answer
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit([tracker])
    assert len(history.history["loss"]) == EPOCHS
    (message,) = ours(record, "Recorder")
    assert "had not taken everything after 0.2 s" in message


def test_only_the_chief_tracks(tmp_path, monkeypatch):
    strategy = ds.OneDeviceStrategy("cpu")
    monkeypatch.setattr(strategy.cluster, "num_workers", 2)  # this process plays worker 1 of a cluster of 2
    monkeypatch.setattr(strategy.cluster, "worker_index", 1)
    assert not strategy.cluster.is_chief
    tracker, mlflow_logger = Recorder(), MLflowLogger(run_dir=tmp_path / "run", log_every_n_steps=1)
    before = {t.name for t in threading.enumerate()}
    fit([tracker, mlflow_logger], strategy=strategy)
    assert (tracker.runs, tracker.calls) == (0, [])
    assert not (tmp_path / "run").exists()  # no store, no file
    assert not {t.name for t in threading.enumerate()} - before  # no sender thread


def test_the_run_is_kept_in_checkpoints_and_a_fit_that_restores_it_continues_it(tmp_path):
    def trainer():
        return Trainer(optimizer="adam", loss="cross_entropy", seed=0)

    model, first = torch.nn.Linear(4, 2), trainer()
    first.fit(model, data(), batch_size=16, callbacks=[Recorder()], verbose=0)
    path = first.save_checkpoint(tmp_path / "ckpt.pt")
    saved = torch.load(path, weights_only=True)["callbacks"]["Recorder_0"]
    assert saved == {"run": {"run_id": "fake"}}

    second, tracker = trainer(), Recorder()
    second.load_checkpoint(path, model)
    second.fit(model, data(), batch_size=16, callbacks=[tracker], verbose=0)
    assert tracker.saved == [{"run_id": "fake"}]  # the run to go on with


# --- W&B ----------------------------------------------------------------------------------------------------------
def wandb_records(run_dir, runs: int = 1) -> list:
    """The records of the offline runs under ``run_dir/wandb`` once ``runs`` of them are complete (W&B's service
    may still be writing its transaction log when ``finish`` returns)."""
    deadline = time.monotonic() + 30
    while True:
        records = read_wandb_records(run_dir)
        if sum(r.WhichOneof("record_type") == "exit" for _, r in records) >= runs or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def read_wandb_records(run_dir) -> list:
    """The records of every offline run under ``run_dir/wandb`` (W&B's transaction log: LevelDB's log format,
    32 KiB blocks of checksummed chunks, each record a protobuf ``Record``)."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        with open(path, "rb") as file:
            raw = file.read()
        if len(raw) < 7:
            continue
        ident, magic, _ = struct.unpack("<4sHB", raw[:7])
        assert (ident, magic) == (b":W&B", 0xBEE1)
        position, pending = 7, b""
        while position + 7 <= len(raw):
            left = 32768 - position % 32768
            if left < 7:  # a block's tail too short for a header is padding
                position += left
                continue
            _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
            if (length, kind) == (0, 0) or position + 7 + length > len(raw):  # padding, or still being written
                position += left
                continue
            chunk = raw[position + 7 : position + 7 + length]
            position += 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST | MIDDLE, LAST
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append((os.path.basename(os.path.dirname(path)), record))
    return records


def items(update) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_wandb_offline_run_in_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = WandbLogger(project="digits", run_dir=run_dir, log_every_n_steps=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit([CSVLogger(run_dir / "history.csv"), logger])
    assert ours(record, "WandbLogger") == []

    records = wandb_records(run_dir)
    (run,) = [r.run for _, r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("digits", "run")
    assert {folder for folder, _ in records} == {folder for folder, _ in records if folder.endswith(f"-{run.run_id}")}
    rows = [items(r.history.item) for _, r in records if r.WhichOneof("record_type") == "history"]
    epochs = [row for row in rows if "epoch" in row]
    assert [row["epoch"] for row in epochs] == list(range(EPOCHS))
    for key, values in history.history.items():
        assert [row[key] for row in epochs] == pytest.approx(values)
    assert [row["batch/step"] for row in rows if "batch/step" in row] == list(range(2, EPOCHS * 5 + 1, 2))
    config = {}
    for _, r in records:
        if r.WhichOneof("record_type") == "config":
            config.update(items(r.config.update))
    assert config["optimizer"] == "adam" and config["batch_size"] == 16 and config["epochs"] == EPOCHS
    (folder,) = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert os.path.exists(os.path.join(folder, "files", "history.csv"))


def test_wandb_resumed_fit_continues_the_same_run_id(tmp_path):
    run_dir = tmp_path / "run"

    def interrupt(epoch, logs):
        if epoch == 1:
            raise KeyboardInterrupt

    def callbacks(*extra):
        return [WandbLogger(run_dir=run_dir), *extra, BackupAndRestore(tmp_path / "backup")]

    with pytest.raises(KeyboardInterrupt):
        fit(callbacks(LambdaCallback(on_epoch_begin=interrupt)))
    fit(callbacks())
    records = wandb_records(run_dir, runs=2)
    runs = [r.run.run_id for _, r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 2 and runs[0] == runs[1]  # two offline attempts of one run (wandb sync joins them)
    epochs = [items(r.history.item).get("epoch") for _, r in records if r.WhichOneof("record_type") == "history"]
    assert sorted(epochs) == list(range(EPOCHS))  # epoch 0 before the interruption, then 1 and 2: each once


def test_wandb_is_offline_without_credentials_unless_a_mode_is_set():
    def fake(mode_set: bool, logged_in: bool):
        settings = types.SimpleNamespace(model_fields_set={"mode"} if mode_set else set())
        return types.SimpleNamespace(
            setup=lambda: types.SimpleNamespace(settings=settings), login=lambda prompt, verify: logged_in
        )

    assert default_mode(fake(mode_set=False, logged_in=False)) == "offline"
    assert default_mode(fake(mode_set=False, logged_in=True)) is None  # W&B's own default: online
    assert default_mode(fake(mode_set=True, logged_in=False)) is None  # WANDB_MODE decides


# --- construction ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, extra", [(MLflowLogger, "mlflow"), (WandbLogger, "wandb")])
def test_a_missing_package_names_the_extra(monkeypatch, cls, extra):
    find_spec = tracker_module.importlib.util.find_spec
    monkeypatch.setattr(
        tracker_module.importlib.util, "find_spec", lambda name, *a: None if name == extra else find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=rf'pip install "replicafit\[{extra}\]"'):
        cls()


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: MLflowLogger(log_every_n_steps=0), "log_every_n_steps must be a positive integer"),
        (lambda: MLflowLogger(tags=["a"]), "tags must be a dict"),
        (lambda: WandbLogger(mode="sometimes"), "mode must be"),
        (lambda: WandbLogger(flush_timeout=-1), "flush_timeout must be"),
    ],
)
def test_bad_arguments_are_refused(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


def test_log_checkpoint_true_needs_a_run_dir():
    with pytest.raises(ValueError, match="run_dir is not set"):
        fit([MLflowLogger(log_checkpoint=True)])


def test_a_fit_that_raises_leaves_its_run_failed_at_exit_not_running(tmp_path):
    """A fit that raises gets no on_train_end: at the process's exit its MLflow run is closed as FAILED (it
    stayed RUNNING for ever)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import torch
        from replicafit.trainer import LambdaCallback, MLflowLogger, Trainer

        def stop(epoch, logs):
            raise RuntimeError("the fit fails")

        x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
        trainer = Trainer(loss="cross_entropy", metrics=[])
        try:
            trainer.fit(torch.nn.Linear(4, 2), (x, y), batch_size=8, epochs=3, verbose=0,
                        callbacks=[MLflowLogger(run_dir={str(tmp_path)!r}), LambdaCallback(on_epoch_end=stop)])
        except RuntimeError:
            pass
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=dict(os.environ))
    run = only_run(mlflow_client(tmp_path))
    assert run.info.status == "FAILED"
    assert [m.step for m in mlflow_client(tmp_path).get_metric_history(run.info.run_id, "loss")] == [0]
