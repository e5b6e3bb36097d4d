"""The optimizer's pipeline around its stages: the state layout the strategy gives, each update under its own
strategy, and the shared arguments set after construction (regressions of the pipeline's refactoring)."""

from __future__ import annotations

import pytest
import torch

import replicafit.strategies as ds
from replicafit import optimizers

pytestmark = pytest.mark.timeout(60)


def test_reduced_gradients_reach_every_copy_of_a_mirrored_variable_on_its_device():
    """Gradients applied in cross-replica context, as one tensor per variable, are broadcast to every copy (on
    GPUs each copy's device), also when no stage changes them."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        variable = ds.Variable(torch.ones(3))
    broadcasts = []
    original = strategy.extended.broadcast_to

    def counted(tensor, destinations):
        broadcasts.append(destinations)
        return original(tensor, destinations)

    strategy.extended.broadcast_to = counted
    for optimizer in (optimizers.SGD(0.5), optimizers.from_torch(torch.optim.SGD, lr=0.5)):
        broadcasts.clear()
        with strategy.scope():
            optimizer.apply_gradients([(torch.ones(3), variable)])
        assert broadcasts and broadcasts[0] is variable, type(optimizer).__name__
    for copy in strategy.experimental_local_results(variable):
        assert torch.equal(copy.value(), torch.zeros(3))


def test_an_optimizer_applies_each_update_under_the_strategy_it_is_given_in():
    """A plain parameter updated outside any strategy, then inside one: each update under its own strategy."""
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = optimizers.SGD(0.1, momentum=0.9, use_ema=True)
    optimizer.apply_gradients([(torch.ones(3), parameter)])
    ds.OneDeviceStrategy("cpu").run(lambda: optimizer.apply_gradients([(torch.ones(3), parameter)]))
    assert torch.allclose(parameter.detach(), torch.full((3,), 0.71))  # m = -0.1, then 0.9 * -0.1 - 0.1
    with ds.OneDeviceStrategy("cpu").scope():
        optimizer.finalize_variable_values([parameter])
    assert torch.allclose(parameter.detach(), torch.full((3,), 0.9 * 0.99 + 0.71 * 0.01))


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("clipnorm", 0.5, 0.5),  # the gradient's norm is 2: clipped to 0.5
        ("global_clipnorm", 0.25, 0.25),
        ("clipvalue", 0.1, 0.2),  # every entry of (1, 1, 1, 1) clipped to 0.1: norm 0.2
        ("weight_decay", 0.5, None),
    ],
)
def test_a_shared_argument_set_after_construction_takes_effect(name, value, expected):
    """As Keras' attributes, and as before the pipeline's stages: ``optimizer.clipnorm = 0.5`` clips the next
    update; an invalid value is refused and the previous one kept."""
    variable = ds.Variable(torch.ones(4))
    optimizer = optimizers.SGD(1.0)
    setattr(optimizer, name, value)
    assert getattr(optimizer, name) == value
    optimizer.apply_gradients([(torch.ones(4), variable)])
    step = torch.ones(4) - variable.value().detach()
    if expected is None:  # decay first: w = 1 - 0.5 * 1; then the step of 1: -0.5
        assert torch.allclose(variable.value().detach(), torch.full((4,), -0.5))
    else:
        assert float(torch.linalg.vector_norm(step)) == pytest.approx(expected)
    with pytest.raises(ValueError):
        setattr(optimizer, name, -1.0)
    assert getattr(optimizer, name) == value


def test_accumulation_and_averages_follow_their_arguments_set_later():
    variable = ds.Variable(torch.zeros(2))
    optimizer = optimizers.SGD(1.0)
    optimizer.gradient_accumulation_steps = 2
    optimizer.apply_gradients([(torch.ones(2), variable)])
    assert optimizer.accumulated_steps == 1 and torch.equal(variable.value().detach(), torch.zeros(2))
    optimizer.apply_gradients([(torch.ones(2), variable)])
    assert torch.equal(variable.value().detach(), -torch.ones(2)) and int(optimizer.iterations) == 1
    assert optimizer.get_config()["gradient_accumulation_steps"] == 2


def test_a_loss_scale_optimizer_sets_the_shared_arguments_of_its_inner_optimizer():
    inner = optimizers.SGD(1.0)
    wrapper = optimizers.LossScaleOptimizer(inner, initial_scale=1.0)
    wrapper.clipnorm = 0.5
    assert inner.clipnorm == 0.5 == wrapper.clipnorm
    variable = ds.Variable(torch.ones(4))
    wrapper.apply_gradients([(torch.ones(4), variable)])
    assert float(torch.linalg.vector_norm(torch.ones(4) - variable.value().detach())) == pytest.approx(0.5)
