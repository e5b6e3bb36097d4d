"""The recipe entries ``mlflow_logger`` and ``wandb_logger``: ``replicafit fit`` records the run in the run
directory (MLflow's SQLite store, W&B's offline run), read back with MLflow's own client; ``replicafit validate``
checks the entries without importing mlflow or wandb.
"""

from __future__ import annotations

import csv
import glob
import pathlib
import subprocess
import sys
import time

import pytest
import yaml

from replicafit import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def digits_with(tmp_path, *entries) -> pathlib.Path:
    """The shipped digits_mlp recipe with ``entries`` added to its callbacks."""
    recipe = yaml.safe_load((ROOT / "recipes" / "digits_mlp.yaml").read_text())
    recipe["callbacks"] = [*recipe.get("callbacks", []), *entries]
    path = tmp_path / "digits_tracked.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_fit_records_the_run_in_the_run_directory(tmp_path, capsys):
    recipe = digits_with(tmp_path, {"type": "mlflow_logger", "log_every_n_steps": 10}, {"type": "wandb_logger"})
    run_dir = tmp_path / "run"
    argv = ["fit", recipe, "--run-dir", run_dir, "--set", "fit.epochs=2", "--set", "fit.verbose=0"]
    assert cli.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    with open(run_dir / "history.csv", newline="") as file:
        rows = list(csv.DictReader(file))

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")  # the default store: in the run directory
    experiment = client.get_experiment_by_name("replicafit")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted((m.step, m.value) for m in history) == [
            (int(row["epoch"]), pytest.approx(float(row[key]))) for row in rows
        ]
    assert {m.step for m in client.get_metric_history(run.info.run_id, "batch/loss")} == {10, 20, 30, 40}
    params = run.data.params
    assert params["strategy"] == "MirroredStrategy" and params["replicas"] == "2" and params["batch_size"] == "64"
    assert params["recipe.optimizer.learning_rate"] == "0.001" and params["recipe.fit.epochs"] == "2"
    assert params["recipe.model.hidden"] == "[128]" and params["recipe.callbacks.1.type"] == "mlflow_logger"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"history.csv", "recipe.yaml"}

    deadline = time.monotonic() + 30  # W&B's service may still be writing its files when finish returns
    while not glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / "history.csv")):
        assert time.monotonic() < deadline, "no offline W&B run with history.csv in the run directory"
        time.sleep(0.1)


def test_validate_checks_the_entries_without_importing_the_trackers(tmp_path):
    recipe = digits_with(
        tmp_path,
        {"type": "mlflow_logger", "tracking_uri": "http://mlflow.invalid:5000", "log_checkpoint": True},
        {"type": "wandb_logger", "project": "digits", "mode": "offline"},
    )
    code = (
        "import sys; from replicafit import cli; status = cli.main(['validate', sys.argv[1]]); "
        "assert not {'mlflow', 'wandb'} & set(sys.modules), 'imported'; sys.exit(status)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(recipe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(": ok")


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"type": "mlflow_logger", "log_every_n_step": 5}, "did you mean 'log_every_n_steps'"),
        ({"type": "wandb_logger", "mode": "sometimes"}, "mode must be"),
    ],
)
def test_a_bad_entry_is_one_message_at_its_key(tmp_path, capsys, entry, fragment):
    status = cli.main(["validate", str(digits_with(tmp_path, entry))])
    err = capsys.readouterr().err
    assert status == 2 and f"callbacks[1].{next(k for k in entry if k != 'type')}:" in err, err
    assert fragment in err and "Traceback" not in err


def test_list_names_the_trackers(capsys):
    assert cli.main(["list", "callback"]) == 0
    out = capsys.readouterr().out
    assert "mlflow_logger" in out and "wandb_logger" in out
