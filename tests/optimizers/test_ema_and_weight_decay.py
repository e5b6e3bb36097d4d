"""Weight-decay exclusions and moving averages of the weights (Keras 3's ``exclude_from_weight_decay``,
``use_ema``/``ema_momentum``/``ema_overwrite_frequency``, ``finalize_variable_values``).

Oracles: float64 NumPy references of Keras 3's rules (base_optimizer.py): decoupled decay
``w -= w * weight_decay * lr`` before the update, for the variables not excluded; after the
update ``average = m * average + (1 - m) * w`` with ``m = 0`` at ``iterations == 0``, and
``w = average`` after the update whose ``iterations + 1`` is a multiple of the overwrite
frequency. Then the same through ``strategy.run`` under Mirrored(2) and CentralStorage(2), the
multi-tensor path against the per-variable path (bit for bit), ``from_torch`` against torch's
own optimizer with two param groups (bit for bit), and state round trips.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import Lion, make_strategy

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies.values import local_results

pytestmark = pytest.mark.timeout(60)

NAMES = ["dense/kernel", "dense/bias", "norm/gamma"]
SHAPES = [(3, 4), (4,), (4,)]
STEPS = 7
RTOL, ATOL = 1e-5, 1e-6


def initial() -> list:
    rng = np.random.RandomState(0)
    return [(0.5 * rng.randn(*shape)).astype(np.float32) for shape in SHAPES]


def gradients(step: int, replicas: int = 1) -> list:
    """Each replica's gradients at ``step`` (their sum is the step's aggregated gradient)."""
    rng = np.random.RandomState(100 + step)
    total = [rng.randn(*shape).astype(np.float32) for shape in SHAPES]
    if replicas == 1:
        return [total]
    parts = [[(g / replicas).astype(np.float32) for g in total] for _ in range(replicas - 1)]
    parts.append([g - sum(p[i] for p in parts) for i, g in enumerate(total)])
    return parts


# --- NumPy references of Keras 3 -------------------------------------------------------------------
def sgd_rule(lr, momentum):
    def step(w, g, slots, t):
        m = slots.setdefault("momentum", np.zeros_like(w))
        m[...] = momentum * m - lr * g
        return w + m

    return step


def adam_rule(lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    def step(w, g, slots, t):
        m = slots.setdefault("m", np.zeros_like(w))
        v = slots.setdefault("v", np.zeros_like(w))
        alpha = lr * math.sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1))
        m += (g - m) * (1 - beta_1)
        v += (g * g - v) * (1 - beta_2)
        return w - m * alpha / (np.sqrt(v) + epsilon)

    return step


def lion_rule(lr, beta_1=0.9, beta_2=0.99):
    def step(w, g, slots, t):
        m = slots.setdefault("m", np.zeros_like(w))
        update = np.sign(m * beta_1 + g * (1 - beta_1))
        m[...] = m * beta_2 + g * (1 - beta_2)
        return w - lr * update

    return step


def reference(rule, lr, steps, *, decay=None, decayed=(True, True, True), ema=None, frequency=None):
    """Keras 3's apply(): decay, update, moving average, overwrite, count. Returns (weights, averages)."""
    weights = [w.astype(np.float64) for w in initial()]
    slots = [{} for _ in weights]
    averages = [np.zeros_like(w) for w in weights]
    for t in range(steps):
        grads = [g.astype(np.float64) for g in gradients(t)[0]]
        for i, g in enumerate(grads):
            if decay and decayed[i]:
                weights[i] = weights[i] - weights[i] * decay * lr
            weights[i] = rule(weights[i], g, slots[i], t)
        if ema is not None:
            momentum = ema if t != 0 else 0.0
            averages = [momentum * a + (1 - momentum) * w for a, w in zip(averages, weights)]
            if frequency and (t + 1) % frequency == 0:
                weights = [a.copy() for a in averages]
    return weights, averages


# --- our side ----------------------------------------------------------------------------------------
CASES = {
    "sgd_momentum": (lambda **kw: optimizers.SGD(0.1, momentum=0.9, **kw), sgd_rule(0.1, 0.9), 0.1),
    "adamw": (lambda **kw: optimizers.AdamW(0.05, **kw), adam_rule(0.05), 0.05),
    "lion_user_subclass": (lambda **kw: Lion(0.01, **kw), lion_rule(0.01), 0.01),
}


def make_variables(strategy):
    with strategy.scope():
        return [ds.Variable(torch.tensor(w), name=name) for w, name in zip(initial(), NAMES)]


def train(strategy, optimizer, variables, steps=STEPS, first=0):
    """``steps`` steps through ``strategy.run``: each replica applies its part of the gradients."""
    replicas = strategy.num_replicas_in_sync

    def step(parts):
        ctx = ds.get_replica_context()
        grads = [torch.tensor(g) for g in parts[ctx.replica_id_in_sync_group]]
        optimizer.apply_gradients(zip(grads, variables))

    for t in range(first, first + steps):
        strategy.run(step, args=(gradients(t, replicas),))


def copies(variable) -> list:
    return [(c._read() if isinstance(c, ds.Variable) else c).detach() for c in local_results(variable)]


def averages_of(optimizer, variables) -> list:
    return [optimizer.get_slot(v, "average") for v in variables]


def assert_matches(values, expected, what):
    for i, (value, want) in enumerate(zip(values, expected)):
        for copy in copies(value):
            np.testing.assert_allclose(copy.numpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"{what} {NAMES[i]}")


# --- weight-decay exclusions -------------------------------------------------------------------------
@pytest.mark.parametrize("by", ["names", "variables"])
@pytest.mark.parametrize("case", ["sgd_momentum", "adamw", "lion_user_subclass"])
def test_exclusions_keep_variables_out_of_the_decay(case, by):
    make, rule, lr = CASES[case]
    strategy = make_strategy("default")
    variables = make_variables(strategy)
    optimizer = make(weight_decay=0.2)
    if by == "names":
        optimizer.exclude_from_weight_decay(var_names=["bias", "norm"])  # substrings of the names
    else:
        optimizer.exclude_from_weight_decay(var_list=variables[1:])
    train(strategy, optimizer, variables)
    weights, _ = reference(rule, lr, STEPS, decay=0.2, decayed=(True, False, False))
    assert_matches(variables, weights, f"{case} by {by}")
    # and the excluded ones really differ from decayed training
    decayed_everywhere, _ = reference(rule, lr, STEPS, decay=0.2)
    assert not np.allclose(copies(variables[1])[0].numpy(), decayed_everywhere[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2", "central_storage2", "multi_worker1x2"])
def test_names_match_as_plain_substrings_and_a_module_parameter_selects_its_variable(strategy_name):
    strategy = make_strategy(strategy_name)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    dm = strategy.distribute_module(model)
    optimizer = optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[model[1].weight], var_names=["0.bias", "2.b.as"])
    with strategy.scope():
        optimizer.build(dm.trainable_variables)
    excluded = sorted(v.name for v in dm.trainable_variables if id(v) in optimizer._weight_decay.excluded)
    assert excluded == ["0.bias", "1.weight"]  # "2.b.as" is no regular expression: 2.bias stays decayed


def test_exclusions_must_come_before_the_optimizer_builds():
    variables = make_variables(make_strategy("default"))
    optimizer = optimizers.AdamW(0.01)
    optimizer.apply_gradients(zip([torch.ones(s) for s in SHAPES], variables))
    with pytest.raises(ValueError, match="before .* is built"):
        optimizer.exclude_from_weight_decay(var_names=["bias"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"var_names": "bias"}, "list of strings"),
        ({"var_names": ["bias", 3]}, "non-empty strings"),
        ({"var_names": [""]}, "non-empty strings"),
        ({"var_list": ["bias"]}, "pass names as var_names"),
    ],
)
def test_bad_exclusions_say_what_to_pass(kwargs, message):
    with pytest.raises(TypeError, match=message):
        optimizers.AdamW(0.01).exclude_from_weight_decay(**kwargs)


# --- moving averages ---------------------------------------------------------------------------------
@pytest.mark.parametrize("frequency", [None, 3])
@pytest.mark.parametrize("case", ["sgd_momentum", "adamw", "lion_user_subclass"])
@pytest.mark.parametrize("strategy_name", ["default", "mirrored2", "central_storage2"])
def test_moving_averages_follow_keras(case, frequency, strategy_name):
    make, rule, lr = CASES[case]
    strategy = make_strategy(strategy_name)
    variables = make_variables(strategy)
    optimizer = make(weight_decay=0.2, use_ema=True, ema_momentum=0.7, ema_overwrite_frequency=frequency)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    train(strategy, optimizer, variables)
    weights, averages = reference(rule, lr, STEPS, decay=0.2, decayed=(True, False, True), ema=0.7, frequency=frequency)
    assert_matches(variables, weights, f"{case} weights")
    assert_matches(averages_of(optimizer, variables), averages, f"{case} averages")
    for variable, average in zip(variables, averages_of(optimizer, variables)):
        # colocated with the variable: as many copies, on the same devices, all equal
        assert [c.device for c in copies(average)] == [c.device for c in copies(variable)]
        assert all(torch.equal(c, copies(average)[0]) for c in copies(average))


def test_the_first_update_sets_the_average_to_the_weights():
    variables = make_variables(make_strategy("default"))
    optimizer = optimizers.SGD(0.1, use_ema=True, ema_momentum=0.99)
    optimizer.apply_gradients(zip([torch.ones(s) for s in SHAPES], variables))
    for variable, average in zip(variables, averages_of(optimizer, variables)):
        assert torch.equal(average.value(), variable.value())


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2", "central_storage2"])
@pytest.mark.parametrize("name", ["sgd_momentum", "adamw"])
def test_multi_tensor_path_equals_the_per_variable_path_bit_for_bit(strategy_name, name):
    results = []
    for multi_tensor in (True, False):
        strategy = make_strategy(strategy_name)
        variables = make_variables(strategy)
        optimizer = CASES[name][0](weight_decay=0.2, use_ema=True, ema_momentum=0.7, ema_overwrite_frequency=3)
        optimizer.exclude_from_weight_decay(var_names=["gamma"])
        optimizer._multi_tensor = multi_tensor
        train(strategy, optimizer, variables)
        results.append([copies(v) for v in variables] + [copies(a) for a in averages_of(optimizer, variables)])
    for fast, slow in zip(*results):
        for a, b in zip(fast, slow):
            assert torch.equal(a, b)


def test_state_round_trip_continues_identically():
    def run(split: bool):
        strategy = make_strategy("mirrored2")
        variables = make_variables(strategy)
        make = CASES["adamw"][0]
        options = {"use_ema": True, "ema_momentum": 0.7, "ema_overwrite_frequency": 4}
        optimizer = make(**options)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        train(strategy, optimizer, variables, steps=3)
        if split:
            state = optimizer.state_dict()
            assert set(state["slots"][0]) == {"average", "momentum", "velocity"}
            optimizer = make(**options)
            optimizer.exclude_from_weight_decay(var_names=["bias"])
            optimizer.load_state_dict(state)
        train(strategy, optimizer, variables, steps=4, first=3)
        return [copies(v) for v in variables] + [copies(a) for a in averages_of(optimizer, variables)]

    for a, b in zip(run(False), run(True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_turning_use_ema_on_or_off_when_resuming_loads_the_state():
    strategy = make_strategy("default")
    variables = make_variables(strategy)
    plain = optimizers.SGD(0.1, momentum=0.9)
    train(strategy, plain, variables, steps=2)
    averaging = optimizers.SGD(0.1, momentum=0.9, use_ema=True)
    averaging.load_state_dict(plain.state_dict())  # no averages saved: they start at the weights
    train(strategy, averaging, variables, steps=1, first=2)
    state = averaging.state_dict()
    assert int(averaging.iterations) == 3 and set(state["slots"][0]) == {"average", "momentum"}
    again = optimizers.SGD(0.1, momentum=0.9)
    again.load_state_dict(state)  # the averages are dropped, the momentum is kept
    again.build(variables)
    assert set(again.state_dict()["slots"][0]) == {"momentum"}
    assert torch.equal(again.state_dict()["slots"][0]["momentum"], state["slots"][0]["momentum"])


def test_loading_without_averages_uses_the_current_weights_as_the_average():
    strategy = make_strategy("default")
    variables = make_variables(strategy)
    plain = optimizers.SGD(0.1)
    train(strategy, plain, variables, steps=2)
    averaging = optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    averaging.load_state_dict(plain.state_dict())
    start = [v.value().clone() for v in variables]
    averaging.build(variables)
    slots = averaging.state_dict()["slots"]  # restores the loaded (empty) entries: averages = current weights
    for position, value in enumerate(start):
        assert torch.equal(slots[position]["average"], value)
        assert torch.equal(averaging.get_slot(variables[position], "average").value(), value)


# --- from_torch ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, kwargs",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05}), (torch.optim.AdamW, {"lr": 0.05})],
)
def test_from_torch_exclusions_are_a_param_group_without_decay(cls, kwargs):
    strategy = make_strategy("mirrored2")
    variables = make_variables(strategy)
    optimizer = optimizers.from_torch(cls, use_ema=True, ema_momentum=0.7, **kwargs)
    optimizer.exclude_from_weight_decay(var_names=["kernel"])  # the first variable: torch's order changes
    train(strategy, optimizer, variables)
    params = [torch.tensor(w).requires_grad_() for w in initial()]
    reference_optimizer = cls([{"params": params[1:]}, {"params": params[:1], "weight_decay": 0.0}], **kwargs)
    averages = [torch.zeros_like(p) for p in params]
    for t in range(STEPS):
        for p, g in zip(params, gradients(t)[0]):
            p.grad = torch.tensor(g)
        reference_optimizer.step()
        momentum = 0.7 if t else 0.0
        with torch.no_grad():
            averages = [momentum * a + (1 - momentum) * p for a, p in zip(averages, params)]
    for variable, param in zip(variables, params):
        assert all(torch.equal(c, param.detach()) for c in copies(variable))
    for average, want in zip(averages_of(optimizer, variables), averages):
        for c in copies(average):
            torch.testing.assert_close(c, want, rtol=RTOL, atol=ATOL)
    # the state keys torch's entries by variable position, whatever torch's own numbering
    state = optimizer.state_dict()
    key = "momentum_buffer" if cls is torch.optim.SGD else "exp_avg"
    assert [list(state["torch_state"][i][key].shape) for i in range(3)] == [list(s) for s in SHAPES]
    assert set(state["slots"]) == {0, 1, 2} and set(state["slots"][0]) == {"average"}


def test_from_torch_state_round_trip_with_exclusions_continues_identically():
    def run(split: bool):
        strategy = make_strategy("default")
        variables = make_variables(strategy)
        make = lambda: optimizers.from_torch(torch.optim.AdamW, lr=0.05, use_ema=True, ema_overwrite_frequency=5)  # noqa: E731
        optimizer = make()
        optimizer.exclude_from_weight_decay(var_names=["kernel"])
        train(strategy, optimizer, variables, steps=3)
        if split:
            state = optimizer.state_dict()
            optimizer = make()
            optimizer.exclude_from_weight_decay(var_names=["kernel"])
            optimizer.load_state_dict(state)
        train(strategy, optimizer, variables, steps=4, first=3)
        return [v.value() for v in variables] + [a.value() for a in averages_of(optimizer, variables)]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


# --- finalize, swapping, configuration ---------------------------------------------------------------
@pytest.mark.parametrize("strategy_name", ["default", "mirrored2", "central_storage2"])
def test_averaged_weights_swaps_in_and_back_and_finalize_writes_the_averages(strategy_name):
    strategy = make_strategy(strategy_name)
    variables = make_variables(strategy)
    inner = optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5)
    optimizer = optimizers.LossScaleOptimizer(inner)  # forwards to the inner optimizer
    train(strategy, optimizer, variables, steps=3)
    trained = [[c.clone() for c in copies(v)] for v in variables]
    averages = [copies(a)[0].clone() for a in averages_of(inner, variables)]
    with optimizer.averaged_weights():
        for variable, average in zip(variables, averages):
            assert all(torch.equal(c, average) for c in copies(variable))
    for variable, values in zip(variables, trained):
        assert all(torch.equal(c, v) for c, v in zip(copies(variable), values))
    optimizer.finalize_variable_values(variables)
    for variable, average in zip(variables, averages):
        assert all(torch.equal(c, average) for c in copies(variable))


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_the_public_swap_methods_swap_in_out_and_keep(strategy_name):
    strategy = make_strategy(strategy_name)
    variables = make_variables(strategy)
    inner = optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.5)
    optimizer = optimizers.LossScaleOptimizer(inner)  # forwards to the inner optimizer
    train(strategy, optimizer, variables, steps=3)
    trained = [[c.clone() for c in copies(v)] for v in variables]
    averages = [copies(a)[0].clone() for a in averages_of(inner, variables)]
    assert not optimizer.averages_swapped_in and optimizer.trained_values() == {}
    optimizer.swap_in_averages()
    assert optimizer.averages_swapped_in and inner.averages_swapped_in
    assert all(torch.equal(optimizer.trained_values()[id(v)], t[0]) for v, t in zip(variables, trained))
    assert all(torch.equal(c, a) for v, a in zip(variables, averages) for c in copies(v))
    with pytest.raises(RuntimeError, match=r"swap_in_averages\(\): the averages are swapped in already"):
        optimizer.swap_in_averages()
    optimizer.swap_out_averages()
    assert not optimizer.averages_swapped_in
    assert all(torch.equal(c, t) for v, ts in zip(variables, trained) for c, t in zip(copies(v), ts))
    optimizer.swap_in_averages()
    optimizer.keep_averages()  # the averages stay; nothing to put back
    optimizer.swap_out_averages()
    assert all(torch.equal(c, a) for v, a in zip(variables, averages) for c in copies(v))
    with pytest.raises(ValueError, match="SwapEMAWeights needs an optimizer with use_ema=True"):
        optimizers.SGD(0.1).swap_in_averages(caller="SwapEMAWeights")


def test_without_use_ema_finalize_does_nothing_and_averaged_weights_says_why():
    variables = make_variables(make_strategy("default"))
    optimizer = optimizers.SGD(0.1)
    optimizer.apply_gradients(zip([torch.ones(s) for s in SHAPES], variables))
    before = [v.value().clone() for v in variables]
    optimizer.finalize_variable_values(variables)
    assert all(torch.equal(v.value(), b) for v, b in zip(variables, before))
    with pytest.raises(ValueError, match="use_ema=True"):
        with optimizer.averaged_weights():
            pass


def test_config_round_trip_keeps_the_ema_arguments():
    optimizer = optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=10)
    config = optimizer.get_config()
    assert (config["use_ema"], config["ema_momentum"], config["ema_overwrite_frequency"]) == (True, 0.9, 10)
    again = optimizers.get({"class_name": "Adam", "config": config})
    assert (again.use_ema, again.ema_momentum, again.ema_overwrite_frequency) == (True, 0.9, 10)
    torch_config = optimizers.from_torch(torch.optim.SGD, lr=0.1, use_ema=True).get_config()
    assert optimizers.get({"class_name": "TorchOptimizer", "config": torch_config}).use_ema


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"use_ema": 1}, TypeError),
        ({"ema_momentum": 1.5}, ValueError),
        ({"ema_momentum": -0.1}, ValueError),
        ({"ema_overwrite_frequency": 0}, ValueError),
        ({"ema_overwrite_frequency": 2.0}, ValueError),
    ],
)
def test_bad_ema_arguments_are_refused(kwargs, error):
    with pytest.raises(error, match="ema"):
        optimizers.SGD(0.1, **kwargs)


def test_a_loss_scale_optimizer_gives_exclusions_and_swaps_to_its_inner_optimizer():
    variables = make_variables(make_strategy("default"))
    inner = optimizers.AdamW(0.05, weight_decay=0.2, use_ema=True)
    wrapped = optimizers.LossScaleOptimizer(inner)
    wrapped.exclude_from_weight_decay(var_names=["bias"])
    train(make_strategy("default"), wrapped, variables, steps=2)
    assert [v.name for v in variables if id(v) in inner._weight_decay.excluded] == ["dense/bias"]
    with wrapped.averaged_weights():
        assert inner.averages_swapped_in and "_swapped" not in vars(wrapped)
    assert not inner.averages_swapped_in
