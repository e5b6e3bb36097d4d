"""``Trainer`` scenarios run in worker processes by test_multi_worker_fit.py (and ``fit_run`` in-process)."""

from __future__ import annotations

import os
import random
import signal

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer, callbacks


def strategy_for(rank, num_workers, port, timeout=30.0):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    return ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=timeout), resolver)


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(150, 8, generator=generator)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def fit_run(
    strategy,
    init_seed,
    *,
    seed=None,
    data_seed=None,
    extra_callbacks=(),
    epochs=3,
    optimizer=None,
    precision="32",
    dropout=0.0,
    validation_split=0.2,
    **fit_kwargs,
):
    """A small fit (partial last batch: 120 training rows in batches of 32, then 30 for validation)."""
    torch.manual_seed(init_seed)
    middle = [torch.nn.Dropout(dropout)] if dropout else []
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), *middle, torch.nn.Linear(16, 3))
    optimizer = optimizer or optimizers.SGD(0.1, momentum=0.9)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", seed=seed, precision=precision)
    if data_seed is not None:  # the reference run takes the seed the workers agreed on
        random.seed(data_seed)
    history = trainer.fit(
        model,
        data(),
        epochs=epochs,
        validation_split=validation_split,
        verbose=0,
        callbacks=list(extra_callbacks),
        **{"batch_size": 32} | fit_kwargs,
    )
    return {
        "history": history.history,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "data_seed": trainer._training_state.data_seed,
        "iterations": int(trainer.optimizer.iterations),
        "predict": trainer.predict(model, data()[0][:37], batch_size=16),
        "evaluate": trainer.evaluate(model, data(), batch_size=32, verbose=0, return_dict=True),
        "loss_scale": trainer.optimizer.state_dict().get("loss_scale"),
        "averages": _averages(trainer.optimizer),
    }


def _averages(optimizer) -> dict | None:
    """The moving averages (``use_ema``) by variable position, else None."""
    if not optimizer.use_ema:
        return None
    return {position: entry["average"] for position, entry in optimizer.state_dict()["slots"].items()}


def accumulated_settings() -> dict:
    """``fit_run`` arguments: accumulation over 3 steps at batch 16 (the workers' and the reference's)."""
    optimizer = optimizers.Adam(0.01, global_clipnorm=1.0, gradient_accumulation_steps=3)
    return {"init_seed": 100, "seed": 3, "optimizer": optimizer, "batch_size": 16}


def accumulated(rank, num_workers, port):
    """Accumulation over 3 steps at batch 16 (8 steps per epoch: windows of 3, 3 and a partial 2),
    with the collectives of each ``strategy.run`` (each step) counted."""
    strategy = strategy_for(rank, num_workers, port)
    per_step = count_collectives_per_run(strategy)
    result = fit_run(strategy, **accumulated_settings())
    return result | {"collectives_per_step": per_step}


def count_collectives_per_run(strategy) -> list:
    """From now on, the collectives of each ``strategy.run`` (each training step) are appended to the list
    returned."""
    from replicafit.strategies.collective import Collective

    operations, per_run = [], []
    guard = Collective._guard
    Collective._guard = lambda self, operation: (operations.append(operation), guard(self, operation))[1]
    run = strategy.run

    def counting_run(fn, args=(), kwargs=None, options=None):
        before = len(operations)
        result = run(fn, args=args, kwargs=kwargs, options=options)
        per_run.append(len(operations) - before)
        return result

    strategy.run = counting_run
    return per_run


def float16_settings() -> dict:
    """``fit_run`` arguments: ``"16-mixed"`` with a scale far too large at first, so float16 overflows
    and steps are skipped until it has come down."""
    inner = optimizers.SGD(0.1, momentum=0.9)
    optimizer = optimizers.LossScaleOptimizer(inner, initial_scale=2.0**24, dynamic_growth_steps=3)
    return {"init_seed": 100, "seed": 3, "optimizer": optimizer, "precision": "16-mixed"}


def float16_mixed(rank, num_workers, port):
    """``precision="16-mixed"`` with skipped steps: every worker must take the same decisions."""
    strategy = strategy_for(rank, num_workers, port)
    return fit_run(strategy, **float16_settings())


def ema_settings() -> dict:
    """``fit_run`` arguments: AdamW with biases excluded from its decay, moving averages that overwrite
    the weights every 4 updates, and validation, early stopping and the end judged on the averages."""
    optimizer = optimizers.AdamW(0.01, weight_decay=0.1, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=4)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    swap = callbacks.SwapEMAWeights(swap_on_epoch=True)
    stop = callbacks.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    return {"init_seed": 100, "seed": 3, "optimizer": optimizer, "extra_callbacks": (swap, stop)}


def ema(rank, num_workers, port):
    """Weight-decay exclusions and moving averages: every worker's copies and averages stay equal."""
    return fit_run(strategy_for(rank, num_workers, port), **ema_settings())


def dropout(rank, num_workers, port, seed=None):
    """Dropout: each worker's replica draws its masks from the stream of its global replica id."""
    random.seed(1000 + rank)
    torch.manual_seed(rank)  # each process's own generator state: the masks must not depend on it
    return fit_run(strategy_for(rank, num_workers, port), init_seed=100, seed=seed, dropout=0.3)


def fit(rank, num_workers, port, seed=None):
    random.seed(1000 + rank)  # each process would draw another data seed: the chief's must win
    return fit_run(strategy_for(rank, num_workers, port), init_seed=100 + rank, seed=seed)


class StopOnOneWorker(callbacks.Callback):
    """Sets stop_training on one worker only (a user's callback with its own reasons)."""

    def __init__(self, worker, at_step):
        super().__init__()
        self.worker, self.at_step, self.steps = worker, at_step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.trainer.strategy.cluster.worker_index == self.worker and self.steps == self.at_step:
            self.trainer.stop_training = True


def stop_on_one_worker(rank, num_workers, port):
    strategy = strategy_for(rank, num_workers, port)
    return fit_run(strategy, init_seed=0, seed=1, extra_callbacks=[StopOnOneWorker(1, 5)], epochs=5)


def chief_writes(rank, num_workers, port, outdir):
    strategy = strategy_for(rank, num_workers, port)
    cbs = [
        callbacks.ModelCheckpoint(os.path.join(outdir, "best.pt"), monitor="val_loss", save_best_only=True),
        callbacks.ModelCheckpoint(os.path.join(outdir, "weights-{epoch}.pt"), save_weights_only=True),
        callbacks.CSVLogger(os.path.join(outdir, "history.csv")),
        callbacks.BackupAndRestore(os.path.join(outdir, "backup"), save_freq=2, delete_checkpoint=False),
    ]
    result = fit_run(strategy, init_seed=0, seed=3, extra_callbacks=cbs)
    result["files"] = sorted(os.listdir(outdir))
    result["backup_files"] = sorted(os.listdir(os.path.join(outdir, "backup")))
    return result


class KillAt(callbacks.Callback):
    """SIGKILLs this worker at a global step, once (a marker file remembers it happened)."""

    def __init__(self, worker, step, marker):
        super().__init__()
        self.worker, self.step, self.marker = worker, step, marker

    def on_train_batch_end(self, batch, logs=None):
        trainer = self.trainer
        if (
            trainer.strategy.cluster.worker_index == self.worker
            and int(trainer.optimizer.iterations) == self.step
            and not os.path.exists(self.marker)
        ):
            with open(self.marker, "w") as file:
                file.write("killed")
            os.kill(os.getpid(), signal.SIGKILL)


def resumed(rank, num_workers, port, outdir, kill_step=None, seed=None):
    strategy = strategy_for(rank, num_workers, port, timeout=10.0)
    random.seed(2000 + rank)
    # (the periodic backups alone, this test's subject; test_peer_failure.py resumes dropout from a survivor's backup)
    cbs = [callbacks.BackupAndRestore(os.path.join(outdir, "backup"), save_freq=1, save_on_peer_failure=False)]
    if kill_step is not None:
        cbs.append(KillAt(1, kill_step, os.path.join(outdir, "killed")))
    return fit_run(strategy, init_seed=7, seed=seed, extra_callbacks=cbs, epochs=3, dropout=0.3)


def uneven_shards(rank, num_workers, port):
    """Worker 0's shard has 5 batches, worker 1's 3: both step 5 times, worker 1 with empty batches at the end."""
    strategy = strategy_for(rank, num_workers, port)
    batches = 5 if rank == 0 else 3

    def dataset_fn(ctx):
        return [torch.full((4, 2), float(ctx.input_pipeline_id * 10 + i)) for i in range(batches)]

    steps = []
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    for batch in iterator:
        rows = strategy.reduce("SUM", strategy.run(lambda b: torch.tensor(float(b.shape[0])), args=(batch,)))
        steps.append((int(batch.shape[0]), float(rows), iterator.global_batch_size))
    return steps


def diverging_source(rank, num_workers, port, kind="list"):
    """A global-batch source with one more batch on worker 1: an error on both, never a hang.

    A list has a length (compared once, up front); a generator has none (checked step by step).
    """
    strategy = strategy_for(rank, num_workers, port, timeout=20.0)
    batches = [torch.ones(4, 2) * i for i in range(4 + rank)]
    if kind == "generator":
        batches = (b for b in batches)
    count = 0
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.reduce("SUM", strategy.run(lambda b: b.sum(), args=(batch,)))
        count += 1
    return count


class StopAtEpochBegin(callbacks.Callback):
    """Sets stop_training in on_epoch_begin, on one worker only."""

    def __init__(self, worker, epoch):
        super().__init__()
        self.worker, self.epoch = worker, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if self.trainer.strategy.cluster.worker_index == self.worker and epoch == self.epoch:
            self.trainer.stop_training = True


def stop_at_epoch_begin(rank, num_workers, port):
    strategy = strategy_for(rank, num_workers, port, timeout=20.0)
    return fit_run(strategy, init_seed=0, seed=1, extra_callbacks=[StopAtEpochBegin(1, 1)], epochs=3)


def fit_batch_norm(strategy, init_seed=0):
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=2)
    trainer.fit(model, data(), batch_size=32, epochs=2, verbose=0)
    return {
        "buffers": {k: v.clone() for k, v in model.state_dict().items()},
        "predict": trainer.predict(model, data()[0][:20], batch_size=8),
    }


def batch_norm(rank, num_workers, port):
    return fit_batch_norm(strategy_for(rank, num_workers, port), init_seed=0)


def batch_norm_model(kind: str, sync: bool, init_seed: int = 0) -> torch.nn.Module:
    """A model with ``BatchNorm1d`` (``"mlp"``) or a CNN with ``BatchNorm2d`` and ``BatchNorm1d`` (``"cnn"``),
    converted to ``nn.SyncBatchNorm`` when ``sync``."""
    nn = torch.nn
    torch.manual_seed(init_seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    else:
        model = nn.Sequential(
            nn.Unflatten(1, (2, 2, 2)),
            nn.Conv2d(2, 4, 2, padding=1, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(36, 8),
            nn.BatchNorm1d(8, momentum=None),
            nn.Linear(8, 3),
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def fit_sync_batch_norm(strategy, kind: str, sync: bool = True, rows: int = 100, batch_size: int = 32) -> dict:
    """A fit on ``rows`` rows (100 in batches of 32: a partial last batch of 4, split 2/2/0 under Mirrored(3),
    an empty replica); the trained state, the history and ``evaluate`` on the other rows."""
    model = batch_norm_model(kind, sync)
    x, y = data()
    trainer = Trainer(
        strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), loss="cross_entropy", metrics=["accuracy"]
    )
    history = trainer.fit(model, (x[:rows], y[:rows]), batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "history": history.history,
        "evaluate": trainer.evaluate(model, (x[100:], y[100:]), batch_size=16, verbose=0, return_dict=True),
    }


def sync_batch_norm(rank, num_workers, port, kind, rows=100):
    return fit_sync_batch_norm(strategy_for(rank, num_workers, port), kind, rows=rows)


class RecordingTrainer(Trainer):
    """Records the first feature of every row each replica trains on."""

    seen: list = []

    def train_step(self, data):
        self.seen.extend(data[0][:, 0].tolist())
        return super().train_step(data)


def dataloader_rows(rank, num_workers, port):
    """A shuffled DataLoader with seed=None: the workers must see one permutation (each its share)."""
    strategy = strategy_for(rank, num_workers, port)
    torch.manual_seed(500 + rank)  # every process's generator starts elsewhere
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    trainer = RecordingTrainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy")
    trainer.fit(model, loader, epochs=1, verbose=0)
    return RecordingTrainer.seen


def join_alone(rank, num_workers, port):
    """The only worker of a cluster of two: joining fails after the timeout, as a WorkerFailedError."""
    try:
        strategy_for(0, 2, port, timeout=2.0)
    except ds.WorkerFailedError as error:
        return str(error)
    return "joined"


def join_without_chief(rank, num_workers, port):
    """Worker 1 of a cluster of two whose chief never starts: ``(message, seconds)`` of the failure."""
    import time

    start = time.monotonic()
    try:
        strategy_for(1, 2, port, timeout=2.0)
    except ds.WorkerFailedError as error:
        return str(error), time.monotonic() - start
    return "joined", time.monotonic() - start


class CountingDataset(torch.utils.data.Dataset):
    """``(x[i], y[i])`` examples, counting how many are read."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.reads += 1
        return self.x[index], self.y[index]


def sharded_run(strategy, kind: str, rows: int = 150, batch: int = 32) -> dict:
    """fit (2 epochs, shuffled), evaluate and predict on a counting map-style ``Dataset`` (``kind="dataset"``,
    with ``batch_size``) or a ``DataLoader(shuffle=True)`` of one (``kind="loader"``); the results and how
    many examples each read."""
    x, y = data()
    dataset = CountingDataset(x[:rows], y[:rows])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = Trainer(
        strategy=strategy,
        optimizer=optimizers.SGD(0.1, momentum=0.9),
        loss="cross_entropy",
        metrics=["accuracy"],
        seed=5,
    )
    if kind == "loader":
        train = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True)
        history = trainer.fit(model, train, epochs=2, verbose=0)
    else:
        history = trainer.fit(model, dataset, batch_size=batch, epochs=2, verbose=0)
    reads = {"fit": dataset.reads}
    dataset.reads = 0
    evaluation = trainer.evaluate(model, dataset, batch_size=batch, verbose=0, return_dict=True)
    reads["evaluate"], dataset.reads = dataset.reads, 0
    predictions = trainer.predict(model, dataset, batch_size=batch)
    reads["predict"] = dataset.reads
    return {
        "history": history.history,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "evaluate": evaluation,
        "predict": predictions,
        "reads": reads,
    }


def sharded(rank, num_workers, port, kind):
    return sharded_run(strategy_for(rank, num_workers, port), kind)


class BatchShards(torch.utils.data.IterableDataset):
    """Batches of 10 rows of ``data()``, shardable by batch (as a list of files is); counts what it yields."""

    def __init__(self, index=0, count=1, shardable=True):
        self.index, self.count, self.reads = index, count, []
        if not shardable:
            self.shard = None

    def shard(self, num_shards, index):
        self.child = BatchShards(index, num_shards)
        return self.child

    def __iter__(self):
        x, y = data()
        for number in range(self.index, 12, self.count):  # 120 rows: 12 batches of 10
            self.reads.append(number)
            yield x[number * 10 : number * 10 + 10], y[number * 10 : number * 10 + 10]


def file_shards(rank, num_workers, port, shardable=True):
    """fit on an IterableDataset of batches: with shard() each worker reads its shard; without, every worker
    reads every batch (and is warned once)."""
    import warnings

    strategy = strategy_for(rank, num_workers, port)
    source = BatchShards(shardable=shardable)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(model, source, epochs=2, verbose=0)
    reads = getattr(source, "child", source).reads
    ours = [str(w.message) for w in caught if "AutoShardPolicy" in str(w.message)]
    return {"reads": reads, "warnings": ours, "history": history.history}


class DrawingDataset(CountingDataset):
    """Draws from torch's global generator as it reads (as a random transform would)."""

    def __getitem__(self, index):
        torch.rand(int(index) % 3 + 1)  # how much it draws depends on the example
        return super().__getitem__(index)


def rows_per_epoch(rank, num_workers, port, policy=None, epochs=3):
    """The labels' row ids each worker trains on, per epoch, from a shuffled DataLoader without a generator
    over a dataset that draws from the global generator (or, with ``policy="OFF"``, a DistributedSampler)."""
    from replicafit.data import InputOptions

    strategy = strategy_for(rank, num_workers, port)
    x, _ = data()
    ids = torch.arange(len(x))
    dataset = DrawingDataset(x[:100], ids[:100])
    if policy == "OFF":
        sampler = torch.utils.data.DistributedSampler(dataset, num_workers, rank, shuffle=True, seed=1)
        loader = torch.utils.data.DataLoader(dataset, batch_size=10, sampler=sampler)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)
    seen: dict = {}

    class Recording(Trainer):
        def train_step(self, data):
            seen.setdefault(self._training_state.epoch, []).extend(data[1].tolist())
            data = (data[0], torch.zeros_like(data[1]))  # class 0: the ids are only recorded
            return super().train_step(data)

    options = InputOptions(auto_shard_policy=policy) if policy else None
    model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    trainer = Recording(
        strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=(), input_options=options
    )
    trainer.fit(model, loader, epochs=epochs, verbose=0)
    return seen


def bad_label_on_one_worker(rank, num_workers, port):
    """The first global batch's label out of range in worker 1's rows only: every worker must raise."""
    strategy = strategy_for(rank, num_workers, port)
    x, y = data()
    y = y.clone()
    y[20] = 7  # 3 classes; row 20 of the first batch of 32 is worker 1's (rows 16-31)
    dataset = CountingDataset(x[:64], y[:64])
    torch.manual_seed(0)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=())
    try:
        trainer.fit(torch.nn.Sequential(torch.nn.Linear(8, 3)), dataset, batch_size=32, shuffle=False, verbose=0)
    except ValueError as error:
        return {"error": str(error), "reads": dataset.reads}
    return {"error": None}


def uneven_file_shards(rank, num_workers, port):
    """11 batches over 2 workers' shards: 6 and 5; the workers step together, one replica empty at the end."""
    strategy = strategy_for(rank, num_workers, port)

    class Eleven(BatchShards):
        def shard(self, num_shards, index):
            self.child = Eleven(index, num_shards)
            return self.child

        def __iter__(self):
            x, y = data()
            for number in range(self.index, 11, self.count):
                self.reads.append(number)
                yield x[number * 10 : number * 10 + 10], y[number * 10 : number * 10 + 10]

    source = Eleven()
    torch.manual_seed(0)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=())
    history = trainer.fit(torch.nn.Sequential(torch.nn.Linear(8, 3)), source, epochs=1, verbose=0)
    return {"reads": source.child.reads, "steps": int(trainer.optimizer.iterations), "loss": history.history["loss"]}
