"""``fit``/``evaluate``/``predict`` check their plain arguments at the entry and say what to do (issue 16,
part 2): an error names the argument, what arrived and the fix, before any replica runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
