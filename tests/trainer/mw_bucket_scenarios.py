"""Gradient-bucket scenarios run in worker processes by test_multi_worker_buckets.py."""

from __future__ import annotations

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies.buckets import GradientBuckets
from replicafit.trainer import Trainer


class Branchy(torch.nn.Module):
    """An MLP whose ``unused`` layer never takes part in the loss (its gradient is None)."""

    def __init__(self, unused: bool):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
        )
        self.unused = torch.nn.Linear(64, 64) if unused else None

    def forward(self, x):
        return self.body(x)


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(150, 8, generator=generator)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def strategy_for(rank, num_workers, port, local, bytes_per_pack, overlap):
    resolver = ds.SimpleClusterResolver(
        num_workers, rank, "127.0.0.1", port, devices=[f"cpu:{i}" for i in range(local)]
    )
    options = ds.CommunicationOptions(timeout_seconds=30.0, bytes_per_pack=bytes_per_pack)
    strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    strategy.extended.overlap_gradients = overlap
    return strategy


def _counting():
    """Records, at every reduce, how many buckets backward had already started."""
    started: list = []
    original = GradientBuckets.reduce

    def reduce(self, values):
        started.append((self._next, self.num_buckets))
        return original(self, values)

    GradientBuckets.reduce = reduce
    return started


def fit(rank, num_workers, port, overlap=True, bytes_per_pack=2048, unused=False, local=1, flag_on_host=None):
    GradientBuckets.flag_on_host = flag_on_host
    started = _counting()
    strategy = strategy_for(rank, num_workers, port, local, bytes_per_pack, overlap)
    torch.manual_seed(0)
    model = Branchy(unused)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), loss="cross_entropy", seed=3)
    history = trainer.fit(model, data(), batch_size=32, epochs=3, validation_split=0.2, verbose=0)
    return {
        "history": history.history,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "started": started,
        "hooks_left": sum(len(p._backward_hooks or {}) for p in model.parameters()),
    }


def transformed(rank, num_workers, port, overlap=True, scale_on=(1,), flag_on_host=None):
    """A step that changes its gradients after backward (in place, on some workers only)."""
    GradientBuckets.flag_on_host = flag_on_host
    strategy = strategy_for(rank, num_workers, port, 1, 2048, overlap)
    torch.manual_seed(0)
    model = Branchy(False)
    dmodel = strategy.distribute_module(model)
    variables = list(dmodel.trainable_variables)
    with strategy.scope():
        optimizer = optimizers.SGD(0.1)
    x, y = data()
    part = x[rank * 16 : (rank + 1) * 16], y[rank * 16 : (rank + 1) * 16]
    redone = []

    def step():
        loss = torch.nn.functional.cross_entropy(dmodel(part[0]), part[1])
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        if rank in scale_on:
            grads[-1].mul_(3.0)  # in place, in the first bucket: started during backward with the old value
        optimizer.apply_gradients(zip(grads, variables))

    for _ in range(3):
        with strategy.extended.gradient_step(variables):
            strategy.run(step)
        redone.append(strategy.extended._grad_buckets.redone)
    buckets = strategy.extended._grad_buckets
    # With the flag element when it rides in a bucket (the step values' spare elements aside).
    reduced = sum(b.buffer.numel() for b in buckets._buckets) - buckets._buckets[-1].spare.numel()
    strategy.extended.release_gradient_hooks()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "redone": redone, "extra": reduced - sum(w.numel() for w in weights.values())}
