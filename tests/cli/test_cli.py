"""The ``replicafit`` command (also ``python -m replicafit``): fit, evaluate, predict, validate, list, plot.

The contract: ``replicafit fit RECIPE [--set a.b=value ...]``, ``replicafit evaluate RECIPE
--checkpoint P``, ``replicafit validate RECIPE``, ``replicafit list``; a bad recipe gets one
message with the key path, exit status 2, no traceback.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from replicafit import cli
from replicafit.cli.command import COMMANDS
from replicafit.recipes import datasets
from replicafit.recipes.registry import REGISTRIES

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))
QUIET = ["--set", "fit.verbose=0"]


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def run_module(*argv, cwd=ROOT, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "replicafit", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_history(run_dir):
    with open(os.path.join(run_dir, "history.csv"), newline="") as file:
        return list(csv.DictReader(file))


def digits_validation():
    return datasets.digits(validation_split=0.2, seed=0)["validation"]


# --- list ---------------------------------------------------------------------------------------
def test_list_prints_every_kind_with_names_and_descriptions(capsys):
    status, out, err = run_cli(capsys, "list")
    assert (status, err) == (0, "")
    headings = [line[:-1] for line in out.splitlines() if not line.startswith(" ")]
    assert headings == ["recipes", *REGISTRIES]
    assert set(headings) == {
        "recipes", "strategy", "model", "dataset", "optimizer", "schedule", "loss", "metric", "callback"
    }  # fmt: skip
    for name in (
        "digits_mlp", "mirrored", "mlp", "digits", "adam", "cosine_decay", "cross_entropy", "accuracy",
        "early_stopping", "tensorboard",
    ):  # fmt: skip
        match = re.search(rf"^  {name}\s+(\S.*)$", out, re.M)
        assert match, f"{name} missing from `replicafit list`"
        assert len(match.group(1)) > 10  # a description, not just the name


def test_list_one_kind(capsys):
    status, out, _ = run_cli(capsys, "list", "optimizer")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "optimizer:"
    assert lines[-1].startswith("  (every optimizer also takes: ") and "use_ema" in lines[-1]
    lines = lines[:-1]
    names = [line.split()[0] for line in lines[1:]]
    assert names == sorted(REGISTRIES["optimizer"].names())
    assert {"sgd", "adam", "adamw", "rmsprop", "adagrad"} <= set(names)
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines[1:]), out  # every name has a description
    assert "Adam" in next(line for line in lines if line.split()[0] == "adam")
    assert "mlp" not in out


def test_list_unknown_kind(capsys):
    status, out, err = run_cli(capsys, "list", "optimizers")
    assert status == 2
    assert out == ""
    assert "unknown kind 'optimizers'" in err and "optimizer" in err and "Traceback" not in err


def test_list_recipes_shows_every_shipped_recipe_with_its_description(capsys):
    status, out, err = run_cli(capsys, "list", "recipes")
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "recipes:"
    described = dict(line.split(maxsplit=1) for line in lines[1:])
    assert list(described) == [path.stem for path in SHIPPED]
    for path in SHIPPED:  # the description is the file's first comment line
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and described[path.stem] == first[2:].strip()


# --- shipped recipes by name ---------------------------------------------------------------------
def test_a_shipped_recipe_runs_by_name_from_any_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ folder here
    assert run_cli(capsys, "validate", "digits_mlp")[:2] == (0, f"{RECIPES / 'digits_mlp.yaml'}: ok\n")
    assert run_cli(capsys, "validate", "digits_mlp.yaml")[0] == 0
    status, out, err = run_cli(capsys, "fit", "regression", "--set", "fit.epochs=1", *QUIET, "--run-dir", "run")
    assert status == 0, err
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
    assert yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["data"]["type"] == "regression"


def test_a_file_path_wins_over_a_shipped_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits_mlp").write_text("model: mlp\ndata: {type: digits}\nfit: {epochs: 0}\n")
    status, _, err = run_cli(capsys, "validate", "digits_mlp")
    assert status == 2 and "digits_mlp:3: fit.epochs: must be a positive integer" in err


@pytest.mark.parametrize(
    "argument,fragment",
    [
        ("digit_mlp", "no shipped recipe of that name (did you mean 'digits_mlp'?); shipped recipes: "),
        ("nothing_like_it", "shipped recipes: digits_central_storage, digits_cnn, digits_mlp"),
        ("elsewhere/digits_mlp.yaml", "cannot read the recipe"),  # a path is a path, never a name
    ],
)
def test_an_unknown_recipe_name_lists_the_shipped_ones(tmp_path, capsys, monkeypatch, argument, fragment):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(capsys, "validate", argument)
    assert (status, out) == (2, "")
    assert fragment in err and "Traceback" not in err


def test_old_top_level_spelling_names_the_new_one(tmp_path, capsys):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("strategy:\n  type: strategies:MirroredStrategy\nmodel: mlp\ndata: digits\n")
    status, _, err = run_cli(capsys, "validate", recipe)
    assert status == 2
    assert err.strip() == (
        f"error: {recipe}:2: strategy.type: cannot import 'strategies:MirroredStrategy': replicafit's packages "
        "live under the `replicafit` import root: write 'replicafit.strategies:MirroredStrategy' instead of "
        "'strategies:MirroredStrategy'"
    )
    recipe.write_text("model:\n  type: trainer.models:mlp\ndata: digits\n")
    assert "write 'replicafit.recipes.models:mlp'" in run_cli(capsys, "validate", recipe)[2]
    recipe.write_text("model:\n  type: replicafit.recipes.models:mlp\ndata: digits\n")
    assert run_cli(capsys, "validate", recipe)[0] == 0


# --- fit ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """digits_mlp.yaml (Mirrored over two logical CPUs) trained for 2 epochs."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    status = cli.main(
        [
            "fit",
            str(RECIPES / "digits_mlp.yaml"),
            "--set",
            "fit.epochs=2",
            "--set",
            "fit.verbose=0",
            "--set",
            "optimizer.learning_rate=0.003",
            "--run-dir",
            str(run_dir),
        ]
    )
    assert status == 0
    return run_dir


def test_fit_run_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RF_TEST_HIDDEN", "24")
    recipe = tmp_path / "digits.yaml"
    recipe.write_text((RECIPES / "digits_mlp.yaml").read_text().replace("hidden: [128]", "hidden: [${RF_TEST_HIDDEN}]"))
    run_dir = tmp_path / "out" / "run1"
    status, out, err = run_cli(
        capsys, "fit", recipe, "--run-dir", run_dir, "--set", "fit.epochs=2", "--set", "optimizer.beta_1=0.8", *QUIET
    )
    assert status == 0, err
    assert "Traceback" not in err
    assert {p.name for p in run_dir.iterdir()} >= {"checkpoints", "history.csv", "metrics.json", "recipe.yaml"}

    saved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert saved["fit"] == {"epochs": 2, "verbose": 0}
    assert saved["optimizer"] == {"type": "adam", "learning_rate": 0.001, "beta_1": 0.8}
    assert saved["model"]["hidden"] == [24]  # resolved: no ${...} left
    assert "${" not in (run_dir / "recipe.yaml").read_text()
    assert run_cli(capsys, "validate", run_dir / "recipe.yaml")[0] == 0

    rows = read_history(run_dir)
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(rows[0])

    for name in ("last.pt", "best.pt"):
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert isinstance(state, dict) and state

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["epochs"] == 2
    final = metrics["final"]
    assert final["val_accuracy"] == pytest.approx(float(rows[-1]["val_accuracy"]))
    assert final["val_loss"] == pytest.approx(float(rows[-1]["val_loss"]))

    match = re.search(r"^validation accuracy: (\d\.\d{4})$", out, re.M)
    assert match, out
    assert float(match.group(1)) == pytest.approx(final["val_accuracy"], abs=5e-5)
    assert re.search(rf"^run directory: {re.escape(str(run_dir))}", out, re.M), out


def test_fit_prints_the_model_summary_first(tmp_path, capsys):
    status, out, err = run_cli(capsys, "fit", "digits_mlp", "--set", "fit.epochs=1", *QUIET, "--run-dir", tmp_path)
    assert status == 0, err
    assert out.startswith('Model: "Sequential"\n')
    assert re.search(r"^ 0 \(Linear\) +\(None, 128\) +8,320$", out, re.M), out
    assert "Total params: 9,610 (37.54 KB)" in out  # 64*128 + 128 + 128*10 + 10
    assert out.index("Total params") < out.index("validation accuracy:")


def test_fit_overrides_change_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    status, _, err = run_cli(
        capsys,
        "fit",
        RECIPES / "digits_onedevice.yaml",
        "--run-dir",
        run_dir,
        "--set",
        "fit.epochs=3",
        "--set",
        "model.hidden=[32,16]",
        *QUIET,
    )
    assert status == 0, err
    assert len(read_history(run_dir)) == 3
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    shapes = sorted(tuple(v.shape) for k, v in state["model"].items() if k.endswith("weight"))
    assert shapes == [(10, 16), (16, 32), (32, 64)]


def test_fit_default_run_dir_under_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(capsys, "fit", RECIPES / "digits_onedevice.yaml", "--set", "fit.epochs=1", *QUIET)
    assert status == 0, err
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    assert re.fullmatch(r"\d{8}-\d{6}-digits_onedevice", runs[0].name), runs[0].name
    assert len(read_history(runs[0])) == 1
    assert (runs[0] / "checkpoints" / "last.pt").exists()
    assert f"run directory: {os.path.join('runs', runs[0].name)}" in out


def test_fit_regression_run(tmp_path, capsys):
    """No accuracy line for a regression; the recipe's `metrics: [mae]` is logged as `mae`, the name the
    recipe uses (as `Trainer(metrics=["mae"])` and Keras log it), so `monitor: val_mae` works."""
    run_dir = tmp_path / "run"
    status, out, err = run_cli(
        capsys, "fit", RECIPES / "regression.yaml", "--run-dir", run_dir, "--set", "fit.epochs=1", *QUIET
    )
    assert status == 0, err
    assert "validation accuracy:" not in out
    assert "run directory:" in out and "val_loss" in out
    assert {"loss", "val_loss", "mae", "val_mae"} <= set(read_history(run_dir)[0]), out


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_runs(tmp_path, capsys, recipe):
    assert len(SHIPPED) >= 5
    run_dir = tmp_path / "run"
    status, out, err = run_cli(capsys, "fit", recipe, "--set", "fit.epochs=1", *QUIET, "--run-dir", run_dir)
    assert status == 0, err
    assert "Traceback" not in err
    assert "run directory:" in out
    assert len(read_history(run_dir)) == 1
    assert run_cli(capsys, "validate", recipe)[0] == 0


# --- evaluate and predict from a checkpoint -----------------------------------------------------
def evaluate(capsys, recipe, checkpoint, *overrides):
    argv = ["evaluate", recipe, "--checkpoint", checkpoint]
    for override in overrides:
        argv += ["--set", override]
    status, out, err = run_cli(capsys, *argv)
    assert status == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["strategy={type: central_storage, compute_devices: [cpu:0, cpu:1], parameter_device: cpu:0}"],
        ["strategy={type: mirrored, devices: [cpu:0, cpu:1, cpu:2]}"],
    ],
    ids=["one_device", "central_storage", "mirrored3"],
)
def test_evaluate_under_another_strategy(trained, capsys, overrides):
    """Trained under Mirrored(2); evaluated on one device, CentralStorage(2) or Mirrored(3)."""
    final = json.loads((trained / "metrics.json").read_text())["final"]
    recipe = RECIPES / "digits_onedevice.yaml"
    logs = evaluate(capsys, recipe, trained / "checkpoints" / "last.pt", *overrides)
    assert logs["accuracy"] == pytest.approx(final["val_accuracy"], abs=1e-6)
    assert logs["loss"] == pytest.approx(final["val_loss"], rel=1e-5)


def test_evaluate_with_strategy_type_override(trained, tmp_path, capsys):
    """`--set strategy.type=central_storage` on a recipe whose strategy has no one-device arguments."""
    final = json.loads((trained / "metrics.json").read_text())["final"]
    recipe = tmp_path / "plain.yaml"
    recipe.write_text((RECIPES / "digits_onedevice.yaml").read_text().replace("  device: cpu ", "  # device: cpu "))
    logs = evaluate(
        capsys,
        recipe,
        trained / "checkpoints" / "last.pt",
        "strategy.type=central_storage",
        "strategy.compute_devices=[cpu:0, cpu:1]",
    )
    assert logs["accuracy"] == pytest.approx(final["val_accuracy"], abs=1e-6)


def test_evaluate_best_checkpoint(trained, capsys):
    rows = read_history(trained)
    best = min(rows, key=lambda r: float(r["val_loss"]))
    logs = evaluate(capsys, RECIPES / "digits_onedevice.yaml", trained / "checkpoints" / "best.pt")
    assert logs["accuracy"] == pytest.approx(float(best["val_accuracy"]), abs=1e-6)


def test_evaluate_checkpoint_of_another_model(trained, capsys):
    status, out, err = run_cli(
        capsys,
        "evaluate",
        RECIPES / "digits_onedevice.yaml",
        "--checkpoint",
        trained / "checkpoints" / "last.pt",
        "--set",
        "model.hidden=[64]",
    )
    assert status == 2
    assert "Traceback" not in err
    assert "does not match" in err and "last.pt" in err


@pytest.mark.parametrize("content", [b"garbage, not a checkpoint\n", b""], ids=["garbage", "empty"])
def test_evaluate_corrupt_checkpoint(trained, tmp_path, capsys, content):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    status, out, err = run_cli(capsys, "evaluate", RECIPES / "digits_onedevice.yaml", "--checkpoint", bad)
    assert status == 2
    assert out == ""
    assert "Traceback" not in err
    assert str(bad) in err and "cannot be read" in err


def test_evaluate_truncated_checkpoint(trained, tmp_path, capsys):
    data = (trained / "checkpoints" / "last.pt").read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: len(data) // 2])
    status, _, err = run_cli(capsys, "evaluate", RECIPES / "digits_onedevice.yaml", "--checkpoint", bad)
    assert status == 2
    assert "Traceback" not in err and str(bad) in err


def test_evaluate_missing_checkpoint(tmp_path, capsys):
    missing = tmp_path / "nope.pt"
    status, _, err = run_cli(capsys, "evaluate", RECIPES / "digits_onedevice.yaml", "--checkpoint", missing)
    assert status == 2
    assert "Traceback" not in err and str(missing) in err


def test_predict_writes_npy(trained, tmp_path, capsys):
    output = tmp_path / "predictions.npy"
    status, out, err = run_cli(
        capsys,
        "predict",
        RECIPES / "digits_onedevice.yaml",
        "--checkpoint",
        trained / "checkpoints" / "last.pt",
        "--output",
        output,
        "--set",
        "strategy={type: mirrored, devices: [cpu:0, cpu:1]}",
    )
    assert status == 0, err
    x_val, y_val = digits_validation()
    predictions = np.load(output)
    assert predictions.shape == (len(x_val), 10) == (359, 10)
    assert f"{(359, 10)}" in out and str(output) in out
    final = json.loads((trained / "metrics.json").read_text())["final"]
    accuracy = float((predictions.argmax(axis=1) == y_val).mean())
    assert accuracy == pytest.approx(final["val_accuracy"], abs=1e-6)


def test_predict_default_output(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(
        capsys, "predict", RECIPES / "digits_onedevice.yaml", "--checkpoint", trained / "checkpoints" / "last.pt"
    )
    assert status == 0, err
    assert np.load(trained / "predictions.npy").shape == (359, 10)  # the checkpoint's run directory
    assert not (tmp_path / "predictions.npy").exists()


# --- plot ---------------------------------------------------------------------------------------
def test_plot_without_matplotlib(trained, capsys):
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed")
    status, out, err = run_cli(capsys, "plot", trained)
    assert status == 2
    assert "Traceback" not in err
    assert "matplotlib" in err and "pip install 'replicafit[plot]'" in err
    assert not (trained / "history.png").exists()


def test_plot_missing_history(tmp_path, capsys):
    status, _, err = run_cli(capsys, "plot", tmp_path)
    assert status == 2
    assert "Traceback" not in err and "history.csv" in err


def test_plot_with_matplotlib(trained, capsys):
    pytest.importorskip("matplotlib")
    status, out, err = run_cli(capsys, "plot", trained)
    assert status == 0, err
    assert (trained / "history.png").stat().st_size > 0


# --- end to end, as a separate process ----------------------------------------------------------
def test_module_validate_ok():
    result = run_module("validate", "recipes/digits_mlp.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "recipes/digits_mlp.yaml: ok"


def test_module_bad_recipe(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: mlp\ndata: digits\noptimizer:\n  type: adam\n  learning_rat: 0.01\n")
    result = run_module("fit", recipe, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"error: {recipe}:5: optimizer.learning_rat: unknown argument of 'adam' (did you mean 'learning_rate'?)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["validate", "recipes/digits_mlp.yaml", "--set", "fit.epochs"], "key.path=value"),
        (["validate", "recipes/no_such_recipe.yaml"], "cannot read"),
        (["validate", "recipes/digits_mlp.yaml", "--set", "strategy.devices=[cuda:0]"], "strategy.devices"),
        (["evaluate", "recipes/digits_onedevice.yaml", "--checkpoint", "no/such/file.pt"], "no/such/file.pt"),
        (["frobnicate"], "invalid choice"),
        ([], "usage"),
        (["evaluate", "recipes/digits_onedevice.yaml"], "--checkpoint"),
    ],
    ids=["set", "no-file", "cuda", "checkpoint", "command", "no-command", "no-checkpoint"],
)
def test_module_errors_exit_2_without_traceback(argv, fragment):
    result = run_module(*argv)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert fragment in result.stderr


def test_module_fit_and_evaluate_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    result = run_module(
        "fit", "recipes/digits_mlp.yaml", "--set", "fit.epochs=1", "--set", "fit.verbose=0", "--run-dir", run_dir
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "validation accuracy:" in result.stdout and f"run directory: {run_dir}" in result.stdout
    accuracy = json.loads((run_dir / "metrics.json").read_text())["final"]["val_accuracy"]
    result = run_module(
        "evaluate",
        "recipes/digits_onedevice.yaml",
        "--checkpoint",
        run_dir / "checkpoints" / "last.pt",
        "--set",
        "strategy.device=cpu:1",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accuracy"] == pytest.approx(accuracy, abs=1e-6)


# --- Ctrl-C ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["validate", "fit", "list"])
def test_ctrl_c_prints_interrupted_and_exits_130(capsys, monkeypatch, command):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS, command, interrupted)
    argv = [command] + (["digits_mlp"] if command != "list" else [])
    status, out, err = run_cli(capsys, *argv)
    assert (status, out, err) == (130, "", "interrupted\n")


@pytest.mark.timeout(180)
def test_sigint_during_fit_prints_interrupted_and_exits_130(tmp_path):
    """A real Ctrl-C (SIGINT) in the middle of training: one line, status 130, no traceback."""
    import select
    import signal
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "replicafit", "fit", "digits_mlp", "--set", "fit.epochs=1000", "--set", "fit.verbose=2"]
        + ["--run-dir", str(tmp_path / "run")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline, seen = time.monotonic() + 120, ""
        while "Epoch 1/1000" not in seen:  # training has started
            assert process.poll() is None, process.stderr.read()
            ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no epoch line within 120 s; got {seen!r}"
            seen += process.stdout.readline()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 130, err
        assert err == "interrupted\n"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_the_replicafit_command_finds_the_users_modules_in_the_working_directory(tmp_path):
    """Regression: ``python -m replicafit`` and ``torchrun -m replicafit`` put the working directory on
    ``sys.path``; the console script ``replicafit`` did not, so a recipe naming ``my_models:small_mlp``
    next to it failed with "No module named 'my_models'" under the command the docs show first."""
    import sysconfig

    # this interpreter's own console script (a shim first on PATH could run another installation)
    command = os.path.join(sysconfig.get_path("scripts"), "replicafit")
    assert os.path.exists(command), "the package's console script is not installed"
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\n\n\ndef small_mlp(inputs, outputs):\n    return nn.Linear(inputs, outputs)\n"
    )
    recipe = yaml.safe_load((RECIPES / "digits_mlp.yaml").read_text())
    recipe["model"] = {"type": "my_models:small_mlp"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(recipe))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    done = subprocess.run(
        [command, "validate", "mine.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "mine.yaml: ok" in done.stdout
    if sys.version_info < (3, 11):
        return  # PYTHONSAFEPATH is Python 3.11's
    # python -P (PYTHONSAFEPATH) asks for no working directory on sys.path: the command respects it
    done = subprocess.run(
        [command, "validate", "mine.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, PYTHONSAFEPATH="1"),
    )
    assert done.returncode == 2 and "No module named 'my_models'" in done.stderr


class _OnAccelerator(torch.Tensor):
    """Stands for predictions on a GPU: no ``numpy()`` until copied to the host (as torch says of CUDA tensors)."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


def test_predict_writes_predictions_made_on_an_accelerator(trained, tmp_path, capsys, monkeypatch):
    from replicafit.trainer import Trainer

    predict = Trainer.predict

    def on_accelerator(self, *args, **kwargs):
        return predict(self, *args, **kwargs).as_subclass(_OnAccelerator)

    monkeypatch.setattr(Trainer, "predict", on_accelerator)
    output = tmp_path / "predictions.npy"
    checkpoint = trained / "checkpoints" / "last.pt"
    status, _, err = run_cli(
        capsys, "predict", RECIPES / "digits_onedevice.yaml", "--checkpoint", checkpoint, "--output", output
    )
    assert status == 0, err
    assert np.load(output).shape == (359, 10)
