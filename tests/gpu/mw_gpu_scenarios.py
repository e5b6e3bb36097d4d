"""Worker functions for tests/gpu/test_cuda_multiworker.py (run in worker processes by the harness;
``fit_run`` in the test process too)."""

from __future__ import annotations

import torch
from gpu_support import GPU, HAVE_CUDA, digits, mlp, weights

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer


def fit_run(strategy) -> dict:
    """A small seeded fit with dropout, under the determinism settings of gpu_support."""
    if HAVE_CUDA:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = mlp(dropout=0.2)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), seed=3, metrics=["accuracy"])
    history = trainer.fit(model, digits(256), batch_size=32, epochs=2, verbose=0)
    return {"weights": weights(model), "history": history.history, "device": str(next(model.parameters()).device)}


def fit(rank, num_workers, port, implementation="RING"):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[GPU])
    options = ds.CommunicationOptions(timeout_seconds=60, implementation=implementation)
    strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    collective = strategy.extended._collective
    return fit_run(strategy) | {"backend": collective.backend if collective is not None else None}


def nccl_collectives(rank, num_workers, port):
    """The collective's data operations on CUDA tensors over NCCL (a one-worker group)."""
    from replicafit.strategies.collective import Collective

    collective = Collective(rank, num_workers, "127.0.0.1", port, torch.device(GPU), 60)
    try:
        a, b = torch.arange(5.0, device=GPU), torch.ones(3, device=GPU)
        collective.all_reduce_flat([a, b], "sum")
        gathered = collective.all_gather(torch.full((2, 2), float(rank), device=GPU), "gather")
        value = torch.full((4,), 7.0, device=GPU)
        collective.broadcast(value, "broadcast")
        ints = collective.start_sum_ints([rank + 1], "ints")()
        return {
            "backend": collective.backend,
            "sum": (a.cpu(), b.cpu()),
            "gathered": [g.cpu() for g in gathered],
            "gathered_device": str(gathered[0].device),
            "broadcast": value.cpu(),
            "ints": ints,
        }
    finally:
        collective.destroy()


def nccl_on_one_gpu(rank, num_workers, port):
    """Two workers on the one GPU with the default (NCCL for CUDA): the error each one gets."""
    try:
        fit(rank, num_workers, port, implementation="AUTO")
    except ValueError as error:
        return str(error)
    return None
