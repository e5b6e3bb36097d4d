"""Golden trajectories: every built-in against a float64 NumPy reference of Keras 3's formulas.

Also: gradient transforms, weight decay and schedules inside the update, the multi-tensor
path against the per-variable path (bit for bit), and ``from_torch`` against the bare
``torch.optim`` optimizer (bit for bit).

Reference: Keras 3 ``SGD``/``Adam``/``AdamW``/``RMSprop``/``Adagrad``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.optimizers import schedules

pytestmark = pytest.mark.timeout(60)

SHAPES = [(3, 4), (5,), (2, 3, 2)]
STEPS = 6
RTOL, ATOL = 1e-5, 1e-6

# Slot names of Keras 3, per optimizer kind and hyper-parameters.
SLOTS = {
    "sgd": lambda hp: ["momentum"] if hp.get("momentum", 0.0) else [],
    "adam": lambda hp: ["momentum", "velocity"] + (["velocity_hat"] if hp.get("amsgrad") else []),
    "rmsprop": lambda hp: (
        ["velocity"]
        + (["momentum"] if hp.get("momentum", 0.0) > 0 else [])
        + (["average_gradient"] if hp.get("centered") else [])
    ),
    "adagrad": lambda hp: ["accumulator"],
}
KIND = {
    optimizers.SGD: "sgd",
    optimizers.Adam: "adam",
    optimizers.AdamW: "adam",
    optimizers.RMSprop: "rmsprop",
    optimizers.Adagrad: "adagrad",
}
DEFAULT_LR = {
    optimizers.SGD: 0.01,
    optimizers.Adam: 0.001,
    optimizers.AdamW: 0.001,
    optimizers.RMSprop: 0.001,
    optimizers.Adagrad: 0.001,
}


# --- data -------------------------------------------------------------------------------------
def initial_weights(seed: int = 0) -> list:
    rng = np.random.RandomState(seed)
    return [(0.5 * rng.randn(*shape)).astype(np.float32) for shape in SHAPES]


def gradient_sequence(seed: int = 1, scale: float = 1.5, steps: int = STEPS) -> list:
    rng = np.random.RandomState(seed)
    return [[(scale * rng.randn(*shape)).astype(np.float32) for shape in SHAPES] for _ in range(steps)]


# --- NumPy references (float64) -------------------------------------------------------------
def np_transform(grads, clipvalue=None, clipnorm=None, global_clipnorm=None):
    if clipvalue is not None:
        return [np.clip(g, -clipvalue, clipvalue) for g in grads]
    if clipnorm is not None:
        return [g * clipnorm / max(np.sqrt(np.sum(g * g)), clipnorm) for g in grads]
    if global_clipnorm is not None:
        norm = np.sqrt(sum(np.sum(g * g) for g in grads))
        return [g * global_clipnorm / max(norm, global_clipnorm) for g in grads]
    return grads


def np_init_slots(kind, hp, w):
    slots = {name: np.zeros_like(w) for name in SLOTS[kind](hp)}
    if kind == "adagrad":
        slots["accumulator"] = np.full_like(w, hp.get("initial_accumulator_value", 0.1))
    return slots


def np_update(kind, hp, w, g, s, lr, iterations):
    """One Keras 3 update of ``w`` (float64), slots ``s`` updated in place; returns the new ``w``."""
    if kind == "sgd":
        momentum = hp.get("momentum", 0.0)
        if not momentum:
            return w - lr * g
        s["momentum"] = momentum * s["momentum"] - lr * g
        if hp.get("nesterov", False):
            return w + momentum * s["momentum"] - lr * g
        return w + s["momentum"]
    if kind == "adam":
        beta_1, beta_2 = hp.get("beta_1", 0.9), hp.get("beta_2", 0.999)
        epsilon = hp.get("epsilon", 1e-7)
        t = iterations + 1
        alpha = lr * math.sqrt(1 - beta_2**t) / (1 - beta_1**t)
        s["momentum"] = s["momentum"] + (g - s["momentum"]) * (1 - beta_1)
        s["velocity"] = s["velocity"] + (g * g - s["velocity"]) * (1 - beta_2)
        v = s["velocity"]
        if hp.get("amsgrad", False):
            s["velocity_hat"] = np.maximum(s["velocity_hat"], s["velocity"])
            v = s["velocity_hat"]
        return w - s["momentum"] * alpha / (np.sqrt(v) + epsilon)
    if kind == "rmsprop":
        rho, momentum = hp.get("rho", 0.9), hp.get("momentum", 0.0)
        epsilon = hp.get("epsilon", 1e-7)
        s["velocity"] = rho * s["velocity"] + (1 - rho) * g * g
        if hp.get("centered", False):
            s["average_gradient"] = rho * s["average_gradient"] + (1 - rho) * g
            denominator = s["velocity"] - s["average_gradient"] ** 2 + epsilon
        else:
            denominator = s["velocity"] + epsilon
        increment = lr * g / np.sqrt(denominator)
        if momentum > 0:
            s["momentum"] = momentum * s["momentum"] + increment
            return w - s["momentum"]
        return w - increment
    if kind == "adagrad":
        epsilon = hp.get("epsilon", 1e-7)
        s["accumulator"] = s["accumulator"] + g * g
        return w - lr * g / np.sqrt(s["accumulator"] + epsilon)
    raise AssertionError(kind)


def np_trajectory(cls, hp, weights, grad_seq, learning_rate=None):
    """Per step: (list of weights, list of slot dicts), all float64.

    ``hp``: the constructor arguments (learning_rate, weight_decay, clip options and the
    optimizer's own); ``learning_rate`` overrides with a callable ``step -> rate``.
    """
    kind = KIND[cls]
    hp = dict(hp)
    rate = hp.pop("learning_rate", DEFAULT_LR[cls])
    if learning_rate is not None:
        rate = learning_rate
    weight_decay = hp.pop("weight_decay", 0.004 if cls is optimizers.AdamW else None)
    clip = {k: hp.pop(k) for k in ("clipvalue", "clipnorm", "global_clipnorm") if k in hp}
    ws = [w.astype(np.float64) for w in weights]
    slots = [np_init_slots(kind, hp, w) for w in ws]
    out = []
    for iterations, grads in enumerate(grad_seq):
        lr = rate(iterations) if callable(rate) else rate
        grads = np_transform([g.astype(np.float64) for g in grads], **clip)
        for i, g in enumerate(grads):
            if weight_decay:
                ws[i] = ws[i] - ws[i] * weight_decay * lr
            ws[i] = np_update(kind, hp, ws[i], g, slots[i], lr, iterations)
        out.append(([w.copy() for w in ws], [{k: v.copy() for k, v in s.items()} for s in slots]))
    return out


# --- running the library ----------------------------------------------------------------------
def make_variables(weights, kind: str) -> list:
    if kind == "variable":
        return [ds.Variable(torch.from_numpy(w.copy()), name=f"w{i}") for i, w in enumerate(weights)]
    if kind == "parameter":
        return [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in weights]
    raise AssertionError(kind)


def tensor_of(variable) -> torch.Tensor:
    return variable.value() if isinstance(variable, ds.Variable) else variable


def snapshot(optimizer, variables, slot_names) -> tuple:
    weights = [tensor_of(v).detach().clone() for v in variables]
    if not all(isinstance(v, ds.Variable) for v in variables):
        return weights, None  # slots are checked through strategies.Variables
    slots = [{n: optimizer.get_slot(v, n).value().detach().clone() for n in slot_names} for v in variables]
    return weights, slots


def run_trajectory(optimizer, variables, grad_seq, slot_names) -> list:
    out = []
    for grads in grad_seq:
        optimizer.apply_gradients(zip([torch.from_numpy(g.copy()) for g in grads], variables))
        out.append(snapshot(optimizer, variables, slot_names))
    return out


def slot_names_of(cls, hp) -> list:
    return SLOTS[KIND[cls]](hp)


def assert_matches_reference(actual, expected, label=""):
    assert len(actual) == len(expected)
    for step, ((weights, slots), (ref_weights, ref_slots)) in enumerate(zip(actual, expected)):
        for i, (w, r) in enumerate(zip(weights, ref_weights)):
            assert w.dtype == torch.float32
            np.testing.assert_allclose(
                w.numpy().astype(np.float64), r, rtol=RTOL, atol=ATOL, err_msg=f"{label} step {step} weight {i}"
            )
        for i, (s, r) in enumerate(zip(slots or [], ref_slots if slots is not None else [])):
            assert set(s) == set(r), f"{label} step {step} slots of weight {i}"
            for name in r:
                np.testing.assert_allclose(
                    s[name].numpy().astype(np.float64),
                    r[name],
                    rtol=RTOL,
                    atol=ATOL,
                    err_msg=f"{label} step {step} slot {name} of weight {i}",
                )


def assert_bitwise_equal(a, b, label=""):
    for step, ((wa, sa), (wb, sb)) in enumerate(zip(a, b, strict=True)):
        for i, (x, y) in enumerate(zip(wa, wb, strict=True)):
            assert torch.equal(x, y), f"{label} step {step} weight {i}"
        if sa is None or sb is None:
            continue
        for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
            assert x.keys() == y.keys()
            for name in x:
                assert torch.equal(x[name], y[name]), f"{label} step {step} slot {name} of weight {i}"


# --- cases ------------------------------------------------------------------------------------
VARIANTS = [
    (optimizers.SGD, {}),
    (optimizers.SGD, {"learning_rate": 0.1}),
    (optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9}),
    (optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    (optimizers.SGD, {"learning_rate": 0.05, "momentum": 0.5, "nesterov": True}),
    (optimizers.Adam, {}),
    (optimizers.Adam, {"learning_rate": 0.02}),
    (optimizers.Adam, {"learning_rate": 0.02, "amsgrad": True}),
    (optimizers.Adam, {"learning_rate": 0.02, "beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-2}),
    (optimizers.AdamW, {}),
    (optimizers.AdamW, {"learning_rate": 0.02, "weight_decay": 0.1}),
    (optimizers.AdamW, {"learning_rate": 0.02, "weight_decay": 0.1, "amsgrad": True}),
    (optimizers.RMSprop, {}),
    (optimizers.RMSprop, {"learning_rate": 0.01, "rho": 0.7}),
    (optimizers.RMSprop, {"learning_rate": 0.01, "centered": True}),
    (optimizers.RMSprop, {"learning_rate": 0.01, "momentum": 0.9}),
    (optimizers.RMSprop, {"learning_rate": 0.01, "momentum": 0.9, "centered": True, "epsilon": 1e-3}),
    (optimizers.Adagrad, {}),
    (optimizers.Adagrad, {"learning_rate": 0.1}),
    (optimizers.Adagrad, {"learning_rate": 0.1, "initial_accumulator_value": 0.5, "epsilon": 1e-2}),
]


def case_id(cls, hp) -> str:
    return cls.__name__ + ("-" + "-".join(f"{k}={v}" for k, v in hp.items()) if hp else "-defaults")


VARIANT_IDS = [case_id(cls, hp) for cls, hp in VARIANTS]

BASE = {
    optimizers.SGD: {"learning_rate": 0.1, "momentum": 0.9},
    optimizers.Adam: {"learning_rate": 0.02},
    optimizers.AdamW: {"learning_rate": 0.02},
    optimizers.RMSprop: {"learning_rate": 0.01, "momentum": 0.5},
    optimizers.Adagrad: {"learning_rate": 0.1},
}
TRANSFORMS = [
    {"clipvalue": 0.5},
    {"clipnorm": 1.0},
    {"global_clipnorm": 2.0},
    {"weight_decay": 0.2},
]
TRANSFORM_CASES = [(cls, base | transform) for cls, base in BASE.items() for transform in TRANSFORMS]
TRANSFORM_IDS = [case_id(cls, hp) for cls, hp in TRANSFORM_CASES]


# --- golden trajectories ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["variable", "parameter"])
@pytest.mark.parametrize("cls,hp", VARIANTS, ids=VARIANT_IDS)
def test_builtin_matches_keras_reference(cls, hp, kind):
    weights, grad_seq = initial_weights(), gradient_sequence()
    variables = make_variables(weights, kind)
    optimizer = cls(**hp)
    actual = run_trajectory(optimizer, variables, grad_seq, slot_names_of(cls, hp))
    expected = np_trajectory(cls, hp, weights, grad_seq)
    assert_matches_reference(actual, expected, case_id(cls, hp))
    assert int(optimizer.iterations) == STEPS
    # the weights moved (the comparison is not between two unchanged tensors)
    assert not np.allclose(expected[-1][0][0], weights[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["variable", "parameter"])
@pytest.mark.parametrize("cls,hp", TRANSFORM_CASES, ids=TRANSFORM_IDS)
def test_gradient_transforms_and_weight_decay_match_reference(cls, hp, kind):
    weights, grad_seq = initial_weights(), gradient_sequence()
    variables = make_variables(weights, kind)
    optimizer = cls(**hp)
    actual = run_trajectory(optimizer, variables, grad_seq, slot_names_of(cls, hp))
    expected = np_trajectory(cls, hp, weights, grad_seq)
    assert_matches_reference(actual, expected, case_id(cls, hp))
    # the transform makes a visible difference with these gradients
    plain = np_trajectory(cls, BASE[cls], weights, grad_seq)
    assert not all(np.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(plain[-1][0], expected[-1][0])), (
        "the transform under test has no effect on these gradients"
    )


@pytest.mark.parametrize("cls,hp", VARIANTS + TRANSFORM_CASES, ids=VARIANT_IDS + TRANSFORM_IDS)
def test_multi_tensor_and_per_variable_paths_agree_bitwise(cls, hp):
    weights, grad_seq = initial_weights(), gradient_sequence()
    names = slot_names_of(cls, hp)
    fast = cls(**hp)
    slow = cls(**hp)
    slow._multi_tensor = False
    a = run_trajectory(fast, make_variables(weights, "variable"), grad_seq, names)
    b = run_trajectory(slow, make_variables(weights, "variable"), grad_seq, names)
    assert_bitwise_equal(a, b, case_id(cls, hp))
    # plain parameters follow the very same arithmetic
    c = run_trajectory(cls(**hp), make_variables(weights, "parameter"), grad_seq, names)
    assert_bitwise_equal(a, c, case_id(cls, hp) + " (parameters)")


@pytest.mark.parametrize("cls", list(KIND))
def test_builtins_take_the_multi_tensor_path_unless_switched_off(cls, monkeypatch):
    calls = {"many": 0, "step": 0}
    original_many, original_step = cls._update_many, cls.update_step

    def update_many(self, *args, **kwargs):
        calls["many"] += 1
        return original_many(self, *args, **kwargs)

    def update_step(self, *args, **kwargs):
        calls["step"] += 1
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(cls, "_update_many", update_many)
    monkeypatch.setattr(cls, "update_step", update_step)
    variables = make_variables(initial_weights(), "variable")
    grads = [torch.from_numpy(g) for g in gradient_sequence()[0]]
    cls().apply_gradients(zip(grads, variables))
    assert calls == {"many": 1, "step": 0}  # one kernel group: same device, same dtype
    slow = cls()
    slow._multi_tensor = False
    slow.apply_gradients(zip(grads, variables))
    assert calls == {"many": 1, "step": len(variables)}


# --- learning rates in the update ---------------------------------------------------------------
class RecordingSGD(optimizers.Optimizer):
    """Plain gradient descent that records the learning rate each update receives."""

    def __init__(self, learning_rate, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.seen: list = []

    def update_step(self, gradient, variable, learning_rate):
        self.seen.append(learning_rate)
        variable.assign_sub(gradient * learning_rate)


def test_update_step_receives_schedule_value_at_iterations():
    schedule = schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
    optimizer = RecordingSGD(schedule)
    variable = ds.Variable(torch.zeros(2), name="x")
    for step in range(STEPS):
        assert int(optimizer.iterations) == step
        optimizer.apply_gradients([(torch.ones(2), variable)])
    assert optimizer.seen == pytest.approx([schedule(step) for step in range(STEPS)], rel=1e-12)
    expected = -sum(schedule(step) for step in range(STEPS))
    np.testing.assert_allclose(variable.numpy(), [expected, expected], rtol=1e-6)


def test_update_step_receives_callable_value_at_iterations():
    seen_steps = []

    def rate(step):
        seen_steps.append(step)
        return 1.0 / (step + 1)

    optimizer = RecordingSGD(rate)
    variable = ds.Variable(torch.zeros(1), name="x")
    for _ in range(5):
        optimizer.apply_gradients([(torch.ones(1), variable)])
    assert optimizer.seen == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert sorted(set(seen_steps)) == [0, 1, 2, 3, 4]


SCHEDULE_CASES = [
    (optimizers.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    (optimizers.Adam, {}),
    (optimizers.AdamW, {"weight_decay": 0.1}),
    (optimizers.RMSprop, {"centered": True}),
    (optimizers.Adagrad, {}),
]


@pytest.mark.parametrize("cls,hp", SCHEDULE_CASES, ids=[case_id(c, h) for c, h in SCHEDULE_CASES])
def test_builtin_with_schedule_uses_rate_at_iterations(cls, hp):
    schedule = schedules.PiecewiseConstantDecay([0, 2, 3], [0.1, 0.05, 0.02, 0.005])
    weights, grad_seq = initial_weights(), gradient_sequence()
    optimizer = cls(learning_rate=schedule, **hp)
    actual = run_trajectory(optimizer, make_variables(weights, "variable"), grad_seq, slot_names_of(cls, hp))
    expected = np_trajectory(cls, hp, weights, grad_seq, learning_rate=schedule)
    assert_matches_reference(actual, expected, case_id(cls, hp))
    # a schedule shifted by one step gives a different trajectory: the test sees the step used
    shifted = np_trajectory(cls, hp, weights, grad_seq, learning_rate=lambda step: schedule(step + 1))
    assert not np.allclose(shifted[-1][0][0], expected[-1][0][0], rtol=RTOL, atol=ATOL)


# --- under every strategy -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls,hp",
    [
        (optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9, "global_clipnorm": 2.0}),
        (optimizers.Adam, {}),
        (optimizers.AdamW, {"learning_rate": 0.02, "weight_decay": 0.1, "clipnorm": 1.0}),
        (optimizers.RMSprop, {"learning_rate": 0.01, "momentum": 0.9, "centered": True}),
        (optimizers.Adagrad, {"learning_rate": 0.1, "clipvalue": 0.5}),
    ],
    ids=["sgd", "adam", "adamw", "rmsprop", "adagrad"],
)
def test_builtin_in_replica_context_sums_gradients_and_matches_reference(strategy, cls, hp):
    weights, grad_seq = initial_weights(), gradient_sequence()
    with strategy.scope():
        variables = [ds.Variable(torch.from_numpy(w.copy()), name=f"w{i}") for i, w in enumerate(weights)]
        optimizer = cls(**hp)
    count = strategy.num_replicas_in_sync

    def step(grads):
        # every replica holds 1/count of the gradient (exact for count in {1, 2})
        optimizer.apply_gradients(zip([g / count for g in grads], variables))

    for grads in grad_seq:
        tensors = [torch.from_numpy(g.copy()) for g in grads]
        strategy.run(lambda tensors=tensors: step(tensors))
    expected = np_trajectory(cls, hp, weights, grad_seq)[-1][0]
    assert int(optimizer.iterations) == STEPS
    for variable, ref in zip(variables, expected):
        for component in strategy.experimental_local_results(variable):
            np.testing.assert_allclose(component.numpy().astype(np.float64), ref, rtol=RTOL, atol=ATOL)


# --- from_torch --------------------------------------------------------------------------------
TORCH_CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    (torch.optim.Adagrad, {"lr": 0.1}),
]
TORCH_IDS = [f"{c.__name__}-" + "-".join(f"{k}={v}" for k, v in kw.items()) for c, kw in TORCH_CASES]


def torch_reference(optimizer_class, kwargs, weights, grad_seq) -> list:
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in weights]
    optimizer = optimizer_class(params, **kwargs)
    out = []
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        optimizer.step()
        out.append([p.detach().clone() for p in params])
    return out


def assert_trajectories_equal(actual, expected, label=""):
    assert len(actual) == len(expected) >= 5
    for step, (a, e) in enumerate(zip(actual, expected)):
        for i, (x, y) in enumerate(zip(a, e, strict=True)):
            assert torch.equal(x, y), f"{label} step {step} weight {i}: max diff {(x - y).abs().max().item()}"


@pytest.mark.parametrize("where", ["default", "one_device"])
@pytest.mark.parametrize("optimizer_class,kwargs", TORCH_CASES, ids=TORCH_IDS)
def test_from_torch_equals_bare_torch_optimizer(optimizer_class, kwargs, where):
    weights, grad_seq = initial_weights(), gradient_sequence()
    expected = torch_reference(optimizer_class, kwargs, weights, grad_seq)
    actual = []
    if where == "default":
        variables = make_variables(weights, "variable")
        optimizer = optimizers.from_torch(optimizer_class, **kwargs)
        for grads in grad_seq:
            optimizer.apply_gradients(zip([torch.from_numpy(g.copy()) for g in grads], variables))
            actual.append([v.value().detach().clone() for v in variables])
    else:
        strategy = make_strategy("one_device")
        with strategy.scope():
            variables = [ds.Variable(torch.from_numpy(w.copy()), name=f"w{i}") for i, w in enumerate(weights)]
            optimizer = optimizers.from_torch(optimizer_class, **kwargs)
        for grads in grad_seq:
            tensors = [torch.from_numpy(g.copy()) for g in grads]
            strategy.run(lambda tensors=tensors: optimizer.apply_gradients(zip(tensors, variables)))
            actual.append([v.value().detach().clone() for v in variables])
    assert_trajectories_equal(actual, expected, optimizer_class.__name__)
    assert int(optimizer.iterations) == STEPS
    assert not torch.equal(expected[-1][0], torch.from_numpy(weights[0]))


@pytest.mark.parametrize("optimizer_class,kwargs", TORCH_CASES[1:4], ids=TORCH_IDS[1:4])
def test_from_torch_on_plain_parameters_equals_bare_torch_optimizer(optimizer_class, kwargs):
    weights, grad_seq = initial_weights(), gradient_sequence()
    expected = torch_reference(optimizer_class, kwargs, weights, grad_seq)
    params = make_variables(weights, "parameter")
    optimizer = optimizers.from_torch(optimizer_class, **kwargs)
    actual = []
    for grads in grad_seq:
        optimizer.apply_gradients(zip([torch.from_numpy(g.copy()) for g in grads], params))
        actual.append([p.detach().clone() for p in params])
    assert_trajectories_equal(actual, expected, optimizer_class.__name__)
    assert all(p.grad is None for p in params)


def test_from_torch_learning_rate_property_and_setter():
    assert optimizers.from_torch(torch.optim.SGD, lr=0.3).learning_rate == pytest.approx(0.3)
    assert optimizers.from_torch(torch.optim.Adam).learning_rate == pytest.approx(0.001)  # torch's default
    weights, grad_seq = initial_weights(), gradient_sequence()
    variables = make_variables(weights, "variable")
    optimizer = optimizers.from_torch(torch.optim.Adam, lr=0.01)
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in weights]
    reference = torch.optim.Adam(params, lr=0.01)
    for step, grads in enumerate(grad_seq):
        if step == 3:
            optimizer.learning_rate = 0.05
            for group in reference.param_groups:
                group["lr"] = 0.05
            assert optimizer.learning_rate == pytest.approx(0.05)
        optimizer.apply_gradients(zip([torch.from_numpy(g.copy()) for g in grads], variables))
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        reference.step()
        for v, p in zip(variables, params):
            assert torch.equal(v.value(), p.detach()), f"step {step}"


def test_from_torch_kwargs_are_validated_by_torch():
    with pytest.raises(ValueError):
        optimizers.from_torch(torch.optim.Adam, lr=-1.0)
    with pytest.raises(ValueError):
        optimizers.from_torch(torch.optim.Adam, betas=(1.5, 0.999))
    with pytest.raises(ValueError):
        optimizers.from_torch(torch.optim.SGD, lr=0.1, nesterov=True)  # nesterov needs momentum
    with pytest.raises(TypeError):
        optimizers.from_torch(torch.optim.SGD, lr=0.1, no_such_argument=1)
    with pytest.raises(TypeError):
        optimizers.from_torch(torch.nn.Linear)


@pytest.mark.parametrize("cls,hp", VARIANTS[2:], ids=VARIANT_IDS[2:])
def test_mixed_dtypes_group_by_dtype_and_match_reference(cls, hp):
    weights, grad_seq = initial_weights(), gradient_sequence()
    names = slot_names_of(cls, hp)
    dtypes = [torch.float32, torch.float64, torch.float32]

    def variables():
        return [
            ds.Variable(torch.from_numpy(w.copy()).to(dtype), name=f"w{i}")
            for i, (w, dtype) in enumerate(zip(weights, dtypes))
        ]

    def run(optimizer, vs):
        out = []
        for grads in grad_seq:
            tensors = [torch.from_numpy(g.copy()).to(dtype) for g, dtype in zip(grads, dtypes)]
            optimizer.apply_gradients(zip(tensors, vs))
            out.append(snapshot(optimizer, vs, names))
        return out

    fast_vars, slow_vars = variables(), variables()
    slow = cls(**hp)
    slow._multi_tensor = False
    fast_out, slow_out = run(cls(**hp), fast_vars), run(slow, slow_vars)
    assert_bitwise_equal(fast_out, slow_out, case_id(cls, hp))
    for v, dtype in zip(fast_vars, dtypes):
        assert v.dtype == dtype
    expected = np_trajectory(cls, hp, weights, grad_seq)
    for step, ((ws, _), (refs, _)) in enumerate(zip(fast_out, expected)):
        for i, (w, r) in enumerate(zip(ws, refs)):
            np.testing.assert_allclose(w.double().numpy(), r, rtol=RTOL, atol=ATOL, err_msg=f"step {step} weight {i}")


@pytest.mark.parametrize(
    "optimizer_class,kwargs",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})],
    ids=["sgd", "adam"],
)
def test_from_torch_in_replica_context_equals_bare_torch(strategy, optimizer_class, kwargs):
    weights, grad_seq = initial_weights(), gradient_sequence()
    expected = torch_reference(optimizer_class, kwargs, weights, grad_seq)
    with strategy.scope():
        variables = [ds.Variable(torch.from_numpy(w.copy()), name=f"w{i}") for i, w in enumerate(weights)]
        optimizer = optimizers.from_torch(optimizer_class, **kwargs)
    count = strategy.num_replicas_in_sync
    for step, grads in enumerate(grad_seq):
        # every replica holds its own 1/count of the gradient: the halves sum back exactly
        tensors = [torch.from_numpy(g.copy()) for g in grads]
        strategy.run(lambda tensors=tensors: optimizer.apply_gradients(zip([t / count for t in tensors], variables)))
        for variable, ref in zip(variables, expected[step]):
            for component in strategy.experimental_local_results(variable):
                assert torch.equal(component.value(), ref), f"step {step} {variable.name}"
    assert int(optimizer.iterations) == STEPS


@pytest.mark.parametrize("transform", TRANSFORMS[:3], ids=["clipvalue", "clipnorm", "global_clipnorm"])
@pytest.mark.parametrize(
    "optimizer_class,kwargs",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})],
    ids=["sgd", "adam"],
)
def test_from_torch_applies_gradient_transforms_before_the_torch_step(optimizer_class, kwargs, transform):
    weights, grad_seq = initial_weights(), gradient_sequence()
    transformed = [
        [g.astype(np.float32) for g in np_transform([g.astype(np.float64) for g in grads], **transform)]
        for grads in grad_seq
    ]
    expected = torch_reference(optimizer_class, kwargs, weights, transformed)
    unclipped = torch_reference(optimizer_class, kwargs, weights, grad_seq)
    variables = make_variables(weights, "variable")
    optimizer = optimizers.from_torch(optimizer_class, **kwargs, **transform)
    for step, grads in enumerate(grad_seq):
        optimizer.apply_gradients(zip([torch.from_numpy(g.copy()) for g in grads], variables))
        for i, (v, ref) in enumerate(zip(variables, expected[step])):
            torch.testing.assert_close(v.value().detach(), ref, rtol=RTOL, atol=ATOL, msg=f"step {step} weight {i}")
    assert not all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(expected[-1], unclipped[-1]))
