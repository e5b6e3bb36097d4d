"""``fit``/``evaluate``/``predict`` check their plain arguments at the entry and say what to do (issue 16,
part 2): an error names the argument, what arrived and the fix, before any replica runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_strategy

from replicafit import optimizers
from replicafit.trainer import Trainer

pytestmark = pytest.mark.timeout(60)

X = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 2, 32)


def no_replica_frames(info) -> bool:
    return not any("strategies" in str(entry.path) for entry in info.traceback)


@pytest.mark.parametrize(
    "call",
    [
        lambda t, m: t.fit(m, X, Y, batch_size=8, verbose=0),
        lambda t, m: t.evaluate(m, X, Y, verbose=0),
        lambda t, m: t.predict(m, X, torch.tensor(Y)),
    ],
    ids=["fit", "evaluate", "predict"],
)
def test_keras_x_y_habit_says_pass_a_tuple(call):
    with pytest.raises(
        TypeError, match=r"got an array for `\w+`.*Pass the data as one argument: \w+\(model, \(x, y\)"
    ) as info:
        call(Trainer(strategy=None), torch.nn.Linear(4, 2))
    assert no_replica_frames(info)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"epochs": "5"}, TypeError, r"`epochs` must be an int >= 0, got '5' \(str\)"),
        ({"epochs": 2.0}, TypeError, r"`epochs` must be an int >= 0, got 2.0 \(float\)"),
        ({"epochs": -1}, ValueError, r"`epochs` must be an int >= 0"),
        ({"validation_split": "0.2"}, TypeError, r"`validation_split` must be a number in \[0, 1\) \(e.g. 0.2\)"),
        ({"steps_per_epoch": 0}, ValueError, r"`steps_per_epoch` must be None or an int >= 1"),
        ({"initial_epoch": "1"}, TypeError, r"`initial_epoch` must be an int >= 0"),
        ({"shuffle": "batch"}, TypeError, r"`shuffle` must be True or False"),
    ],
)
def test_fit_arguments_of_the_wrong_type(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        Trainer().fit(torch.nn.Linear(4, 2), (X, Y), **({"batch_size": 8, "verbose": 0} | kwargs))
    assert no_replica_frames(info)


def test_numpy_integers_are_integers():
    history = Trainer().fit(torch.nn.Linear(4, 2), (X, Y), batch_size=np.int64(8), epochs=np.int32(2), verbose=0)
    assert len(history.history["loss"]) == 2


def test_from_torch_given_an_optimizer_instance_shows_the_right_call():
    instance = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError) as info:
        optimizers.from_torch(instance)
    message = str(info.value)
    assert "optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)" in message
    assert "\n" not in message and len(message) < 300  # no repr of the instance


@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_float64_inputs_train_as_the_models_float32(strategy):
    x64 = np.random.default_rng(2).standard_normal((40, 4))  # NumPy's default float64
    y64 = x64[:, :1] * 2.0 - 1.0  # float64 regression targets
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x64), torch.tensor(y64)), 8)

    def run(data, **kwargs):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        trainer = Trainer(strategy=make_strategy(strategy), loss="mse", metrics=["mae"], seed=0)
        history = trainer.fit(model, data, epochs=2, verbose=0, shuffle=False, **kwargs)
        prediction = trainer.predict(model, x64, batch_size=8)
        return history.history, [p.detach().clone() for p in model.parameters()], prediction

    expected = run((x64.astype(np.float32), y64.astype(np.float32)), batch_size=8)
    for got in (run((x64, y64), batch_size=8), run(loader)):
        assert got[0] == expected[0]
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
        assert got[2].dtype == torch.float32 and torch.equal(got[2], expected[2])
