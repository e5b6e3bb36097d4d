"""Worker scenarios of test_peer_failure.py: a worker dies (SIGKILL) or stops (SIGSTOP) during a fit, a survivor
writes the backup of the last step every worker finished, and a second run resumes from it.

Every worker logs the examples it reads (``reads-<run>-<rank>.txt``: one line per ``__getitem__``, after a line
``epoch E`` at each epoch's start) so the tests count how often each example was read.
"""

from __future__ import annotations

import os
import signal

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer, callbacks

ROWS, BATCH = 96, 8  # 12 steps per epoch
EPOCHS = 3


class CountedRows(torch.utils.data.Dataset):
    """Rows that log every read (``__getitem__``) to ``log`` (append, flushed)."""

    def __init__(self, log):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(ROWS, 6, generator=generator)
        self.y = (self.x[:, :2].sum(dim=1) > 0).long() + (self.x[:, 2] > 0.5).long()
        self.log = log

    def __len__(self):
        return ROWS

    def __getitem__(self, index):
        if self.log is not None:
            self.log.write(f"{int(index)}\n")
            self.log.flush()
        return self.x[index], self.y[index]


class EpochMarks(callbacks.Callback):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def on_epoch_begin(self, epoch, logs=None):
        self.log.write(f"epoch {epoch}\n")
        self.log.flush()


class Fault(callbacks.Callback):
    """On worker ``worker`` (or each of a list), once (marker files remember it): ``signal`` to itself at iteration
    ``iteration``, in the hook ``where``: ``"batch_end"`` (after the step's update, before the backup's hook),
    ``"forward"`` (inside the next step's forward: the failure reaches the others in its gradient reduction),
    ``"forward_index"`` (the same, ``iteration`` counting the fit's steps, not updates),
    ``"batch_index"`` (after the epoch's step of that index, ``iteration`` counting steps, not updates),
    ``"validation"`` (in the epoch's validation), ``"first_step"`` (before any step's update), ``"train_end"``
    (in ``on_train_end``, the run trained)."""

    def __init__(self, worker, iteration, where, signum, marker):
        super().__init__()
        self.worker, self.iteration, self.where, self.signum, self.marker = worker, iteration, where, signum, marker

    def _now(self) -> bool:
        index = self.trainer.strategy.cluster.worker_index
        mine = index in self.worker if isinstance(self.worker, (list, tuple)) else index == self.worker
        return mine and not os.path.exists(f"{self.marker}-{index}")

    def _fire(self):
        index = self.trainer.strategy.cluster.worker_index
        for path in (self.marker, f"{self.marker}-{index}"):
            with open(path, "w") as file:
                file.write("fired")
        os.kill(os.getpid(), self.signum)

    def on_train_begin(self, logs=None):
        self.seen = 0  # steps ended in this fit
        if self.where in ("forward", "forward_index"):
            self.model.register_forward_pre_hook(self._forward)

    def _forward(self, module, args):
        at = self.seen if self.where == "forward_index" else int(self.trainer.optimizer.iterations)
        if self._now() and at == self.iteration:
            self._fire()

    def on_train_batch_begin(self, batch, logs=None):
        if self.where == "first_step" and self._now():
            self._fire()

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.where == "stats":  # (not a fault: this worker's first BatchNorm statistics after each step)
            with open(f"{self.marker}-stats-{self.trainer.strategy.cluster.worker_index}", "a") as file:
                file.write(" ".join(f"{v:.9g}" for v in self.model[1].running_mean.tolist()) + "\n")
        if self.where == "batch_end" and self._now() and int(self.trainer.optimizer.iterations) == self.iteration:
            self._fire()
        if self.where == "batch_index" and self._now() and batch == self.iteration:  # (a step within a window)
            self._fire()

    def on_train_end(self, logs=None):
        if self.where == "train_end" and self._now():  # the run is trained: the backup is being deleted
            self._fire()

    def on_test_batch_end(self, batch, logs=None):
        if self.where == "validation" and self._now() and int(self.trainer.optimizer.iterations) >= self.iteration:
            self._fire()


def _die_in_saves_after(marker):
    real = torch.save

    def save(obj, file, *args, **kwargs):
        if not os.path.exists(marker):
            return real(obj, file, *args, **kwargs)
        file.write(b"half a backup")
        file.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def run(
    rank,
    num_workers,
    port,
    outdir,
    name="run",
    fault=None,
    save_freq="epoch",
    timeout=30.0,
    accumulate=0,
    fully_sharded=False,
    save_on_peer_failure=True,
    die_in_save=False,
    shard_states=False,
    batchnorm=False,
    watch_stats=False,
    csv=False,
    epochs=EPOCHS,
    dropout=0.0,
):
    """A fit of 3 epochs with ``BackupAndRestore(outdir/backup)`` and validation; ``fault``: ``Fault``'s
    arguments ``(worker, iteration, where, signal name)``; ``dropout``: a dropout layer of that rate. Returns the
    weights and history."""
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(timeout_seconds=timeout)
    if fully_sharded:
        strategy = ds.FullyShardedStrategy(options, resolver)
    else:
        strategy = ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=shard_states)
    torch.manual_seed(3)
    middle = [torch.nn.BatchNorm1d(16)] if batchnorm else []
    middle += [torch.nn.Dropout(dropout)] if dropout else []
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), *middle, torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=accumulate or None)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", seed=11)
    log = open(os.path.join(outdir, f"reads-{name}-{rank}.txt"), "a")  # noqa: SIM115 (closed below)
    cbs = [
        EpochMarks(log),
        callbacks.BackupAndRestore(
            os.path.join(outdir, "backup"), save_freq=save_freq, save_on_peer_failure=save_on_peer_failure
        ),
    ]
    if fault is not None:
        worker, iteration, where, signame = fault
        fault = Fault(worker, iteration, where, getattr(signal, signame), os.path.join(outdir, "fired"))
        cbs.insert(1 if where == "train_end" else len(cbs), fault)  # (train_end: before the backup's deletion)
    if csv:  # (its rows and the file's offset are the chief's)
        cbs.append(callbacks.CSVLogger(os.path.join(outdir, "history.csv"), append=True))
    if watch_stats:
        cbs.append(Fault(rank, 0, "stats", signal.SIGKILL, os.path.join(outdir, "watch")))
    if die_in_save:  # a survivor that writes a backup after the fault dies half-way through the file
        _die_in_saves_after(os.path.join(outdir, "fired"))
    validation = CountedRows(None)
    try:
        history = trainer.fit(
            model,
            CountedRows(log),
            epochs=epochs,
            batch_size=BATCH,
            validation_data=torch.utils.data.Subset(validation, range(24)),
            callbacks=cbs,
            verbose=0,
        )
    finally:
        log.close()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "history": history.history,
        "iterations": int(trainer.optimizer.iterations),
    }


# --- for recipes (test_peer_failure_launcher.py): the workers of `replicafit fit RECIPE --workers 2` -----------


def _process_log(log_dir):
    """This worker process's log of reads (one per process: each start of each worker)."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f"reads-{os.getpid()}.txt")
    fresh = not os.path.exists(path)
    log = open(path, "a")  # noqa: SIM115 (the process's, until it exits)
    if fresh:
        log.write(f"attempt {os.environ.get('REPLICAFIT_RESTART_COUNT', '0')} rank {os.environ.get('RANK', '0')}\n")
        log.flush()
    return log


class CountedDigits(torch.utils.data.Dataset):
    """Rows that log every read to this process's file in ``log_dir``."""

    def __init__(self, x, y, log_dir):
        self.x, self.y, self.log_dir, self.log = x, y, log_dir, None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        if self.log is None:
            self.log = _process_log(self.log_dir)
        self.log.write(f"{int(index)}\n")
        self.log.flush()
        return self.x[index], self.y[index]


def counted_digits(log_dir, validation_split=0.2):
    """The recipe's ``digits`` data with every training read logged (``data: {type: 'mw_peer_failure_scenarios:
    counted_digits', log_dir: ...}``)."""
    from replicafit.recipes.datasets import digits

    info = digits(validation_split=validation_split)
    x, y = info["train"]
    info["train"] = CountedDigits(torch.as_tensor(x), torch.as_tensor(y), log_dir)
    return info


class EpochLog(callbacks.Callback):
    """Marks each epoch's start in this process's read log."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir

    def on_epoch_begin(self, epoch, logs=None):
        log = _process_log(self.log_dir)
        log.write(f"epoch {epoch}\n")
        log.close()


class FaultAt(callbacks.Callback):
    """``signal`` (a name) to worker ``worker`` at optimizer iteration ``step`` or later, while the cluster has at
    least ``while_workers`` workers, ``times`` times in all (marker files in ``marker_dir`` count them)."""

    def __init__(self, worker, step, marker_dir, signal="SIGKILL", times=1, while_workers=2):
        super().__init__()
        self.worker, self.step, self.marker_dir, self.signal = worker, step, marker_dir, signal
        self.times, self.while_workers = times, while_workers

    def on_train_batch_end(self, batch, logs=None):
        trainer = self.trainer
        cluster = trainer.strategy.cluster
        if cluster.worker_index != self.worker or cluster.num_workers < self.while_workers:
            return
        if int(trainer.optimizer.iterations) < self.step:
            return
        os.makedirs(self.marker_dir, exist_ok=True)
        fired = len(os.listdir(self.marker_dir))
        if fired < self.times:
            with open(os.path.join(self.marker_dir, f"fired-{fired}"), "w") as file:
                file.write(str(int(trainer.optimizer.iterations)))
            os.kill(os.getpid(), getattr(signal, self.signal))


def last_after_fit(rank, num_workers, port, outdir):
    """``replicafit fit``'s ``last.pt`` when worker 1 dies once ``fit`` returned (its backup deleted): worker 0
    writes it alone (``cli.fit._save_last``). Returns whether the file exists and the fit's iterations."""
    import types

    from replicafit.cli.fit import _save_last

    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=5.0), resolver)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.05), loss="cross_entropy", seed=11)
    backup = callbacks.BackupAndRestore(os.path.join(outdir, "backup"))
    trainer.fit(model, CountedRows(None), epochs=1, batch_size=BATCH, callbacks=[backup], verbose=0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    path = os.path.join(outdir, "last.pt")
    _save_last(types.SimpleNamespace(trainer=trainer, strategy=strategy), path)
    return os.path.exists(path), int(trainer.optimizer.iterations)
