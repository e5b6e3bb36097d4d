"""The distribution runtime on CUDA tensors: reductions, updates, gathers and random streams, with
replicas on logical GPUs of the one GPU and beside the host, against the same on logical CPUs."""

from __future__ import annotations

import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    HOST,
    cuda_determinism,  # noqa: F401 - autouse
    logical_gpus,
    on_gpu,
)

import replicafit.strategies as ds
from replicafit.strategies.devices import torch_device

pytestmark = GPU_TESTS


def _per_replica(strategy, make):
    """``make(replica_id)`` on each replica's device, as a ``PerReplica``."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: make(ctx.replica_id_in_sync_group).to(
            torch_device(strategy.extended.worker_devices[ctx.replica_id_in_sync_group])
        )
    )


def _values(rid: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rid + 1) + 0.25


@pytest.mark.parametrize("placement", ["logical_gpus", "gpu_and_host"])
def test_batch_reduce_to_sums_and_averages_cuda_tensors(placement):
    with logical_gpus(2) as gpus:
        devices = gpus if placement == "logical_gpus" else [GPU, HOST]
        strategy = ds.MirroredStrategy(devices)
        with strategy.scope():
            variable = ds.Variable(torch.zeros(2, 3))
        value = _per_replica(strategy, _values)
        total, mean = (
            strategy.extended.batch_reduce_to("SUM", [(value, variable), (value, variable)])[0],
            strategy.extended.batch_reduce_to("MEAN", [(value, variable)])[0],
        )
        expected = _values(0) + _values(1)
        for component, device in zip(strategy.experimental_local_results(total), devices):
            assert torch.equal(component.cpu(), expected)
            assert component.device == torch_device(device)
        for component in strategy.experimental_local_results(mean):
            assert torch.equal(component.cpu(), expected / 2)
        assert torch.equal(strategy.reduce("SUM", value, axis=None).cpu(), expected)
        assert torch.equal(strategy.reduce("MEAN", value, axis=0).cpu(), (_values(0) + _values(1)).sum(0) / 4)


def test_update_runs_once_per_copy_on_its_device():
    with logical_gpus(2) as devices:
        strategy = ds.MirroredStrategy(devices)
        with strategy.scope():
            variable = ds.Variable(torch.ones(4))
        seen = []

        def step(copy, delta):
            seen.append((copy.device, delta.device))
            copy.assign_add(delta)

        delta = _per_replica(strategy, lambda rid: torch.full((4,), 2.0))
        reduced = strategy.extended.reduce_to("MEAN", delta, variable)
        strategy.extended.update(variable, step, args=(reduced,))
        assert [d for d, _ in seen] == list(devices)
        assert all(on_gpu(t) for t in (c.value() for c in strategy.experimental_local_results(variable)))
        for component in strategy.experimental_local_results(variable):
            assert torch.equal(component.value().cpu(), torch.full((4,), 3.0))


def test_all_gather_and_gather_with_uneven_rows():
    with logical_gpus(2) as devices:
        strategy = ds.MirroredStrategy(devices)
        rows = _per_replica(strategy, lambda rid: torch.arange(3.0 + rid).reshape(-1, 1) + 10 * rid)

        def replica_fn(x):
            return ds.get_replica_context().all_gather(x, axis=0)

        gathered = strategy.run(replica_fn, args=(rows,))
        expected = torch.cat([torch.arange(3.0).reshape(-1, 1), torch.arange(4.0).reshape(-1, 1) + 10])
        for component in strategy.experimental_local_results(gathered):
            assert on_gpu(component)
            assert torch.equal(component.cpu(), expected)
        assert torch.equal(strategy.gather(rows, axis=0).cpu(), expected)


def test_replica_all_reduce_is_differentiable_on_the_gpu():
    """Gradients flow back through a replica-context all-reduce (a differentiable collective runs
    the replicas on threads), as on logical CPUs."""

    def grads(devices):
        strategy = ds.MirroredStrategy(devices)
        inputs = _per_replica(strategy, lambda rid: torch.tensor([1.0 + rid, 2.0]))

        def replica_fn(x):
            x = x.clone().requires_grad_(True)
            total = ds.get_replica_context().all_reduce("SUM", x * x)
            (grad,) = torch.autograd.grad(total.sum(), [x])
            return grad

        return [g.cpu() for g in strategy.experimental_local_results(strategy.run(replica_fn, args=(inputs,)))]

    expected = grads(["cpu:0", "cpu:1"])
    with logical_gpus(2) as devices:
        got = grads(devices)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_each_replica_draws_from_its_own_stream_on_the_gpu():
    """Seeded replicas draw the same on the GPU run after run; taking turns (the default for logical
    GPUs) and threads draw alike; replicas differ from one another."""

    def draws(devices, execution):
        previous = ds.get_replica_execution()
        ds.set_replica_execution(execution)
        try:
            strategy = ds.MirroredStrategy(devices)
            ds.seed_replicas(strategy, 11)
            out = []
            for _ in range(2):
                result = strategy.run(
                    lambda: torch.nn.functional.dropout(
                        torch.ones(64, device=torch_device(ds.get_replica_context().devices[0])), 0.5
                    )
                )
                out.append([t.cpu() for t in strategy.experimental_local_results(result)])
            return out
        finally:
            ds.set_replica_execution(previous)

    with logical_gpus(2) as devices:
        turns = draws(devices, "auto")
        again = draws(devices, "auto")
        threads = draws(devices, "threads")
    for a, b, c in zip(turns, again, threads):
        for x, y, z in zip(a, b, c):
            assert torch.equal(x, y) and torch.equal(x, z)
    assert not torch.equal(turns[0][0], turns[0][1])  # replicas differ
    assert not torch.equal(turns[0][0], turns[1][0])  # a stream advances
