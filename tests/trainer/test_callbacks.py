"""Callbacks of ``trainer``: hooks, History, ModelCheckpoint, EarlyStopping, LR callbacks,
CSVLogger, TerminateOnNaN, LambdaCallback and the progress bar (Keras 3 semantics)."""

from __future__ import annotations

import csv
import io
import math
import os
import random
import re
import sys

import pytest
import torch
from conftest import make_strategy

from replicafit import optimizers
from replicafit.trainer import (
    Callback,
    CSVLogger,
    EarlyStopping,
    History,
    LambdaCallback,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgbarLogger,
    ReduceLROnPlateau,
    TerminateOnNaN,
    Trainer,
)
from replicafit.trainer import callbacks as callbacks_module

# --- helpers ------------------------------------------------------------------------------------


def make_data(n: int = 32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def make_model(seed: int = 1) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def make_trainer(strategy="default", optimizer=None, metrics=("accuracy",)) -> Trainer:
    return Trainer(
        strategy=make_strategy(strategy),
        optimizer=optimizer if optimizer is not None else optimizers.Adam(0.01),
        loss="cross_entropy",
        metrics=list(metrics),
        seed=0,
    )


def snapshot(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


class Recorder(Callback):
    """Records every hook call with a copy of its arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def _record(self, hook, *args):
        self.calls.append((hook, *[dict(a) if isinstance(a, dict) else a for a in args]))


for _hook in [name for name in dir(Callback) if name.startswith("on_")]:

    def _make(hook):
        def method(self, *args):
            self._record(hook, *args)

        return method

    setattr(Recorder, _hook, _make(_hook))


class Script(Callback):
    """Overwrites ``logs[key]`` at the end of each epoch with a scripted value (put it first)."""

    def __init__(self, key, values):
        super().__init__()
        self.key, self.values = key, list(values)

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = self.values[epoch]


class EpochWeights(Callback):
    """The model's weights at the end of each epoch."""

    def __init__(self):
        super().__init__()
        self.weights: dict = {}

    def on_epoch_end(self, epoch, logs=None):
        self.weights[epoch] = snapshot(self.trainer.model_state_dict())


class LearningRates(Callback):
    """The optimizer's learning rate during each epoch (read at every batch)."""

    def __init__(self):
        super().__init__()
        self.per_epoch: dict = {}
        self._epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.per_epoch.setdefault(self._epoch, set()).add(float(self.trainer.optimizer.learning_rate))


# --- hooks, params, History -------------------------------------------------------------------------


def test_hooks_order_arguments_and_params():
    x, y = make_data(40)
    vx, vy = make_data(12, seed=5)
    trainer, model = make_trainer(), make_model()
    recorder = Recorder()
    history = trainer.fit(
        model, (x, y), batch_size=10, epochs=2, validation_data=(vx, vy), callbacks=[recorder], verbose=0
    )

    assert recorder.trainer is trainer
    assert recorder.model is model
    assert recorder.params == {"epochs": 2, "steps": 4, "verbose": 0}

    train_calls = [c for c in recorder.calls if not c[0].startswith("on_test")]
    names = [c[0] if c[0] in ("on_train_begin", "on_train_end") else (c[0], c[1]) for c in train_calls]
    expected = ["on_train_begin"]
    for epoch in range(2):
        expected.append(("on_epoch_begin", epoch))
        for batch in range(4):
            expected += [("on_train_batch_begin", batch), ("on_train_batch_end", batch)]
        expected.append(("on_epoch_end", epoch))
    expected.append("on_train_end")
    assert names == expected

    for call in train_calls:
        if call[0] == "on_train_batch_end":
            assert {"loss", "accuracy"} <= set(call[2])
            assert all(math.isfinite(v) for v in call[2].values())
    epoch_logs = [c[2] for c in train_calls if c[0] == "on_epoch_end"]
    for logs in epoch_logs:
        assert set(logs) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    # The epoch's logs are the History's values, and the last batch's logs are the epoch's training logs.
    assert [logs["loss"] for logs in epoch_logs] == history.history["loss"]
    assert [logs["val_accuracy"] for logs in epoch_logs] == history.history["val_accuracy"]
    last_batch_logs = [c[2] for c in train_calls if c[0] == "on_train_batch_end"][-1]
    assert last_batch_logs["loss"] == epoch_logs[-1]["loss"]
    # on_train_end gets the last epoch's logs (Keras 3).
    assert train_calls[-1][1] == epoch_logs[-1]


def test_validation_inside_fit_calls_the_test_hooks():
    # Keras 3: fit's validation runs evaluate with the fit's callbacks, so on_test_begin,
    # on_test_batch_begin/end and on_test_end run before each on_epoch_end.
    x, y = make_data(40)
    vx, vy = make_data(12, seed=5)
    recorder = Recorder()
    make_trainer().fit(
        make_model(), (x, y), batch_size=10, epochs=2, validation_data=(vx, vy), callbacks=[recorder], verbose=0
    )
    sequence = [c[0] for c in recorder.calls if c[0] in ("on_test_begin", "on_test_end", "on_epoch_end")]
    assert sequence == ["on_test_begin", "on_test_end", "on_epoch_end"] * 2
    test_batches = [c[1] for c in recorder.calls if c[0] == "on_test_batch_end"]
    assert test_batches == [0, 1] * 2


def test_history_returned_by_fit():
    x, y = make_data(40)
    trainer = make_trainer()
    history = trainer.fit(make_model(), (x, y), batch_size=8, epochs=3, validation_split=0.25, verbose=0)
    assert isinstance(history, History)
    assert trainer.history is history
    assert history.epoch == [0, 1, 2]
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == 3 for v in history.history.values())
    assert all(isinstance(v, float) for values in history.history.values() for v in values)
    assert history.history["loss"][-1] < history.history["loss"][0]

    later = make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=3, initial_epoch=1, verbose=0)
    assert later.epoch == [1, 2]
    assert set(later.history) == {"loss", "accuracy"} and len(later.history["loss"]) == 2


def test_stop_training_from_a_callback_ends_after_the_current_batch():
    x, y = make_data(40)
    trainer = make_trainer()
    recorder = Recorder()

    class StopAtBatch(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.trainer.stop_training = True

    history = trainer.fit(make_model(), (x, y), batch_size=8, epochs=5, callbacks=[StopAtBatch(), recorder], verbose=0)
    batches = [c[1] for c in recorder.calls if c[0] == "on_train_batch_end"]
    assert batches == [0, 1]
    assert int(trainer.optimizer.iterations) == 2
    assert history.epoch == [0]  # the epoch still ends (logs, on_epoch_end), then training ends
    assert [c[0] for c in recorder.calls][-2:] == ["on_epoch_end", "on_train_end"]

    # A later fit starts afresh (stop_training is reset).
    again = trainer.fit(make_model(), (x, y), batch_size=8, epochs=2, verbose=0)
    assert again.epoch == [0, 1]


def test_stop_training_at_epoch_end():
    x, y = make_data(40)
    trainer = make_trainer()
    stop = LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(trainer, "stop_training", epoch == 1))
    history = trainer.fit(make_model(), (x, y), batch_size=8, epochs=6, callbacks=[stop], verbose=0)
    assert history.epoch == [0, 1]
    assert int(trainer.optimizer.iterations) == 10


def test_lambda_callback():
    x, y = make_data(24)
    calls = []
    callback = LambdaCallback(
        on_train_begin=lambda logs: calls.append("begin"),
        on_epoch_begin=lambda epoch, logs: calls.append(("epoch", epoch)),
        on_train_batch_end=lambda batch, logs: calls.append(("batch", batch, sorted(logs))),
        on_epoch_end=lambda epoch, logs: calls.append(("end", epoch, sorted(logs))),
        on_train_end=lambda logs: calls.append("done"),
    )
    make_trainer().fit(make_model(), (x, y), batch_size=12, epochs=2, callbacks=[callback], verbose=0)
    one_epoch = lambda e: [  # noqa: E731
        ("epoch", e),
        ("batch", 0, ["accuracy", "loss"]),
        ("batch", 1, ["accuracy", "loss"]),
        ("end", e, ["accuracy", "loss"]),
    ]
    assert calls == ["begin", *one_epoch(0), *one_epoch(1), "done"]

    with pytest.raises(ValueError, match="on_epoch_ending"):
        LambdaCallback(on_epoch_ending=lambda epoch, logs: None)


def test_callbacks_must_be_callbacks():
    x, y = make_data(16)
    with pytest.raises(TypeError, match="Callback"):
        make_trainer().fit(make_model(), (x, y), batch_size=8, callbacks=[lambda *a: None], verbose=0)


# --- ModelCheckpoint ----------------------------------------------------------------------------------


def test_model_checkpoint_filename_template_with_epoch_and_metric(tmp_path):
    x, y = make_data(40)
    vx, vy = make_data(12, seed=5)
    trainer, model = make_trainer(), make_model()
    weights = EpochWeights()
    checkpoint = ModelCheckpoint(str(tmp_path / "ckpt-{epoch:02d}-{val_loss:.3f}.pt"))
    history = trainer.fit(
        model, (x, y), batch_size=8, epochs=3, validation_data=(vx, vy), callbacks=[weights, checkpoint], verbose=0
    )
    expected = {f"ckpt-{e + 1:02d}-{v:.3f}.pt" for e, v in enumerate(history.history["val_loss"])}
    assert set(os.listdir(tmp_path)) == expected
    for epoch, value in enumerate(history.history["val_loss"]):
        state = torch.load(tmp_path / f"ckpt-{epoch + 1:02d}-{value:.3f}.pt", weights_only=True)
        assert {"model", "optimizer"} <= set(state)
        assert_same_state(state["model"], weights.weights[epoch])
        assert state["optimizer"]["iterations"] == 5 * (epoch + 1)


@pytest.mark.parametrize(
    "monitor, mode, values, saved",
    [
        ("val_loss", "auto", [0.5, 0.4, 0.6, 0.3, 0.35], [1, 2, 4]),
        ("val_loss", "min", [0.5, 0.4, 0.6, 0.3, 0.35], [1, 2, 4]),
        ("val_loss", "max", [0.5, 0.4, 0.6, 0.3, 0.7], [1, 3, 5]),
        ("val_accuracy", "auto", [0.5, 0.4, 0.6, 0.6, 0.7], [1, 3, 5]),  # auto: accuracy is maximised
        ("val_accuracy", "max", [0.5, 0.4, 0.6, 0.3, 0.7], [1, 3, 5]),
        ("val_accuracy", "min", [0.5, 0.4, 0.6, 0.3, 0.7], [1, 2, 4]),
        ("loss", "auto", [0.9, 0.9, 0.8, 0.85, 0.1], [1, 3, 5]),  # equal is not better
    ],
)
def test_model_checkpoint_save_best_only(tmp_path, monitor, mode, values, saved):
    x, y = make_data(16)
    checkpoint = ModelCheckpoint(
        str(tmp_path / "best-{epoch}.pt"), monitor=monitor, mode=mode, save_best_only=True, save_weights_only=True
    )
    make_trainer().fit(
        make_model(), (x, y), batch_size=8, epochs=5, callbacks=[Script(monitor, values), checkpoint], verbose=0
    )
    assert sorted(os.listdir(tmp_path)) == sorted(f"best-{e}.pt" for e in saved)


def test_model_checkpoint_save_best_only_single_file_holds_best_epoch(tmp_path):
    x, y = make_data(16)
    weights = EpochWeights()
    path = tmp_path / "best.pt"
    checkpoint = ModelCheckpoint(str(path), monitor="val_loss", save_best_only=True)
    make_trainer().fit(
        make_model(),
        (x, y),
        batch_size=8,
        epochs=4,
        callbacks=[Script("val_loss", [0.5, 0.2, 0.3, 0.25]), weights, checkpoint],
        verbose=0,
    )
    assert os.listdir(tmp_path) == ["best.pt"]
    assert_same_state(torch.load(path, weights_only=True)["model"], weights.weights[1])


def test_model_checkpoint_missing_monitor_saves_nothing(tmp_path):
    x, y = make_data(16)
    checkpoint = ModelCheckpoint(str(tmp_path / "c-{epoch}.pt"), monitor="val_loss", save_best_only=True)
    with pytest.warns(UserWarning, match="monitors 'val_loss', which is not in the logs"):
        make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=2, callbacks=[checkpoint], verbose=0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_model_checkpoint_save_weights_only_is_a_plain_state_dict(tmp_path, strategy):
    x, y = make_data(40)
    weights = EpochWeights()
    model = make_model()
    checkpoint = ModelCheckpoint(str(tmp_path / "w{epoch}.pt"), save_weights_only=True)
    make_trainer(strategy).fit(model, (x, y), batch_size=8, epochs=2, callbacks=[weights, checkpoint], verbose=0)
    assert sorted(os.listdir(tmp_path)) == ["w1.pt", "w2.pt"]
    for epoch in (0, 1):
        state = torch.load(tmp_path / f"w{epoch + 1}.pt", weights_only=True)
        assert set(state) == set(model.state_dict())
        fresh = make_model(seed=7)
        fresh.load_state_dict(state)  # strict
        assert_same_state(fresh.state_dict(), weights.weights[epoch])
    assert_same_state(torch.load(tmp_path / "w2.pt", weights_only=True), model.state_dict())


def test_model_checkpoint_save_freq_in_steps(tmp_path):
    x, y = make_data(32)  # 4 steps per epoch

    class BatchWeights(Callback):
        def __init__(self):
            super().__init__()
            self.weights, self.epoch = {}, None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.weights[(self.epoch, batch)] = snapshot(self.trainer.model_state_dict())

    recorder = BatchWeights()
    checkpoint = ModelCheckpoint(str(tmp_path / "s-{epoch}-{batch}.pt"), save_freq=3, save_weights_only=True)
    make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=2, callbacks=[recorder, checkpoint], verbose=0)
    # Global steps 3 and 6: epoch 1 batch 3, epoch 2 batch 2 (1-based); nothing at epoch ends.
    assert sorted(os.listdir(tmp_path)) == ["s-1-3.pt", "s-2-2.pt"]
    assert_same_state(torch.load(tmp_path / "s-1-3.pt", weights_only=True), recorder.weights[(0, 2)])
    assert_same_state(torch.load(tmp_path / "s-2-2.pt", weights_only=True), recorder.weights[(1, 1)])


@pytest.mark.parametrize("save_freq", [0, -2, "batch", 1.5])
def test_model_checkpoint_rejects_bad_save_freq(tmp_path, save_freq):
    with pytest.raises(ValueError, match="save_freq"):
        ModelCheckpoint(str(tmp_path / "c.pt"), save_freq=save_freq)


def test_monitor_mode_is_validated(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        ModelCheckpoint(str(tmp_path / "c.pt"), mode="maximum")
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(mode="up")


# --- EarlyStopping ------------------------------------------------------------------------------------


def keras_early_stopping(values, patience=0, min_delta=0.0, mode="min", baseline=None, start_from_epoch=0):
    """Keras 3's EarlyStopping.on_epoch_end, for a list of monitored values: (epochs run, best epoch)."""
    delta = abs(min_delta) if mode == "max" else -abs(min_delta)

    def improved(value, reference):
        if reference is None:
            return True
        return value - delta > reference if mode == "max" else value - delta < reference

    wait, best, best_epoch = 0, None, 0
    for epoch, current in enumerate(values):
        if epoch < start_from_epoch:
            continue
        wait += 1
        if improved(current, best):
            best, best_epoch = current, epoch
            if baseline is None or improved(current, baseline):
                wait = 0
            continue
        if wait >= patience and epoch > 0:
            return epoch + 1, best_epoch
    return len(values), best_epoch


@pytest.mark.parametrize(
    "kwargs, values, epochs_run",
    [
        ({"patience": 2}, [1.0, 0.9, 0.95, 0.96, 0.5, 0.4], 4),
        ({"patience": 0}, [1.0, 1.1, 0.5, 0.4], 2),
        ({"patience": 0}, [1.0, 1.0, 0.5, 0.4], 2),  # equal is no improvement
        ({"patience": 0}, [math.inf, 1.0, 0.5], 3),  # no stop at epoch 0
        ({"patience": 3}, [1.0, 1.1, 0.9, 1.2, 1.3, 1.4, 0.1], 6),  # wait resets on improvement
        ({"patience": 1, "min_delta": 0.1}, [1.0, 0.95, 0.9, 0.85, 0.8], 2),
        ({"patience": 1, "min_delta": -0.1}, [1.0, 0.95, 0.9, 0.85, 0.8], 2),  # the sign is ignored
        ({"patience": 1, "min_delta": 0.01}, [1.0, 0.95, 0.9, 0.85, 0.8], 5),
        ({"patience": 2, "baseline": 0.5}, [0.9, 0.8, 0.7, 0.75, 0.6, 0.5], 4),  # never beats baseline
        ({"patience": 2, "baseline": 0.5}, [0.9, 0.8, 0.4, 0.45, 0.46, 0.47], 5),
        ({"patience": 1, "start_from_epoch": 2}, [1.0, 4.0, 3.0, 3.5, 3.6], 4),
        ({"patience": 1}, [1.0, 4.0, 3.0, 3.5, 3.6], 2),
        ({"patience": 1, "mode": "max"}, [0.5, 0.6, 0.55, 0.58, 0.7], 3),
        ({"patience": 1, "mode": "max", "min_delta": 0.2}, [0.5, 0.6, 0.9, 0.95, 1.0], 2),
    ],
)
def test_early_stopping_rules(kwargs, values, epochs_run):
    assert keras_early_stopping(values, **kwargs)[0] == epochs_run  # the expectation is Keras'
    x, y = make_data(16)
    stopper = EarlyStopping(monitor="val_loss", **kwargs)
    history = make_trainer().fit(
        make_model(),
        (x, y),
        batch_size=16,
        epochs=len(values),
        callbacks=[Script("val_loss", values), stopper],
        verbose=0,
    )
    assert history.epoch == list(range(epochs_run))
    assert stopper.stopped_epoch == (epochs_run - 1 if epochs_run < len(values) else 0)


def test_early_stopping_auto_mode_maximises_accuracy():
    x, y = make_data(16)
    values = [0.5, 0.6, 0.55, 0.58, 0.7]
    for mode, epochs_run in (("auto", 3), ("max", 3), ("min", 2)):
        history = make_trainer().fit(
            make_model(),
            (x, y),
            batch_size=16,
            epochs=5,
            callbacks=[Script("val_accuracy", values), EarlyStopping(monitor="val_accuracy", patience=1, mode=mode)],
            verbose=0,
        )
        assert len(history.epoch) == epochs_run, mode


def test_early_stopping_matches_keras_on_random_sequences():
    x, y = make_data(8)
    rng = random.Random(1234)
    trainer, model = make_trainer(), make_model()
    for _ in range(12):
        values = [round(rng.uniform(0, 1), 2) for _ in range(8)]
        kwargs = {
            "patience": rng.randint(0, 3),
            "min_delta": rng.choice([0.0, 0.05]),
            "mode": rng.choice(["min", "max"]),
            "baseline": rng.choice([None, 0.3, 0.7]),
            "start_from_epoch": rng.choice([0, 0, 2]),
        }
        history = trainer.fit(
            model,
            (x, y),
            batch_size=8,
            epochs=8,
            callbacks=[Script("val_loss", values), EarlyStopping(**kwargs)],
            verbose=0,
        )
        assert len(history.epoch) == keras_early_stopping(values, **kwargs)[0], (values, kwargs)


@pytest.mark.parametrize("strategy", ["default", "mirrored2", "central_storage2"])
def test_early_stopping_restore_best_weights(tmp_path, strategy):
    x, y = make_data(32)
    model = make_model()
    trainer = make_trainer(strategy)
    stopper = EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    saver = ModelCheckpoint(str(tmp_path / "w{epoch}.pt"), save_weights_only=True)
    history = trainer.fit(
        model,
        (x, y),
        batch_size=8,
        epochs=10,
        callbacks=[Script("val_loss", [0.5, 0.3, 0.4, 0.45, 0.1]), stopper, saver],
        verbose=0,
    )
    assert history.epoch == [0, 1, 2, 3]
    assert stopper.best_epoch == 1 and stopper.stopped_epoch == 3
    best = torch.load(tmp_path / "w2.pt", weights_only=True)
    last = torch.load(tmp_path / "w4.pt", weights_only=True)
    assert not torch.equal(best["0.weight"], last["0.weight"])
    assert_same_state(trainer.model_state_dict(), best)
    assert_same_state(model.state_dict(), best)  # the user's module holds them too
    # ... and they are the weights a later evaluate/predict uses.
    expected = make_model(seed=9)
    expected.load_state_dict(best)
    assert torch.allclose(trainer.predict(model, x, batch_size=32), expected(x).detach(), atol=1e-6)


def test_early_stopping_restore_best_weights_without_stopping(tmp_path):
    # Keras 3 restores the best weights at the end of training even when it did not stop early.
    x, y = make_data(16)
    model = make_model()
    trainer = make_trainer()
    saver = ModelCheckpoint(str(tmp_path / "w{epoch}.pt"), save_weights_only=True)
    stopper = EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    history = trainer.fit(
        model,
        (x, y),
        batch_size=8,
        epochs=3,
        callbacks=[Script("val_loss", [0.5, 0.2, 0.4]), stopper, saver],
        verbose=0,
    )
    assert history.epoch == [0, 1, 2]
    assert_same_state(trainer.model_state_dict(), torch.load(tmp_path / "w2.pt", weights_only=True))


# --- LearningRateScheduler -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, expected",
    [
        (lambda epoch, lr: lr * 0.5, [0.05, 0.025, 0.0125]),
        (lambda epoch: 0.1 / (epoch + 1), [0.1, 0.05, 0.1 / 3]),
    ],
    ids=["epoch_and_lr", "epoch_only"],
)
def test_learning_rate_scheduler(schedule, expected):
    x, y = make_data(24)
    trainer = make_trainer(optimizer=optimizers.SGD(0.1))
    rates = LearningRates()
    seen = []
    after = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(logs["learning_rate"]))
    trainer.fit(
        make_model(),
        (x, y),
        batch_size=8,
        epochs=3,
        callbacks=[LearningRateScheduler(schedule), rates, after],
        verbose=0,
    )
    assert all(len(rates.per_epoch[e]) == 1 for e in range(3))
    assert [next(iter(rates.per_epoch[e])) for e in range(3)] == pytest.approx(expected, rel=1e-12)
    assert seen == pytest.approx(expected, rel=1e-12)
    assert float(trainer.optimizer.learning_rate) == pytest.approx(expected[-1], rel=1e-12)


def test_learning_rate_scheduler_drives_the_updates():
    # lr 0 from epoch 1 on: the weights stop changing after the first epoch.
    x, y = make_data(24)
    weights = EpochWeights()
    trainer = make_trainer(optimizer=optimizers.SGD(0.1))
    schedule = LearningRateScheduler(lambda epoch: 0.1 if epoch == 0 else 1e-30)
    trainer.fit(make_model(), (x, y), batch_size=8, epochs=3, callbacks=[schedule, weights], verbose=0)
    for key, value in weights.weights[0].items():
        assert torch.allclose(weights.weights[2][key], value, atol=1e-20)
    assert not torch.equal(weights.weights[0]["0.weight"], make_model().state_dict()["0.weight"])


def test_learning_rate_is_recorded_in_history():
    # Keras 3 appends History after the user's callbacks, so logs["learning_rate"] is in history.
    x, y = make_data(16)
    history = make_trainer(optimizer=optimizers.SGD(0.1)).fit(
        make_model(),
        (x, y),
        batch_size=8,
        epochs=3,
        callbacks=[LearningRateScheduler(lambda epoch, lr: 0.1 * 2**-epoch)],
        verbose=0,
    )
    assert history.history.get("learning_rate") == [0.1, 0.05, 0.025]


def test_learning_rate_scheduler_rejects_non_numbers():
    x, y = make_data(16)
    with pytest.raises(ValueError, match="number"):
        make_trainer().fit(
            make_model(), (x, y), batch_size=8, callbacks=[LearningRateScheduler(lambda e, lr: "fast")], verbose=0
        )


# --- ReduceLROnPlateau -----------------------------------------------------------------------------------


def keras_reduce_lr(values, lr, factor=0.1, patience=10, mode="min", min_delta=1e-4, cooldown=0, min_lr=0.0):
    """Keras 3's ReduceLROnPlateau: the learning rate logged at each epoch end."""
    import numpy as np

    better = (lambda a, b: a < b - min_delta) if mode == "min" else (lambda a, b: a > b + min_delta)
    best = math.inf if mode == "min" else -math.inf
    wait = cooldown_counter = 0
    logged = []
    for current in values:
        logged.append(lr)
        if cooldown_counter > 0:
            cooldown_counter -= 1
            wait = 0
        if better(current, best):
            best, wait = current, 0
        elif not cooldown_counter > 0:
            wait += 1
            if wait >= patience and lr > np.float32(min_lr):
                lr = max(lr * factor, min_lr)
                cooldown_counter, wait = cooldown, 0
    return logged, lr


def run_plateau(values, lr0=0.1, monitor="val_loss", **kwargs):
    x, y = make_data(16)
    trainer = make_trainer(optimizer=optimizers.SGD(lr0))
    rates = LearningRates()
    logged = []
    after = LambdaCallback(on_epoch_end=lambda epoch, logs: logged.append(logs["learning_rate"]))
    trainer.fit(
        make_model(),
        (x, y),
        batch_size=8,
        epochs=len(values),
        callbacks=[Script(monitor, values), rates, ReduceLROnPlateau(monitor=monitor, **kwargs), after],
        verbose=0,
    )
    used = [next(iter(rates.per_epoch[e])) for e in range(len(values))]
    assert all(len(rates.per_epoch[e]) == 1 for e in range(len(values)))
    return logged, used, float(trainer.optimizer.learning_rate)


def test_reduce_lr_on_plateau_factor_patience_cooldown_min_lr_min_delta():
    values = [1.0, 0.995, 0.992, 0.97, 0.965, 0.966, 0.964, 0.963, 0.962, 0.961]
    kwargs = {"factor": 0.5, "patience": 2, "min_delta": 0.01, "cooldown": 1, "min_lr": 0.02}
    expected = [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.02, 0.02]
    assert keras_reduce_lr(values, 0.1, **kwargs) == (expected, 0.02)
    logged, used, final = run_plateau(values, **kwargs)
    assert logged == pytest.approx(expected, rel=1e-12)
    assert used == pytest.approx(expected, rel=1e-12)  # the optimizer used the reduced rate next epoch
    assert final == pytest.approx(0.02, rel=1e-12)


def test_reduce_lr_on_plateau_auto_mode_for_accuracy():
    values = [0.5, 0.5, 0.6, 0.6, 0.6]
    logged, _, final = run_plateau(values, monitor="val_accuracy", factor=0.1, patience=1, min_delta=0.0)
    assert logged == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001], rel=1e-12)
    assert final == pytest.approx(0.0001, rel=1e-12)


def test_reduce_lr_on_plateau_matches_keras_on_random_sequences():
    rng = random.Random(99)
    for _ in range(8):
        values = [round(rng.uniform(0, 1), 2) for _ in range(8)]
        kwargs = {
            "factor": rng.choice([0.5, 0.1]),
            "patience": rng.randint(0, 2),
            "min_delta": rng.choice([0.0, 0.05]),
            "cooldown": rng.randint(0, 2),
            "min_lr": rng.choice([0.0, 0.01]),
            "mode": rng.choice(["min", "max"]),
        }
        expected_logged, expected_final = keras_reduce_lr(values, 0.1, **kwargs)
        logged, used, final = run_plateau(values, **kwargs)
        assert logged == pytest.approx(expected_logged, rel=1e-12), (values, kwargs)
        assert used == pytest.approx(expected_logged, rel=1e-12), (values, kwargs)
        assert final == pytest.approx(expected_final, rel=1e-12), (values, kwargs)


def test_reduce_lr_on_plateau_rejects_factor_one():
    with pytest.raises(ValueError, match="factor"):
        ReduceLROnPlateau(factor=1.0)


def test_a_callback_says_which_batch_logs_it_reads_and_an_override_of_the_private_hook_still_counts():
    class EveryBatch(callbacks_module.Callback):
        def on_train_batch_end(self, batch, logs=None): ...

    class EveryThird(callbacks_module.Callback):  # decides itself, as a display that redraws now and then
        def __init__(self):
            super().__init__()
            self.seen = 0

        def _wants_logs(self, hook):
            return hook == "on_train_batch_end"

        def _wants_logs_now(self, hook):
            self.seen += 1
            return self.seen % 3 == 0

    hook = "on_train_batch_end"
    assert EveryBatch().wants_logs(hook) and EveryBatch().wants_logs_now(hook)
    assert not callbacks_module.Callback().wants_logs(hook)
    third = EveryThird()
    listed = callbacks_module.CallbackList([third])
    assert listed.wants_batch_logs[hook] and not listed.wants_batch_logs["on_train_batch_begin"]
    assert [listed.wants_logs_now(hook) for _ in range(6)] == [False, False, True, False, False, True]


# --- CSVLogger ------------------------------------------------------------------------------------------


def read_csv(path, separator=","):
    with open(path, newline="") as file:
        return list(csv.reader(file, delimiter=separator))


def test_csv_logger_header_and_rows(tmp_path):
    x, y = make_data(40)
    path = tmp_path / "log.csv"
    history = make_trainer().fit(
        make_model(), (x, y), batch_size=8, epochs=3, validation_split=0.2, callbacks=[CSVLogger(path)], verbose=0
    )
    rows = read_csv(path)
    assert rows[0] == ["epoch", "accuracy", "loss", "val_accuracy", "val_loss"]
    assert len(rows) == 4
    for epoch, row in enumerate(rows[1:]):
        assert int(row[0]) == epoch
        for key, cell in zip(rows[0][1:], row[1:]):
            assert float(cell) == history.history[key][epoch]


def test_csv_logger_append_and_overwrite(tmp_path):
    x, y = make_data(16)
    path = tmp_path / "log.csv"
    trainer = make_trainer()
    trainer.fit(make_model(), (x, y), batch_size=8, epochs=2, callbacks=[CSVLogger(path)], verbose=0)
    trainer.fit(make_model(), (x, y), batch_size=8, epochs=2, callbacks=[CSVLogger(path, append=True)], verbose=0)
    rows = read_csv(path)
    assert rows[0] == ["epoch", "accuracy", "loss"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "0", "1"]  # one header, rows appended
    trainer.fit(make_model(), (x, y), batch_size=8, epochs=1, callbacks=[CSVLogger(path)], verbose=0)
    rows = read_csv(path)
    assert len(rows) == 2 and rows[0] == ["epoch", "accuracy", "loss"]  # overwritten


def test_csv_logger_separator(tmp_path):
    x, y = make_data(16)
    path = tmp_path / "log.tsv"
    make_trainer().fit(
        make_model(), (x, y), batch_size=8, epochs=2, callbacks=[CSVLogger(path, separator="\t")], verbose=0
    )
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch\taccuracy\tloss"
    assert len(lines) == 3 and all(len(line.split("\t")) == 3 for line in lines)
    assert "," not in path.read_text()


# --- TerminateOnNaN ---------------------------------------------------------------------------------------


def test_terminate_on_nan_stops_in_the_batch_that_became_nan():
    x, y = make_data(40)
    x[20, 1] = float("nan")  # in batch 2 (batch_size 8, no shuffling)
    trainer = make_trainer()
    recorder = Recorder()
    history = trainer.fit(
        make_model(),
        (x, y),
        batch_size=8,
        epochs=3,
        shuffle=False,
        callbacks=[recorder, TerminateOnNaN()],
        verbose=0,
    )
    batches = [c for c in recorder.calls if c[0] == "on_train_batch_end"]
    assert [c[1] for c in batches] == [0, 1, 2]
    assert math.isfinite(batches[1][2]["loss"]) and math.isnan(batches[2][2]["loss"])
    assert int(trainer.optimizer.iterations) == 3
    assert history.epoch == [0]


def test_terminate_on_nan_leaves_finite_training_alone():
    x, y = make_data(16)
    history = make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=3, callbacks=[TerminateOnNaN()], verbose=0)
    assert history.epoch == [0, 1, 2]


# --- progress bar -----------------------------------------------------------------------------------------


def test_progbar_verbose_1_on_a_stream_that_is_no_terminal_prints_each_epochs_final_lines():
    x, y = make_data(32)
    stream = io.StringIO()
    make_trainer().fit(
        make_model(), (x, y), batch_size=8, epochs=2, callbacks=[ProgbarLogger(1, stream=stream)], verbose=0
    )
    text = stream.getvalue()
    assert "Epoch 1/2" in text and "Epoch 2/2" in text
    assert "4/4 " in text and "- loss: " in text
    assert "\r" not in text  # no redrawing into a file (the bar redraws on a terminal: test_progress_bar.py)


def test_progbar_verbose_2_one_line_per_epoch():
    x, y = make_data(32)
    stream = io.StringIO()
    history = make_trainer().fit(
        make_model(), (x, y), batch_size=8, epochs=3, callbacks=[ProgbarLogger(2, stream=stream)], verbose=0
    )
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    for epoch, line in enumerate(lines):
        assert line.startswith(f"Epoch {epoch + 1}/3")
        assert f"loss: {history.history['loss'][epoch]:.4f}" in line
        assert f"accuracy: {history.history['accuracy'][epoch]:.4f}" in line


def test_fit_verbose_levels(capsys):
    x, y = make_data(32)
    make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=2, verbose=0)
    assert capsys.readouterr().out == ""

    make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=2, verbose=2)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(re.match(rf"Epoch {i + 1}/2 ", line) for i, line in enumerate(out))

    assert not sys.stdout.isatty()
    make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=2, verbose="auto")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("Epoch 1/2 ")  # "auto" is 2 off a terminal

    make_trainer().fit(make_model(), (x, y), batch_size=8, epochs=2, verbose=1)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Epoch 2/2" in text and "4/4 " in text and "\r" not in text  # off a terminal: final lines only

    with pytest.raises(ValueError, match="verbose"):
        make_trainer().fit(make_model(), (x, y), batch_size=8, verbose=3)


def test_verbose_auto_is_1_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert callbacks_module.resolve_verbose("auto") == 1
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert callbacks_module.resolve_verbose("auto") == 2
