"""``optimizer.gradient_denominator``: an update divides by a global total that rides with its own gradient
reduction (a loop of one's own: the mean over the real tokens of the global batch), against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import optimizers


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, 3, generator=generator)
    y = torch.randint(0, 4, (12, 5), generator=generator)
    y[y == 3] = -100
    y[:4] = -100  # replica 0 of Mirrored(3) has no real token at all
    return x, y


@pytest.mark.parametrize("name", ["default", "mirrored2", "mirrored3", "central_storage2"])
def test_a_loop_of_ones_own_takes_torchs_mean_over_real_tokens(name):
    x, y = _data()
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 4)
    expected = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected.zero_grad()
    F.cross_entropy(reference(x).transpose(1, 2), y).backward()
    expected.step()

    strategy = make_strategy(name)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    with strategy.scope():
        dm = strategy.distribute_module(model)
        optimizer = optimizers.SGD(0.5)
    optimizer.gradient_denominator = optimizers.GradientDenominator("tokens", prescale=7.0)
    variables = dm.trainable_variables

    def step(x, y):
        values = F.cross_entropy(dm(x).transpose(1, 2), y, reduction="none")  # 0 where y == -100
        strategy.cluster.add_to_step("tokens", (y != -100).sum())
        loss = values.sum() / 7.0  # the prescale: divided back after the reduction
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        optimizer.apply_gradients(zip(grads, variables))

    distributed = strategy.experimental_distribute_dataset([(x, y)])
    for batch in distributed:
        strategy.run(step, args=batch)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(ours, theirs, atol=1e-6)


def test_the_setting_is_checked():
    optimizer = optimizers.SGD(0.1)
    with pytest.raises(TypeError, match="GradientDenominator"):
        optimizer.gradient_denominator = "tokens"
    with pytest.raises(ValueError, match="prescale must be a positive number"):
        optimizers.GradientDenominator("tokens", prescale=0)
    wrapped = optimizers.LossScaleOptimizer(optimizers.SGD(0.1))
    wrapped.gradient_denominator = optimizers.GradientDenominator("tokens")
    assert wrapped.inner_optimizer.gradient_denominator == optimizers.GradientDenominator("tokens")
    assert isinstance(ds.get_strategy(), ds.Strategy)
