"""The ``TensorBoard`` callback: Keras 3's layout and tags, read back with TensorBoard's own reader."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import replicafit.strategies as ds
from replicafit import cli
from replicafit.trainer import Callback, TensorBoard, Trainer
from replicafit.trainer.callbacks import CallbackList

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the optional `tensorboard` extra is not installed (pip install 'replicafit[tensorboard]')",
)


def read(log_dir) -> dict:
    """``{tag: [(step, value), ...]}`` of the scalars, plus ``{tag: steps}`` of the histograms, in one dict."""
    accumulator = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    out = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in tags["scalars"]}
    out.update({tag: [e.step for e in accumulator.Histograms(tag)] for tag in tags["histograms"]})
    return out


def digits(n=320):
    from replicafit.data import datasets

    x, y = datasets.load_digits(normalize=True)
    return x[:n], y[:n]


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )


def fit(strategy, log_dir, epochs=2, **tensorboard):
    model = mlp()
    trainer = Trainer(strategy=strategy, optimizer="sgd", metrics=["accuracy"], seed=0)
    history = trainer.fit(
        model, digits(), batch_size=64, epochs=epochs, validation_split=0.25, verbose=0,
        callbacks=[TensorBoard(log_dir, **tensorboard)],
    )  # fmt: skip
    return trainer, model, history


def test_two_epoch_fit_writes_keras_tags_and_values(strategy, tmp_path):
    trainer, model, history = fit(strategy, tmp_path, histogram_freq=1)
    train, validation = read(tmp_path / "train"), read(tmp_path / "validation")
    weights = [name for name, _ in model.named_parameters()] + ["1.running_mean", "1.running_var"]
    assert set(train) == {"epoch_loss", "epoch_accuracy", "epoch_learning_rate"} | {f"{w}/histogram" for w in weights}
    assert set(validation) == {
        "epoch_loss", "epoch_accuracy", "evaluation_loss_vs_iterations", "evaluation_accuracy_vs_iterations"
    }  # fmt: skip
    for tag, key in (("epoch_loss", "loss"), ("epoch_accuracy", "accuracy")):
        assert [s for s, _ in train[tag]] == [0, 1]
        assert [v for _, v in train[tag]] == pytest.approx(history.history[key], rel=1e-6)  # stored as float32
        assert [v for _, v in validation[tag]] == pytest.approx(history.history[f"val_{key}"], rel=1e-6)
    assert [v for _, v in train["epoch_learning_rate"]] == pytest.approx([0.01, 0.01])
    steps_per_epoch = 240 // 64 + 1
    assert [s for s, _ in validation["evaluation_loss_vs_iterations"]] == [steps_per_epoch, 2 * steps_per_epoch]
    assert [v for _, v in validation["evaluation_loss_vs_iterations"]] == pytest.approx(
        history.history["val_loss"], rel=1e-6
    )
    assert train["0.weight/histogram"] == [0, 1]


def test_batch_level_scalars_every_update_freq_steps(tmp_path):
    trainer, _, history = fit(ds.MirroredStrategy(["cpu:0", "cpu:1"]), tmp_path, update_freq=2)
    train = read(tmp_path / "train")
    assert [s for s, _ in train["batch_loss"]] == [2, 4, 6, 8]  # 4 steps per epoch, stepped by iterations
    assert {"batch_loss", "batch_accuracy", "epoch_loss"} <= set(train)
    batch_losses = dict(train["batch_loss"])
    assert batch_losses[4] == pytest.approx(history.history["loss"][0], rel=1e-6)  # the epoch's last batch: its mean


def test_update_freq_batch_and_steps_per_second(tmp_path):
    fit(ds.get_strategy(), tmp_path, epochs=1, update_freq="batch", write_steps_per_second=True)
    train = read(tmp_path / "train")
    assert [s for s, _ in train["batch_loss"]] == [1, 2, 3, 4]
    assert len(train["batch_steps_per_second"]) == 4 and len(train["epoch_steps_per_second"]) == 1
    assert all(v > 0 and math.isfinite(v) for _, v in train["batch_steps_per_second"] + train["epoch_steps_per_second"])


def test_epoch_logging_does_not_make_the_trainer_read_batch_logs():
    assert not CallbackList([TensorBoard("unused")]).wants_batch_logs["on_train_batch_end"]
    assert CallbackList([TensorBoard("unused", update_freq=5)]).wants_batch_logs["on_train_batch_end"]


def test_standalone_evaluate_writes_evaluation_scalars(tmp_path):
    model = mlp()
    trainer = Trainer(optimizer="sgd", metrics=["accuracy"], seed=0)
    trainer.fit(model, digits(128), batch_size=64, epochs=1, verbose=0)
    logs = trainer.evaluate(model, digits(128), batch_size=64, return_dict=True, callbacks=[TensorBoard(tmp_path)])
    validation = read(tmp_path / "validation")
    assert validation["evaluation_loss_vs_iterations"] == [(2, pytest.approx(logs["loss"], rel=1e-6))]
    assert not (tmp_path / "train").exists()  # no empty event files for what was not logged


def test_a_second_fit_continues_the_batch_curve(tmp_path):
    model = mlp()
    trainer = Trainer(optimizer="sgd", seed=0)
    for _ in range(2):
        trainer.fit(
            model, digits(128), batch_size=64, epochs=1, verbose=0, callbacks=[TensorBoard(tmp_path, update_freq=1)]
        )
    assert [s for s, _ in read(tmp_path / "train")["batch_loss"]] == [1, 2, 3, 4]


def test_nothing_is_written_where_the_strategy_says_not_to(tmp_path, monkeypatch):
    strategy = ds.OneDeviceStrategy("cpu")
    monkeypatch.setattr(type(strategy.extended), "should_save_summary", property(lambda self: False))
    fit(strategy, tmp_path, epochs=1, update_freq=1, histogram_freq=1)
    assert list(tmp_path.iterdir()) == []


def test_metrics_added_by_other_callbacks_are_logged(tmp_path):
    class AddsALog(Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["custom"] = float(epoch) * 2

    model = mlp()
    Trainer(optimizer="sgd", seed=0).fit(
        model, digits(128), batch_size=64, epochs=2, verbose=0, callbacks=[AddsALog(), TensorBoard(tmp_path)]
    )
    assert read(tmp_path / "train")["epoch_custom"] == [(0, 0.0), (1, 2.0)]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"update_freq": 0}, "update_freq must be"),
        ({"update_freq": "step"}, "update_freq must be"),
        ({"update_freq": True}, "update_freq must be"),
        ({"histogram_freq": -1}, "histogram_freq must be"),
        ({"histogram_freq": 1.5}, "histogram_freq must be"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TensorBoard("logs", **kwargs)


def test_missing_tensorboard_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were absent
    with pytest.raises(ImportError, match=r"pip install 'replicafit\[tensorboard\]'"):
        TensorBoard("logs")


def test_recipe_runner_logs_into_the_run_directory(tmp_path, capsys):
    recipe = tmp_path / "tb.yaml"
    recipe.write_text(
        "seed: 0\nmodel: {type: mlp, hidden: [16]}\ndata: {type: digits, validation_split: 0.2, batch_size: 128}\n"
        "metrics: [accuracy]\ncallbacks:\n  - type: tensorboard\n    update_freq: 5\nfit: {epochs: 2, verbose: 0}\n"
    )
    assert cli.main(["fit", str(recipe), "--run-dir", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    train = read(tmp_path / "run" / "tensorboard" / "train")
    assert {"epoch_loss", "epoch_accuracy", "epoch_learning_rate", "batch_loss"} <= set(train)
    assert "epoch_accuracy" in read(tmp_path / "run" / "tensorboard" / "validation")


def test_fit_tensorboard_flag(tmp_path, capsys):
    run_dir = tmp_path / "run"
    status = cli.main(["fit", "regression", "--set", "fit.epochs=2", "--set", "fit.verbose=0", "--tensorboard",
                       "--run-dir", str(run_dir)])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    history = np.genfromtxt(run_dir / "history.csv", delimiter=",", names=True)
    train = read(run_dir / "tensorboard" / "train")
    assert [v for _, v in train["epoch_loss"]] == pytest.approx(list(history["loss"]), rel=1e-6)
