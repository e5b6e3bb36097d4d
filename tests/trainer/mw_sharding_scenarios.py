"""Sharded optimizer states scenarios, run in worker processes by test_sharded_optimizer_states.py."""

from __future__ import annotations

import os
import sys

import torch
from conftest import Lion  # the base class docstring's subclass: build and update_step only (tests/ is on the path)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies.collective import Collective
from replicafit.trainer import Trainer


class WholeNorm(Lion):
    """A rule that reads whole variables (as LAMB's trust ratio): it declares so."""

    elementwise_update = False


def make_optimizer(kind: str):
    if kind == "adam":
        return optimizers.Adam(1e-2)
    if kind == "adamw_global_clipnorm":
        return optimizers.AdamW(1e-2, weight_decay=0.05, global_clipnorm=0.5)
    if kind == "adamw_excluded":
        optimizer = optimizers.AdamW(1e-2, weight_decay=0.1, clipnorm=0.3)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer
    if kind == "sgd_momentum_ema":
        return optimizers.SGD(0.05, momentum=0.9, use_ema=True, ema_momentum=0.9)
    if kind == "rmsprop_clipvalue":
        return optimizers.RMSprop(1e-2, momentum=0.5, clipvalue=0.05)
    if kind == "adagrad":
        return optimizers.Adagrad(0.05)
    if kind == "lion":
        return Lion(1e-3)
    if kind == "whole_norm":
        return WholeNorm(1e-3)
    if kind == "torch_adamw":
        return optimizers.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
    if kind == "adam_accumulation":
        return optimizers.Adam(1e-2, gradient_accumulation_steps=3)
    if kind == "loss_scaled":
        return optimizers.LossScaleOptimizer(optimizers.Adam(1e-2), initial_scale=2.0**120, dynamic_growth_steps=3)
    raise ValueError(kind)


def model_of(units: int = 7):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 33), torch.nn.ReLU(), torch.nn.Linear(33, units), torch.nn.ReLU(), torch.nn.Linear(units, 3)
    )


def data(rows: int = 120):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 6, generator=generator)
    y = (x[:, :2].sum(dim=1) > 0).long() + (x[:, 2] > 0.5).long()
    return x, y


def strategy_for(rank, num_workers, port, shard, bytes_per_pack=0, local=1):
    devices = [f"cpu:{i}" for i in range(local)]
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=devices)
    options = ds.CommunicationOptions(timeout_seconds=30.0, bytes_per_pack=bytes_per_pack)
    return ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=shard)


def fit(rank, num_workers, port, kind="adam", shard=True, epochs=2, units=7, bytes_per_pack=0, local=1, overlap=True):
    """Two epochs of fit; the weights, history and the whole optimizer state afterwards."""
    strategy = strategy_for(rank, num_workers, port, shard, bytes_per_pack, local)
    strategy.extended.overlap_gradients = overlap
    model = model_of(units)
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer(kind), loss="cross_entropy", seed=3)
    history = trainer.fit(model, data(), batch_size=24, epochs=epochs, verbose=0)
    state = trainer.optimizer.state_dict()
    shards = trainer.optimizer._shards if hasattr(trainer.optimizer, "_shards") else None
    return {
        "history": history.history,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "state": state,
        "owned": None if shards is None else sum(p.size for p in shards.pieces),
    }


def refused(rank, num_workers, port):
    """The message of a rule that needs whole variables under sharding (None if it trained)."""
    strategy = strategy_for(rank, num_workers, port, True)
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer("whole_norm"), loss="cross_entropy")
    try:
        trainer.fit(model_of(), data(), batch_size=24, epochs=1, verbose=0)
    except ValueError as error:
        return str(error)
    return None


def custom_loops(rank, num_workers, port, scatter=None):
    """``custom_loop`` sharded and whole, in replica and cross-replica context; and ``refused``."""
    Collective.prefer_scatter = scatter
    out = {
        (shard, cross): custom_loop(rank, num_workers, port, shard=shard, cross_replica=cross)
        for shard in (True, False)
        for cross in (False, True)
    }
    out["refused"] = refused(rank, num_workers, port)
    return out


def custom_loop(rank, num_workers, port, shard=True, kind="adam", cross_replica=False):
    """``strategy.run`` + ``apply_gradients`` (the packed reduce-scatter, no buckets), or gradients reduced by
    hand and applied in cross-replica context."""
    strategy = strategy_for(rank, num_workers, port, shard)
    with strategy.scope():
        model = strategy.distribute_module(model_of())
        optimizer = make_optimizer(kind)
    x, y = data(48)
    variables = model.trainable_variables

    def step(xb, yb):
        ctx = ds.get_replica_context()
        loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") / 48
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        if cross_replica:
            return grads
        optimizer.apply_gradients(zip(grads, variables))
        return ctx.replica_id_in_sync_group

    for _ in range(3):
        part = slice(rank * 24, rank * 24 + 24)
        out = strategy.run(step, args=(x[part], y[part]))
        if cross_replica:
            reduced = strategy.extended.batch_reduce_to("SUM", [(g, v) for g, v in zip(out, variables)])
            optimizer.apply_gradients(zip(reduced, variables))
    shards = optimizer._shards
    return {
        "weights": [v.read_value().detach().clone() for v in variables],
        "state": optimizer.state_dict(),
        "owned": None if shards is None else sum(p.size for p in shards.pieces),
    }


def compare(rank, num_workers, port, cases=(("adam", {}),), scatter=None):
    """For each ``(kind, fit kwargs)``: ``fit`` sharded, then unsharded, in the same processes (the strategies
    share the process group). ``scatter=True``: reduce-scatter and all-gather (NCCL's way) on gloo too."""
    Collective.prefer_scatter = scatter
    return [
        {
            "sharded": fit(rank, num_workers, port, kind, shard=True, **kwargs),
            "whole": fit(rank, num_workers, port, kind, shard=False, **kwargs),
        }
        for kind, kwargs in cases
    ]


def element_level(rank, num_workers, port, scatter=None):
    """An element-level loss (its real-element count rides with the reduce-scatter) sharded and whole."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import element_scenarios

    Collective.prefer_scatter = scatter
    out = {}
    for shard in (True, False):
        strategy = strategy_for(rank, num_workers, port, shard)
        out[shard] = element_scenarios.ours("ignore_index", strategy, batch_size=8)["weights"]
    return out


def _trainer(rank, num_workers, port, shard, kind):
    strategy = strategy_for(rank, num_workers, port, shard) if num_workers > 1 else None
    return Trainer(strategy=strategy, optimizer=make_optimizer(kind), loss="cross_entropy", seed=3)


def first_epoch(rank, num_workers, port, directory, kinds=("adam",)):
    """For each kind, sharded and whole: one epoch, then ``save_checkpoint`` (the chief writes the whole state)
    to ``directory/{kind}-{sharded|whole}.pt``."""
    for kind in kinds:
        for shard in (True, False):
            trainer = _trainer(rank, num_workers, port, shard, kind)
            trainer.fit(model_of(), data(), batch_size=24, epochs=1, verbose=0)
            trainer.save_checkpoint(os.path.join(directory, f"{kind}-{'sharded' if shard else 'whole'}.pt"))


def second_epoch(rank, num_workers, port, directory, kinds=("adam",), shard=True):
    """For each checkpoint ``first_epoch`` wrote: ``load_checkpoint`` on this number of workers (one: no
    strategy), then one more epoch; the loaded state, weights and state after it."""
    out = {}
    for kind in kinds:
        for saved in ("sharded", "whole"):
            trainer = _trainer(rank, num_workers, port, shard, kind)
            model = model_of()
            trainer.load_checkpoint(os.path.join(directory, f"{kind}-{saved}.pt"), model)
            loaded = trainer.optimizer.state_dict()
            trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
            out[kind, saved] = {
                "loaded": loaded,
                "weights": {k: v.clone() for k, v in model.state_dict().items()},
                "state": trainer.optimizer.state_dict(),
            }
    return out
