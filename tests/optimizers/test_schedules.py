"""Learning-rate schedules: Keras 3 formulas, configs, serialization, validation, use by optimizers.

Reference: Keras 3 ``keras.optimizers.schedules``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.optimizers import schedules

pytestmark = pytest.mark.timeout(60)

STEPS = list(range(0, 41)) + [55, 99, 100, 101, 250, 1000, 12345]


def check(schedule, reference, steps=STEPS):
    for step in steps:
        value = schedule(step)
        assert isinstance(value, float | int), type(value)
        assert value == pytest.approx(reference(step), rel=1e-12, abs=1e-15), f"step {step}"


# --- formulas ---------------------------------------------------------------------------------
@pytest.mark.parametrize("staircase", [False, True])
@pytest.mark.parametrize("decay_steps,decay_rate", [(10, 0.5), (7, 0.96), (1, 0.9)])
def test_exponential_decay(decay_steps, decay_rate, staircase):
    schedule = schedules.ExponentialDecay(0.1, decay_steps, decay_rate, staircase=staircase)

    def reference(step):
        p = step / decay_steps
        if staircase:
            p = np.floor(p)
        return 0.1 * decay_rate**p

    check(schedule, reference)


def test_exponential_decay_known_values():
    smooth = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    stairs = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5, staircase=True)
    assert smooth(0) == pytest.approx(0.1)
    assert smooth(5) == pytest.approx(0.1 * math.sqrt(0.5))
    assert smooth(10) == pytest.approx(0.05)
    assert stairs(9) == pytest.approx(0.1)
    assert stairs(10) == pytest.approx(0.05)
    assert stairs(25) == pytest.approx(0.025)
    assert schedules.ExponentialDecay(1.0, 4, 0.5).staircase is False  # Keras' default


@pytest.mark.parametrize(
    "boundaries,values",
    [([10, 20], [1.0, 0.5, 0.1]), ([0], [0.3, 0.2]), ([3, 4, 5, 30], [0.5, 0.4, 0.3, 0.2, 0.1])],
)
def test_piecewise_constant_decay(boundaries, values):
    schedule = schedules.PiecewiseConstantDecay(boundaries, values)

    def reference(step):
        for boundary, value in zip(boundaries, values):
            if step <= boundary:
                return value
        return values[-1]

    check(schedule, reference)


def test_piecewise_constant_boundaries_are_inclusive():
    schedule = schedules.PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1])
    assert [schedule(s) for s in (0, 9, 10, 11, 19, 20, 21, 1000)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.1, 0.1]


@pytest.mark.parametrize("cycle", [False, True])
@pytest.mark.parametrize("power", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("end", [0.0001, 0.01])
def test_polynomial_decay(power, cycle, end):
    decay_steps = 10
    schedule = schedules.PolynomialDecay(0.1, decay_steps, end_learning_rate=end, power=power, cycle=cycle)

    def reference(step):
        steps = float(decay_steps)
        if cycle:
            steps *= 1.0 if step == 0 else math.ceil(step / decay_steps)
        else:
            step = min(step, decay_steps)
        return (0.1 - end) * (1 - step / steps) ** power + end

    check(schedule, reference)


def test_polynomial_decay_known_values():
    schedule = schedules.PolynomialDecay(0.1, decay_steps=10, end_learning_rate=0.01, power=2.0)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(5) == pytest.approx(0.09 * 0.25 + 0.01)
    assert schedule(10) == pytest.approx(0.01)
    assert schedule(500) == pytest.approx(0.01)  # held at the end rate
    cyclic = schedules.PolynomialDecay(0.1, decay_steps=10, end_learning_rate=0.01, power=1.0, cycle=True)
    assert cyclic(10) == pytest.approx(0.01)
    assert cyclic(15) == pytest.approx(0.09 * 0.25 + 0.01)  # decay_steps grew to 20
    defaults = schedules.PolynomialDecay(0.1, decay_steps=10)
    assert defaults(10) == pytest.approx(0.0001)  # Keras' default end rate
    assert defaults(5) == pytest.approx((0.1 - 0.0001) * 0.5 + 0.0001)  # power 1


@pytest.mark.parametrize("staircase", [False, True])
@pytest.mark.parametrize("decay_steps,decay_rate", [(10, 0.5), (1.0, 0.5), (3, 2.0)])
def test_inverse_time_decay(decay_steps, decay_rate, staircase):
    schedule = schedules.InverseTimeDecay(0.1, decay_steps, decay_rate, staircase=staircase)

    def reference(step):
        p = step / decay_steps
        if staircase:
            p = np.floor(p)
        return 0.1 / (1 + decay_rate * p)

    check(schedule, reference)


def test_inverse_time_decay_known_values():
    assert schedules.InverseTimeDecay(0.1, 10, 0.5)(5) == pytest.approx(0.1 / 1.25)
    assert schedules.InverseTimeDecay(0.1, 10, 0.5, staircase=True)(5) == pytest.approx(0.1)
    assert schedules.InverseTimeDecay(0.1, 10, 0.5, staircase=True)(10) == pytest.approx(0.1 / 1.5)


def cosine_reference(initial, decay_steps, alpha=0.0, warmup_target=None, warmup_steps=0):
    def decay(step, target):
        step = min(step, decay_steps)
        return target * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * step / decay_steps)) + alpha)

    def reference(step):
        if warmup_target is None:
            return decay(step, initial)
        if step < warmup_steps:
            return initial + (warmup_target - initial) * step / warmup_steps
        return decay(step - warmup_steps, warmup_target)

    return reference


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"alpha": 0.1},
        {"warmup_target": 0.5, "warmup_steps": 5},
        {"alpha": 0.2, "warmup_target": 1.0, "warmup_steps": 12},
        {"warmup_target": 0.05, "warmup_steps": 3},  # warming "down"
    ],
    ids=["plain", "alpha", "warmup", "alpha-warmup", "warmup-down"],
)
def test_cosine_decay(kwargs):
    schedule = schedules.CosineDecay(0.1, decay_steps=20, **kwargs)
    check(schedule, cosine_reference(0.1, 20, **kwargs))


def test_cosine_decay_known_values():
    plain = schedules.CosineDecay(1.0, decay_steps=10, alpha=0.1)
    assert plain(0) == pytest.approx(1.0)
    assert plain(5) == pytest.approx(0.9 * 0.5 + 0.1)
    assert plain(10) == pytest.approx(0.1)
    assert plain(1000) == pytest.approx(0.1)
    warm = schedules.CosineDecay(0.0, decay_steps=10, warmup_target=0.4, warmup_steps=4)
    assert [warm(s) for s in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])  # linear warmup
    assert warm(9) == pytest.approx(0.2)  # then cosine from the warmup target
    assert warm(14) == pytest.approx(0.0, abs=1e-15)
    assert warm(100) == pytest.approx(0.0, abs=1e-15)


# --- configs and serialization ----------------------------------------------------------------
SCHEDULES = [
    schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True, name="exp"),
    schedules.ExponentialDecay(0.2, 3, 0.9),
    schedules.PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1]),
    schedules.PolynomialDecay(0.1, 10, end_learning_rate=0.01, power=0.5, cycle=True),
    schedules.InverseTimeDecay(0.1, 10, 0.5, staircase=True),
    schedules.CosineDecay(0.0, 20, alpha=0.1, warmup_target=0.3, warmup_steps=5),
    schedules.CosineDecay(0.1, 20),
]
SCHEDULE_IDS = [f"{type(s).__name__}{i}" for i, s in enumerate(SCHEDULES)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_get_config_from_config_round_trip(schedule):
    config = schedule.get_config()
    json.dumps(config)  # plain data
    rebuilt = type(schedule).from_config(config)
    assert type(rebuilt) is type(schedule)
    assert rebuilt is not schedule
    assert rebuilt.get_config() == config
    assert [rebuilt(s) for s in STEPS] == [schedule(s) for s in STEPS]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_serialize_deserialize_round_trip(schedule):
    data = schedules.serialize(schedule)
    assert data["class_name"] == type(schedule).__name__
    assert data["config"] == schedule.get_config()
    json.dumps(data)
    rebuilt = schedules.deserialize(json.loads(json.dumps(data)))
    assert type(rebuilt) is type(schedule)
    assert rebuilt.get_config() == schedule.get_config()
    assert [rebuilt(s) for s in STEPS] == [schedule(s) for s in STEPS]


def test_config_carries_every_argument():
    config = schedules.CosineDecay(0.0, 20, alpha=0.1, warmup_target=0.3, warmup_steps=5, name="c").get_config()
    assert config == {
        "initial_learning_rate": 0.0,
        "decay_steps": 20,
        "alpha": 0.1,
        "name": "c",
        "warmup_target": 0.3,
        "warmup_steps": 5,
    }
    config = schedules.PolynomialDecay(0.1, 10, end_learning_rate=0.01, power=0.5, cycle=True).get_config()
    assert {k: config[k] for k in ("initial_learning_rate", "decay_steps", "end_learning_rate", "power", "cycle")} == {
        "initial_learning_rate": 0.1,
        "decay_steps": 10,
        "end_learning_rate": 0.01,
        "power": 0.5,
        "cycle": True,
    }


def test_deserialize_unknown_class_raises():
    with pytest.raises(ValueError, match="NoSuchDecay"):
        schedules.deserialize({"class_name": "NoSuchDecay", "config": {}})
    with pytest.raises(ValueError):
        schedules.deserialize({"config": {"initial_learning_rate": 0.1}})


# --- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("decay_steps", [0, -1, -10.0])
@pytest.mark.parametrize(
    "make",
    [
        lambda d: schedules.ExponentialDecay(0.1, d, 0.5),
        lambda d: schedules.PolynomialDecay(0.1, d),
        lambda d: schedules.InverseTimeDecay(0.1, d, 0.5),
        lambda d: schedules.CosineDecay(0.1, d),
    ],
    ids=["exponential", "polynomial", "inverse_time", "cosine"],
)
def test_decay_steps_must_be_positive(make, decay_steps):
    with pytest.raises(ValueError, match="decay_steps"):
        make(decay_steps)
    make(1)  # a positive value is accepted


@pytest.mark.parametrize(
    "boundaries,values", [([10, 20], [1.0, 0.5]), ([10], [1.0, 0.5, 0.1]), ([], [1.0, 0.5]), ([1, 2], [])]
)
def test_piecewise_constant_mismatched_lengths_raise(boundaries, values):
    with pytest.raises(ValueError):
        schedules.PiecewiseConstantDecay(boundaries, values)


# --- schedules inside optimizers ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [optimizers.SGD, optimizers.Adam, optimizers.RMSprop, optimizers.Adagrad])
def test_optimizer_learning_rate_follows_iterations(cls):
    schedule = schedules.PiecewiseConstantDecay([0, 1, 3], [0.4, 0.3, 0.2, 0.1])
    optimizer = cls(learning_rate=schedule)
    variable = ds.Variable(torch.ones(3), name="x")
    seen = []
    for _ in range(6):
        seen.append(optimizer.learning_rate)
        optimizer.apply_gradients([(torch.ones(3), variable)])
    assert seen == pytest.approx([0.4, 0.3, 0.2, 0.2, 0.1, 0.1])
    assert optimizer.learning_rate == pytest.approx(0.1)
    # restoring iterations moves the schedule back
    optimizer.iterations.assign(1)
    assert optimizer.learning_rate == pytest.approx(0.3)


def test_optimizer_learning_rate_setter_takes_a_schedule():
    optimizer = optimizers.SGD(0.5)
    assert optimizer.learning_rate == pytest.approx(0.5)
    optimizer.learning_rate = schedules.ExponentialDecay(1.0, 1, 0.5)
    variable = ds.Variable(torch.zeros(1), name="x")
    for step in range(4):
        assert optimizer.learning_rate == pytest.approx(0.5**step)
        optimizer.apply_gradients([(torch.ones(1), variable)])
    assert variable.numpy()[0] == pytest.approx(-(1 + 0.5 + 0.25 + 0.125))


def test_from_torch_learning_rate_follows_a_schedule():
    optimizer = optimizers.from_torch(torch.optim.SGD, lr=1.0)
    optimizer.learning_rate = schedules.ExponentialDecay(1.0, 1, 0.5)
    variable = ds.Variable(torch.zeros(1), name="x")
    for step in range(4):
        assert optimizer.learning_rate == pytest.approx(0.5**step)
        optimizer.apply_gradients([(torch.ones(1), variable)])
    assert variable.numpy()[0] == pytest.approx(-(1 + 0.5 + 0.25 + 0.125))
