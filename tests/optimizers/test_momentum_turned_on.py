"""SGD's and RMSprop's ``momentum`` set above 0 after the first updates (``TorchLRScheduler`` with
``OneCycleLR`` does it, as torch's ``momentum`` may change in a plain torch loop): the momentum slots are
made at the next update under every strategy, on both update paths, and in ``state_dict()``; states with
or without them load either way, as torch's momentum buffers do.

Reference: Keras 3's SGD formula (``m = momentum * m - lr * g; w += m``, ``m`` from 0) in NumPy, and an
optimizer made with its momentum slots from the start.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import optimizers

pytestmark = pytest.mark.timeout(60)

SHAPES = [(3, 4), (5,)]
STEPS_WITHOUT, STEPS_WITH = 2, 3


def gradients(step: int) -> list:
    rng = np.random.RandomState(step)
    return [torch.from_numpy(rng.randn(*shape).astype(np.float32)) for shape in SHAPES]


def make_variables(strategy) -> list:
    with strategy.scope():
        return [ds.Variable(torch.full(shape, 0.5), name=f"v{i}") for i, shape in enumerate(SHAPES)]


def apply(strategy, optimizer, variables, step: int) -> None:
    grads = gradients(step)

    def replica_step():  # every replica gives the same gradient: the sum is R times it
        count = strategy.num_replicas_in_sync
        optimizer.apply_gradients(zip([g / count for g in grads], variables))

    strategy.run(replica_step)


def turned_on(make, momentum, strategy_name="default", per_variable=False):
    """``STEPS_WITHOUT`` updates with momentum 0, then ``STEPS_WITH`` with ``momentum``: the weights, the optimizer."""
    strategy = make_strategy(strategy_name)
    variables = make_variables(strategy)
    optimizer = make()
    if per_variable:
        optimizer._multi_tensor = False  # private switch: the fast path is chosen automatically
    for step in range(STEPS_WITHOUT + STEPS_WITH):
        if step == STEPS_WITHOUT:
            optimizer.momentum = momentum
        apply(strategy, optimizer, variables, step)
    with strategy.scope():
        copies = [strategy.experimental_local_results(v) for v in variables]
    for per_copy in copies:  # every copy of every variable alike
        assert all(torch.equal(c.value(), per_copy[0].value()) for c in per_copy)
    return [c[0].value().detach().clone() for c in copies], optimizer


def keras_sgd_reference(momentum: float, lr: float = 0.1) -> list:
    weights = [np.full(shape, 0.5, dtype=np.float32) for shape in SHAPES]
    buffers = [np.zeros(shape, dtype=np.float32) for shape in SHAPES]
    for step in range(STEPS_WITHOUT + STEPS_WITH):
        for w, m, g in zip(weights, buffers, gradients(step)):
            g = g.numpy()
            if step < STEPS_WITHOUT:
                w -= lr * g
            else:
                m[...] = momentum * m - lr * g
                w += m
    return weights


@pytest.mark.parametrize("per_variable", [False, True], ids=["multi_tensor", "per_variable"])
@pytest.mark.parametrize("strategy_name", ["default", "mirrored2", "central_storage2"])
def test_sgd_momentum_turned_on_later_follows_keras_formula_from_then_on(strategy_name, per_variable):
    weights, optimizer = turned_on(lambda: optimizers.SGD(0.1), 0.9, strategy_name, per_variable)
    for got, want in zip(weights, keras_sgd_reference(0.9)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    assert all(set(slots) == {"momentum"} for slots in optimizer.state_dict()["slots"].values())


@pytest.mark.parametrize("per_variable", [False, True], ids=["multi_tensor", "per_variable"])
@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_rmsprop_momentum_turned_on_later_equals_slots_made_from_the_start(strategy_name, per_variable):
    later, optimizer = turned_on(lambda: optimizers.RMSprop(0.01), 0.5, strategy_name, per_variable)

    def from_the_start():  # momentum slots made at the first update, left alone while the momentum is 0
        made = optimizers.RMSprop(0.01, momentum=0.5)
        made.momentum = 0.0
        return made

    reference, _ = turned_on(from_the_start, 0.5, strategy_name, per_variable)
    assert all(torch.equal(a, b) for a, b in zip(later, reference))
    assert all(set(slots) == {"momentum", "velocity"} for slots in optimizer.state_dict()["slots"].values())


def test_the_slots_are_in_the_state_as_soon_as_the_momentum_is_set():
    variables = make_variables(ds.get_strategy())
    optimizer = optimizers.SGD(0.1)
    optimizer.apply_gradients(zip(gradients(0), variables))
    assert optimizer.state_dict()["slots"] == {0: {}, 1: {}}
    optimizer.momentum = 0.9
    slots = optimizer.state_dict()["slots"]
    assert [sorted(s) for s in slots.values()] == [["momentum"], ["momentum"]]
    assert all(not s["momentum"].any() for s in slots.values())
    with pytest.raises(ValueError, match=r"`momentum` must be a number in \[0, 1\], got 1.5"):
        optimizer.momentum = 1.5


def trained_sgd(momentum: float):
    variables = make_variables(ds.get_strategy())
    optimizer = optimizers.SGD(0.1, momentum=momentum)
    for step in range(2):
        optimizer.apply_gradients(zip(gradients(step), variables))
    return optimizer, variables


def test_a_state_with_momentum_slots_loads_into_sgd_built_without_them():
    source, _ = trained_sgd(0.9)
    target, _ = trained_sgd(0.0)
    target.load_state_dict(source.state_dict())
    for got, want in zip(target.state_dict()["slots"].values(), source.state_dict()["slots"].values()):
        assert torch.equal(got["momentum"], want["momentum"])
    # the slots made by the load are the ones the next update uses
    target.momentum = source.momentum
    for optimizer in (source, target):
        optimizer.apply_gradients(zip(gradients(5), optimizer._variables))
    assert all(
        torch.equal(a["momentum"], b["momentum"])
        for a, b in zip(target.state_dict()["slots"].values(), source.state_dict()["slots"].values())
    )


def test_a_state_without_momentum_slots_starts_them_again_at_zero():
    source, _ = trained_sgd(0.0)
    target, _ = trained_sgd(0.9)
    target.load_state_dict(source.state_dict())
    assert all(not s["momentum"].any() for s in target.state_dict()["slots"].values())


def test_a_slot_that_is_not_optional_is_still_refused():
    source, _ = trained_sgd(0.9)
    state = source.state_dict()
    state["slots"][0]["velocity"] = torch.zeros(SHAPES[0])
    target, _ = trained_sgd(0.0)
    with pytest.raises(ValueError, match=r"variable 0 \('v0'\) has slots \['momentum', 'velocity'\]"):
        target.load_state_dict(state)
    assert target.state_dict()["slots"] == {0: {}, 1: {}}  # nothing made
