"""Mixed precision on the GPU: ``"bf16-mixed"`` against a hand-written autocast loop, float32 state,
``"16-mixed"`` loss scaling under replicas (the ``GradScaler`` oracle is in test_loss_scale.py)."""

from __future__ import annotations

import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    GPU_TYPE,
    assert_close_weights,
    cuda_determinism,  # noqa: F401 - autouse
    digits,
    logical_gpus,
    mlp,
    weights,
)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies.devices import torch_device
from replicafit.trainer import Callback, Trainer

pytestmark = GPU_TESTS


def _hand_loop(precision_dtype, steps_data, device):
    """torch's own recipe: autocast around the forward pass and the loss, float32 weights, SGD."""
    model = mlp().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in steps_data:
        xb, yb = xb.to(device), yb.to(device)
        with torch.autocast(device.type, dtype=precision_dtype):
            per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = per_example.float().sum() / len(xb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return weights(model)


def test_bf16_mixed_runs_the_forward_in_bfloat16_and_equals_an_autocast_loop():
    x, y = digits(256)
    seen = set()

    class Dtypes(Callback):
        def on_train_begin(self, logs=None):
            self.model[0].register_forward_hook(lambda module, args, out: seen.add(out.dtype))

    model = mlp()
    trainer = Trainer(
        strategy=ds.OneDeviceStrategy(GPU),
        optimizer=optimizers.from_torch(torch.optim.SGD, lr=0.1),
        metrics=[],
        precision="bf16-mixed",
    )
    trainer.fit(model, (x, y), batch_size=32, shuffle=False, verbose=0, callbacks=[Dtypes()])
    assert seen == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    expected = _hand_loop(torch.bfloat16, list(zip(x.split(32), y.split(32))), torch_device(GPU))
    assert_close_weights(weights(model), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_keeps_float32_variables_and_slots(precision):
    model = mlp()
    trainer = Trainer(strategy=ds.OneDeviceStrategy(GPU), optimizer="adam", precision=precision, seed=0)
    trainer.fit(model, digits(128), batch_size=32, verbose=0)
    assert all(p.dtype == torch.float32 and p.device.type == GPU_TYPE for p in model.parameters())
    slots = trainer.optimizer.variables
    assert slots and all(v.dtype in (torch.float32, torch.int64) for v in slots)
    if precision == "16-mixed":
        assert isinstance(trainer.optimizer, optimizers.LossScaleOptimizer)


def test_sixteen_mixed_on_two_logical_gpus_equals_one_gpu():
    """Loss scaling under two replicas: the same scale decisions and steps as one device (the
    scale after a forced overflow included)."""
    x, y = digits(256)
    x[40, 0] = 1e6  # an overflow in float16 at step 1

    def run(strategy):
        model = mlp()
        inner = optimizers.SGD(0.1, momentum=0.9)
        trainer = Trainer(strategy=strategy, optimizer=optimizers.LossScaleOptimizer(inner), precision="16-mixed")
        trainer.fit(model, (x, y), batch_size=32, shuffle=False, verbose=0)
        return weights(model), trainer.optimizer.dynamic_scale

    expected, expected_scale = run(ds.OneDeviceStrategy(GPU))
    with logical_gpus(2) as devices:
        got, scale = run(ds.MirroredStrategy(devices))
    assert expected_scale == scale == 2.0**14
    assert_close_weights(got, expected, rtol=1e-3, atol=1e-4)
