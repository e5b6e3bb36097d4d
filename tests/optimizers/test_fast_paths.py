"""The optimizer's per-step fast paths equal the general path they skip (issue 12, item 3)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.optimizers import base


def _setup(name: str, make_optimizer):
    """``(strategy, optimizer, variables, step)``: a small model under ``name``, one batch, and the
    replica step that applies its gradients (``strategy.run(step)``)."""
    strategy = make_strategy(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    dmodel = strategy.distribute_module(model)
    variables = list(dmodel.trainable_variables)
    with strategy.scope():
        optimizer = make_optimizer()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1, 0, 1, 0])

    def step():
        loss = torch.nn.functional.cross_entropy(dmodel(x), y)
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        optimizer.apply_gradients(zip(grads, variables))

    return strategy, optimizer, variables, step


def _train(name: str, fast: bool, steps: int = 5):
    strategy, optimizer, variables, step = _setup(name, lambda: optimizers.SGD(0.1, momentum=0.9))
    counted = base._count_update
    if not fast:
        base._count_update = lambda iterations: iterations.assign_add(1)
    try:
        for _ in range(steps):
            if not fast:
                optimizer._resolver.last = None  # resolve the variables again every call
            strategy.run(step)
    finally:
        base._count_update = counted
    copies = [[t.clone() for t in v.copy_tensors()] for v in variables]
    iterations = [int(t) for t in optimizer.iterations.copy_tensors()]
    return copies, iterations


@pytest.mark.parametrize("name", ["default", "one_device", "mirrored2", "central_storage2"])
def test_resolved_variables_and_the_direct_count_equal_the_general_path(name):
    fast, fast_iterations = _train(name, True)
    slow, slow_iterations = _train(name, False)
    assert fast_iterations == slow_iterations and set(fast_iterations) == {5}
    for a, b in zip(fast, slow):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_plain_parameters_resolve_once_and_the_same_each_time():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = optimizers.SGD(0.1)
    for _ in range(3):
        optimizer.apply_gradients([(torch.ones_like(p), p) for p in layer.parameters()])
    assert len(optimizer._resolver.wrapped) == 2  # one LocalVariable per parameter, made once
    other = torch.nn.Linear(3, 2)  # a different list: resolved afresh
    optimizer.apply_gradients([(torch.ones_like(p), p) for p in other.parameters()])
    assert len(optimizer._resolver.wrapped) == 4
    assert int(optimizer.iterations) == 4
    assert ds.get_replica_context() is not None


def _adam_with_schedule(name: str):
    def make():
        schedule = optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
        return optimizers.Adam(schedule, use_ema=True)

    strategy, optimizer, variables, step = _setup(name, make)
    return strategy, optimizer, variables, lambda: strategy.run(step)


@pytest.mark.parametrize("name", ["default", "one_device", "mirrored2", "central_storage2"])
def test_the_host_count_of_updates_equals_reading_the_counter_every_step(name, monkeypatch):
    # Adam's bias correction, a schedule and EMA all need the update count every step; on an
    # accelerator reading ``iterations`` back would make the host wait for the device each time.
    def run(read_back: bool):
        if read_back:
            monkeypatch.setattr(base.Optimizer, "updates_so_far", lambda self: int(self.iterations))
        strategy, optimizer, variables, step = _adam_with_schedule(name)
        rates = []
        for k in range(7):
            if k == 3:
                with strategy.scope():
                    optimizer.iterations.assign(10)  # a write of one's own: read back once
            step()
            rates.append(optimizer.learning_rate)
        monkeypatch.undo()
        return rates, [[t.clone() for t in v.copy_tensors()] for v in variables], int(optimizer.iterations)

    host, device = run(False), run(True)
    assert host[0] == device[0] and host[2] == device[2] == 14
    for a, b in zip(host[1], device[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["default", "mirrored2", "central_storage2"])
def test_steps_do_not_read_the_update_count_back(name, monkeypatch):
    strategy, optimizer, _, step = _adam_with_schedule(name)
    step()  # the first step reads it once
    reads = []
    kind = type(optimizer.iterations)
    original = kind.__int__
    monkeypatch.setattr(kind, "__int__", lambda self: reads.append(self) or original(self))
    rates = []
    for _ in range(5):
        step()
        rates.append(optimizer.learning_rate)  # what a learning-rate logger reads every step
    assert [r for r in reads if r is optimizer.iterations] == []
    assert rates == [0.1 * 0.5 ** (k / 2) for k in range(2, 7)]
    state = optimizer.state_dict()  # saving reads the counter itself
    assert state["iterations"] == 6
    optimizer.load_state_dict({**state, "iterations": 2})
    assert optimizer.updates_so_far() == 2  # a load is read back
