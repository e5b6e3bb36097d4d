"""``gradient_accumulation_steps``: N steps of batch b equal one step of batch N*b (partial
batches and windows included) under every strategy, with one cross-replica reduction per
window; a custom loop gets Keras' mean of the N gradients; the open window survives
``state_dict`` and a ``BackupAndRestore`` resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import InterruptAt, make_strategy

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.optimizers import schedules
from replicafit.trainer import BackupAndRestore, Trainer

# 200 examples: batch 32 gives 6 full steps and one of 8 per epoch; batch 8 with N=4 gives the
# same 6 windows and a partial window of one step, applied at the epoch's end.
X = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))
Y = (X[:, :4].argmax(1) + (X[:, 4] > 1).long()) % 4


def make_model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fit(strategy, batch_size, optimizer, epochs=2, callbacks=(), model=None):
    model = model or make_model()
    trainer = Trainer(strategy=make_strategy(strategy), optimizer=optimizer, loss="cross_entropy", metrics=(), seed=0)
    history = trainer.fit(
        model, (X, Y), batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )
    return trainer, model, history


@pytest.mark.parametrize("strategy", ["default", "one_device", "mirrored2", "mirrored3", "central_storage2"])
@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda n: optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=n),
        lambda n: optimizers.Adam(0.01, global_clipnorm=0.5, gradient_accumulation_steps=n),
        lambda n: optimizers.from_torch(torch.optim.AdamW, lr=0.01, gradient_accumulation_steps=n),
    ],
    ids=["sgd", "adam_clipped", "torch_adamw"],
)
def test_four_steps_of_8_equal_one_step_of_32(strategy, make_optimizer):
    reference, ref_model, _ = fit("default", 32, make_optimizer(None))
    trainer, model, history = fit(strategy, 8, make_optimizer(4))
    assert int(trainer.optimizer.iterations) == int(reference.optimizer.iterations) == 14  # updates, not steps
    torch.testing.assert_close(flat(model), flat(ref_model), rtol=0, atol=1e-6)
    assert len(history.history["loss"]) == 2


@pytest.mark.parametrize("strategy", ["one_device", "mirrored2", "mirrored3", "central_storage2"])
def test_one_reduction_per_window_and_none_between(strategy, monkeypatch):
    strategy = make_strategy(strategy)
    calls = []
    original = type(strategy.extended)._batch_reduce_to

    def counting(self, op, pairs, options):
        calls.append(len(pairs))
        return original(self, op, pairs, options)

    monkeypatch.setattr(type(strategy.extended), "_batch_reduce_to", counting)
    with strategy.scope():
        variable = ds.Variable(torch.zeros(3))
        optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=4)

    def step(value):
        optimizer.apply_gradients([(torch.full((3,), float(value)), variable)])

    for i in range(10):
        strategy.run(step, args=(i,))
    assert len(calls) == 2  # after steps 4 and 8; none on the other steps
    optimizer.apply_accumulated_gradients()  # steps 9 and 10
    assert len(calls) == 3 and int(optimizer.iterations) == 3


def test_a_loop_of_ones_own_takes_the_mean_of_the_window_gradients():
    variable = ds.Variable(torch.zeros(2))
    optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=3)
    grads = [np.array([1.0, 2.0]), np.array([3.0, -1.0]), np.array([5.0, 0.5]), np.array([2.0, 2.0])]
    for g in grads:
        optimizer.apply_gradients([(torch.tensor(g, dtype=torch.float32), variable)])
    expected = -np.mean(grads[:3], axis=0)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)  # Keras 3's rule: the mean of the N
    optimizer.apply_accumulated_gradients()  # the partial window: the one step left
    np.testing.assert_allclose(variable.numpy(), expected - grads[3], rtol=1e-6)
    assert int(optimizer.iterations) == 2
    optimizer.apply_accumulated_gradients()  # nothing open: nothing happens
    assert int(optimizer.iterations) == 2


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "loss_scaled"])
def test_step_weight_weighs_each_step_of_the_window(wrap):
    variable = ds.Variable(torch.zeros(2))
    inner = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    optimizer = optimizers.LossScaleOptimizer(inner, initial_scale=1.0) if wrap else inner
    assert optimizer.step_weight == 1.0
    for weight, g in ((1.0, [4.0, 0.0]), (3.0, [0.0, 4.0])):
        optimizer.step_weight = weight  # as Trainer.fit sets it: the step's examples
        optimizer.apply_gradients([(torch.tensor(g), variable)])
    assert inner.step_weight == 3.0
    np.testing.assert_allclose(variable.numpy(), [-1.0, -3.0], rtol=1e-6)  # (1 * g1 + 3 * g2) / 4


def test_the_schedule_advances_per_update():
    rates = []
    schedule = schedules.PiecewiseConstantDecay([0, 1], [1.0, 0.5, 0.25])  # by iterations: 0, 1, then 2+
    variable = ds.Variable(torch.zeros(1))
    optimizer = optimizers.SGD(schedule, gradient_accumulation_steps=2)
    for _ in range(6):
        before = variable.numpy().copy()
        optimizer.apply_gradients([(torch.ones(1), variable)])
        rates.append(float(before[0] - variable.numpy()[0]))
    assert rates == [0.0, 1.0, 0.0, 0.5, 0.0, 0.25]


@pytest.mark.parametrize("strategy", ["default", "mirrored2", "central_storage2"])
def test_state_dict_mid_window_continues_identically(strategy):
    def run(split: bool):
        s = make_strategy(strategy)
        with s.scope():
            variable = ds.Variable(torch.zeros(4))
            optimizer = optimizers.Adam(0.1, gradient_accumulation_steps=3)

        def step(i):
            ctx = ds.get_replica_context()
            g = torch.arange(4.0) * (i + 1) + ctx.replica_id_in_sync_group
            optimizer.apply_gradients([(g, variable)])

        for i in range(5):
            s.run(step, args=(i,))
        if split:  # a fresh optimizer continues from the state of the first (a window of 2 steps open)
            state = optimizer.state_dict()
            assert state["accumulation"]["count"] == 2
            with s.scope():
                optimizer = optimizers.Adam(0.1, gradient_accumulation_steps=3)
            optimizer.build([variable])
            optimizer.load_state_dict(state)
        for i in range(5, 7):
            s.run(step, args=(i,))
        return variable.numpy(), int(optimizer.iterations)

    whole, split = run(False), run(True)
    assert whole[1] == split[1] == 2
    np.testing.assert_array_equal(whole[0], split[0])


def test_a_window_saved_under_two_replicas_loads_under_one():
    mirrored = make_strategy("mirrored2")
    with mirrored.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    mirrored.run(lambda: optimizer.apply_gradients([(torch.tensor([1.0, 2.0]), variable)]))
    state = optimizer.state_dict()
    other_variable = ds.Variable(torch.zeros(2))
    other = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    other.build([other_variable])
    other.load_state_dict(state)
    other.apply_gradients([(torch.tensor([4.0, 4.0]), other_variable)])  # already reduced: counts once
    # window: (1+1, 2+2) from the two replicas, then (4, 4): the mean of the two steps
    np.testing.assert_allclose(other_variable.numpy(), -np.array([3.0, 4.0]))


def _open_window_of_two_replicas():
    """An SGD(1.0) window of one step on Mirrored(2): replica r's sums are (1 + r) * [1, 2]."""
    mirrored = make_strategy("mirrored2")
    with mirrored.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=2)

    def step():
        replica = ds.get_replica_context().replica_id_in_sync_group
        optimizer.apply_gradients([(torch.tensor([1.0, 2.0]) * (1 + replica), variable)])

    mirrored.run(step)
    return optimizer.state_dict()


@pytest.mark.parametrize("count", [1, 3])
def test_a_window_of_two_replicas_goes_on_per_replica_on_another_count_with_its_total(count):
    """On another replica count the saved sums are added together onto replica 0 (the others start at zero): the
    window's reduction gives the saved total plus the new steps'."""
    state = _open_window_of_two_replicas()
    window = state["accumulation"]
    assert (window["first_replica"], window["replicas_in_sync"], len(window["gradients"][0])) == (0, 2, 2)
    strategy = make_strategy(f"mirrored{count}")
    with strategy.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    optimizer.build([variable])
    optimizer.load_state_dict(state)
    strategy.run(lambda: optimizer.apply_gradients([(torch.tensor([2.0, 2.0]), variable)]))
    # (1 + 2) * [1, 2] saved, then [2, 2] on each of `count` replicas: the sum over 2 steps, divided by 2
    expected = -(np.array([3.0, 6.0]) + count * np.array([2.0, 2.0])) / 2
    np.testing.assert_allclose(variable.numpy(), expected)


def test_a_window_of_one_workers_replicas_loads_only_where_they_are():
    """One worker's part of a window (its ``optimizer.state_dict()``, not gathered) cannot be divided on another
    layout: a clear error, not a window that silently lacks the other workers' sums."""
    state = _open_window_of_two_replicas()
    window = state["accumulation"]
    state["accumulation"] = dict(window, first_replica=1, gradients={p: v[1:] for p, v in window["gradients"].items()})
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    optimizer.build([variable])
    optimizer.load_state_dict(state)
    with pytest.raises(ValueError, match="holds the sums of replicas 1-1 of 2 only"):
        strategy.run(lambda: optimizer.apply_gradients([(torch.ones(2), variable)]))


def test_a_state_with_a_window_needs_an_accumulating_optimizer():
    variable = ds.Variable(torch.zeros(2))
    optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    optimizer.apply_gradients([(torch.ones(2), variable)])
    plain = optimizers.SGD(1.0)
    plain.build([ds.Variable(torch.zeros(2))])
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        plain.load_state_dict(optimizer.state_dict())


@pytest.mark.parametrize("steps", [0, 1, -2, 2.0, True, "4"])
def test_bad_accumulation_steps_are_refused(steps):
    with pytest.raises(ValueError, match="integer >= 2"):
        optimizers.SGD(gradient_accumulation_steps=steps)


def test_a_window_needs_the_same_variables_at_every_step():
    a, b = ds.Variable(torch.zeros(2)), ds.Variable(torch.zeros(2))
    optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=3)
    optimizer.apply_gradients([(torch.ones(2), a), (torch.ones(2), b)])
    with pytest.raises(ValueError, match="same variables"):
        optimizer.apply_gradients([(torch.ones(2), a)])


def test_apply_accumulated_gradients_inside_run_is_refused():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(1.0, gradient_accumulation_steps=2)
    strategy.run(lambda: optimizer.apply_gradients([(torch.ones(2), variable)]))
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(optimizer.apply_accumulated_gradients)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_backup_mid_window_resumes_bit_identical(tmp_path, strategy):
    def optimizer():
        return optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=4)

    _, reference, _ = fit(strategy, 8, optimizer())
    # 25 steps per epoch; backups every 6 steps (mid-window: 6 = 4 + 2); the crash before step 33
    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        fit(strategy, 8, optimizer(), callbacks=[BackupAndRestore(backup, save_freq=6), InterruptAt(33)])
    _, model, _ = fit(strategy, 8, optimizer(), callbacks=[BackupAndRestore(backup, save_freq=6)])
    assert torch.equal(flat(model), flat(reference))
