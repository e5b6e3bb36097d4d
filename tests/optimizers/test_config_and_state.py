"""Optimizer configs, ``replicafit.optimizers.get``, validation, iterations, variables and state dicts.

Reference: API.md section 3; Keras 3 optimizer defaults and ``get``.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.optimizers import schedules

pytestmark = pytest.mark.timeout(60)

SHAPES = [(3, 4), (5,)]
NAMES = ["kernel", "bias"]


def initial_weights(seed: int = 0) -> list:
    rng = np.random.RandomState(seed)
    return [(0.5 * rng.randn(*shape)).astype(np.float32) for shape in SHAPES]


def gradient_sequence(steps: int, seed: int = 1) -> list:
    rng = np.random.RandomState(seed)
    return [[torch.from_numpy((1.5 * rng.randn(*shape)).astype(np.float32)) for shape in SHAPES] for _ in range(steps)]


def make_variables(weights) -> list:
    return [ds.Variable(torch.from_numpy(w.copy()), name=n) for w, n in zip(weights, NAMES)]


def values(variables) -> list:
    return [v.value().detach().clone() for v in variables]


def train(optimizer, variables, grad_seq) -> None:
    for grads in grad_seq:
        optimizer.apply_gradients(zip(grads, variables))


BUILTINS = [
    lambda lr=0.05: optimizers.SGD(lr),
    lambda lr=0.05: optimizers.SGD(lr, momentum=0.9, nesterov=True),
    lambda lr=0.05: optimizers.Adam(lr),
    lambda lr=0.05: optimizers.Adam(lr, amsgrad=True, clipnorm=1.0),
    lambda lr=0.05: optimizers.AdamW(lr, weight_decay=0.1),
    lambda lr=0.05: optimizers.RMSprop(lr, momentum=0.5, centered=True),
    lambda lr=0.05: optimizers.Adagrad(lr, global_clipnorm=2.0),
    lambda lr=0.05: optimizers.from_torch(torch.optim.Adam, lr=lr),
]
BUILTIN_IDS = ["sgd", "sgd-nesterov", "adam", "adam-amsgrad", "adamw", "rmsprop-centered", "adagrad", "torch-adam"]


# --- get_config / from_config --------------------------------------------------------------------
CONFIG_CASES = [
    (optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.8, "nesterov": True, "clipvalue": 0.5}),
    (optimizers.Adam, {"learning_rate": 0.02, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5, "amsgrad": True}),
    (optimizers.AdamW, {"learning_rate": 0.02, "weight_decay": 0.05, "global_clipnorm": 1.0}),
    (optimizers.RMSprop, {"learning_rate": 0.02, "rho": 0.8, "momentum": 0.5, "centered": True, "epsilon": 1e-4}),
    (optimizers.Adagrad, {"learning_rate": 0.2, "initial_accumulator_value": 0.3, "epsilon": 1e-4, "clipnorm": 2.0}),
    (optimizers.SGD, {"learning_rate": schedules.ExponentialDecay(0.1, 2, 0.5), "momentum": 0.9}),
    (optimizers.Adam, {"learning_rate": schedules.CosineDecay(0.0, 10, warmup_target=0.1, warmup_steps=2)}),
]
CONFIG_IDS = ["sgd", "adam", "adamw", "rmsprop", "adagrad", "sgd-schedule", "adam-schedule"]


@pytest.mark.parametrize("cls,kwargs", CONFIG_CASES, ids=CONFIG_IDS)
def test_get_config_from_config_round_trip(cls, kwargs):
    optimizer = cls(**kwargs, name="my_optimizer")
    config = optimizer.get_config()
    for key, value in kwargs.items():
        if isinstance(value, schedules.LearningRateSchedule):
            assert config[key] == schedules.serialize(value)
        else:
            assert config[key] == value, key
    assert config["name"] == "my_optimizer"
    config = json.loads(json.dumps(config))  # plain data
    rebuilt = cls.from_config(config)
    assert type(rebuilt) is cls
    assert rebuilt.get_config() == optimizer.get_config()
    # the rebuilt optimizer trains identically
    grad_seq = gradient_sequence(4)
    a, b = make_variables(initial_weights()), make_variables(initial_weights())
    train(optimizer, a, grad_seq)
    train(rebuilt, b, grad_seq)
    for x, y in zip(values(a), values(b)):
        assert torch.equal(x, y)


def test_builtin_defaults_in_config():
    assert optimizers.SGD().get_config() | {"name": None} == {
        "name": None,
        "learning_rate": 0.01,
        "momentum": 0.0,
        "nesterov": False,
        "weight_decay": None,
        "clipnorm": None,
        "clipvalue": None,
        "global_clipnorm": None,
    }
    adam = optimizers.Adam().get_config()
    assert {k: adam[k] for k in ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad", "weight_decay")} == {
        "learning_rate": 0.001,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "amsgrad": False,
        "weight_decay": None,
    }
    assert optimizers.AdamW().get_config()["weight_decay"] == 0.004
    rms = optimizers.RMSprop().get_config()
    assert {k: rms[k] for k in ("learning_rate", "rho", "momentum", "epsilon", "centered")} == {
        "learning_rate": 0.001,
        "rho": 0.9,
        "momentum": 0.0,
        "epsilon": 1e-7,
        "centered": False,
    }
    ada = optimizers.Adagrad().get_config()
    assert {k: ada[k] for k in ("learning_rate", "initial_accumulator_value", "epsilon")} == {
        "learning_rate": 0.001,
        "initial_accumulator_value": 0.1,
        "epsilon": 1e-7,
    }


def test_plain_callable_learning_rate_is_not_serializable():
    with pytest.raises(ValueError):
        optimizers.SGD(lambda step: 0.1).get_config()


# --- optimizers.get -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "identifier,cls,defaults",
    [
        ("sgd", optimizers.SGD, {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False}),
        ("SGD", optimizers.SGD, {"learning_rate": 0.01}),
        ("adam", optimizers.Adam, {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}),
        ("ADAM", optimizers.Adam, {"learning_rate": 0.001, "amsgrad": False}),
        ("adamw", optimizers.AdamW, {"learning_rate": 0.001, "weight_decay": 0.004}),
        ("AdamW", optimizers.AdamW, {"weight_decay": 0.004}),
        ("rmsprop", optimizers.RMSprop, {"learning_rate": 0.001, "rho": 0.9, "momentum": 0.0, "centered": False}),
        ("RMSprop", optimizers.RMSprop, {"epsilon": 1e-7}),
        ("adagrad", optimizers.Adagrad, {"learning_rate": 0.001, "initial_accumulator_value": 0.1}),
        ("Adagrad", optimizers.Adagrad, {"epsilon": 1e-7}),
    ],
)
def test_get_by_name(identifier, cls, defaults):
    optimizer = optimizers.get(identifier)
    assert type(optimizer) is cls
    for key, value in defaults.items():
        assert getattr(optimizer, key) == value, key
    assert optimizer.learning_rate == defaults.get("learning_rate", optimizer.learning_rate)
    assert int(optimizer.iterations) == 0
    assert optimizers.get(identifier) is not optimizer  # a fresh instance each time


def test_get_from_keras_config_dict():
    optimizer = optimizers.get({"class_name": "SGD", "config": {"learning_rate": 0.1, "momentum": 0.9}})
    assert type(optimizer) is optimizers.SGD
    assert optimizer.learning_rate == pytest.approx(0.1)
    assert optimizer.momentum == pytest.approx(0.9)
    keras_form = {
        "module": "keras.optimizers",
        "class_name": "Adam",
        "config": {"learning_rate": 0.01, "beta_1": 0.8, "amsgrad": True},
        "registered_name": None,
    }
    adam = optimizers.get(keras_form)
    assert type(adam) is optimizers.Adam
    assert (adam.learning_rate, adam.beta_1, adam.amsgrad) == (pytest.approx(0.01), pytest.approx(0.8), True)
    # a whole get_config() output, schedule included
    source = optimizers.RMSprop(schedules.ExponentialDecay(0.1, 2, 0.5), momentum=0.5, name="r")
    rebuilt = optimizers.get({"class_name": "RMSprop", "config": source.get_config()})
    assert type(rebuilt) is optimizers.RMSprop
    assert rebuilt.get_config() == source.get_config()
    assert isinstance(rebuilt._learning_rate, schedules.ExponentialDecay)


def test_get_instance_is_itself():
    optimizer = optimizers.Adam(0.5)
    assert optimizers.get(optimizer) is optimizer
    wrapped = optimizers.from_torch(torch.optim.SGD, lr=0.1)
    assert optimizers.get(wrapped) is wrapped


def test_get_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'adam'"):
        optimizers.get("adamm")
    with pytest.raises(ValueError, match="did you mean 'rmsprop'"):
        optimizers.get("rmsprob")
    with pytest.raises(ValueError):
        optimizers.get({"class_name": "Adamm", "config": {}})


# --- constructor validation -----------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: optimizers.SGD(-0.1),
        lambda: optimizers.SGD(learning_rate=-1),
        lambda: optimizers.Adam(learning_rate=-0.001),
        lambda: optimizers.AdamW(learning_rate=-0.001),
        lambda: optimizers.RMSprop(learning_rate=-0.001),
        lambda: optimizers.Adagrad(learning_rate=-0.001),
        lambda: optimizers.Adam(beta_1=1.0),
        lambda: optimizers.Adam(beta_1=1.5),
        lambda: optimizers.Adam(beta_1=-0.1),
        lambda: optimizers.Adam(beta_2=1.0),
        lambda: optimizers.Adam(beta_2=-0.5),
        lambda: optimizers.AdamW(beta_2=2.0),
        lambda: optimizers.SGD(momentum=-0.5),
        lambda: optimizers.SGD(momentum=1.5),
        lambda: optimizers.RMSprop(rho=1.5),
        lambda: optimizers.RMSprop(momentum=-0.1),
        lambda: optimizers.Adagrad(initial_accumulator_value=-1.0),
        lambda: optimizers.SGD(weight_decay=-0.1),
        lambda: optimizers.SGD(clipnorm=-1.0),
        lambda: optimizers.SGD(clipvalue=0.0),
        lambda: optimizers.SGD(global_clipnorm=-2.0),
    ],
)
def test_invalid_arguments_raise(make):
    with pytest.raises(ValueError):
        make()


BUILTIN_CLASSES = [optimizers.SGD, optimizers.Adam, optimizers.AdamW, optimizers.RMSprop, optimizers.Adagrad]


@pytest.mark.parametrize("cls", BUILTIN_CLASSES)
@pytest.mark.parametrize(
    "clips",
    [
        {"clipnorm": 1.0, "clipvalue": 1.0},
        {"clipnorm": 1.0, "global_clipnorm": 1.0},
        {"clipvalue": 1.0, "global_clipnorm": 1.0},
        {"clipnorm": 1.0, "clipvalue": 1.0, "global_clipnorm": 1.0},
    ],
)
def test_two_clip_options_raise(cls, clips):
    with pytest.raises(ValueError, match="clip"):
        cls(**clips)
    with pytest.raises(ValueError, match="clip"):
        optimizers.from_torch(torch.optim.SGD, lr=0.1, **clips)
    for key, value in clips.items():  # each one alone is fine
        assert getattr(cls(**{key: value}), key) == value


# --- iterations and variables ---------------------------------------------------------------------
@pytest.mark.parametrize("make", BUILTINS, ids=BUILTIN_IDS)
def test_iterations_counts_applies(make):
    optimizer = make()
    assert isinstance(optimizer.iterations, ds.Variable)
    assert int(optimizer.iterations) == 0
    variables = make_variables(initial_weights())
    for step, grads in enumerate(gradient_sequence(3)):
        result = optimizer.apply_gradients(zip(grads, variables))
        assert int(optimizer.iterations) == step + 1
        assert int(result) == step + 1
    optimizer.apply(gradient_sequence(1)[0], variables)
    assert int(optimizer.iterations) == 4


def test_iterations_counts_applies_not_replicas(strategy):
    with strategy.scope():
        variable = ds.Variable(torch.zeros(3), name="x")
        optimizer = optimizers.Adam(0.1)
    for _ in range(3):
        strategy.run(lambda: optimizer.apply_gradients([(torch.ones(3), variable)]))
    assert int(optimizer.iterations) == 3
    # and in cross-replica context
    optimizer.apply_gradients([(torch.ones(3), variable)])
    assert int(optimizer.iterations) == 4


@pytest.mark.parametrize(
    "make,slot_names",
    [
        (lambda: optimizers.SGD(0.1), []),
        (lambda: optimizers.SGD(0.1, momentum=0.9), ["momentum"]),
        (lambda: optimizers.Adam(), ["momentum", "velocity"]),
        (lambda: optimizers.Adam(amsgrad=True), ["momentum", "velocity", "velocity_hat"]),
        (lambda: optimizers.AdamW(), ["momentum", "velocity"]),
        (lambda: optimizers.RMSprop(), ["velocity"]),
        (lambda: optimizers.RMSprop(momentum=0.5, centered=True), ["velocity", "momentum", "average_gradient"]),
        (lambda: optimizers.Adagrad(), ["accumulator"]),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adam-amsgrad", "adamw", "rmsprop", "rmsprop-all", "adagrad"],
)
def test_variables_lists_iterations_and_slots(make, slot_names):
    optimizer = make()
    assert optimizer.variables == [optimizer.iterations]
    variables = make_variables(initial_weights())
    optimizer.apply_gradients(zip(gradient_sequence(1)[0], variables))
    own = optimizer.variables
    assert own[0] is optimizer.iterations
    assert len(own) == 1 + len(slot_names) * len(variables)
    expected_slots = [optimizer.get_slot(v, n) for v in variables for n in slot_names]
    assert {id(s) for s in own[1:]} == {id(s) for s in expected_slots}
    for variable in variables:
        for name in slot_names:
            slot = optimizer.get_slot(variable, name)
            assert isinstance(slot, ds.Variable)
            assert not slot.trainable
            assert slot.shape == variable.shape and slot.dtype == variable.dtype
    state = optimizer.state_dict()
    assert state["iterations"] == 1
    assert set(state["slots"]) == (set(NAMES) if slot_names else set())
    for name in NAMES if slot_names else []:
        assert set(state["slots"][name]) == set(slot_names)
    with pytest.raises(KeyError):
        optimizer.get_slot(variables[0], "no_such_slot")


# --- state dicts ---------------------------------------------------------------------------------
STATE_CASES = [
    lambda: optimizers.SGD(0.05, momentum=0.9),
    lambda: optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    lambda: optimizers.SGD(schedules.ExponentialDecay(0.1, 1, 0.7), momentum=0.5),
    lambda: optimizers.Adam(0.05),
    lambda: optimizers.Adam(0.05, amsgrad=True),
    lambda: optimizers.AdamW(0.05, weight_decay=0.1),
    lambda: optimizers.Adam(schedules.PiecewiseConstantDecay([2, 4], [0.1, 0.05, 0.01])),
    lambda: optimizers.RMSprop(0.05),
    lambda: optimizers.RMSprop(0.05, momentum=0.9, centered=True),
    lambda: optimizers.Adagrad(0.2),
    lambda: optimizers.from_torch(torch.optim.Adam, lr=0.05),
    lambda: optimizers.from_torch(torch.optim.SGD, lr=0.05, momentum=0.9),
]
STATE_IDS = [
    "sgd-momentum",
    "sgd-nesterov",
    "sgd-schedule",
    "adam",
    "adam-amsgrad",
    "adamw",
    "adam-schedule",
    "rmsprop",
    "rmsprop-centered-momentum",
    "adagrad",
    "torch-adam",
    "torch-sgd",
]


@pytest.mark.parametrize("fresh_applied_first", [False, True], ids=["before-first-apply", "after-first-apply"])
@pytest.mark.parametrize("make", STATE_CASES, ids=STATE_IDS)
def test_state_dict_restores_and_continues_identically(make, fresh_applied_first):
    grad_seq = gradient_sequence(7)
    # uninterrupted run: 3 steps, save, 4 more steps
    variables = make_variables(initial_weights())
    optimizer = make()
    train(optimizer, variables, grad_seq[:3])
    state = optimizer.state_dict()
    saved_weights = values(variables)
    train(optimizer, variables, grad_seq[3:])
    expected = values(variables)
    assert state["iterations"] == 3

    # a fresh optimizer restored from the state
    restored = make()
    fresh = make_variables(initial_weights(seed=5))
    if fresh_applied_first:
        restored.apply_gradients(zip(gradient_sequence(1, seed=9)[0], fresh))
    for variable, value in zip(fresh, saved_weights):
        variable.assign(value)
    restored.load_state_dict(state)
    assert int(restored.iterations) == 3
    assert restored.learning_rate == pytest.approx(optimizer_at(make, 3).learning_rate)
    train(restored, fresh, grad_seq[3:])
    for name, x, y in zip(NAMES, values(fresh), expected):
        assert torch.equal(x, y), name
    assert int(restored.iterations) == 7

    # without the state the continuation differs (the test sees the state)
    unrestored = make()
    other = make_variables(initial_weights())
    for variable, value in zip(other, saved_weights):
        variable.assign(value)
    train(unrestored, other, grad_seq[3:])
    assert not all(torch.equal(x, y) for x, y in zip(values(other), expected))


def optimizer_at(make, iterations: int):
    optimizer = make()
    optimizer.iterations.assign(iterations)
    return optimizer


def test_state_dict_keys_slots_by_variable_name_and_is_a_snapshot():
    variables = make_variables(initial_weights())
    optimizer = optimizers.Adam(0.1)
    optimizer.apply_gradients(zip(gradient_sequence(1)[0], variables))
    state = optimizer.state_dict()
    assert set(state) >= {"iterations", "slots"}
    assert set(state["slots"]) == {"kernel", "bias"}
    assert set(state["slots"]["kernel"]) == {"momentum", "velocity"}
    momentum = optimizer.get_slot(variables[0], "momentum")
    assert torch.equal(state["slots"]["kernel"]["momentum"], momentum.value())
    before = state["slots"]["kernel"]["momentum"].clone()
    optimizer.apply_gradients(zip(gradient_sequence(1, seed=3)[0], variables))
    assert torch.equal(state["slots"]["kernel"]["momentum"], before)  # not a view of the live slot
    assert not torch.equal(momentum.value(), before)


def test_torch_optimizer_state_dict_keys_state_by_variable_name():
    variables = make_variables(initial_weights())
    optimizer = optimizers.from_torch(torch.optim.Adam, lr=0.1)
    optimizer.apply_gradients(zip(gradient_sequence(1)[0], variables))
    state = optimizer.state_dict()
    assert state["iterations"] == 1
    assert set(state["torch_state"]) == {"kernel", "bias"}
    assert {"exp_avg", "exp_avg_sq"} <= set(state["torch_state"]["kernel"])


# --- state across strategies ----------------------------------------------------------------
def linear_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def distributed_steps(strategy, dm, optimizer, batches) -> None:
    variables = dm.trainable_variables
    count = strategy.num_replicas_in_sync

    def replica_step(x, y):
        loss = ((dm(x) - y) ** 2).sum() / (x.shape[0] * count)
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        optimizer.apply_gradients(zip(grads, variables))

    for x, y in batches:
        strategy.run(replica_step, args=(split(strategy, x), split(strategy, y)))


def split(strategy, batch: torch.Tensor):
    """``batch`` split into consecutive per-replica slices (plain with one replica)."""
    size = batch.shape[0] // strategy.num_replicas_in_sync
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: batch[ctx.replica_id_in_sync_group * size : (ctx.replica_id_in_sync_group + 1) * size]
    )


@pytest.mark.parametrize(
    "make",
    [lambda: optimizers.Adam(0.05), lambda: optimizers.SGD(0.05, momentum=0.9), lambda: optimizers.RMSprop(0.05)],
    ids=["adam", "sgd-momentum", "rmsprop"],
)
@pytest.mark.parametrize(
    "saved_under,loaded_under",
    [("mirrored2", "default"), ("default", "mirrored2"), ("central_storage2", "default")],
    ids=["mirrored-to-default", "default-to-mirrored", "central-storage-to-default"],
)
def test_state_saved_under_one_strategy_continues_under_another(make, saved_under, loaded_under):
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, generator=generator), torch.randn(8, 2, generator=generator)) for _ in range(6)]

    source = make_strategy(saved_under)
    dm = source.distribute_module(linear_model())
    with source.scope():
        optimizer = make()
    distributed_steps(source, dm, optimizer, batches[:3])
    model_state = copy.deepcopy(dm.state_dict())
    optimizer_state = optimizer.state_dict()
    assert optimizer_state["iterations"] == 3
    assert set(optimizer_state["slots"]) == {"weight", "bias"}
    distributed_steps(source, dm, optimizer, batches[3:])
    expected = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    for replica in dm.replicas[1:]:  # the replicas agree
        for name, value in replica.state_dict().items():
            assert torch.equal(value, expected[name]), name

    target = make_strategy(loaded_under)
    model = linear_model(seed=11)
    model.load_state_dict(model_state)
    dm_target = target.distribute_module(model)
    with target.scope():
        restored = make()
    restored.load_state_dict(optimizer_state)
    distributed_steps(target, dm_target, restored, batches[3:])
    for r, replica in enumerate(dm_target.replicas):
        for name, value in replica.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=f"replica {r} {name}")
    assert int(restored.iterations) == 6

    # without the optimizer state the continuation is visibly different
    model = linear_model(seed=11)
    model.load_state_dict(model_state)
    dm_fresh = target.distribute_module(model)
    with target.scope():
        fresh = make()
    distributed_steps(target, dm_fresh, fresh, batches[3:])
    assert any(
        not torch.allclose(value, expected[name], rtol=1e-5, atol=1e-6) for name, value in dm_fresh.state_dict().items()
    )


@pytest.mark.parametrize("make", STATE_CASES, ids=STATE_IDS)
def test_state_dict_of_a_restored_optimizer_before_its_first_apply_keeps_the_state(make):
    """Save, load into a fresh optimizer, save again before training: nothing is lost."""
    grad_seq = gradient_sequence(6)
    variables = make_variables(initial_weights())
    optimizer = make()
    train(optimizer, variables, grad_seq[:3])
    state = optimizer.state_dict()
    saved_weights = values(variables)
    train(optimizer, variables, grad_seq[3:])
    expected = values(variables)

    middle = make()
    middle.load_state_dict(state)
    resaved = middle.state_dict()  # e.g. a checkpoint written right after restoring
    assert resaved["iterations"] == 3
    restored = make()
    restored.load_state_dict(resaved)
    fresh = make_variables(initial_weights())
    for variable, value in zip(fresh, saved_weights):
        variable.assign(value)
    train(restored, fresh, grad_seq[3:])
    for name, x, y in zip(NAMES, values(fresh), expected):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    "bad",
    [{}, {"iterations": 1}, {"slots": {}}, "state", None, [("iterations", 1)]],
    ids=["empty", "no-slots", "no-iterations", "str", "none", "list"],
)
def test_load_state_dict_with_a_bad_dict_raises(bad):
    with pytest.raises(ValueError):
        optimizers.Adam().load_state_dict(bad)
    with pytest.raises(ValueError):
        optimizers.from_torch(torch.optim.Adam).load_state_dict(bad)


# --- gradients ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", BUILTINS, ids=BUILTIN_IDS)
def test_all_none_gradients_raise(make):
    variables = make_variables(initial_weights())
    optimizer = make()
    with pytest.raises(ValueError):
        optimizer.apply_gradients(zip([None, None], variables))
    with pytest.raises(ValueError):
        optimizer.apply_gradients([])
    assert int(optimizer.iterations) == 0
    for variable, w in zip(variables, initial_weights()):
        assert torch.equal(variable.value(), torch.from_numpy(w))


@pytest.mark.parametrize("make", BUILTINS, ids=BUILTIN_IDS)
def test_none_gradients_are_dropped(make):
    weights = initial_weights()
    variables = make_variables(weights)
    optimizer = make()
    grads = gradient_sequence(3)
    for step in range(3):
        optimizer.apply_gradients([(grads[step][0], variables[0]), (None, variables[1])])
        assert int(optimizer.iterations) == step + 1
    assert not torch.equal(variables[0].value(), torch.from_numpy(weights[0]))
    assert torch.equal(variables[1].value(), torch.from_numpy(weights[1]))
    # the same as training the first variable alone
    alone = make_variables(weights)[:1]
    reference = make()
    for step in range(3):
        reference.apply_gradients([(grads[step][0], alone[0])])
    assert torch.equal(variables[0].value(), alone[0].value())


def test_custom_callable_learning_rate():
    def rate(step):
        return 0.1 / (step + 1)

    optimizer = optimizers.SGD(rate)
    variable = ds.Variable(torch.zeros(2), name="x")
    total = 0.0
    for step in range(5):
        assert optimizer.learning_rate == pytest.approx(rate(step))
        optimizer.apply_gradients([(torch.ones(2), variable)])
        total += rate(step)
    np.testing.assert_allclose(variable.numpy(), [-total, -total], rtol=1e-6)
    adam = optimizers.Adam(lambda step: 0.01 * (step + 1))
    adam.apply_gradients([(torch.ones(2), variable)])
    assert adam.learning_rate == pytest.approx(0.02)


def test_minimize_applies_the_gradients_of_the_loss():
    weights = initial_weights()
    a, b = make_variables(weights), make_variables(weights)
    target = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    def loss_of(variables):
        return ((variables[0].value() - target) ** 2).sum() + (variables[1].value() ** 3).sum()

    first, second = optimizers.Adam(0.1), optimizers.Adam(0.1)
    for _ in range(3):
        first.minimize(loss_of(a), a)
        second.minimize(lambda: loss_of(b), b)
    reference = make_variables(weights)
    optimizer = optimizers.Adam(0.1)
    for _ in range(3):
        grads = torch.autograd.grad(loss_of(reference), [v.value() for v in reference])
        optimizer.apply_gradients(zip(grads, reference))
    for x, y, z in zip(values(a), values(b), values(reference)):
        assert torch.equal(x, z)
        assert torch.equal(y, z)
    assert int(first.iterations) == 3


def test_get_from_flat_config_dict():
    optimizer = optimizers.get({"class_name": "RMSprop", "learning_rate": 0.1, "centered": True})
    assert type(optimizer) is optimizers.RMSprop
    assert optimizer.learning_rate == pytest.approx(0.1)
    assert optimizer.centered is True


@pytest.mark.parametrize("make", BUILTINS, ids=BUILTIN_IDS)
def test_none_gradient_leaves_a_parameter_with_a_stale_grad_unchanged(make):
    """A None gradient means "do not update", even if the tensor's .grad is set (e.g. by backward())."""
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = make()
    optimizer.apply_gradients([(torch.ones(3), first), (torch.ones(2), second)])
    (first.sum() + second.sum()).backward()  # .grad populated on both
    before = second.detach().clone()
    optimizer.apply_gradients([(torch.full((3,), 2.0), first), (None, second)])
    assert torch.equal(second.detach(), before)
    assert torch.equal(second.grad, torch.ones(2))  # the user's .grad is left alone
