"""Worker functions for tests/gpu/test_cuda_fully_sharded.py (run in worker processes by the harness; the
one-process oracle in the test process too)."""

from __future__ import annotations

import os

import torch
from gpu_support import HAVE_CUDA, digits

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer

#: The workers' environment: they import gpu_support and these scenarios from this folder.
WORKER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def blocks_model(width: int = 96, depth: int = 4, seed: int = 100) -> torch.nn.Module:
    """Digits (64 features) -> ``depth`` residual blocks of ``width`` -> 10 classes; the blocks are the units."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(64, width), *[Block(width) for _ in range(depth)], torch.nn.Linear(width, 10)
        )


def device_of(rank: int) -> str:
    return f"cuda:{rank}" if HAVE_CUDA else "cpu:1"  # (a dry run: the tests' logic on the CPU)


def fit_run(strategy, precision="32", width=96) -> dict:
    """Two epochs of AdamW with a global clipnorm on the digits (a partial last batch); the whole weights, the
    dtype the first block's forward sees, and the peak of CUDA memory allocated by this process."""
    if HAVE_CUDA:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.cuda.reset_peak_memory_stats()
    model = blocks_model(width)
    seen = []
    model[1].linear.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
    optimizer = optimizers.AdamW(1e-3, weight_decay=0.01, global_clipnorm=1.0)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, seed=3, precision=precision)
    history = trainer.fit(model, digits(250), batch_size=32, epochs=2, verbose=0)
    weights = {k: v.detach().cpu().clone() for k, v in trainer.model_state_dict().items()}
    return {
        "weights": weights,
        "history": history.history,
        "forward": sorted(set(seen)),
        "peak": torch.cuda.max_memory_allocated() if HAVE_CUDA else None,
    }


def fit(rank, num_workers, port, kind="fully_sharded", precision="32", width=96, implementation="AUTO"):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[device_of(rank)])
    options = ds.CommunicationOptions(timeout_seconds=60, implementation=implementation)
    if kind == "fully_sharded":
        strategy = ds.FullyShardedStrategy(options, resolver, shard_units=[Block])
    else:
        strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    return fit_run(strategy, precision, width) | {"device": strategy.extended.worker_devices[0]}


def refused_on_a_shared_gpu(rank, num_workers, port):
    """Two workers on one GPU over gloo: the message (None if it was built)."""
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=["cuda:0"])
    options = ds.CommunicationOptions(timeout_seconds=60, implementation="RING")
    try:
        ds.FullyShardedStrategy(options, resolver)
    except ValueError as error:
        return str(error)
    return None
