"""FullyShardedStrategy scenarios, run in worker processes by test_fully_sharded.py (and in one process as the
oracle)."""

from __future__ import annotations

import os
import sys

import torch
from conftest import Lion  # the base class docstring's subclass: build and update_step only (tests/ is on the path)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path in the worker processes


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


def fits(rank, num_workers, port, kinds=("adam",), **kwargs):
    """``fit`` for each optimizer kind, one after another in the same processes (one strategy)."""
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    return {kind: fit_with(strategy, kind, **kwargs) for kind in kinds}


def fit_with(strategy, kind, epochs=2, batch_size=24, precision="32"):
    torch.manual_seed(0)
    model = Net()
    calls = []  # the first block's forward passes (with activation checkpointing: again in each backward)
    model.blocks[0].linear.register_forward_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    optimizer = make_optimizer(kind)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", seed=3, precision=precision)
    history = trainer.fit(model, data(), batch_size=batch_size, epochs=epochs, verbose=0)
    weights = {k: v.clone() for k, v in trainer.model_state_dict().items()}
    state = trainer.optimizer.state_dict()
    return {"history": history.history, "weights": weights, "state": state, "forward_calls": len(calls)}


def element_fit(rank, num_workers, port, epochs=2):
    """A token tagger with a torch loss of ``ignore_index`` over padded labels (a row with no real token), in
    batches of 8 of 30 rows (a partial last batch of 6, cut 3/3 or 3/3/0)."""
    from element_scenarios import case

    strategy = strategy_for(rank, num_workers, port)
    model, (ids, labels), loss, _, _ = case("ignore_index")
    trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-2), loss=loss, metrics=[], seed=0)
    history = trainer.fit(model, (ids, labels), batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return {"history": history.history, "weights": {k: v.clone() for k, v in trainer.model_state_dict().items()}}


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=40,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def gpt2_data(rows: int = 20, length: int = 9):
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 40, (rows, length), generator=generator)
    lengths = torch.randint(3, length + 1, (rows,), generator=generator)
    padding = torch.arange(length) >= lengths[:, None]
    ids = ids.masked_fill(padding, 0)
    return {"input_ids": ids, "attention_mask": (~padding).long(), "labels": ids.masked_fill(padding, -100)}


def gpt2_fit(rank, num_workers, port, epochs=2):
    """A tiny GPT-2 with its own loss (``loss=None``), its units its ``_no_split_modules`` (``GPT2Block``), in
    batches of 8 of 20 rows (a partial last batch of 4)."""
    strategy = strategy_for(rank, num_workers, port)
    model = tiny_gpt2()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.5, momentum=0.5), loss=None, metrics=[], seed=0)
    validation = {key: value[:10] for key, value in gpt2_data(30).items()}  # batches of 8: a partial one of 2
    history = trainer.fit(
        model, gpt2_data(), batch_size=8, epochs=epochs, shuffle=False, verbose=0, validation_data=validation
    )
    units = [type(u).__name__ for u in strategy.extended.units] if strategy is not None else []
    evaluated = trainer.evaluate(model, validation, batch_size=8, verbose=0)
    predicted = trainer.predict(model, {"input_ids": validation["input_ids"]}, batch_size=4, verbose=0)
    return {
        "history": history.history,
        "weights": {k: v.clone() for k, v in trainer.model_state_dict().items()},
        "units": units,
        "evaluated": evaluated,
        "predicted": predicted,
    }


def precision_fit(rank, num_workers, port, precision="bf16-mixed"):
    """A fit under a mixed precision: the dtype the blocks' forward sees, the sharded parameters' dtype after."""
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    torch.manual_seed(0)
    model = Net()
    seen = []
    model.blocks[0].linear.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-2), loss="cross_entropy", precision=precision)
    history = trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
    sharded = [p.dtype for p in model.parameters()]
    return {
        "history": history.history,
        "forward": sorted({str(d) for d in seen}),
        "stored": sorted({str(d) for d in sharded}),
    }


def one_worker_fit(rank, num_workers, port):
    """One worker: nothing is sharded (the default strategy's results, bit for bit)."""
    out = fit(rank, 1 if num_workers else None, port, kind="adamw_global_clipnorm")
    out["units"] = None
    return out


def backed_up_fit(rank, num_workers, port, backup_dir, crash_at=None, kind="adamw_global_clipnorm", save_freq=2):
    """Two epochs of ``fit`` (5 steps each, the last a partial batch) backed up every ``save_freq`` steps;
    ``crash_at``: interrupted at that global step (the backup stays). ``num_workers=None``: the default strategy,
    ``"one"``: a one-worker FullyShardedStrategy. What is in the backup folder when it stops."""
    if num_workers == "one":
        strategy = strategy_for(0, 1, port, shard_units=["Block"])
    else:
        strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    torch.manual_seed(0)
    model = Net()
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer(kind), loss="cross_entropy", seed=3)
    from mw_resume_scenarios import Crash, CrashAt

    backup = BackupAndRestore(backup_dir, save_freq=save_freq)
    callbacks = [backup] + ([CrashAt(crash_at)] if crash_at is not None else [])
    try:
        history = trainer.fit(model, data(), batch_size=24, epochs=2, verbose=0, callbacks=callbacks)
    except Crash:
        return {"crashed": True, "files": sorted(os.listdir(backup_dir)), "path": backup.path}
    return {
        "crashed": False,
        "history": history.history,
        "weights": {k: v.clone() for k, v in trainer.model_state_dict().items()},
        "files": sorted(os.listdir(backup_dir)),
    }


def exported(rank, num_workers, port, path):
    """A fit, then the consolidated export ``trainer.save_checkpoint(path)`` (one file, written by the chief)."""
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    torch.manual_seed(0)
    model = Net()
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer("adam"), loss="cross_entropy", seed=3)
    trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
    trainer.save_checkpoint(path)
    with ds.sharded_state_dict():
        shards = {
            k: v.to_local().clone() if hasattr(v, "to_local") else v for k, v in trainer.model_state_dict().items()
        }
    return {"shards": shards}


def variant_fit(rank, num_workers, port, **options):
    """``fit`` with strategy options (``activation_checkpointing``, ``reshard_after_forward``, ``shard_units``) and
    ``precision``."""
    precision = options.pop("precision", "32")
    options.setdefault("shard_units", ["Block"])
    strategy = None if num_workers is None else strategy_for(rank, num_workers, port, **options)
    return fit_with(strategy, "adamw_global_clipnorm", precision=precision)


def surface(rank, num_workers, port):
    """The tf.distribute surface under FullyShardedStrategy: run, reduce, gather, the distributed dataset (each
    worker its rows), variables created in scope, the cluster."""
    strategy = strategy_for(rank, num_workers, port)
    out = strategy.run(lambda: torch.tensor([1.0 + ds.get_replica_context().replica_id_in_sync_group]))
    total = strategy.reduce("SUM", out, axis=None)
    gathered = strategy.gather(out, axis=0)
    rows = []
    for batch in strategy.experimental_distribute_dataset(
        torch.utils.data.DataLoader(torch.arange(10.0), batch_size=4)
    ):
        rows.append(strategy.experimental_local_results(batch)[0].tolist())
    with strategy.scope():
        v = ds.Variable(float(rank))  # worker 0's initial value everywhere
    return {
        "replicas": strategy.num_replicas_in_sync,
        "total": total.tolist(),
        "gathered": gathered.tolist(),
        "rows": rows,
        "variable": float(v.numpy()),
        "chief": strategy.cluster.is_chief,
        "capabilities": strategy.extended.capabilities,
    }


def model_checkpoints(rank, num_workers, port, folder, weights_only=False):
    """``ModelCheckpoint`` every epoch: sharded directories under FullyShardedStrategy."""
    from replicafit.trainer import ModelCheckpoint

    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    torch.manual_seed(0)
    model = Net()
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer("adam"), loss="cross_entropy", seed=3)
    callback = ModelCheckpoint(os.path.join(folder, "ckpt-{epoch}"), save_weights_only=weights_only)
    trainer.fit(model, data(), batch_size=24, epochs=2, verbose=0, callbacks=[callback])
    return {"weights": {k: v.clone() for k, v in trainer.model_state_dict().items()}}


def load_model_checkpoint(rank, num_workers, port, path):
    """``trainer.load_checkpoint`` of a (sharded) checkpoint: the weights and the optimizer's iterations."""
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    torch.manual_seed(1)  # other initial weights: the checkpoint's replace them
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer("adam"), loss="cross_entropy", seed=3)
    state = trainer.load_checkpoint(path, Net())
    return {
        "weights": {k: v.clone() for k, v in trainer.model_state_dict().items()},
        "iterations": int(trainer.optimizer.iterations),
        "epoch": state["epoch"],
    }


class WholeNorm(Lion):
    """A rule that reads whole variables (as LAMB's trust ratio): it declares so."""

    elementwise_update = False


def refused(rank, num_workers, port):
    """The message of a rule that needs whole variables under sharded parameters (None if it trained)."""
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    trainer = Trainer(strategy=strategy, optimizer=WholeNorm(1e-3), loss="cross_entropy")
    try:
        trainer.fit(Net(), data(), batch_size=24, epochs=1, verbose=0)
    except ValueError as error:
        return str(error)
    return None


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Net()
        self.other = torch.nn.Linear(3, 2)

    def forward(self, x):
        scores = self.body(x)
        return {"a": scores, "b": self.other(torch.tanh(scores))}


def two_outputs(rank, num_workers, port):
    """A model of two outputs on 97 rows in batches of 24 (the last row alone: a worker without rows on 2 workers):
    the per-output losses of the history and of ``evaluate``."""
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    torch.manual_seed(0)
    x, y = data(97)
    targets = {"a": y, "b": (y > 0).long()}
    trainer = Trainer(
        strategy=strategy,
        optimizer=make_optimizer("adam"),
        loss={"a": "cross_entropy", "b": "cross_entropy"},
        metrics=[],
        seed=3,
    )
    history = trainer.fit(TwoHeads(), (x, targets), batch_size=24, epochs=2, verbose=0)
    return {
        "history": history.history,
        "evaluate": trainer.evaluate(trainer.model.module, (x, targets), batch_size=24, verbose=0, return_dict=True),
    }


def edges(rank, num_workers, port, folder):
    """The mesh is the default group's (its timeout the strategy's) even where CUDA is present; TensorBoard's
    histograms of a sharded model; ``Optimizer.minimize`` in a custom loop (``num_workers=None``: that loop alone, in
    one process)."""
    import torch.distributed as dist

    from replicafit.trainer import TensorBoard

    out = {}
    strategy = strategy_for(rank, num_workers, port, shard_units=["Block"])
    if strategy is not None:
        available = torch.cuda.is_available
        torch.cuda.is_available = lambda: True  # where init_device_mesh would make a group of its own (no timeout)
        try:
            strategy.distribute_module(Net())
        finally:
            torch.cuda.is_available = available
        out["world"] = strategy.extended.device_mesh.get_group() is dist.group.WORLD
        trainer = Trainer(strategy=strategy, optimizer=make_optimizer("adam"), loss="cross_entropy", seed=3)
        board = TensorBoard(os.path.join(folder, f"logs{rank}"), histogram_freq=1)
        trainer.fit(Net(), data(), batch_size=24, epochs=1, verbose=0, callbacks=[board])
        out["logs"] = sorted(os.listdir(os.path.join(folder, f"logs{rank}"))) if rank == 0 else None
    else:
        strategy = ds.get_strategy()
    torch.manual_seed(0)
    dm = strategy.distribute_module(Net())
    optimizer = make_optimizer("adam")
    x, y = data()
    source = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=20)

    def step(xs, ys):
        loss = torch.nn.functional.cross_entropy(dm(xs), ys, reduction="sum") / 20
        optimizer.minimize(loss, dm.trainable_variables)

    with strategy.scope():
        for batch in strategy.experimental_distribute_dataset(source):
            strategy.run(step, args=batch)
    out["weights"] = {k: v.clone() for k, v in dm.state_dict().items()}
    return out
