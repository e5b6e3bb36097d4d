"""Optimizer configs, ``replicafit.optimizers.get``, validation, iterations, variables and state dicts.

Reference: Keras 3 optimizer defaults and ``get``.
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


@pytest.mark.parametrize(
    "name", ["torch.optim.NoSuchOptimizer", "torch.optimx.Adam", "torch.optim.lr_scheduler.StepLR"]
)
def test_a_torch_optimizer_config_naming_no_torch_optim_class_is_a_value_error(name):
    """Regression: a name under torch.optim that is not an optimizer class raised AttributeError (or rebuilt
    whatever ``torch.optim.<name>`` was), a module merely starting with "torch.optim" was searched there."""
    config = optimizers.from_torch(torch.optim.SGD, lr=0.1).get_config()
    with pytest.raises(ValueError, match="only torch.optim classes"):
        optimizers.TorchOptimizer.from_config(dict(config, optimizer_class=name))


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
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "gradient_accumulation_steps": None,
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
    assert isinstance(rebuilt.learning_rate_schedule, schedules.ExponentialDecay)


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
    assert [record["name"] for record in state["variables"]] == NAMES
    assert set(state["slots"]) == {0, 1}
    for position in range(len(NAMES)):
        assert set(state["slots"][position]) == set(slot_names)
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


def test_state_dict_keys_slots_by_position_with_names_as_a_check_and_is_a_snapshot():
    variables = make_variables(initial_weights())
    optimizer = optimizers.Adam(0.1)
    optimizer.apply_gradients(zip(gradient_sequence(1)[0], variables))
    state = optimizer.state_dict()
    assert set(state) >= {"iterations", "variables", "slots"}
    assert state["variables"] == [{"name": "kernel", "shape": [3, 4]}, {"name": "bias", "shape": [5]}]
    assert set(state["slots"]) == {0, 1}
    assert set(state["slots"][0]) == {"momentum", "velocity"}
    momentum = optimizer.get_slot(variables[0], "momentum")
    assert torch.equal(state["slots"][0]["momentum"], momentum.value())
    before = state["slots"][0]["momentum"].clone()
    optimizer.apply_gradients(zip(gradient_sequence(1, seed=3)[0], variables))
    assert torch.equal(state["slots"][0]["momentum"], before)  # not a view of the live slot
    assert not torch.equal(momentum.value(), before)


def test_torch_optimizer_state_dict_keys_state_by_position_with_names_as_a_check():
    variables = make_variables(initial_weights())
    optimizer = optimizers.from_torch(torch.optim.Adam, lr=0.1)
    optimizer.apply_gradients(zip(gradient_sequence(1)[0], variables))
    state = optimizer.state_dict()
    assert state["iterations"] == 1
    assert state["variables"] == [{"name": "kernel", "shape": [3, 4]}, {"name": "bias", "shape": [5]}]
    assert set(state["torch_state"]) == {0, 1}
    assert {"exp_avg", "exp_avg_sq"} <= set(state["torch_state"][0])


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
    assert [record["name"] for record in optimizer_state["variables"]] == ["weight", "bias"]
    assert set(optimizer_state["slots"]) == {0, 1}
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


def test_the_learning_rate_schedule_and_the_torch_hyperparameters_are_public():
    schedule = schedules.ExponentialDecay(0.1, 2, 0.5)
    assert optimizers.SGD(schedule).learning_rate_schedule is schedule
    assert optimizers.SGD(0.1).learning_rate_schedule is None
    assert optimizers.LossScaleOptimizer(optimizers.SGD(schedule)).learning_rate_schedule is schedule
    optimizer = optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert optimizer.torch_class is torch.optim.SGD and optimizer.torch_kwargs == {"lr": 0.1, "momentum": 0.9}
    optimizer.apply_gradients([(torch.ones(2), ds.Variable(torch.zeros(2), name="x"))])  # builds torch's
    optimizer.set_torch_hyperparameters(momentum=0.5)
    assert optimizer.torch_kwargs["momentum"] == 0.5
    assert [group["momentum"] for o in optimizer._torch_optimizers for group in o.param_groups] == [0.5]


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


# --- state keyed by position: unnamed and same-named variables (hardening item 13) -----------------------
POSITION_CASES = [
    lambda: optimizers.SGD(0.05, momentum=0.9),
    lambda: optimizers.Adam(0.05),
    lambda: optimizers.RMSprop(0.05, momentum=0.5, centered=True),
    lambda: optimizers.from_torch(torch.optim.SGD, lr=0.05, momentum=0.9),
    lambda: optimizers.from_torch(torch.optim.Adam, lr=0.05),
]
POSITION_IDS = ["sgd-momentum", "adam", "rmsprop", "torch-sgd-momentum", "torch-adam"]


def unnamed_variables(strategy, seed: int = 0) -> list:
    """Three unnamed variables of one shape: every one is called "Variable"."""
    generator = torch.Generator().manual_seed(seed)
    with strategy.scope():
        return [ds.Variable(torch.randn(3, generator=generator)) for _ in range(3)]


def two_modules_variables(strategy, seed: int = 0) -> list:
    """Two Linear(3, 3) modules trained by one optimizer: "weight", "bias", "weight", "bias"."""
    torch.manual_seed(seed)
    modules = [strategy.distribute_module(torch.nn.Linear(3, 3)) for _ in range(2)]
    return [v for module in modules for v in module.trainable_variables]


def position_gradients(variables, steps: int, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(v.shape, generator=generator) for v in variables] for _ in range(steps)]


def run_steps(strategy, optimizer, variables, grad_seq) -> None:
    for grads in grad_seq:
        strategy.run(lambda grads=grads: optimizer.apply_gradients(zip(grads, variables)))


@pytest.mark.parametrize("make_variables_for", [unnamed_variables, two_modules_variables], ids=["unnamed", "modules"])
@pytest.mark.parametrize("make", POSITION_CASES, ids=POSITION_IDS)
def test_variables_sharing_a_name_restore_like_an_uninterrupted_run(strategy, make, make_variables_for, tmp_path):
    """Names need not be unique; the state is keyed by position, so each variable gets its own slots back."""
    variables = make_variables_for(strategy)
    assert len({v.name for v in variables}) < len(variables)
    grad_seq = position_gradients(variables, 7)
    with strategy.scope():
        uninterrupted = make()
    run_steps(strategy, uninterrupted, variables, grad_seq)
    expected = values(variables)

    variables = make_variables_for(strategy)
    with strategy.scope():
        first = make()
    run_steps(strategy, first, variables, grad_seq[:3])
    torch.save(first.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)

    resumed_variables = make_variables_for(strategy, seed=9)
    for variable, value in zip(resumed_variables, values(variables)):
        variable.assign(value)
    with strategy.scope():
        resumed = make()
    resumed.load_state_dict(state)
    run_steps(strategy, resumed, resumed_variables, grad_seq[3:])
    for position, (got, want) in enumerate(zip(values(resumed_variables), expected)):
        assert torch.equal(got, want), f"variable {position}"
    assert int(resumed.iterations) == 7


def built_adam(names=("a", "b"), shapes=((3,), (2, 2))):
    variables = [ds.Variable(torch.ones(shape), name=name) for name, shape in zip(names, shapes)]
    optimizer = optimizers.Adam(0.1)
    optimizer.apply_gradients(zip([torch.ones(shape) for shape in shapes], variables))
    return optimizer, variables


def edited(state: dict, edit) -> dict:
    state = copy.deepcopy(state)
    edit(state)
    return state


MISFITS = {
    "one-variable-fewer": (
        lambda s: (s["variables"].pop(), s["slots"].pop(1)),
        "holds 1 variables, but this optimizer has 2",
    ),
    "another-name": (lambda s: s["variables"][1].update(name="c"), r"variable 1 is 'c'.*variable 1 is 'b'"),
    "another-shape": (lambda s: s["variables"][0].update(shape=[4]), r"variable 0 is 'a' of shape \[4\]"),
    "a-missing-slot": (lambda s: s["slots"][1].pop("velocity"), r"variable 1 \('b'\) has slots \['momentum'\]"),
    "an-extra-slot": (lambda s: s["slots"][0].update(extra=torch.ones(3)), "variable 0"),
    "a-slot-of-another-shape": (
        lambda s: s["slots"][1].update(momentum=torch.ones(7)),
        r"slot 'momentum' of variable 1 \('b'\) must be a tensor of shape \[2, 2\], got shape \[7\]",
    ),
    "a-slot-that-is-no-tensor": (lambda s: s["slots"][0].update(velocity="junk"), "slot 'velocity' of variable 0"),
    "a-position-out-of-range": (lambda s: s["slots"].update({5: {}}), "positions 0..1"),
    "string-keys-with-variables": (lambda s: s["slots"].update(a={}), "positions 0..1"),
    "slots-not-a-dict": (lambda s: s.update(slots="junk"), "'slots' must be a dict"),
    "iterations-not-an-int": (lambda s: s.update(iterations="3"), "'iterations' must be an int"),
    "variables-not-records": (lambda s: s.update(variables=["a", "b"]), "variable 0 must be"),
    "a-negative-learning-rate": (lambda s: s.update(learning_rate=-1.0), "learning_rate"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_state_that_does_not_fit_raises_naming_the_position_and_changes_nothing(case):
    edit, message = MISFITS[case]
    source, _ = built_adam()
    source.apply_gradients(zip([torch.full((3,), 2.0), torch.full((2, 2), 3.0)], source._variables))
    state = edited(source.state_dict(), edit)
    target, _ = built_adam()
    before = target.state_dict()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    after = target.state_dict()
    assert after["iterations"] == before["iterations"] == 1
    for position in before["slots"]:
        for slot, value in before["slots"][position].items():
            assert torch.equal(after["slots"][position][slot], value), (position, slot)


def test_a_state_of_another_optimizer_is_refused():
    adam, _ = built_adam()
    sgd = optimizers.SGD(0.1, momentum=0.9)
    sgd.apply_gradients(
        zip(
            [torch.ones(3), torch.ones(2, 2)],
            [ds.Variable(torch.ones(3), name="a"), ds.Variable(torch.ones(2, 2), name="b")],
        )
    )
    with pytest.raises(ValueError, match=r"has slots \['momentum', 'velocity'\], but SGD 'sgd' keeps \['momentum'\]"):
        sgd.load_state_dict(adam.state_dict())


def test_a_misfit_found_when_the_optimizer_is_built_later_raises_at_its_first_apply():
    state = built_adam()[0].state_dict()
    fresh = optimizers.Adam(0.1)
    fresh.load_state_dict(state)  # not built yet: nothing to check against
    other = [ds.Variable(torch.ones(3), name="a"), ds.Variable(torch.ones(5), name="b")]
    with pytest.raises(ValueError, match=r"variable 1 is 'b' of shape \[2, 2\]"):
        fresh.apply_gradients(zip([torch.ones(3), torch.ones(5)], other))


@pytest.mark.parametrize(
    "make",
    [lambda: optimizers.from_torch(torch.optim.Adam, lr=0.1), lambda: optimizers.from_torch(torch.optim.SGD, lr=0.1)],
    ids=["torch-adam", "torch-sgd"],
)
def test_a_torch_optimizer_state_that_does_not_fit_raises(make):
    variables = make_variables(initial_weights())
    source = make()
    train(source, variables, gradient_sequence(2))
    state = source.state_dict()
    target = make()
    train(target, make_variables(initial_weights()), gradient_sequence(1))
    for edit, message in [
        (lambda s: s["variables"][1].update(name="other"), "variable 1 is 'other'"),
        (lambda s: (s["variables"].pop(), s["torch_state"].pop(1, None)), "holds 1 variables, but this optimizer"),
        (lambda s: s["torch_state"].setdefault(0, {}).update(exp_avg="junk"), "torch entry 'exp_avg' of variable 0"),
        (lambda s: s.update(torch_state={"kernel": {}, 0: {}}), "must be the positions"),
    ]:
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(edited(state, edit))
        assert int(target.iterations) == 1


def name_keyed(state: dict, key: str = "slots") -> dict:
    """``state`` in the layout of earlier versions: entries keyed by variable name, no ``variables``."""
    legacy = {k: v for k, v in state.items() if k not in ("variables", key)}
    legacy[key] = {state["variables"][p]["name"]: entry for p, entry in state[key].items()}
    return legacy


@pytest.mark.parametrize("fresh_applied_first", [False, True], ids=["before-first-apply", "after-first-apply"])
@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: optimizers.Adam(0.05), "slots"),
        (lambda: optimizers.SGD(0.05, momentum=0.9), "slots"),
        (lambda: optimizers.from_torch(torch.optim.Adam, lr=0.05), "torch_state"),
    ],
    ids=["adam", "sgd-momentum", "torch-adam"],
)
def test_name_keyed_states_of_earlier_versions_load_when_names_are_unique(make, key, fresh_applied_first):
    grad_seq = gradient_sequence(6)
    variables = make_variables(initial_weights())
    optimizer = make()
    train(optimizer, variables, grad_seq[:3])
    legacy = name_keyed(optimizer.state_dict(), key)
    assert set(legacy[key]) == set(NAMES)
    saved_weights = values(variables)
    train(optimizer, variables, grad_seq[3:])
    expected = values(variables)

    restored = make()
    fresh = make_variables(initial_weights(seed=4))
    if fresh_applied_first:
        restored.apply_gradients(zip(gradient_sequence(1, seed=9)[0], fresh))
    for variable, value in zip(fresh, saved_weights):
        variable.assign(value)
    restored.load_state_dict(legacy)
    train(restored, fresh, grad_seq[3:])
    for name, x, y in zip(NAMES, values(fresh), expected):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: optimizers.SGD(0.05, momentum=0.9), "slots"),
        (lambda: optimizers.from_torch(torch.optim.Adam), "torch_state"),
    ],
    ids=["sgd-momentum", "torch-adam"],
)
def test_name_keyed_states_are_refused_when_variables_share_a_name(make, key):
    strategy = ds.get_strategy()
    variables = unnamed_variables(strategy)
    optimizer = make()
    run_steps(strategy, optimizer, variables, position_gradients(variables, 2))
    state = optimizer.state_dict()
    legacy = {k: v for k, v in state.items() if k not in ("variables", key)} | {key: {"Variable": state[key][0]}}
    restored = make()
    run_steps(strategy, restored, unnamed_variables(strategy), position_gradients(variables, 1))
    with pytest.raises(ValueError, match=r"variables \[0, 1, 2\] are all named 'Variable'.*cannot be told apart"):
        restored.load_state_dict(legacy)
    pending = make()
    pending.load_state_dict(legacy)  # not built: refused once it is built for the variables
    with pytest.raises(ValueError, match="cannot be told apart"):
        run_steps(strategy, pending, unnamed_variables(strategy), position_gradients(variables, 1))


# --- a learning rate of 0 (hardening item 12) -----------------------------------------------------------------
ZERO_RATE = [
    lambda lr: optimizers.SGD(lr),
    lambda lr: optimizers.SGD(lr, momentum=0.9),
    lambda lr: optimizers.Adam(lr),
    lambda lr: optimizers.AdamW(lr, weight_decay=0.1),
    lambda lr: optimizers.RMSprop(lr),
    lambda lr: optimizers.Adagrad(lr),
    lambda lr: optimizers.from_torch(torch.optim.SGD, lr=lr, momentum=0.9),
    lambda lr: optimizers.from_torch(torch.optim.Adam, lr=lr),
]
ZERO_RATE_IDS = ["sgd", "sgd-momentum", "adam", "adamw", "rmsprop", "adagrad", "torch-sgd", "torch-adam"]


@pytest.mark.parametrize("make", ZERO_RATE, ids=ZERO_RATE_IDS)
def test_a_learning_rate_of_0_is_valid_and_leaves_the_variables_as_torch_optim_does(make):
    weights = initial_weights()
    variables = make_variables(weights)
    optimizer = make(0.0)
    assert optimizer.learning_rate == 0.0
    train(optimizer, variables, gradient_sequence(3))
    # torch.optim's oracle: lr=0 moves no parameter.
    params = [torch.from_numpy(w.copy()).requires_grad_() for w in weights]
    oracle = torch.optim.SGD(params, lr=0.0, momentum=0.9)
    for grads in gradient_sequence(3):
        for p, g in zip(params, grads):
            p.grad = g
        oracle.step()
    for got, want in zip(values(variables), params):
        assert torch.equal(got, want.detach())
    assert int(optimizer.iterations) == 3

    moving = make(0.1)
    moving.learning_rate = 0.0  # the setter too (a LearningRateScheduler's path)
    state = moving.state_dict()
    assert state.get("learning_rate", state.get("param_groups", [{}])[0].get("lr")) == 0.0
    restored = make(0.1)
    restored.load_state_dict(state)  # a backup taken at rate 0 restores
    assert restored.learning_rate == 0.0


BAD_RATES = [-0.1, -1, float("nan"), float("inf"), float("-inf"), "0.1", True, None]
BAD_RATE_IDS = ["negative", "negative-int", "nan", "inf", "-inf", "string", "bool", "none"]


@pytest.mark.parametrize("bad", BAD_RATES, ids=BAD_RATE_IDS)
def test_negative_nan_and_infinite_learning_rates_are_refused(bad):
    for cls in (optimizers.SGD, optimizers.Adam, optimizers.AdamW, optimizers.RMSprop, optimizers.Adagrad):
        with pytest.raises(ValueError, match="learning_rate"):
            cls(learning_rate=bad)
    if not isinstance(bad, (str, bool)) and bad is not None:
        with pytest.raises(ValueError):
            optimizers.from_torch(torch.optim.SGD, lr=bad)
    optimizer = optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="learning_rate"):
        optimizer.learning_rate = bad
    assert optimizer.learning_rate == 0.1
    variables = make_variables(initial_weights())
    train(optimizer, variables, gradient_sequence(1))
    if bad is not None:
        state = optimizer.state_dict() | {"learning_rate": bad}
        with pytest.raises(ValueError, match="learning_rate"):
            optimizers.SGD(0.1).load_state_dict(state)


def with_schedule(make, schedule):
    optimizer = make()
    optimizer.learning_rate = schedule
    return optimizer


@pytest.mark.parametrize("rate", [-0.01, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
@pytest.mark.parametrize(
    "make",
    [lambda: optimizers.SGD(0.1), lambda: optimizers.from_torch(torch.optim.SGD, lr=0.1)],
    ids=["builtin", "torch"],
)
def test_a_schedule_giving_a_refused_rate_raises_at_that_step(rate, make):
    optimizer = with_schedule(make, lambda step: 0.1 if step < 2 else rate)
    variables = make_variables(initial_weights())
    train(optimizer, variables, gradient_sequence(2))
    before = values(variables)
    with pytest.raises(ValueError, match="schedule at step 2"):
        train(optimizer, variables, gradient_sequence(1))
    for got, want in zip(values(variables), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "make",
    [lambda: optimizers.SGD(0.1), lambda: optimizers.from_torch(torch.optim.SGD, lr=0.1)],
    ids=["builtin", "torch"],
)
def test_a_schedule_reaching_0_is_valid(make):
    schedule = schedules.CosineDecay(0.1, decay_steps=3, alpha=0.0)
    assert schedule(3) == 0.0
    optimizer = with_schedule(make, schedule)
    variables = make_variables(initial_weights())
    train(optimizer, variables, gradient_sequence(3))
    frozen = values(variables)
    train(optimizer, variables, gradient_sequence(2, seed=5))  # steps 3 and 4 run at rate 0
    for got, want in zip(values(variables), frozen):
        assert torch.equal(got, want)
