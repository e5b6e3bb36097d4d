"""``LossScaleOptimizer``: Keras 3's dynamic rule inside our pipeline (reduce → unscale → an
agreed finite check → clip → update), for any inner optimizer, under every strategy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import InterruptAt, Lion, gpu, make_strategy, requires_gpus

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Callback, Trainer

X = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] - X[:, 1] > 0).long() + (X[:, 2] > 0.5).long()


def make_model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fit(strategy="default", optimizer=None, precision="32", epochs=3, callbacks=(), batch_size=16):
    model = make_model()
    trainer = Trainer(
        strategy=make_strategy(strategy),
        optimizer=optimizer or optimizers.SGD(0.1, momentum=0.9),
        loss="cross_entropy",
        metrics=["accuracy"],
        seed=0,
        precision=precision,
    )
    history = trainer.fit(
        model, (X, Y), batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )
    return trainer, model, history


INNER = {
    "sgd": lambda: optimizers.SGD(0.1, momentum=0.9),
    "adam_clipped": lambda: optimizers.Adam(0.01, clipnorm=0.5),
    "subclass": lambda: Lion(0.01),
    "torch_adamw": lambda: optimizers.from_torch(torch.optim.AdamW, lr=0.01),
}


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_loss_scaling_in_float32_equals_the_inner_optimizer(inner, strategy):
    # A power-of-two scale multiplies and divides exactly: with no overflow, the same bits.
    reference = fit(strategy, INNER[inner]())[1]
    trainer, model, _ = fit(strategy, optimizers.LossScaleOptimizer(INNER[inner]()))
    assert torch.equal(flat(model), flat(reference))
    assert trainer.optimizer.dynamic_scale == 2.0**15 and int(trainer.optimizer.iterations) == 18


def test_sixteen_mixed_is_plain_sgd_within_float16_round_off():
    reference = fit("default")[1]
    trainer, model, _ = fit("default", precision="16-mixed")
    assert isinstance(trainer.optimizer, optimizers.LossScaleOptimizer)
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=2e-2)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("strategy", ["mirrored2", "central_storage2", "mirrored3"])
def test_mixed_precision_under_replicas_equals_one_device(precision, strategy):
    _, reference, ref_history = fit("default", precision=precision)
    _, model, history = fit(strategy, precision=precision)
    tolerance = 3e-2 if precision == "bf16-mixed" else 5e-3  # half precision rounds each replica's part
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=tolerance)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], atol=tolerance)


def _replica_step(optimizer, variable, blow_up_replica=None):
    def step():
        ctx = ds.get_replica_context()
        weight = variable.value()
        loss = (weight * torch.arange(1.0, 4.0)).sum()
        if ctx.replica_id_in_sync_group == blow_up_replica:
            loss = loss * torch.tensor(float("inf"))  # this replica's loss overflows, the other's does not
        (grad,) = torch.autograd.grad(optimizer.scale_loss(loss), [weight])
        optimizer.apply_gradients([(grad, variable)])

    return step


@pytest.mark.parametrize("strategy", ["mirrored2", "central_storage2", "mirrored3"])
def test_an_overflow_on_one_replica_skips_the_step_on_every_replica(strategy):
    strategy = make_strategy(strategy)
    with strategy.scope():
        variable = ds.Variable(torch.ones(3))
        optimizer = optimizers.LossScaleOptimizer(optimizers.SGD(0.1, momentum=0.9), initial_scale=1024.0)
    strategy.run(_replica_step(optimizer, variable))  # a finite step: momentum is set
    before = [c.numpy().copy() for c in strategy.experimental_local_results(variable)]
    momentum = [c.numpy().copy() for c in strategy.experimental_local_results(optimizer.get_slot(variable, "momentum"))]
    strategy.run(_replica_step(optimizer, variable, blow_up_replica=1))
    after = [c.numpy() for c in strategy.experimental_local_results(variable)]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)  # skipped everywhere
    for a, b in zip(after, after[1:]):
        np.testing.assert_array_equal(a, b)  # and every copy equal
    slots = strategy.experimental_local_results(optimizer.get_slot(variable, "momentum"))
    for a, b in zip(momentum, slots):
        np.testing.assert_array_equal(a, b.numpy())
    assert optimizer.dynamic_scale == 512.0 and optimizer.step_counter == 0
    assert int(optimizer.iterations) == 2  # a skipped step counts (as tf.keras counted it)


def test_the_scale_doubles_after_the_growth_steps():
    variable = ds.Variable(torch.ones(3))
    optimizer = optimizers.LossScaleOptimizer(optimizers.SGD(0.01), initial_scale=8.0, dynamic_growth_steps=3)
    scales = []
    for _ in range(7):
        _plain_step(optimizer, variable)
        scales.append((optimizer.dynamic_scale, optimizer.step_counter))
    assert scales == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (16.0, 2), (32.0, 0), (32.0, 1)]
    _plain_step(optimizer, variable, factor=float("nan"))
    assert (optimizer.dynamic_scale, optimizer.step_counter) == (16.0, 0)


def _plain_step(optimizer, variable, factor=1.0):
    weight = variable.value()
    loss = (weight * torch.arange(1.0, 4.0)).sum() * factor
    (grad,) = torch.autograd.grad(optimizer.scale_loss(loss), [weight])
    optimizer.apply_gradients([(grad, variable)])


def test_the_gradients_are_unscaled_before_clipping_and_the_update():
    variable = ds.Variable(torch.zeros(2))
    optimizer = optimizers.LossScaleOptimizer(optimizers.SGD(1.0, clipnorm=1.0), initial_scale=256.0)
    optimizer.apply_gradients([(torch.tensor([3.0, 4.0]) * 256.0, variable)])
    np.testing.assert_allclose(variable.numpy(), [-0.6, -0.8], rtol=1e-6)  # clip(unscaled) = (3, 4) / 5


@pytest.mark.parametrize("strategy", ["default", "mirrored2", "mirrored3", "central_storage2"])
def test_sixteen_mixed_with_accumulation_and_clipping_equals_one_device(strategy):
    def optimizer():
        return optimizers.Adam(0.01, global_clipnorm=1.0, gradient_accumulation_steps=3)

    _, reference, _ = fit("default", optimizer(), precision="16-mixed", batch_size=8)
    trainer, model, _ = fit(strategy, optimizer(), precision="16-mixed", batch_size=8)
    torch.testing.assert_close(flat(model), flat(reference), rtol=0, atol=5e-3)
    assert int(trainer.optimizer.iterations) == 3 * 4  # 12 steps per epoch: 4 windows


def test_an_overflow_inside_a_window_skips_the_whole_window():
    variable = ds.Variable(torch.ones(3))
    optimizer = optimizers.LossScaleOptimizer(optimizers.SGD(0.1, gradient_accumulation_steps=2), initial_scale=64.0)
    _plain_step(optimizer, variable, factor=float("inf"))
    _plain_step(optimizer, variable)
    np.testing.assert_array_equal(variable.numpy(), np.ones(3))
    assert optimizer.dynamic_scale == 32.0 and int(optimizer.iterations) == 1
    _plain_step(optimizer, variable)
    _plain_step(optimizer, variable)
    np.testing.assert_allclose(variable.numpy(), 1 - 0.1 * np.arange(1.0, 4.0), rtol=1e-6)


def test_state_dict_round_trip_and_config():
    variable = ds.Variable(torch.ones(3))
    optimizer = optimizers.LossScaleOptimizer(optimizers.Adam(0.01), initial_scale=4.0, dynamic_growth_steps=5)
    for _ in range(3):
        _plain_step(optimizer, variable)
    _plain_step(optimizer, variable, factor=float("inf"))
    _plain_step(optimizer, variable)
    state = optimizer.state_dict()
    assert state["loss_scale"] == {"scale": 2.0, "step_counter": 1}
    config = optimizer.get_config()
    rebuilt = optimizers.get({"class_name": "LossScaleOptimizer", "config": config})
    assert isinstance(rebuilt.inner_optimizer, optimizers.Adam) and rebuilt.dynamic_growth_steps == 5
    rebuilt.build([variable])
    rebuilt.load_state_dict(state)
    assert (rebuilt.dynamic_scale, rebuilt.step_counter, int(rebuilt.iterations)) == (2.0, 1, 5)
    plain = optimizers.Adam(0.01)
    plain.build([variable])
    plain.load_state_dict(state)  # the inner state loads into an unwrapped optimizer too
    with pytest.raises(ValueError, match="step_counter"):
        rebuilt.load_state_dict(state | {"loss_scale": {"scale": 2.0, "step_counter": 9}})
    with pytest.raises(ValueError, match="loss_scale"):
        rebuilt.load_state_dict(state | {"loss_scale": {"scale": -1.0, "step_counter": 0}})
    assert rebuilt.dynamic_scale == 2.0  # unchanged by the refused loads


def test_bad_arguments():
    with pytest.raises(TypeError, match="from_torch"):
        optimizers.LossScaleOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    inner = optimizers.SGD()
    optimizers.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="only once"):
        optimizers.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="positive finite"):
        optimizers.LossScaleOptimizer(optimizers.SGD(), initial_scale=math.inf)
    with pytest.raises(ValueError, match=">= 1"):
        optimizers.LossScaleOptimizer(optimizers.SGD(), dynamic_growth_steps=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_backup_resumes_loss_scaling_bit_exactly(tmp_path, strategy):
    def optimizer():  # a small growth interval, so that the scale moves during the run
        return optimizers.LossScaleOptimizer(optimizers.Adam(0.01), initial_scale=2.0**20, dynamic_growth_steps=4)

    reference, ref_model, _ = fit(strategy, optimizer(), precision="16-mixed")
    with pytest.raises(KeyboardInterrupt):
        fit(strategy, optimizer(), "16-mixed", callbacks=[BackupAndRestore(tmp_path, save_freq=5), InterruptAt(13)])
    trainer, model, _ = fit(strategy, optimizer(), "16-mixed", callbacks=[BackupAndRestore(tmp_path, save_freq=5)])
    assert torch.equal(flat(model), flat(ref_model))
    assert trainer.optimizer.state_dict()["loss_scale"] == reference.optimizer.state_dict()["loss_scale"]


# --- against torch's GradScaler ----------------------------------------------------------------------

OVERFLOW_STEPS = (2, 3, 9)  # batches whose input overflows float16 (an infinity in the forward pass)


def _overflowing_data(device: str):
    """Batches of 8 rows; the batches in ``OVERFLOW_STEPS`` hold a value beyond float16's range."""
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(3))
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    for step in OVERFLOW_STEPS:
        x[step * 8, 0] = 1e6
    return x.to(device), y.to(device)


def _grad_scaler_loop(device: str, growth_interval: int):
    """The oracle: torch's own float16 recipe (autocast + GradScaler + torch.optim.SGD), with
    LossScaleOptimizer's constants (initial scale 2**15, factors 2 and 0.5)."""
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(
        device, init_scale=2.0**15, growth_factor=2.0, backoff_factor=0.5, growth_interval=growth_interval
    )
    x, y = _overflowing_data(device)
    scales, steps_taken = [], 0
    for start in range(0, len(x), 8):
        xb, yb = x[start : start + 8], y[start : start + 8]
        with torch.autocast(device, dtype=torch.float16):
            per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = per_example.float().sum() / 8
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        before = optimizer.state_dict()["state"].get(0, {}).get("momentum_buffer")
        before = None if before is None else before.clone()
        scaler.step(optimizer)
        scaler.update()
        after = optimizer.state_dict()["state"].get(0, {}).get("momentum_buffer")
        steps_taken += int(after is not None and (before is None or not torch.equal(before, after)))
        scales.append(float(scaler.get_scale()))
    return model, scales, steps_taken


@pytest.mark.parametrize("growth_interval", [2000, 4])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, requires_gpus(1)])])
def test_sixteen_mixed_skips_and_scales_as_torch_grad_scaler(device, growth_interval):
    """A forced overflow: the same steps skipped, the same scales after every step and the same
    weights as torch's GradScaler loop. Documented difference: a skipped step counts in
    ``iterations`` (tf.keras' rule), while the torch optimizer takes no step."""
    expected_model, expected_scales, steps_taken = _grad_scaler_loop(device, growth_interval)
    assert steps_taken == 12 - len(OVERFLOW_STEPS)
    scales = []

    class Scales(Callback):
        def on_train_batch_end(self, batch, logs=None):
            scales.append(self.trainer.optimizer.dynamic_scale)

    model = make_model()
    strategy = ds.OneDeviceStrategy(device) if device != "cpu" else ds.get_strategy()
    inner = optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    optimizer = optimizers.LossScaleOptimizer(inner, dynamic_growth_steps=growth_interval)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", metrics=[], precision="16-mixed")
    trainer.fit(model, _overflowing_data("cpu"), batch_size=8, shuffle=False, verbose=0, callbacks=[Scales()])
    assert scales == expected_scales
    assert scales[OVERFLOW_STEPS[0]] == 2.0**14  # halved at the first overflow
    assert int(optimizer.iterations) == 12  # skipped steps count too
    for got, want in zip(model.parameters(), expected_model.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), rtol=1e-5, atol=1e-6)
        assert got.dtype == torch.float32
