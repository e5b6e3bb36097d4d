"""Trainer.fit / evaluate / predict: the same numbers under every strategy, Keras' arguments.

The contract: the loss of a step is the per-example loss summed and divided by the
step's global batch size, so every strategy takes the same steps as one device on the
same global batches, partial last batch included; the user's own module holds the
trained weights; batch-norm statistics are aggregated as their cross-replica mean.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import STRATEGY_IDS, make_strategy
from torch import nn

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.data import as_global_batches, datasets
from replicafit.trainer import Callback, LambdaCallback, LearningRateScheduler, Trainer

ALL_STRATEGIES = ["default", "one_device", "mirrored2", "mirrored3", "central_storage2"]


# --- helpers -------------------------------------------------------------------------------
def tiny_data(n: int = 10, features: int = 3, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    return x, y


def mlp(seed: int = 0, features: int = 3, classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, classes))


def clone_state(state) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def assert_states_close(actual: dict, expected: dict, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=0, msg=f"state {key!r} differs")


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"state {key!r} differs"


def assert_history_close(actual: dict, expected: dict, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(actual[key], expected[key], atol=atol, rtol=0, err_msg=key)


class Recorder(nn.Module):
    """A linear classifier whose first input column is the example's index: records what it trains on."""

    def __init__(self, features: int = 2, classes: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(features, classes)
        self.seen: list[list[int]] = []

    def forward(self, x):
        if self.training:
            self.seen.append([int(v) for v in x[:, 0].tolist()])
        return self.linear(x)


def indexed_data(n: int = 10):
    """x[:, 0] is the row index, x[:, 1] a feature; y alternates."""
    x = np.stack([np.arange(n, dtype=np.float32), np.linspace(-1, 1, n, dtype=np.float32)], axis=1)
    return x, (np.arange(n) % 2).astype(np.int64)


class StepCounter(Callback):
    def __init__(self):
        super().__init__()
        self.steps_per_epoch: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps_per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps_per_epoch[-1] += 1


def fit_run(strategy_name, *, epochs=3, optimizer=None, seed=1, shuffle=True, model_seed=0):
    x, y = tiny_data()
    model = mlp(model_seed)
    initial = clone_state(model.state_dict())
    trainer = Trainer(
        strategy=make_strategy(strategy_name),
        optimizer=optimizer or optimizers.Adam(learning_rate=0.05),
        loss="cross_entropy",
        metrics=["accuracy"],
        seed=seed,
    )
    history = trainer.fit(model, (x, y), batch_size=4, epochs=epochs, shuffle=shuffle, verbose=0)
    return model, initial, trainer, history


# --- equivalence across strategies ----------------------------------------------------------------
_REFERENCE: dict = {}


def reference_run():
    if "default" not in _REFERENCE:
        model, initial, trainer, history = fit_run("default")
        _REFERENCE["default"] = (clone_state(model.state_dict()), initial, history.history)
    return _REFERENCE["default"]


@pytest.mark.parametrize("strategy_name", ALL_STRATEGIES)
def test_every_strategy_gives_the_same_history_and_weights(strategy_name):
    """10 examples, batch 4 (a partial last batch, an empty replica under Mirrored(3)):
    the same per-epoch losses and final weights as one device, in the user's model."""
    expected_state, initial, expected_history = reference_run()
    model, initial_here, trainer, history = fit_run(strategy_name)
    assert_states_equal(initial_here, initial)
    assert set(history.history) == {"loss", "accuracy"}
    assert len(history.history["loss"]) == 3
    assert_history_close(history.history, expected_history)
    assert_states_close(clone_state(model.state_dict()), expected_state)
    # the user's own object holds the trained (aggregated) weights, and they did change
    assert_states_close(clone_state(trainer.model_state_dict()), clone_state(model.state_dict()), atol=0)
    for key in initial:
        assert not torch.allclose(model.state_dict()[key], initial[key]), f"{key} did not train"


def test_default_strategy_matches_a_plain_torch_loop():
    """The reference itself: plain SGD on sum(loss)/global_batch, per-epoch loss = mean over examples."""
    x, y = tiny_data()
    model_plain = mlp()
    sgd = torch.optim.SGD(model_plain.parameters(), lr=0.1)
    epoch_losses = []
    for _ in range(2):
        values = []
        for start in range(0, 10, 4):
            xb, yb = torch.from_numpy(x[start : start + 4]), torch.from_numpy(y[start : start + 4])
            per_example = F.cross_entropy(model_plain(xb), yb, reduction="none")
            sgd.zero_grad()
            (per_example.sum() / len(xb)).backward()
            sgd.step()
            values.append(per_example.detach())
        epoch_losses.append(float(torch.cat(values).mean()))

    for name in ("default", "mirrored3"):
        model = mlp()
        trainer = Trainer(strategy=make_strategy(name), optimizer=optimizers.SGD(0.1), metrics=(), seed=0)
        history = trainer.fit(model, (x, y), batch_size=4, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(history.history["loss"], epoch_losses, atol=1e-6, rtol=0)
        assert_states_close(clone_state(model.state_dict()), clone_state(model_plain.state_dict()))


# --- batch norm -------------------------------------------------------------------------------------
def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


class ReplicaStatistics(Callback):
    """Clones every replica's batch-norm statistics after each training step."""

    def __init__(self):
        super().__init__()
        self.after_step: list = []

    def on_train_batch_end(self, batch, logs=None):
        self.after_step.append([clone_state(r[1].state_dict()) for r in self.trainer.model.replicas])


def bn_fit():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, 3)).astype(np.float32)
    y = (np.arange(12) % 2).astype(np.int64)
    model = bn_model()
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer=optimizers.SGD(0.1), seed=0)
    recorder = ReplicaStatistics()
    history = trainer.fit(model, (x, y), batch_size=4, epochs=2, callbacks=[recorder], verbose=0)
    assert len(trainer.model.replicas) == 2
    assert np.isfinite(history.history["loss"]).all()
    # the replicas' own statistics after the last step (each saw other rows, so they differ)
    last = recorder.after_step[-1]
    assert len(recorder.after_step) == 6
    assert not torch.allclose(last[0]["running_mean"], last[1]["running_mean"])
    expected = {
        "1.running_mean": (last[0]["running_mean"] + last[1]["running_mean"]) / 2,
        "1.running_var": (last[0]["running_var"] + last[1]["running_var"]) / 2,
        "1.num_batches_tracked": last[0]["num_batches_tracked"],
    }
    return model, trainer, expected


def test_batchnorm_under_mirrored_saves_the_mean_of_the_replicas_statistics(tmp_path):
    model, trainer, expected = bn_fit()
    state = trainer.model_state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0, msg=key)
    assert int(state["1.num_batches_tracked"]) == 2 * 3  # 3 steps per epoch, 2 epochs
    # the weights are the same on both replicas and in the user's module
    for key in ("0.weight", "1.weight", "1.bias", "3.weight"):
        torch.testing.assert_close(trainer.model.replicas[1].state_dict()[key], model.state_dict()[key])
        torch.testing.assert_close(state[key], model.state_dict()[key])
    # a saved checkpoint holds the aggregate too
    path = trainer.save_checkpoint(tmp_path / "bn.pt")
    saved = torch.load(path, weights_only=True)["model"]
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, atol=1e-6, rtol=0, msg=key)


def test_batchnorm_user_model_state_after_fit_holds_the_mean_statistics():
    """After fit the user's own module (what torch.save(model.state_dict()) writes) holds the
    aggregated running statistics, as a Keras model read in cross-replica context does."""
    model, _, expected = bn_fit()
    state = model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0, msg=key)
    model.eval()
    with torch.no_grad():
        x = torch.ones(2, 3)
        h = model[0](x)
        manual = (h - expected["1.running_mean"]) / torch.sqrt(expected["1.running_var"] + model[1].eps)
        manual = model[3](torch.relu(manual * model[1].weight + model[1].bias))
        torch.testing.assert_close(model(x), manual, atol=1e-5, rtol=0)


# --- digits -----------------------------------------------------------------------------------------
def test_digits_mlp_reaches_95_percent_validation_accuracy_under_mirrored():
    x, y = datasets.load_digits(normalize=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    trainer = Trainer(
        strategy=make_strategy("mirrored2"), optimizer="adam", loss="cross_entropy", metrics=["accuracy"], seed=0
    )
    history = trainer.fit(model, (x, y), batch_size=64, epochs=20, validation_split=0.2, verbose=0)
    val_accuracy = history.history["val_accuracy"]
    assert len(val_accuracy) == 20
    assert max(val_accuracy) >= 0.95, val_accuracy
    assert history.history["loss"][-1] < history.history["loss"][0]
    # the last epoch's val_accuracy is the model's accuracy on the last 20% of the data (Keras' cut: 1,437 + 360)
    cut = int(math.floor(len(x) * (1 - 0.2)))
    with torch.no_grad():
        predicted = model(torch.from_numpy(x[cut:])).argmax(-1).numpy()
    assert val_accuracy[-1] == pytest.approx(float((predicted == y[cut:]).mean()), abs=1e-6)


# --- reproducibility ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_same_seed_gives_bit_identical_runs(strategy_name):
    runs = [fit_run(strategy_name, seed=7) for _ in range(2)]
    (model_a, _, _, history_a), (model_b, _, _, history_b) = runs
    assert history_a.history == history_b.history
    assert_states_equal(clone_state(model_a.state_dict()), clone_state(model_b.state_dict()))
    # another seed shuffles differently, so it trains differently
    model_c, _, _, history_c = fit_run(strategy_name, seed=8)
    assert history_c.history["loss"] != history_a.history["loss"]


def record_orders(seed, epochs=3, shuffle=True):
    x, y = indexed_data()
    model = Recorder()
    Trainer(optimizer=optimizers.SGD(1e-3), seed=seed).fit(
        model, (x, y), batch_size=4, epochs=epochs, shuffle=shuffle, verbose=0
    )
    assert [len(b) for b in model.seen] == [4, 4, 2] * epochs
    flat = [i for batch in model.seen for i in batch]
    return [flat[e * 10 : (e + 1) * 10] for e in range(epochs)]


def test_shuffle_order_changes_every_epoch_and_is_fixed_by_the_seed():
    orders = record_orders(seed=3)
    for order in orders:
        assert sorted(order) == list(range(10))  # every example once per epoch
    assert orders[0] != list(range(10))
    assert len({tuple(o) for o in orders}) == 3  # a new order every epoch
    assert record_orders(seed=3) == orders  # fixed by the seed
    assert record_orders(seed=4) != orders
    assert record_orders(seed=None) != record_orders(seed=None)  # no seed: a fresh order every fit


def test_the_seed_also_fixes_dropout_on_one_device():
    x, y = tiny_data()

    def run(seed, global_state):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.5), nn.Linear(16, 3))
        torch.manual_seed(global_state)  # the global RNG state before fit must not matter
        history = Trainer(seed=seed).fit(model, (x, y), batch_size=4, epochs=2, verbose=0)
        return clone_state(model.state_dict()), history.history

    state_a, history_a = run(5, global_state=1)
    state_b, history_b = run(5, global_state=2)
    assert_states_equal(state_a, state_b)
    assert history_a == history_b
    state_c, _ = run(6, global_state=1)  # another seed drops other units
    assert not torch.equal(state_c["0.weight"], state_a["0.weight"])


def test_shuffle_false_keeps_the_order():
    assert record_orders(seed=3, shuffle=False) == [list(range(10))] * 3


# --- fit arguments ----------------------------------------------------------------------------------------
def test_epochs_and_initial_epoch_set_the_history_length():
    x, y = tiny_data()
    trainer = Trainer(seed=0)
    history = trainer.fit(mlp(), (x, y), batch_size=4, epochs=4, verbose=0)
    assert history.epoch == [0, 1, 2, 3]
    assert all(len(v) == 4 for v in history.history.values())
    counter = StepCounter()
    history = trainer.fit(mlp(), (x, y), batch_size=4, epochs=5, initial_epoch=2, callbacks=[counter], verbose=0)
    assert history.epoch == [2, 3, 4]
    assert len(history.history["loss"]) == 3
    assert counter.steps_per_epoch == [3, 3, 3]
    assert trainer.history is history


def test_validation_data_is_evaluated_every_epoch():
    x, y = tiny_data()
    xv, yv = tiny_data(n=7, seed=5)
    model = mlp()
    trainer = Trainer(strategy=make_strategy("mirrored2"), seed=0)
    history = trainer.fit(model, (x, y), batch_size=4, epochs=3, validation_data=(xv, yv), verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(history.history["val_loss"]) == 3
    assert len(set(history.history["val_loss"])) == 3  # re-evaluated as the model trains
    with torch.no_grad():
        logits = model(torch.from_numpy(xv))
    expected_loss = float(F.cross_entropy(logits, torch.from_numpy(yv)))
    expected_accuracy = float((logits.argmax(-1).numpy() == yv).mean())
    assert history.history["val_loss"][-1] == pytest.approx(expected_loss, abs=1e-6)
    assert history.history["val_accuracy"][-1] == pytest.approx(expected_accuracy, abs=1e-6)
    # validation does not leak into the training numbers: same loss as a fit without it
    plain = Trainer(strategy=make_strategy("mirrored2"), seed=0).fit(mlp(), (x, y), batch_size=4, epochs=3, verbose=0)
    np.testing.assert_allclose(history.history["loss"], plain.history["loss"], atol=1e-6, rtol=0)


def test_validation_split_keeps_the_last_examples_for_validation():
    x, y = indexed_data()
    model = Recorder()
    trainer = Trainer(optimizer=optimizers.SGD(0.1), seed=0)
    history = trainer.fit(model, (x, y), batch_size=4, epochs=2, validation_split=0.2, verbose=0)
    trained_on = {i for batch in model.seen for i in batch}
    assert trained_on == set(range(8))
    assert [len(b) for b in model.seen] == [4, 4] * 2
    with torch.no_grad():
        logits = model(torch.from_numpy(x[8:]))
    expected = float(F.cross_entropy(logits, torch.from_numpy(y[8:])))
    assert history.history["val_loss"][-1] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="validation_split"):
        trainer.fit(Recorder(), (x, y), batch_size=4, validation_split=1.0, verbose=0)


def test_steps_per_epoch_repeats_the_data_when_it_runs_out():
    x, y = indexed_data()
    model = Recorder()
    counter = StepCounter()
    trainer = Trainer(optimizer=optimizers.SGD(1e-3), seed=0)
    history = trainer.fit(
        model, (x, y), batch_size=4, epochs=3, steps_per_epoch=5, shuffle=False, callbacks=[counter], verbose=0
    )
    assert counter.steps_per_epoch == [5, 5, 5]
    assert len(history.history["loss"]) == 3
    assert len(model.seen) == 15
    flat = [i for batch in model.seen for i in batch]
    # 15 steps walk the data again and again, in order, the partial batch closing each pass
    assert [len(b) for b in model.seen] == [4, 4, 2] * 5
    assert flat == list(range(10)) * 5


def test_verbose_0_prints_nothing(capsys):
    x, y = tiny_data()
    Trainer(seed=0).fit(mlp(), (x, y), batch_size=4, epochs=2, validation_split=0.2, verbose=0)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


def test_verbose_2_prints_one_line_per_epoch_with_loss_and_metrics(capsys):
    x, y = tiny_data()
    Trainer(seed=0).fit(mlp(), (x, y), batch_size=4, epochs=3, validation_split=0.2, verbose=2)
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.strip()]
    assert len(lines) == 3, captured.out
    for epoch, line in enumerate(lines, start=1):
        assert f"{epoch}/3" in line
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert re.search(rf"\b{key}\b", line), (key, line)
    assert "\r" not in captured.out


def test_verbose_1_draws_a_progress_bar(capsys):
    x, y = tiny_data()
    Trainer(seed=0).fit(mlp(), (x, y), batch_size=4, epochs=2, verbose=1)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Epoch 1/2" in text and "Epoch 2/2" in text
    assert "3/3" in text  # the counter reaching the 3 steps of an epoch
    assert "loss" in text


# --- evaluate ----------------------------------------------------------------------------------------------
def whole_data_numbers(model, x, y):
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    loss = float(F.cross_entropy(logits, torch.from_numpy(y)))
    accuracy = float((logits.argmax(-1).numpy() == y).mean())
    return loss, accuracy


@pytest.mark.parametrize("strategy_name", ALL_STRATEGIES)
def test_evaluate_counts_every_example_once(strategy_name):
    x, y = tiny_data(n=11, seed=2)
    model = mlp(3)
    loss, accuracy = whole_data_numbers(model, x, y)
    trainer = Trainer(strategy=make_strategy(strategy_name))
    logs = trainer.evaluate(model, (x, y), batch_size=4, return_dict=True, verbose=0)
    assert list(logs) == ["loss", "accuracy"]
    assert logs["loss"] == pytest.approx(loss, abs=1e-6)
    assert logs["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    values = trainer.evaluate(model, (x, y), batch_size=4, verbose=0)
    assert isinstance(values, list)
    np.testing.assert_allclose(values, [logs["loss"], logs["accuracy"]], atol=0, rtol=0)
    # a batch of 3 rows over 3 replicas and then 2 more: partial and empty replica slices
    logs = trainer.evaluate(model, (x, y), batch_size=3, return_dict=True, verbose=0)
    assert logs["loss"] == pytest.approx(loss, abs=1e-6)
    assert logs["accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_evaluate_without_metrics_returns_a_float_and_steps_limits_it():
    x, y = tiny_data()
    model = mlp()
    trainer = Trainer(strategy=make_strategy("mirrored2"), metrics=())
    value = trainer.evaluate(model, (x, y), batch_size=4, verbose=0)
    assert isinstance(value, float)
    assert value == pytest.approx(whole_data_numbers(model, x, y)[0], abs=1e-6)
    first = trainer.evaluate(model, (x, y), batch_size=4, steps=1, verbose=0)
    assert first == pytest.approx(whole_data_numbers(model, x[:4], y[:4])[0], abs=1e-6)


# --- predict ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy_name", ALL_STRATEGIES)
def test_predict_returns_outputs_in_input_order(strategy_name):
    x, _ = tiny_data(n=11, seed=3)
    model = mlp(2)
    with torch.no_grad():
        expected = model(torch.from_numpy(x))
    trainer = Trainer(strategy=make_strategy(strategy_name))
    out = trainer.predict(model, x, batch_size=4, verbose=0)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (11, 3)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    out = trainer.predict(model, torch.from_numpy(x), batch_size=3, verbose=0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


class DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 1)

    def forward(self, x):
        return {"a": self.a(x), "b": self.b(x)}


class TupleOutput(DictOutput):
    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored3", "central_storage2"])
def test_predict_keeps_the_output_nest(strategy_name):
    x, _ = tiny_data(n=10, seed=4)
    trainer = Trainer(strategy=make_strategy(strategy_name))
    model = DictOutput()
    with torch.no_grad():
        expected = model(torch.from_numpy(x))
    out = trainer.predict(model, x, batch_size=4, verbose=0)
    assert isinstance(out, dict) and set(out) == {"a", "b"}
    torch.testing.assert_close(out["a"], expected["a"], atol=1e-6, rtol=0)
    torch.testing.assert_close(out["b"], expected["b"], atol=1e-6, rtol=0)
    model = TupleOutput()
    out = Trainer(strategy=make_strategy(strategy_name)).predict(model, x, batch_size=4, verbose=0)
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0].shape == (10, 2) and out[1].shape == (10, 1)
    torch.testing.assert_close(out[0], expected["a"], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1], expected["b"], atol=1e-6, rtol=0)


# --- data forms -----------------------------------------------------------------------------------------------
def weights_after(dataset, strategy_name="mirrored2", **fit_kwargs):
    model = mlp()
    trainer = Trainer(strategy=make_strategy(strategy_name), optimizer=optimizers.SGD(0.1), metrics=(), seed=0)
    history = trainer.fit(model, dataset, epochs=2, shuffle=False, verbose=0, **fit_kwargs)
    return clone_state(model.state_dict()), history.history["loss"]


def test_a_dataset_a_dataloader_and_arrays_train_alike():
    x, y = tiny_data()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    expected_state, expected_loss = weights_after((x, y), batch_size=4)
    dataset = torch.utils.data.TensorDataset(tx, ty)
    for data, kwargs in [
        (dataset, {"batch_size": 4}),
        (torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False), {}),
        ((tx, ty), {"batch_size": 4}),
        ((x, y, np.ones(10, dtype=np.float32)), {"batch_size": 4}),
    ]:
        state, loss = weights_after(data, **kwargs)
        assert_states_close(state, expected_state)
        np.testing.assert_allclose(loss, expected_loss, atol=1e-6, rtol=0)


def test_sample_weights_scale_the_loss_as_sum_of_weighted_losses_over_n():
    x, y = tiny_data()
    w = np.linspace(0.0, 2.0, 10).astype(np.float32)
    # one step on the whole batch: the plain torch update of sum(l * w) / N
    reference = mlp()
    per_example = F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y), reduction="none")
    weighted_loss = (per_example * torch.from_numpy(w)).sum() / 10
    weighted_loss.backward()
    weighted = float(weighted_loss.detach())
    with torch.no_grad():
        expected = {k: p - 0.1 * p.grad for k, p in reference.named_parameters()}
    for name in ("default", "mirrored3"):
        model = mlp()
        trainer = Trainer(strategy=make_strategy(name), optimizer=optimizers.SGD(0.1), metrics=(), seed=0)
        history = trainer.fit(model, (x, y, w), batch_size=10, epochs=1, verbose=0)
        assert history.history["loss"][0] == pytest.approx(weighted, abs=1e-6)
        assert_states_close(clone_state(dict(model.named_parameters())), expected)
        # evaluate weighs the same way (and the weights matter)
        model = mlp()
        loss = Trainer(strategy=make_strategy(name), metrics=()).evaluate(model, (x, y, w), batch_size=4, verbose=0)
        assert loss == pytest.approx(weighted, abs=1e-6)
        unweighted = Trainer(strategy=make_strategy(name), metrics=()).evaluate(model, (x, y), batch_size=4, verbose=0)
        assert unweighted == pytest.approx(float(per_example.detach().mean()), abs=1e-6)
        assert abs(unweighted - loss) > 1e-3


# --- overriding the steps --------------------------------------------------------------------------------------
class CustomTrainer(Trainer):
    """Own train_step (plain MSE on one-hot targets), test_step and predict_step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list = []

    def train_step(self, data):
        x, y = data
        ctx = ds.get_replica_context()
        self.calls.append(("train", ctx.replica_id_in_sync_group, x.shape[0]))
        variables = self.model.trainable_variables
        target = F.one_hot(y, 3).float()
        loss = ((self.model(x) - target) ** 2).sum() / self.global_batch_size
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        self.optimizer.apply_gradients(zip(grads, variables))

    def test_step(self, data):
        x, y = data
        self.calls.append(("test", ds.get_replica_context().replica_id_in_sync_group, x.shape[0]))
        super().test_step((x, y))

    def predict_step(self, data):
        (x,) = data if isinstance(data, (tuple, list)) else (data,)
        self.calls.append(("predict", ds.get_replica_context().replica_id_in_sync_group, x.shape[0]))
        return {"twice": 2 * super().predict_step(data)}


def custom_run(strategy_name):
    x, y = tiny_data()
    model = mlp()
    trainer = CustomTrainer(strategy=make_strategy(strategy_name), optimizer=optimizers.SGD(0.1), metrics=(), seed=0)
    trainer.fit(model, (x, y), batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model, trainer, x, y


def test_overridden_steps_run_per_replica():
    x, y = tiny_data()
    # the plain torch reference of the custom train_step
    reference = mlp()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for start in range(0, 10, 4):
            xb, yb = torch.from_numpy(x[start : start + 4]), torch.from_numpy(y[start : start + 4])
            sgd.zero_grad()
            (((reference(xb) - F.one_hot(yb, 3).float()) ** 2).sum() / len(xb)).backward()
            sgd.step()
    for name in ("default", "mirrored2"):
        model, trainer, x, y = custom_run(name)
        assert_states_close(clone_state(model.state_dict()), clone_state(reference.state_dict()))
        train_calls = [c for c in trainer.calls if c[0] == "train"]
        if name == "mirrored2":
            assert sorted(train_calls) == sorted([("train", r, n) for n in (2, 2, 1) for r in (0, 1)] * 2)
        else:
            assert train_calls == [("train", 0, n) for n in (4, 4, 2)] * 2
        trainer.calls.clear()
        loss = trainer.evaluate(model, (x, y), batch_size=4, verbose=0)
        assert loss == pytest.approx(whole_data_numbers(model, x, y)[0], abs=1e-6)
        assert sum(c[2] for c in trainer.calls if c[0] == "test") == 10
        assert {c[1] for c in trainer.calls} == ({0, 1} if name == "mirrored2" else {0})
        out = trainer.predict(model, x, batch_size=4, verbose=0)
        with torch.no_grad():
            torch.testing.assert_close(out["twice"], 2 * model(torch.from_numpy(x)), atol=1e-6, rtol=0)


# --- a custom training loop beside the trainer --------------------------------------------------------------------
@pytest.mark.parametrize("strategy_name", ["mirrored2", "central_storage2"])
def test_a_custom_loop_with_strategy_run_works_beside_the_trainer(strategy_name):
    x, y = tiny_data()
    strategy = make_strategy(strategy_name)

    # one epoch with the trainer ...
    model_a = mlp()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), metrics=(), seed=0)
    trainer.fit(model_a, (x, y), batch_size=4, epochs=1, shuffle=False, verbose=0)

    # ... equals one epoch of a hand-written strategy.run loop on the same strategy
    model_b = mlp()
    dm = strategy.distribute_module(model_b)
    with strategy.scope():
        optimizer = optimizers.SGD(0.1)
    variables = dm.trainable_variables
    batches = as_global_batches((x, y), batch_size=4)

    def step(xb, yb, global_batch_size):
        loss = F.cross_entropy(dm(xb), yb, reduction="sum") / global_batch_size
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        optimizer.apply_gradients(zip(grads, variables))
        return loss.detach()

    total = 0.0
    for (xb, yb), (global_x, _) in zip(strategy.experimental_distribute_dataset(batches), batches):
        losses = strategy.run(step, args=(xb, yb, global_x.shape[0]))
        total += float(strategy.reduce("SUM", losses, axis=None))
    assert_states_close(clone_state(model_b.state_dict()), clone_state(model_a.state_dict()))

    # the trainer keeps working on the same strategy after the custom loop, and sees its weights
    logs = trainer.evaluate(model_b, (x, y), batch_size=4, return_dict=True, verbose=0)
    assert logs["loss"] == pytest.approx(whole_data_numbers(model_b, x, y)[0], abs=1e-6)
    history = trainer.fit(model_a, (x, y), batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert total > 0


# --- data with no batch at all (hardening item 11) ------------------------------------------------------------
class HookLog(Callback):
    """Records every hook called: an empty run must call none."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            self_calls = object.__getattribute__(self, "calls")
            return lambda *args, **kwargs: self_calls.append(name)
        return object.__getattribute__(self, name)


def empty_data(kind: str):
    """``(dataset, fit/evaluate keyword arguments)`` with no example at all."""
    x, y = np.zeros((0, 3), np.float32), np.zeros((0,), np.int64)
    tensors = torch.utils.data.TensorDataset(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    return {
        "arrays": ((x, y), {"batch_size": 4}),
        "tensors": ((torch.from_numpy(x), torch.from_numpy(y)), {"batch_size": 4}),
        "dataset": (tensors, {"batch_size": 4}),
        "dataloader": (torch.utils.data.DataLoader(tensors, batch_size=4), {}),
        "list": ([], {}),
        "generator": ((batch for batch in []), {}),
        "iterable-dataset": (torch.utils.data.DataLoader(EmptyStream(), batch_size=None), {}),
    }[kind]


class EmptyStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


EMPTY_KINDS = ["arrays", "tensors", "dataset", "dataloader", "list", "generator", "iterable-dataset"]


@pytest.mark.parametrize("kind", EMPTY_KINDS)
def test_fit_on_data_with_no_batch_raises_before_any_callback(strategy, kind, tmp_path):
    from replicafit.trainer import BackupAndRestore, CSVLogger

    data, kwargs = empty_data(kind)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), seed=0)
    log, csv_path = HookLog(), tmp_path / "history.csv"
    csv_path.write_text("an earlier run's history\n")
    callbacks = [log, CSVLogger(csv_path), BackupAndRestore(tmp_path / "backup", save_freq=1)]
    with pytest.raises(ValueError, match=r"training data of fit\(\) is empty: it yields no batch"):
        trainer.fit(mlp(), data, epochs=2, callbacks=callbacks, verbose=0, **kwargs)
    assert log.calls == []
    assert csv_path.read_text() == "an earlier run's history\n"  # CSVLogger did not start
    assert not (tmp_path / "backup").exists()
    assert trainer.history is None and int(trainer.optimizer.iterations) == 0


@pytest.mark.parametrize("kind", ["arrays", "generator"])
def test_fit_with_steps_per_epoch_on_data_with_no_batch_raises_before_any_callback(kind):
    data, kwargs = empty_data(kind)
    log = HookLog()
    with pytest.raises(ValueError, match="training data of fit"):
        Trainer(seed=0).fit(mlp(), data, epochs=2, steps_per_epoch=3, callbacks=[log], verbose=0, **kwargs)
    assert log.calls == []


@pytest.mark.parametrize("kind", EMPTY_KINDS)
def test_evaluate_on_data_with_no_batch_raises(strategy, kind):
    data, kwargs = empty_data(kind)
    log = HookLog()
    with pytest.raises(ValueError, match=r"evaluation data of evaluate\(\) is empty"):
        Trainer(strategy=strategy, seed=0).evaluate(mlp(), data, callbacks=[log], verbose=0, **kwargs)
    assert log.calls == []


@pytest.mark.parametrize("kind", ["arrays", "dataset", "list", "generator"])
def test_fit_with_empty_validation_data_raises_before_training(strategy, kind):
    x, y = tiny_data()
    validation, kwargs = empty_data(kind)
    log = HookLog()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), seed=0)
    batch_size = 4 if kwargs else None
    train = (x, y) if batch_size else [(x[:4], y[:4]), (x[4:], y[4:])]
    with pytest.raises(ValueError, match=r"validation data of fit\(\) is empty"):
        trainer.fit(mlp(), train, batch_size=batch_size, validation_data=validation, callbacks=[log], verbose=0)
    assert log.calls == [] and int(trainer.optimizer.iterations) == 0


@pytest.mark.parametrize("as_dataset", [False, True], ids=["arrays", "dataset"])
def test_a_validation_split_that_leaves_no_training_example_raises(as_dataset):
    x, y = tiny_data(n=3)
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)) if as_dataset else (x, y)
    log = HookLog()
    with pytest.raises(ValueError, match=r"validation_split=0.7 of 3 examples leaves 0 for training and 3 for valid"):
        Trainer(seed=0).fit(mlp(), data, batch_size=4, validation_split=0.7, callbacks=[log], verbose=0)
    assert log.calls == []
    history = Trainer(seed=0).fit(mlp(), data, batch_size=4, validation_split=0.2, verbose=0)  # Keras: 2 and 1
    assert len(history.history["val_loss"]) == 1


# (n, split) -> rows that train, as Keras 3's train_validation_split computes them: floor(n * (1 - split)) in
# floating point (90 * 0.7 is 62.99999999999999, so 62), or None where no row would train
KERAS_CUTS = {
    (1797, 0.2): 1437,
    (3, 0.2): 2,
    (10, 0.3): 7,
    (256, 0.2): 204,
    (90, 0.3): 62,
    (64, 0.25): 48,
    (3, 1 / 3): 2,
    (10, 0.9): None,
    (3, 0.7): None,
}


@pytest.mark.parametrize(("n", "split"), list(KERAS_CUTS))
def test_validation_split_cuts_where_keras_does(n, split):
    """Regression: this kept int(n * split) rows for validation, 359 of the 1,797 digits at 0.2 where Keras
    validates on 360."""
    from replicafit.trainer.inputs import _split_point

    expected = KERAS_CUTS[n, split]
    if expected is None:
        with pytest.raises(ValueError, match="leaves 0 for training"):
            _split_point(n, split)
    else:
        assert _split_point(n, split) == expected


def test_a_generator_trains_and_evaluates_like_a_list_of_its_batches(strategy):
    """Checking that a one-shot iterator yields a batch reads its first batch: it must not be lost."""
    x, y = tiny_data()
    batches = [(torch.from_numpy(x[i : i + 4]), torch.from_numpy(y[i : i + 4])) for i in range(0, 10, 4)]
    results = []
    for one_shot in (False, True):
        model = Recorder(features=3, classes=3)
        trainer = Trainer(strategy=make_strategy_like(strategy), optimizer=optimizers.SGD(0.1), seed=0)
        history = trainer.fit(model, (b for b in batches) if one_shot else batches, epochs=1, verbose=0)
        logs = trainer.evaluate(model, (b for b in batches) if one_shot else batches, verbose=0, return_dict=True)
        results.append((model.seen, clone_state(model.state_dict()), history.history, logs))
    (seen, state, history, logs), (seen_once, state_once, history_once, logs_once) = results
    assert seen_once == seen and len(seen) == 3
    assert_states_equal(state_once, state)
    assert history_once == history and logs_once == logs


def make_strategy_like(strategy):
    """A fresh strategy of the fixture's kind."""
    for name in STRATEGY_IDS:
        candidate = make_strategy(name)
        if type(candidate) is type(strategy) and candidate.num_replicas_in_sync == strategy.num_replicas_in_sync:
            return candidate
    raise AssertionError(strategy)


# --- a learning rate of 0 (hardening item 12) ------------------------------------------------------------------
def weights_per_epoch(trainer, model, x, y, callbacks, epochs=3):
    states = []
    record = LambdaCallback(on_epoch_end=lambda epoch, logs: states.append(clone_state(model.state_dict())))
    history = trainer.fit(model, (x, y), batch_size=4, epochs=epochs, callbacks=[*callbacks, record], verbose=0)
    return states, history


def test_a_learning_rate_scheduler_ending_at_0_trains(strategy):
    """A cosine schedule per epoch that reaches exactly 0 at the last epoch (as Keras allows)."""
    x, y = tiny_data()

    def cosine(epoch):
        return 0.1 * 0.5 * (1 + math.cos(math.pi * epoch / 2))

    assert cosine(2) == 0.0
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), seed=0)
    states, history = weights_per_epoch(trainer, mlp(), x, y, [LearningRateScheduler(cosine)])
    assert history.history["learning_rate"] == [0.1, 0.05, 0.0]
    assert not torch.equal(states[1]["0.weight"], states[0]["0.weight"])
    assert_states_equal(states[2], states[1])  # torch.optim's rule too: a rate of 0 moves nothing


def test_a_cosine_decay_reaching_0_keeps_training_at_rate_0(strategy):
    x, y = tiny_data()
    schedule = optimizers.schedules.CosineDecay(0.1, decay_steps=3, alpha=0.0)  # 0 from step 3 on
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(schedule), seed=0)
    states, history = weights_per_epoch(trainer, mlp(), x, y, [])
    assert trainer.optimizer.learning_rate == 0.0 and int(trainer.optimizer.iterations) == 9
    assert_states_equal(states[2], states[1])
    assert len(history.history["loss"]) == 3


def test_predict_concatenates_the_replicas_outputs_on_the_first_replicas_device():
    """Replicas on different devices give outputs on each (Mirrored over two GPUs, or a GPU and the host):
    ``predict`` brings them to the first replica's device, where ``strategy.gather`` puts them across workers.
    torch's ``meta`` device stands for an accelerator (a host tensor concatenated with it raises, as with a
    GPU's); the whole ``predict`` on logical CPUs keeps its outputs on the host."""
    from replicafit.trainer import trainer as trainer_module

    host, device = torch.ones(2, 3), torch.zeros(1, 3, device="meta")
    joined = trainer_module._concatenated([device, host], torch.device("meta"))
    assert joined.device.type == "meta" and joined.shape == (3, 3)
    x, _ = tiny_data(n=11, seed=3)
    out = Trainer(strategy=ds.MirroredStrategy(["cpu:1", "cpu:0"])).predict(mlp(2), x, batch_size=4, verbose=0)
    assert out.device.type == "cpu" and out.shape == (11, 3)
