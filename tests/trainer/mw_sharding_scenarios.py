"""Sharded optimizer states scenarios, run in worker processes by test_sharded_optimizer_states.py."""

from __future__ import annotations

import os
import sys

import torch
from conftest import Lion  # the base class docstring's subclass: build and update_step only (tests/ is on the path)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.strategies.collective import Collective
from replicafit.strategies.state_sharding import StateShards
from replicafit.trainer import Callback, Trainer, metrics


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
    if kind == "sgd_momentum_later":  # momentum set after the first epoch (MomentumLater): its slots made then
        return optimizers.SGD(0.05)
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


# Cut every bucket (the tests' models are small: by default buckets under StateShards.min_bytes stay whole).
StateShards.min_bytes = 0


def strategy_for(rank, num_workers, port, shard, bytes_per_pack=0, local=1):
    devices = [f"cpu:{i}" for i in range(local)]
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=devices)
    options = ds.CommunicationOptions(timeout_seconds=30.0, bytes_per_pack=bytes_per_pack)
    return ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=shard)


class Weights(Callback):
    """Reads the model's weights at every batch's end (a user's callback: the step's update must be there)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([p.detach().clone() for p in self.model.parameters()])


class MomentumLater(Callback):
    """Sets SGD's momentum at the first epoch's end (as a scheduler of momentum does): the slots are made then."""

    def on_epoch_end(self, epoch, logs=None):
        self.trainer.optimizer.momentum = 0.9


def fit(
    rank,
    num_workers,
    port,
    kind="adam",
    shard=True,
    epochs=2,
    units=7,
    bytes_per_pack=0,
    local=1,
    overlap=True,
    reader=False,
    min_bytes=0,
):
    """Two epochs of fit; the weights, history and the whole optimizer state afterwards (``reader``: and the
    weights a callback read after every step)."""
    StateShards.min_bytes = min_bytes
    strategy = strategy_for(rank, num_workers, port, shard, bytes_per_pack, local)
    start = strategy.extended._collective.operations
    strategy.extended.overlap_gradients = overlap
    model = model_of(units)
    trainer = Trainer(strategy=strategy, optimizer=make_optimizer(kind), loss="cross_entropy", seed=3)
    callbacks = ([Weights()] if reader else []) + ([MomentumLater()] if kind == "sgd_momentum_later" else [])
    history = trainer.fit(model, data(), batch_size=24, epochs=epochs, verbose=0, callbacks=callbacks)
    state = trainer.optimizer.state_dict()
    shards = _shards_of(trainer.optimizer)
    StateShards.min_bytes = 0
    return {
        "history": history.history,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "state": state,
        "owned": None if shards is None else sum(p.size for p in shards.pieces if p.segment not in shards.plan.whole),
        "whole": None if shards is None else sum(p.size for p in shards.pieces if p.segment in shards.plan.whole),
        "read": callbacks[0].seen if reader else None,
        "operations": strategy.extended._collective.operations - start,  # this fit's data collectives
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
    shards = _shards_of(optimizer)
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


def first_epoch(rank, num_workers, port, directory, kinds=("adam",), sharded_format=False):
    """For each kind, sharded and whole: one epoch, then ``save_checkpoint`` (the chief writes the whole state)
    to ``directory/{kind}-{sharded|whole}.pt``; ``sharded_format``: the sharded run writes a sharded checkpoint
    directory instead (every worker its chunks of the slots)."""
    for kind in kinds:
        for shard in (True, False):
            trainer = _trainer(rank, num_workers, port, shard, kind)
            trainer.fit(model_of(), data(), batch_size=24, epochs=1, verbose=0)
            path = os.path.join(directory, f"{kind}-{'sharded' if shard else 'whole'}.pt")
            trainer.save_checkpoint(path, sharded=sharded_format and shard)


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


class WithEmpty(torch.nn.Module):
    """An MLP with two parameters of no elements, one a float64 bucket of its own (an empty segment)."""

    def __init__(self):
        super().__init__()
        self.body = model_of()
        self.nothing = torch.nn.Parameter(torch.zeros(0))
        self.nothing64 = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))

    def forward(self, x):
        return self.body(x) + self.nothing.sum() + self.nothing64.sum().float()


def edges(rank, num_workers, port):
    """Edge cases, sharded and whole: parameters whose memory moves between steps (``param.data = ...``), for a
    built-in and a ``from_torch`` optimizer; a model with empty parameters; the refusals (a worker that would own
    nothing, a torch rule that reads whole parameters)."""
    out = {}
    for shard in (True, False):
        for kind in ("adam", "torch_adamw"):
            strategy = strategy_for(rank, num_workers, port, shard)
            net = model_of()
            with strategy.scope():
                model = strategy.distribute_module(net)
                optimizer = make_optimizer(kind)
            x, y = data(48)
            variables = model.trainable_variables

            def step(xb, yb, model=model, optimizer=optimizer, variables=variables):
                loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") / 48
                grads = torch.autograd.grad(loss, [v.value() for v in variables])
                optimizer.apply_gradients(zip(grads, variables))

            for number in range(3):
                part = slice(rank * 24, rank * 24 + 24)
                strategy.run(step, args=(x[part], y[part]))
                if number == 0:
                    for parameter in net.parameters():
                        parameter.data = parameter.data + 0.01  # other memory and values, the same parameter
            out["moved", kind, shard] = [v.read_value().detach().clone() for v in variables]
        strategy = strategy_for(rank, num_workers, port, shard)
        trainer = Trainer(strategy=strategy, optimizer=make_optimizer("adam"), loss="cross_entropy", seed=3)
        model = WithEmpty()
        trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
        out["empty", shard] = {
            "weights": {k: v.clone() for k, v in model.state_dict().items()},
            "state": trainer.optimizer.state_dict(),
        }
    for name, optimizer in (("tiny", "adam"), ("adafactor", "adafactor")):
        strategy = strategy_for(rank, num_workers, port, True)
        model = torch.nn.Linear(1, 1, bias=False) if name == "tiny" else model_of()
        made = optimizers.from_torch(torch.optim.Adafactor) if optimizer == "adafactor" else make_optimizer(optimizer)
        trainer = Trainer(strategy=strategy, optimizer=made, loss="mse")
        try:
            trainer.fit(model, (torch.randn(8, 1 if name == "tiny" else 6), torch.randn(8, 1 if name == "tiny" else 3)),
                        batch_size=4, epochs=1, verbose=0)  # fmt: skip
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    return out


class Boom(metrics.SparseCategoricalAccuracy):
    """An accuracy whose update raises at its ``at``-th call: a step that fails after its update was applied."""

    def __init__(self, at: int):
        super().__init__(name="accuracy")
        self.at, self.calls = at, 0

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom")
        super().update_state(y_true, y_pred, sample_weight)


def failed_step(rank, num_workers, port):
    """A step that raises after ``apply_gradients`` (in the metrics' update), sharded and whole: the weights that
    fit leaves behind (every worker's update gathered in, as unsharded)."""
    out = {}
    for shard in (True, False):
        strategy = strategy_for(rank, num_workers, port, shard)
        trainer = Trainer(
            strategy=strategy, optimizer=make_optimizer("adam"), loss="cross_entropy", metrics=[Boom(4)], seed=3
        )
        model = model_of()
        try:
            trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
        except RuntimeError as error:
            out[shard, "error"] = str(error)
        out[shard] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _shards_of(optimizer):
    """The optimizer's ``StateShards`` (its state layout where that cuts the variables into slices), else None."""
    layout = getattr(optimizer, "_layout", None)
    return layout if layout is not None and layout.slices_variables else None


def second_optimizers(rank, num_workers, port):
    """Two optimizers, one after the other, on the same variables (the strategy hands both the same shards):
    a second ``fit`` with a new optimizer, and a custom loop whose second optimizer excludes the bias from
    weight decay; sharded and unsharded."""
    out = {}
    for shard in (True, False):
        strategy = strategy_for(rank, num_workers, port, shard)
        model = model_of()
        trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-2), loss="cross_entropy", seed=3)
        trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
        trainer.optimizer = optimizers.from_torch(torch.optim.SGD, lr=0.05, momentum=0.9)
        trainer.fit(model, data(), batch_size=24, epochs=1, verbose=0)
        with strategy.scope():
            distributed = strategy.distribute_module(model)
            decayed = optimizers.SGD(0.1, momentum=0.9, weight_decay=0.5)
        decayed.exclude_from_weight_decay(var_names=["bias"])
        variables = distributed.trainable_variables
        x, y = data(48)

        def step(xb, yb, distributed=distributed, decayed=decayed, variables=variables):
            loss = torch.nn.functional.cross_entropy(distributed(xb), yb, reduction="sum") / 48
            decayed.apply_gradients(zip(torch.autograd.grad(loss, [v.value() for v in variables]), variables))

        for _ in range(2):
            strategy.run(step, args=(x[rank * 24 : rank * 24 + 24], y[rank * 24 : rank * 24 + 24]))
        out[shard] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def weights_checkpoints(rank, num_workers, port, folder):
    """``ModelCheckpoint`` with and without ``save_weights_only`` under sharded optimizer states: what each wrote."""
    from replicafit.trainer import ModelCheckpoint

    trainer = _trainer(rank, num_workers, port, True, "adam")
    callbacks = [
        ModelCheckpoint(os.path.join(folder, "weights.pt"), save_weights_only=True),
        ModelCheckpoint(os.path.join(folder, "full")),
    ]
    trainer.fit(model_of(), data(), batch_size=24, epochs=1, verbose=0, callbacks=callbacks)
    return {"weights": {k: v.clone() for k, v in trainer.model_state_dict().items()}}
