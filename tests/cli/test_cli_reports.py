"""What ``replicafit`` reports matches what it saved (issue 16, part 3).

The console and metrics.json name the weights last.pt holds (the last epoch's, or the best epoch's
that ``EarlyStopping(restore_best_weights=True)`` put back), the validation accuracy is printed once,
``predict`` writes into the checkpoint's run directory, small values keep their digits, a checkpoint
of another model gets a fix in the command's terms, and history.png has a title, axis labels and the
best epoch marked.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import pathlib
import re
import shutil

import numpy as np
import pytest

from replicafit import cli
from replicafit.cli.plot import plot_spec
from replicafit.cli.reports import report_lines

ROOT = pathlib.Path(__file__).resolve().parents[2]
ONE_DEVICE = ROOT / "recipes" / "digits_onedevice.yaml"
RESTORING = "callbacks=[{type: early_stopping, monitor: val_accuracy, patience: 5, restore_best_weights: true}]"
# digits_onedevice with Adam(0.01): val_accuracy peaks at epoch 3 of 4 (seed 0), so EarlyStopping puts
# epoch 3's weights back although epoch 4 ran.
FAST = ["--set", "fit.verbose=0", "--set", "optimizer={type: adam, learning_rate: 0.01}"]


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def fit(run_dir, *sets, recipe=ONE_DEVICE):
    """``replicafit fit`` (outside capsys, for module fixtures): (status, stdout)."""
    argv = ["fit", str(recipe), "--run-dir", str(run_dir), *FAST]
    for item in sets:
        argv += ["--set", item]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv)
    return status, out.getvalue()


def history(run_dir):
    with open(os.path.join(run_dir, "history.csv"), newline="") as file:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(file)]


def metrics(run_dir):
    return json.loads((pathlib.Path(run_dir) / "metrics.json").read_text())


def evaluate(capsys, checkpoint, *argv):
    status, out, err = run_cli(capsys, "evaluate", ONE_DEVICE, "--checkpoint", checkpoint, *argv)
    assert status == 0, err
    return json.loads(out)


def report(out):
    """The lines after the model summary: what fit says at the end."""
    return out[out.rindex("_____\n") + len("_____\n") :].splitlines()


def four(value):
    return f"{value:.4f}"


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    """A run whose last.pt holds epoch 3's weights, restored by EarlyStopping after epoch 4."""
    run_dir = tmp_path_factory.mktemp("restored") / "run-restored"
    status, out = fit(run_dir, "fit.epochs=4", RESTORING)
    assert status == 0
    return run_dir, out


# --- 1. the last epoch and the restored best epoch, both named -----------------------------------
def test_restored_best_epoch_is_reported_beside_the_last_and_matches_the_checkpoint(restored, capsys):
    run_dir, out = restored
    rows = history(run_dir)
    best = max(range(len(rows)), key=lambda i: rows[i]["val_accuracy"])  # the first maximum, as EarlyStopping
    assert (best + 1, len(rows)) == (3, 4), rows  # the premise: an earlier epoch is restored
    last = rows[-1]

    saved = metrics(run_dir)
    assert saved["recipe"] == "digits_onedevice"
    assert saved["final"] == pytest.approx({k: v for k, v in last.items() if k != "epoch"})  # the last epoch, as before
    assert (saved["final_epoch"], saved["epochs"]) == (4, 4)
    weights = saved["checkpoint_weights"]
    assert {k: weights[k] for k in ("epoch", "restored_best", "monitor", "moving_averages")} == {
        "epoch": 3, "restored_best": True, "monitor": "val_accuracy", "moving_averages": False
    }  # fmt: skip
    assert weights["metrics"] == pytest.approx({k: v for k, v in rows[best].items() if k != "epoch"})
    assert "note" not in weights
    assert saved["best"] == {
        "monitor": "val_accuracy",
        "mode": "max",
        "epoch": 3,
        "value": weights["metrics"]["val_accuracy"],
    }

    # What metrics.json says last.pt holds is what evaluating last.pt gives, not the last epoch.
    logs = evaluate(capsys, run_dir / "checkpoints" / "last.pt")
    assert logs["accuracy"] == pytest.approx(weights["metrics"]["val_accuracy"], abs=1e-6)
    assert logs["loss"] == pytest.approx(weights["metrics"]["val_loss"], rel=1e-5)
    assert logs["accuracy"] != pytest.approx(last["val_accuracy"], abs=1e-6)

    lines = report(out)
    assert lines[:3] == [
        f"last epoch (4): val_loss {four(last['val_loss'])}",
        f"best epoch (3) by val_accuracy, restored and saved in last.pt: val_loss {four(rows[best]['val_loss'])}",
        f"validation accuracy: {four(rows[best]['val_accuracy'])} in last.pt (best epoch 3), "
        f"{four(last['val_accuracy'])} at the last epoch (4)",
    ]
    assert lines[3].startswith(f"run directory: {run_dir}") and len(lines) == 4


def test_restored_best_epoch_that_is_the_last_one_is_reported_once(tmp_path, capsys):
    status, out = fit(tmp_path, "fit.epochs=3", RESTORING)  # val_accuracy still rises at epoch 3
    assert status == 0
    final = metrics(tmp_path)["final"]
    weights = metrics(tmp_path)["checkpoint_weights"]
    assert (weights["epoch"], weights["restored_best"]) == (3, True)
    assert weights["metrics"] == pytest.approx(final)
    lines = report(out)
    assert (
        lines[0] == f"final (epoch 3, the best by val_accuracy, saved in last.pt): val_loss {four(final['val_loss'])}"
    )
    assert lines[1] == f"validation accuracy: {four(final['val_accuracy'])}"
    assert not any(line.startswith(("last epoch", "best epoch")) for line in lines)


def test_without_early_stopping_the_checkpoint_holds_the_last_epoch(tmp_path, capsys):
    status, out = fit(tmp_path, "fit.epochs=2")
    assert status == 0
    saved = metrics(tmp_path)
    rows = history(tmp_path)
    assert saved["checkpoint_weights"] == {
        "epoch": 2, "restored_best": False, "monitor": None, "moving_averages": False, "metrics": saved["final"]
    }  # fmt: skip
    lowest = min(range(len(rows)), key=lambda i: rows[i]["val_loss"])  # what best.pt keeps
    assert saved["best"] == {
        "monitor": "val_loss", "mode": "min", "epoch": lowest + 1, "value": pytest.approx(rows[lowest]["val_loss"])
    }  # fmt: skip
    assert report(out)[0] == f"final (epoch 2, saved in last.pt): val_loss {four(saved['final']['val_loss'])}"
    logs = evaluate(capsys, tmp_path / "checkpoints" / "last.pt")
    assert logs["accuracy"] == pytest.approx(saved["final"]["val_accuracy"], abs=1e-6)


@pytest.mark.parametrize(
    "callbacks, averaged, note",
    [
        # A recipe with use_ema gets SwapEMAWeights(swap_on_epoch=True) first: EarlyStopping keeps averages.
        ("[{type: early_stopping, monitor: val_accuracy, patience: 5, restore_best_weights: true}]", True, None),
        # Listed after the EarlyStopping, the swap comes too late: it keeps the trained weights.
        (
            "[{type: early_stopping, monitor: val_accuracy, patience: 5, restore_best_weights: true}, "
            "{type: swap_ema_weights, swap_on_epoch: true}]",
            False,
            "measured with the optimizer's moving averages, the checkpoint holds the trained weights",
        ),
    ],
    ids=["swap_first", "swap_after_early_stopping"],
)
def test_moving_averages_say_which_weights_the_checkpoint_holds(tmp_path, capsys, callbacks, averaged, note):
    optimizer = "optimizer={type: adam, learning_rate: 0.01, use_ema: true, ema_momentum: 0.9}"
    status, out = fit(tmp_path, "fit.epochs=3", optimizer, f"callbacks={callbacks}")
    assert status == 0
    weights = metrics(tmp_path)["checkpoint_weights"]
    assert weights["moving_averages"] is averaged
    assert ("as the optimizer's moving averages" in out) is averaged
    logs = evaluate(capsys, tmp_path / "checkpoints" / "last.pt")
    matches = logs["accuracy"] == pytest.approx(weights["metrics"]["val_accuracy"], abs=1e-6)
    if note is None:
        assert matches and "note" not in weights
    else:  # the reported values are not the checkpoint's, and the report says so
        assert not matches
        assert note in weights["note"] and f"note: {weights['note']}" in report(out)


# --- 2. the validation accuracy once ------------------------------------------------------------
def test_validation_accuracy_is_printed_once(tmp_path, restored):
    status, out = fit(tmp_path, "fit.epochs=2")
    assert status == 0
    accuracy = metrics(tmp_path)["final"]["val_accuracy"]
    assert out.count("val_accuracy") + out.count("validation accuracy") == 1, out
    assert out.count(four(accuracy)) == 1, out
    assert re.search(rf"^validation accuracy: {four(accuracy)}$", out, re.M), out
    # Restored: each of the two values once, on the one line.
    run_dir, out = restored
    saved = metrics(run_dir)
    assert out.count("val_accuracy") == 1  # the monitor's name, in "best epoch (3) by val_accuracy"
    assert out.count("validation accuracy") == 1
    for value in (saved["final"]["val_accuracy"], saved["checkpoint_weights"]["metrics"]["val_accuracy"]):
        assert out.count(four(value)) == 1, out


# --- 3. predictions.npy in the checkpoint's run directory --------------------------------------
def test_predict_writes_into_the_checkpoints_run_directory(restored, tmp_path, capsys, monkeypatch):
    run_dir, _ = restored
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(capsys, "predict", ONE_DEVICE, "--checkpoint", run_dir / "checkpoints" / "last.pt")
    assert status == 0, err
    written = run_dir / "predictions.npy"
    assert out == f"wrote (359, 10) predictions to {written}\n"
    assert np.load(written).shape == (359, 10) and not (tmp_path / "predictions.npy").exists()

    # A relative path from inside the run directory's checkpoints/ folder.
    written.unlink()
    monkeypatch.chdir(run_dir / "checkpoints")
    status, out, err = run_cli(capsys, "predict", ONE_DEVICE, "--checkpoint", "last.pt")
    assert status == 0, err
    assert out == f"wrote (359, 10) predictions to {os.path.join(os.pardir, 'predictions.npy')}\n"
    assert written.is_file()

    # --output still chooses.
    status, out, err = run_cli(
        capsys, "predict", ONE_DEVICE, "--checkpoint", "last.pt", "--output", tmp_path / "mine.npy"
    )
    assert status == 0, err
    assert np.load(tmp_path / "mine.npy").shape == (359, 10) and str(tmp_path / "mine.npy") in out


def test_predict_of_a_checkpoint_outside_a_run_directory_says_where_it_wrote(restored, tmp_path, capsys, monkeypatch):
    run_dir, _ = restored
    loose = tmp_path / "elsewhere" / "model.pt"
    loose.parent.mkdir()
    shutil.copy(run_dir / "checkpoints" / "last.pt", loose)
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(capsys, "predict", ONE_DEVICE, "--checkpoint", loose)
    assert status == 0, err
    assert np.load(tmp_path / "predictions.npy").shape == (359, 10)
    assert out.startswith("wrote (359, 10) predictions to predictions.npy (in the current directory: ")
    assert str(loose) in out and "--output" in out


# --- 4. small values keep their digits ----------------------------------------------------------
def test_small_values_keep_significant_digits(tmp_path):
    status, out = fit(
        tmp_path,
        "fit.epochs=2",
        "data.validation_split=0",  # no val_ values: the report shows every logged value, the rate too
        "optimizer.learning_rate=0.00003",
        "callbacks=[{type: reduce_lr_on_plateau, monitor: loss}]",
        recipe="regression",
    )
    assert status == 0
    line = report(out)[0]
    assert line.startswith("final (epoch 2, saved in last.pt): loss ") and "learning_rate 3.0000e-05" in line, line
    assert "0.0000" not in line

    lines = report_lines(
        {
            "final": {"val_loss": 2.5e-05, "val_mae": 0.0},
            "final_epoch": 1,
            "checkpoint_weights": {"epoch": 1, "restored_best": False, "moving_averages": False, "metrics": {}},
        }
    )
    assert lines == ["final (epoch 1, saved in last.pt): val_loss 2.5000e-05, val_mae 0.0000"]


# --- 5. a checkpoint of another model: the fix in the command's terms ---------------------------
@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_checkpoint_of_another_model_names_the_keys_and_the_runs_recipe(restored, capsys, command):
    run_dir, _ = restored
    checkpoint = run_dir / "checkpoints" / "last.pt"
    status, out, err = run_cli(
        capsys, command, ONE_DEVICE, "--checkpoint", checkpoint, "--set", "model.hidden=[128, 32]"
    )
    assert (status, out) == (2, "")
    assert "Traceback" not in err and "strict=False" not in err
    assert err.startswith(f"error: {checkpoint} does not match the recipe's model: it was saved from a different model")
    assert "only in the recipe's model: 4.weight, 4.bias" in err
    assert "2.weight (10, 128) vs (32, 128)" in err
    assert f"`replicafit {command} {run_dir / 'recipe.yaml'} --checkpoint {checkpoint}`" in err
    assert "without --set overrides that change the model" in err
    # The advice works: the run's own recipe loads the checkpoint.
    assert run_cli(capsys, "evaluate", run_dir / "recipe.yaml", "--checkpoint", checkpoint)[0] == 0


def test_checkpoint_of_another_model_outside_a_run_directory(restored, tmp_path, capsys):
    run_dir, _ = restored
    loose = tmp_path / "model.pt"
    shutil.copy(run_dir / "checkpoints" / "last.pt", loose)
    recipe = tmp_path / "wide.yaml"
    recipe.write_text(ONE_DEVICE.read_text().replace("hidden: [128]", "hidden: [64]"))
    status, _, err = run_cli(capsys, "evaluate", recipe, "--checkpoint", loose)
    assert status == 2
    assert "strict=False" not in err and "Traceback" not in err
    assert "shapes differ, checkpoint vs model: 0.weight (128, 64) vs (64, 64)" in err
    assert err.rstrip().endswith("To use it, pass the recipe it was trained with.")


# --- 6. history.png: title, axis labels, the best epoch marked ---------------------------------
def test_plot_spec_titles_labels_and_marks_the_monitored_best_epoch(restored):
    run_dir, _ = restored
    spec = plot_spec(str(run_dir))
    rows = history(run_dir)
    assert spec["title"] == "recipe digits_onedevice, run run-restored"
    assert spec["epochs"] == [1, 2, 3, 4]
    assert [p["name"] for p in spec["panels"]] == ["loss", "accuracy"]
    for panel in spec["panels"]:
        assert (panel["xlabel"], panel["ylabel"]) == ("epoch", panel["name"])
        assert panel["series"]["train"] == pytest.approx([r[panel["name"]] for r in rows])
        assert panel["series"]["validation"] == pytest.approx([r[f"val_{panel['name']}"] for r in rows])
    best = rows[2]["val_accuracy"]
    assert spec["best"] == {
        "panel": "accuracy", "series": "validation", "epoch": 3, "value": pytest.approx(best),
        "label": f"best val_accuracy: {four(best)} (epoch 3)",
    }  # fmt: skip


def test_plot_spec_without_metrics_json_marks_the_lowest_val_loss(restored, tmp_path):
    run_dir, _ = restored
    copy = tmp_path / "old-run"
    copy.mkdir()
    shutil.copy(run_dir / "history.csv", copy / "history.csv")  # a run directory from before metrics.json's best
    spec = plot_spec(str(copy))
    rows = history(run_dir)
    lowest = min(range(len(rows)), key=lambda i: rows[i]["val_loss"])
    assert spec["title"] == "run old-run"
    assert (spec["best"]["panel"], spec["best"]["series"], spec["best"]["epoch"]) == ("loss", "validation", lowest + 1)


def test_history_png_draws_the_spec(restored, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    run_dir, _ = restored
    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    status, out, err = run_cli(capsys, "plot", run_dir)
    assert status == 0, err
    assert (run_dir / "history.png").stat().st_size > 0
    (figure,) = drawn
    assert figure.get_suptitle() == "recipe digits_onedevice, run run-restored"
    loss, accuracy = figure.axes
    assert [(a.get_xlabel(), a.get_ylabel()) for a in (loss, accuracy)] == [("epoch", "loss"), ("epoch", "accuracy")]
    marks = [line for line in accuracy.get_lines() if line.get_label().startswith("best val_accuracy")]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [3]
    assert not any(line.get_label().startswith("best") for line in loss.get_lines())
    assert "best val_accuracy" in [t.get_text() for t in accuracy.get_legend().get_texts()][-1]
