"""torchmetrics scenarios, run in worker processes by test_torch_metrics.py (and in-process as its reference)."""

from __future__ import annotations

import torch
import torchmetrics
from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score
from torchmetrics.regression import MeanSquaredError
from torchmetrics.utilities import dim_zero_cat

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer


class OrderedSum(torchmetrics.Metric):
    """``sum(target[i] * (i + 1))`` over the targets in the order they were appended: a ``cat`` state whose
    value changes with the order (the input's order gives one value)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, preds, target):
        self.values.append(target.detach().float().reshape(-1))

    def compute(self):
        values = dim_zero_cat(self.values)
        return (values.double() * torch.arange(1, values.numel() + 1, dtype=torch.float64)).sum()


def strategy_for(rank, num_workers, port, kind="multi_worker_mirrored", timeout=30.0):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(timeout_seconds=timeout)
    if kind == "fully_sharded":
        return ds.FullyShardedStrategy(options, resolver)
    return ds.MultiWorkerMirroredStrategy(options, resolver)


def classification_data():
    """115 training rows (a last batch of 19 at batch 32: uneven over 2 or 3 replicas) and 37 validation rows
    (a last batch of 5)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(152, 6, generator=generator)
    y = (x[:, :2].sum(dim=1) > 0).long() + (x[:, 2] > 0.5).long()
    return (x[:115], y[:115]), (x[115:], y[115:])


def regression_data():
    """Targets are the row indices (an ordered metric tells the input's order apart)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(115, 4, generator=generator)
    return x, torch.arange(115, dtype=torch.float32).reshape(-1, 1) / 100


def classifier():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def classification_metrics():
    return [MulticlassF1Score(num_classes=3), MulticlassAUROC(num_classes=3)]


def classification_run(strategy, epochs=2, callbacks=(), **fit_kwargs):
    """A fit with validation and an evaluation: their logs, and the model."""
    train, validation = classification_data()
    model = classifier()
    trainer = Trainer(
        strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=classification_metrics()
    )
    history = trainer.fit(
        model,
        train,
        epochs=epochs,
        batch_size=32,
        validation_data=validation,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
        **fit_kwargs,
    )
    evaluation = trainer.evaluate(model, validation, batch_size=32, verbose=0, return_dict=True)
    return {
        "history": history.history,
        "evaluate": evaluation,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


def regression_run(strategy):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(
        strategy=strategy, optimizer=optimizers.SGD(0.01), loss="mse", metrics=[MeanSquaredError(), OrderedSum()]
    )
    history = trainer.fit(model, regression_data(), epochs=1, batch_size=32, shuffle=False, verbose=0)
    evaluation = trainer.evaluate(model, regression_data(), batch_size=32, verbose=0, return_dict=True)
    return {"history": history.history, "evaluate": evaluation}


def workers(rank, num_workers, port, kind="multi_worker_mirrored"):
    strategy = strategy_for(rank, num_workers, port, kind)
    return {"classification": classification_run(strategy), "regression": regression_run(strategy)}


def collectives_per_read(rank, num_workers, port):
    """The collectives a fit issues (every ``torch.distributed`` call of the workers' ``Collective``, counted)
    from its first step on, with the logs read at every step: with the trainer's accuracy alone, with F1 beside
    it, and with F1, MulticlassAccuracy and a binned MulticlassAUROC beside it."""
    from torchmetrics.classification import MulticlassAccuracy

    from replicafit.strategies import collective
    from replicafit.trainer import LambdaCallback

    counts: dict = {}
    summing = [False]  # within a sum of the collective's: its own all-reduce or all-gather is that sum
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier"):
        original = getattr(collective.dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if not summing[0]:
                counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(collective.dist, name, counted)
    start_sum = collective.Collective._start_sum

    def counted_sum(self, buffer, group):
        """A sum across workers, counted as an all-reduce whichever way it runs (a small one is an all-gather)."""
        counts["all_reduce"] = counts.get("all_reduce", 0) + 1
        summing[0] = True
        try:
            return start_sum(self, buffer, group)
        finally:
            summing[0] = False

    collective.Collective._start_sum = counted_sum
    strategy = strategy_for(rank, num_workers, port)
    (x, y), _ = classification_data()
    out = {}
    for name, metrics in (
        ("accuracy", ["accuracy"]),
        ("f1", ["accuracy", MulticlassF1Score(num_classes=3)]),
        (
            "three",
            [
                "accuracy",
                MulticlassF1Score(num_classes=3),
                MulticlassAccuracy(num_classes=3),
                MulticlassAUROC(num_classes=3, thresholds=20),
            ],
        ),
    ):
        reads = []
        # from the first step on (the metrics' variables are made, and checked across workers, before it)
        steps = LambdaCallback(
            on_train_batch_begin=lambda batch, logs: counts.clear() if batch == 0 else None,
            on_train_batch_end=lambda batch, logs, _reads=reads: _reads.append(batch),  # the logs at every step
        )
        trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=metrics)
        trainer.fit(classifier(), (x, y), epochs=1, batch_size=32, shuffle=False, verbose=0, callbacks=[steps])
        out[name] = dict(counts)
        out["reads"] = len(reads)
    return out


class RowCount(torchmetrics.Metric):
    """The number of rows seen (a ``cat`` state): a restored part counted twice shows at once."""

    def __init__(self):
        super().__init__()
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, preds, target):
        self.rows.append(target.float().reshape(-1))

    def compute(self):
        return torch.tensor(float(dim_zero_cat(self.rows).numel()))


def resumed_run(strategy, callbacks=()):
    """One epoch of 8 steps (64 rows), with a cat-state count, F1 and AUROC."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    torch.manual_seed(1)
    trainer = Trainer(
        strategy=strategy,
        optimizer=optimizers.SGD(0.1),
        loss="cross_entropy",
        metrics=[RowCount(), MulticlassF1Score(num_classes=3), MulticlassAUROC(num_classes=3)],
    )
    model = torch.nn.Linear(4, 3)
    return trainer.fit(
        model, (x, y), batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks)
    ).history


def interrupted_then_resumed(rank, num_workers, port, backup_dir, local_devices=None):
    """Interrupted at step 5 after a backup at every step (``local_devices`` None), or resumed from such a
    backup on workers of ``local_devices`` each."""
    from replicafit.trainer import callbacks

    class Stop(callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 5:
                raise KeyboardInterrupt("stop")

    if local_devices is None:
        strategy = strategy_for(rank, num_workers, port)
        try:
            resumed_run(strategy, [callbacks.BackupAndRestore(backup_dir, save_freq=1), Stop()])
        except KeyboardInterrupt:
            pass
    else:
        resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=local_devices)
        strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=30), resolver)
    return resumed_run(strategy, [callbacks.BackupAndRestore(backup_dir)])
