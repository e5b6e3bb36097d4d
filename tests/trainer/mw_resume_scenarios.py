"""A fit backed up by ``BackupAndRestore``, interrupted mid-epoch and resumed under another strategy, number of
workers or replicas (test_resume_other_counts.py): ``resume_run`` in-process, ``worker`` in worker processes.

The model has no per-replica state (no dropout, no BatchNorm), so every strategy with the same global batches
trains alike up to float rounding: the resumed run must equal the uninterrupted one within that rounding.
"""

from __future__ import annotations

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Callback, Trainer, callbacks

EPOCHS = 3
BATCH = 12  # 114 training rows: 10 steps an epoch, the last one a partial batch of 6
SAVE_FREQ = 3  # backups after global steps 3, 6, 9, 12, 15, ...
ACCUMULATION = 4  # windows of 4, 4 and a partial 2 in every epoch


class Crash(Exception):
    """The interruption."""


class CrashAt(Callback):
    """Raises at the beginning of global step ``step`` (0-based) on every worker: ``step`` steps are done."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.step:
            raise Crash(f"interrupted at global step {self.step}")
        self.seen += 1


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(150, 8, generator=generator)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def strategy_of(kind: str, rank: int = 0, num_workers: int = 1, port: int | None = None):
    """``"default"``, ``"mirrored<N>"`` (N logical CPUs in this process) or ``"worker"`` (this process as worker
    ``rank`` of ``num_workers``, one replica each)."""
    if kind == "default":
        return ds.get_strategy()
    if kind.startswith("mirrored"):
        return ds.MirroredStrategy([f"cpu:{i}" for i in range(int(kind[len("mirrored") :]))])
    if kind == "worker":
        resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=["cpu:0"])
        return ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=30.0), resolver)
    raise ValueError(kind)


def training_data(source: str):
    """The training data as fit takes it: arrays with ``batch_size`` (``"arrays"``), or a shuffled ``DataLoader``
    drawing its order from torch's generator (``"loader"``)."""
    x, y = data()
    if source == "arrays":
        return (x[:114], y[:114]), {"batch_size": BATCH}
    if source == "loader":
        dataset = torch.utils.data.TensorDataset(x[:114], y[:114])
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True), {}
    raise ValueError(source)


def resume_run(
    strategy,
    backup_dir,
    *,
    crash_at=None,
    source="arrays",
    accumulate=False,
    batch_size=None,
    init_seed=0,
    extra_callbacks=(),
) -> dict:
    """Adam, accuracy, validation data, ReduceLROnPlateau and EarlyStopping, backed up every ``SAVE_FREQ``
    steps (kept at the end); interrupted at global step ``crash_at`` when given. A run that finds a backup
    goes on from it (``init_seed``: the initial weights, which the backup replaces). Returns what the
    comparison needs."""
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = optimizers.Adam(0.02, gradient_accumulation_steps=ACCUMULATION if accumulate else None)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", metrics=["accuracy"], seed=3)
    plateau = callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=0.25)
    stopping = callbacks.EarlyStopping(monitor="val_loss", patience=5, min_delta=0.12)
    cbs = [plateau, stopping, BackupAndRestore(backup_dir, save_freq=SAVE_FREQ, delete_checkpoint=False)]
    cbs.extend(extra_callbacks)
    if crash_at is not None:
        cbs.append(CrashAt(crash_at))
    x, y = data()
    train, settings = training_data(source)
    if batch_size is not None:
        settings = {"batch_size": batch_size}
    try:
        history = trainer.fit(
            model, train, epochs=EPOCHS, validation_data=(x[114:], y[114:]), callbacks=cbs, verbose=0, **settings
        )
    except Crash:
        return {"crashed": True, "iterations": int(trainer.optimizer.iterations)}
    state = trainer.optimizer.state_dict()
    return {
        "crashed": False,
        "history": history.history,
        "epoch": list(history.epoch),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "iterations": int(state["iterations"]),
        "slots": {position: dict(slots) for position, slots in state["slots"].items()},
        "learning_rate": float(trainer.optimizer.learning_rate),
        "callbacks": {"plateau": plateau.state_dict(), "stopping": stopping.state_dict()},
    }


def worker(rank, num_workers, port, backup_dir, **kwargs):
    """``resume_run`` as worker ``rank`` of ``num_workers`` (one replica each)."""
    return resume_run(strategy_of("worker", rank, num_workers, port), backup_dir, **kwargs)


def old_window_saved_again(rank, num_workers, port, folder):
    """A checkpoint with an open accumulation window in an earlier version's layout (no ``first_replica`` /
    ``replicas_in_sync``), loaded on 2 workers and saved again before any step: the window's sums per position."""
    import os

    strategy = strategy_of("worker", rank, num_workers, port)

    def trainer_and_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 3))
        optimizer = optimizers.SGD(0.1, gradient_accumulation_steps=4)
        return Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", seed=1), model

    first = os.path.join(folder, "new.pt")

    class SaveMidWindow(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # 2 steps of a window of 4: open
                self.trainer.save_checkpoint(first)

    trainer, model = trainer_and_model()
    x, y = data()
    trainer.fit(model, (x[:64], y[:64]), batch_size=16, epochs=1, verbose=0, callbacks=[SaveMidWindow()])
    if rank == 0:
        state = torch.load(first, weights_only=True)
        window = state["optimizer"]["accumulation"]
        window.pop("first_replica"), window.pop("replicas_in_sync")
        torch.save(state, os.path.join(folder, "old.pt"))
    strategy.cluster.barrier("old checkpoint written")
    again, model = trainer_and_model()
    again.load_checkpoint(os.path.join(folder, "old.pt"), model=model)
    saved = again.save_checkpoint(os.path.join(folder, "again.pt"))
    window = torch.load(saved, weights_only=True)["optimizer"]["accumulation"]
    return {position: len(sums) for position, sums in window["gradients"].items()}
