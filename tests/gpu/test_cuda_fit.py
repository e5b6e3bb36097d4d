"""``fit``/``evaluate``/``predict`` and checkpoints on a GPU, against the same work on the CPU."""

from __future__ import annotations

import pytest
import torch
from gpu_support import (
    ATOL,
    GPU,
    GPU_TESTS,
    HAVE_CUDA,
    HOST,
    RTOL,
    assert_close_history,
    assert_close_weights,
    assert_same_weights,
    cnn,
    cuda_determinism,  # noqa: F401 - autouse
    digits,
    logical_gpus,
    mlp,
    on_gpu,
    weights,
)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer

pytestmark = GPU_TESTS


def fit_run(strategy, model=None, epochs=3, optimizer=None, batch_size=32, data=None, **trainer_kwargs):
    model = model if model is not None else mlp()
    trainer = Trainer(
        strategy=strategy,
        optimizer=optimizer or optimizers.SGD(0.1, momentum=0.9),
        loss="cross_entropy",
        metrics=["accuracy"],
        seed=0,
        **trainer_kwargs,
    )
    history = trainer.fit(
        model, data or digits(), epochs=epochs, batch_size=batch_size, validation_split=0.25, verbose=0
    )
    return trainer, model, history


def test_one_device_on_the_gpu_trains_as_on_the_cpu():
    _, cpu_model, cpu_history = fit_run(ds.OneDeviceStrategy(HOST))
    _, model, history = fit_run(ds.OneDeviceStrategy(GPU))
    assert all(on_gpu(p) for p in model.parameters())  # the user's module holds the trained weights, on the GPU
    assert_close_weights(weights(model), weights(cpu_model))
    assert_close_history(history, cpu_history)


def test_a_cnn_with_batch_norm_trains_on_the_gpu_as_on_the_cpu():
    _, cpu_model, cpu_history = fit_run(ds.OneDeviceStrategy(HOST), model=cnn(), epochs=2)
    _, model, history = fit_run(ds.OneDeviceStrategy(GPU), model=cnn(), epochs=2)
    assert_close_weights(weights(model), weights(cpu_model))  # batch-norm statistics included
    assert_close_history(history, cpu_history)


def test_adam_with_a_schedule_and_accumulation_on_the_gpu():
    """Adam's bias correction and the schedule read the host update count; accumulation keeps
    per-replica sums on the device."""

    def adam():
        schedule = optimizers.schedules.ExponentialDecay(1e-2, decay_steps=5, decay_rate=0.5)
        # epsilon 1e-3: Adam divides by sqrt(v); a gradient that is float noise (another summation order
        # on the GPU) would otherwise get a full step in either direction
        return optimizers.Adam(schedule, epsilon=1e-3, gradient_accumulation_steps=2)

    _, cpu_model, _ = fit_run(ds.OneDeviceStrategy(HOST), optimizer=adam(), epochs=2)
    trainer, model, _ = fit_run(ds.OneDeviceStrategy(GPU), optimizer=adam(), epochs=2)
    assert_close_weights(weights(model), weights(cpu_model), rtol=1e-3, atol=1e-4)
    assert int(trainer.optimizer.iterations) == 12  # 2 epochs of 12 steps (360 rows), windows of 2


def test_evaluate_and_predict_on_the_gpu_equal_the_cpu():
    x, y = digits()
    model = mlp()
    fit_run(ds.OneDeviceStrategy(HOST), model=model, epochs=1)
    cpu = Trainer(strategy=ds.OneDeviceStrategy(HOST), metrics=["accuracy"])
    expected_loss, expected_accuracy = cpu.evaluate(model, (x, y), batch_size=50, verbose=0)
    expected_predictions = cpu.predict(model, x, batch_size=50, verbose=0)
    gpu = Trainer(strategy=ds.OneDeviceStrategy(GPU), metrics=["accuracy"])
    loss, accuracy = gpu.evaluate(model, (x, y), batch_size=50, verbose=0)  # a partial last batch: 480 = 9 * 50 + 30
    predictions = gpu.predict(model, x, batch_size=50, verbose=0)
    assert loss == pytest.approx(expected_loss, rel=RTOL)
    assert accuracy == pytest.approx(expected_accuracy, abs=1 / 480)
    assert predictions.shape == (480, 10) and on_gpu(predictions)
    torch.testing.assert_close(predictions.cpu(), expected_predictions, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("saved_on, loaded_on", [(GPU, HOST), (HOST, GPU)], ids=["gpu_to_cpu", "cpu_to_gpu"])
def test_checkpoints_move_between_the_gpu_and_the_cpu(tmp_path, saved_on, loaded_on):
    """A checkpoint written on one device loads on the other (its tensors are host tensors, so
    ``torch.load(weights_only=True)`` needs no ``map_location``) and training continues as it
    would have on the saving device."""
    path = tmp_path / "ckpt.pt"
    trainer, model, _ = fit_run(ds.OneDeviceStrategy(saved_on), epochs=1)
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert all(t.device.type == "cpu" for t in saved["model"].values())

    def resumed(device):
        restored = mlp(seed=7)  # other initial weights: the checkpoint must replace them all
        other = Trainer(strategy=ds.OneDeviceStrategy(device), optimizer=optimizers.SGD(0.1, momentum=0.9), seed=0)
        other.load_checkpoint(path, model=restored)
        assert_same_weights(weights(restored), weights(model), "restored")
        other.fit(restored, digits(), epochs=1, batch_size=32, verbose=0)
        return weights(restored)

    assert_close_weights(resumed(loaded_on), resumed(saved_on))


def test_mirrored_on_one_gpu_equals_one_device():
    _, expected, expected_history = fit_run(ds.OneDeviceStrategy(GPU))
    trainer, model, history = fit_run(ds.MirroredStrategy([GPU]))
    assert trainer.strategy.num_replicas_in_sync == 1
    assert_close_weights(weights(model), weights(expected), rtol=1e-6, atol=1e-7)
    assert_close_history(history, expected_history, rtol=1e-6)


def test_mirrored_over_the_gpu_and_the_cpu_equals_one_device():
    """Two replicas, one on the GPU and one on the host, side by side on threads: equal to one
    device on the global batch."""
    _, expected, expected_history = fit_run(ds.OneDeviceStrategy(GPU))
    strategy = ds.MirroredStrategy([GPU, HOST])
    trainer, model, history = fit_run(strategy)
    copies = strategy.experimental_local_results(trainer.model.trainable_variables[0])
    assert [c.device for c in copies] == [GPU, HOST]
    assert_close_weights(weights(model), weights(expected))
    assert_close_history(history, expected_history)
    x, _ = digits()
    predictions = trainer.predict(model, x, batch_size=50, verbose=0)  # (the replicas' parts on two devices)
    expected_predictions = Trainer(strategy=ds.OneDeviceStrategy(GPU)).predict(expected, x, batch_size=50, verbose=0)
    assert predictions.shape == (480, 10) and on_gpu(predictions)
    torch.testing.assert_close(predictions, expected_predictions, rtol=RTOL, atol=ATOL)


def test_a_class_weight_given_on_the_host_trains_on_the_gpu_as_on_the_cpu():
    """``nn.CrossEntropyLoss(weight=...)`` with its weight on the host: the loss follows the predictions to
    the GPU, and the run equals the CPU's."""
    weight = torch.linspace(0.5, 1.5, 10)
    runs = {}
    for device in (HOST, GPU):
        trainer = Trainer(
            strategy=ds.OneDeviceStrategy(device),
            optimizer=optimizers.SGD(0.1, momentum=0.9),
            loss=torch.nn.CrossEntropyLoss(weight=weight),
            seed=0,
        )
        model = mlp()
        runs[device] = (model, trainer.fit(model, digits(), epochs=2, batch_size=32, verbose=0))
    assert_close_weights(weights(runs[GPU][0]), weights(runs[HOST][0]))
    assert_close_history(runs[GPU][1], runs[HOST][1])


def test_central_storage_computes_on_the_gpu_and_keeps_variables_on_the_host():
    _, expected, expected_history = fit_run(ds.OneDeviceStrategy(GPU))
    strategy = ds.CentralStorageStrategy(compute_devices=[GPU], parameter_device="cpu")
    trainer, model, history = fit_run(strategy)
    assert strategy.extended.parameter_devices == ("cpu:0",)
    assert all(v.device == "cpu:0" for v in trainer.model.trainable_variables)
    assert_close_weights(weights(model), weights(expected))
    assert_close_history(history, expected_history)


def test_two_logical_gpus_train_as_two_logical_cpus():
    """Mirrored over two logical GPUs on the one GPU (``set_logical_device_configuration``) takes
    the steps of Mirrored over two logical CPUs."""
    _, expected, expected_history = fit_run(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    with logical_gpus(2) as devices:
        strategy = ds.MirroredStrategy(devices)
        _, model, history = fit_run(strategy)
    if HAVE_CUDA:
        assert type(strategy.extended._cross_device_ops).__name__ == "ReductionToOneDevice"
    assert_close_weights(weights(model), weights(expected))
    assert_close_history(history, expected_history)


def test_the_default_mirrored_strategy_takes_every_logical_gpu():
    with logical_gpus(3) as devices:
        strategy = ds.MirroredStrategy() if HAVE_CUDA else ds.MirroredStrategy(devices)
        others = torch.cuda.device_count() - 1 if HAVE_CUDA else 0  # the machine's other GPUs, one device each
        assert strategy.extended.worker_devices[:3] == tuple(devices)
        assert strategy.num_replicas_in_sync == 3 + others
