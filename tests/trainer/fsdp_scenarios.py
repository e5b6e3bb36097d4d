"""FullyShardedStrategy scenarios, run in worker processes by test_fully_sharded.py (and in one process as the
oracle)."""

from __future__ import annotations

import torch
from conftest import Lion  # the base class docstring's subclass: build and update_step only (tests/ is on the path)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    """An input layer, three blocks (the units), a head: parameters of rows not divisible by 2 or 3 included."""

    def __init__(self, width: int = 11, classes: int = 3):
        super().__init__()
        self.inp = torch.nn.Linear(6, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(3)])
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_optimizer(kind: str):
    if kind == "adam":
        return optimizers.Adam(1e-2)
    if kind == "adamw_global_clipnorm":
        return optimizers.AdamW(1e-2, weight_decay=0.05, global_clipnorm=0.5)
    if kind == "adamw_clipnorm_excluded":
        optimizer = optimizers.AdamW(1e-2, weight_decay=0.1, clipnorm=0.3)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer
    if kind == "sgd_momentum_ema":
        return optimizers.SGD(0.05, momentum=0.9, use_ema=True, ema_momentum=0.9)
    if kind == "lion":
        return Lion(1e-3)
    if kind == "torch_adamw":
        return optimizers.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
    if kind == "adam_accumulation":
        return optimizers.Adam(1e-2, gradient_accumulation_steps=3)
    if kind == "loss_scaled":
        return optimizers.LossScaleOptimizer(optimizers.Adam(1e-2), initial_scale=2.0**120, dynamic_growth_steps=3)
    raise ValueError(kind)


def data(rows: int = 100):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 6, generator=generator)
    y = (x[:, :2].sum(dim=1) > 0).long() + (x[:, 2] > 0.5).long()
    return x, y


def strategy_for(rank, num_workers, port, **kwargs):
    if num_workers is None:
        return None  # the oracle: one process, the default strategy
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(timeout_seconds=30.0)
    return ds.FullyShardedStrategy(options, resolver, **kwargs)


def fit(rank, num_workers, port, kind="adam", epochs=2, batch_size=24, units=("Block",), precision="32"):
    """Two epochs of fit (100 rows in batches of 24: a partial last batch of 4); weights, history, optimizer state."""
    strategy = strategy_for(rank, num_workers, port, shard_units=list(units) if units else None)
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer(kind)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", seed=3, precision=precision)
    history = trainer.fit(model, data(), batch_size=batch_size, epochs=epochs, verbose=0)
    weights = {k: v.clone() for k, v in trainer.model_state_dict().items()}
    state = trainer.optimizer.state_dict()
    return {"history": history.history, "weights": weights, "state": state}
