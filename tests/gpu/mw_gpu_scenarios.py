"""Worker functions for tests/gpu/test_cuda_multiworker.py (run in worker processes by the harness;
``fit_run`` in the test process too)."""

from __future__ import annotations

import os

import torch
from gpu_support import GPU, HAVE_CUDA, digits, mlp, weights

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer

#: The workers' environment: they import gpu_support and these scenarios from this folder.
WORKER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}


def fit_run(strategy) -> dict:
    """A small seeded fit with dropout, under the determinism settings of gpu_support."""
    if HAVE_CUDA:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = mlp(dropout=0.2)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), seed=3, metrics=["accuracy"])
    history = trainer.fit(model, digits(256), batch_size=32, epochs=2, verbose=0)
    return {"weights": weights(model), "history": history.history, "device": str(next(model.parameters()).device)}


def fit(rank, num_workers, port, implementation="RING"):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[GPU])
    options = ds.CommunicationOptions(timeout_seconds=60, implementation=implementation)
    strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    collective = strategy.extended._collective
    return fit_run(strategy) | {"backend": collective.backend if collective is not None else None}


def batch_norm_cnn(sync: bool) -> torch.nn.Module:
    """A small CNN on the digits images with BatchNorm2d and BatchNorm1d (synchronized when ``sync``)."""
    nn = torch.nn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def batch_norm_fit(strategy, sync: bool = True) -> dict:
    """A fit of ``batch_norm_cnn`` on 250 digits in batches of 32 (a partial last batch of 26)."""
    if HAVE_CUDA:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = batch_norm_cnn(sync)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"])
    history = trainer.fit(model, digits(250), batch_size=32, epochs=2, shuffle=False, verbose=0)
    return {"weights": weights(model), "history": history.history, "device": str(next(model.parameters()).device)}


def sync_batch_norm(rank, num_workers, port):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[GPU])
    options = ds.CommunicationOptions(timeout_seconds=60, implementation="RING")
    return batch_norm_fit(ds.MultiWorkerMirroredStrategy(options, resolver))


def nccl_collectives(rank, num_workers, port):
    """The collective's data operations on CUDA tensors over NCCL (a one-worker group)."""
    from replicafit.strategies.collective import Collective

    collective = Collective(rank, num_workers, "127.0.0.1", port, torch.device(GPU), 60)
    try:
        a, b = torch.arange(5.0, device=GPU), torch.ones(3, device=GPU)
        collective.all_reduce_flat([a, b], "sum")
        gathered = collective.all_gather(torch.full((2, 2), float(rank), device=GPU), "gather")
        value = torch.full((4,), 7.0, device=GPU)
        collective.broadcast(value, "broadcast")
        ints = collective.start_sum_ints([rank + 1], "ints")()
        return {
            "backend": collective.backend,
            "sum": (a.cpu(), b.cpu()),
            "gathered": [g.cpu() for g in gathered],
            "gathered_device": str(gathered[0].device),
            "broadcast": value.cpu(),
            "ints": ints,
        }
    finally:
        collective.destroy()


def nccl_on_one_gpu(rank, num_workers, port):
    """Two workers on the one GPU with the default (NCCL for CUDA): the error each one gets."""
    try:
        fit(rank, num_workers, port, implementation="AUTO")
    except ValueError as error:
        return str(error)
    return None


def preempted(rank, num_workers, port, outdir):
    """SIGTERM to worker 1 after step 5 of 2 workers sharing the GPU with save_before_preemption: where each
    stops (the flags' total is read one step late on an accelerator), and the rerun against the uninterrupted run."""
    import signal

    from replicafit.trainer import BackupAndRestore, Callback, Preempted

    class SignalAt(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and int(self.trainer.optimizer.iterations) == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[GPU])
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=60), resolver)

    def run(folder, *extra):
        model = mlp(dropout=0.0)
        trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-3), seed=3, metrics=["accuracy"])
        backup = BackupAndRestore(os.path.join(outdir, folder), save_before_preemption=True)
        history = trainer.fit(model, digits(256), batch_size=32, epochs=2, verbose=0, callbacks=[*extra, backup])
        return {"weights": weights(model), "history": history.history}

    reference = run("reference")
    try:
        run("backup", SignalAt())
        stop = None
    except Preempted as error:
        stop = (error.epoch, error.step)
    return {"stop": stop, "resumed": run("backup"), "reference": reference}


def sharded_fit(rank, num_workers, port, scatter=None):
    """``fit_run`` with sharded optimizer states (every bucket cut), then without, two workers sharing the GPU over
    gloo: the collectives run on host copies of the GPU buffers (``scatter=True``: reduce-scatter and all-gather,
    NCCL's way, else gloo's all-reduces)."""
    from replicafit.strategies.collective import Collective
    from replicafit.strategies.state_sharding import StateShards

    StateShards.min_bytes, Collective.prefer_scatter = 0, scatter
    out = {}
    for shard in (True, False):
        resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[GPU])
        options = ds.CommunicationOptions(timeout_seconds=60, implementation="RING")
        strategy = ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=shard)
        out[shard] = fit_run(strategy)
    return out


def gpu_objects(rank, num_workers, port):
    """Objects holding GPU tensors broadcast and gathered by two workers sharing the GPU over gloo: where each
    one lands."""
    from replicafit.strategies.collective import from_host_bytes, host_bytes

    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=[GPU])
    options = ds.CommunicationOptions(timeout_seconds=60, implementation="RING")
    strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    collective = strategy.extended._collective
    device = torch.device(GPU) if GPU.startswith("cuda") else torch.device("cpu")
    mine = {"rank": rank, "state": torch.full((3,), float(rank), device=device), "host": torch.arange(2)}
    gathered = collective.all_gather_object(mine, "objects with GPU tensors")
    broadcast = collective.broadcast_object(mine, "an object with GPU tensors")
    out = {
        "host_objects": collective._host_objects,
        "gathered": [(g["rank"], g["state"].cpu(), str(g["state"].device), str(g["host"].device)) for g in gathered],
        "broadcast": (broadcast["rank"], broadcast["state"].cpu(), str(broadcast["state"].device)),
        # (the receiver's device, not the sender's: both workers share one GPU above, so this tells them apart)
        "onto_host": str(from_host_bytes(host_bytes(mine["state"]), "cpu").device),
    }
    strategy.cluster.barrier("end")
    return out
