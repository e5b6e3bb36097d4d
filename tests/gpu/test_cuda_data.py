"""The data layer onto a GPU: background prefetch through pinned memory, TensorFlow's split rule with
partial and empty replica batches on logical GPUs, a ``DataLoader`` with worker processes."""

from __future__ import annotations

import threading

import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    HAVE_CUDA,
    HOST,
    assert_close_weights,
    cuda_determinism,  # noqa: F401 - autouse
    cuda_only,
    digits,
    logical_gpus,
    mlp,
    on_gpu,
    weights,
)
from torch.utils.data import DataLoader, TensorDataset

import replicafit.strategies as ds
from replicafit import data, optimizers
from replicafit.trainer import Trainer

pytestmark = GPU_TESTS


@cuda_only
def test_prefetch_onto_the_gpu_pins_host_memory_on_a_background_thread(monkeypatch):
    """The default buffer (``None``) prefetches where it overlaps copies onto an accelerator: the
    next batch is pinned and copied (non-blocking) on the prefetch thread while a step runs."""
    pinning_threads = []
    original = torch.Tensor.pin_memory

    def pin_memory(tensor, *args, **kwargs):
        pinning_threads.append(threading.current_thread().name)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    strategy = ds.OneDeviceStrategy(GPU)
    batches = [torch.arange(8.0).reshape(4, 2) + 10 * i for i in range(5)]
    distributed = strategy.experimental_distribute_dataset(batches)
    iterator = iter(distributed)
    assert iterator._prefetch is not None  # a prefetch thread
    got = list(iterator)
    assert all(on_gpu(b) for b in got)
    assert len(got) == 5 and all(torch.equal(a.cpu(), b) for a, b in zip(got, batches))
    assert len(pinning_threads) == 5 and set(pinning_threads) == {"replicafit-prefetch"}


def test_a_host_only_strategy_does_not_prefetch_by_default():
    strategy = ds.OneDeviceStrategy(HOST)
    assert iter(strategy.experimental_distribute_dataset([torch.ones(2)]))._prefetch is None
    options = data.InputOptions(experimental_per_replica_buffer_size=2)
    assert iter(strategy.experimental_distribute_dataset([torch.ones(2)], options))._prefetch is not None


@pytest.mark.parametrize(
    "replicas, batch, expected", [(2, 4, [[2, 2], [2, 2], [1, 1]]), (3, 4, [[2, 2, 0], [2, 2, 0], [1, 1, 0]])]
)
def test_partial_and_empty_replica_batches_on_logical_gpus(replicas, batch, expected):
    """TensorFlow's split rule on GPUs: 10 rows in batches of ``batch``; an empty replica batch keeps
    its trailing shape and dtype, on its device."""
    x = torch.arange(30.0).reshape(10, 3)
    y = torch.arange(10)
    with logical_gpus(replicas) as devices:
        strategy = ds.MirroredStrategy(devices)
        sizes, rows = [], []
        for xb, yb in strategy.experimental_distribute_dataset(list(zip(x.split(batch), y.split(batch)))):
            parts = strategy.experimental_local_results(xb)
            labels = strategy.experimental_local_results(yb)
            assert all(on_gpu(p) and p.shape[1:] == (3,) and p.dtype == torch.float32 for p in parts)
            assert all(on_gpu(label) and label.dtype == torch.int64 for label in labels)
            sizes.append([p.shape[0] for p in parts])
            rows.append(torch.cat([p.cpu() for p in parts]))
    assert sizes == expected
    assert torch.equal(torch.cat(rows), x)


def test_a_dataloader_with_worker_processes_trains_on_the_gpu_as_on_the_cpu():
    x, y = digits()

    def run(device):
        loader = DataLoader(
            TensorDataset(x, y),
            batch_size=32,
            shuffle=True,
            num_workers=2,
            pin_memory=HAVE_CUDA and device == GPU,
            generator=torch.Generator().manual_seed(5),
        )
        model = mlp()
        trainer = Trainer(strategy=ds.OneDeviceStrategy(device), optimizer=optimizers.SGD(0.1, momentum=0.9), seed=0)
        history = trainer.fit(model, loader, epochs=2, verbose=0)
        return weights(model), history.history["loss"]

    expected, expected_loss = run(HOST)
    got, loss = run(GPU)
    assert_close_weights(got, expected)
    assert loss == pytest.approx(expected_loss, rel=1e-4)


def test_fetch_to_device_false_keeps_the_batches_on_the_host():
    with logical_gpus(2) as devices:
        strategy = ds.MirroredStrategy(devices)
        options = data.InputOptions(experimental_fetch_to_device=False)
        (step,) = list(strategy.experimental_distribute_dataset([torch.arange(4.0)], options))
        assert all(p.device.type == "cpu" for p in strategy.experimental_local_results(step))


def test_arrays_already_on_the_gpu_train_shuffled_as_arrays_on_the_host():
    """``fit((x, y))`` with tensors on the GPU gathers each shuffled batch there (the epoch's order
    goes to the GPU once), as host arrays are shuffled on the host."""
    x, y = digits()

    def run(x, y):
        model = mlp()
        trainer = Trainer(strategy=ds.OneDeviceStrategy(GPU), optimizer=optimizers.SGD(0.1, momentum=0.9), seed=0)
        trainer.fit(model, (x, y), batch_size=32, epochs=2, shuffle=True, verbose=0)
        return weights(model)

    gpu = ds.devices.torch_device(GPU)
    assert_close_weights(run(x.to(gpu), y.to(gpu)), run(x, y), rtol=1e-6, atol=1e-7)
