"""The cost of synchronized BatchNorm: ``nn.SyncBatchNorm`` against plain BatchNorm, same model and data.

The workload: a small CNN (two blocks of Conv 3x3 -> BatchNorm2d -> ReLU -> MaxPool, 16 and 32
channels, then Linear -> BatchNorm1d -> Linear; three BatchNorm layers) on 2,048 images of 3x16x16,
global batches of 64, SGD with momentum, 4 epochs; the figure is the steps per second over epochs 2-4.
Rows, each printed as ours, the reference and the ratio of step times (median and range over paired
repeats, every measurement in fresh interpreters, the order reversed every repeat):

- sync_mirrored / plain_mirrored: ``MirroredStrategy(["cpu:0", "cpu:1"])``. Plain BatchNorm's replicas
  take turns on one thread; a synchronized layer's backward pass is a collective, which needs a thread
  per replica, so this row holds both costs.
- sync_mirrored / plain_mirrored_threads: the same against plain BatchNorm on threads
  (``set_replica_execution("threads")``): the synchronization alone.
- sync_workers / plain_workers: ``MultiWorkerMirroredStrategy`` on 2 worker processes (gloo over
  127.0.0.1, one intra-op thread each).
- ddp_sync_workers / ddp_plain_workers: the reference's own cost of synchronizing: a torch loop under
  ``DistributedDataParallel`` with a synchronized BatchNorm written on ``torch.distributed.nn``'s
  differentiable all-reduce (torch's ``nn.SyncBatchNorm`` runs on GPUs only).
- sync_workers / ddp_sync_workers: ours against that reference, both synchronized.

It also prints the collectives of one training step: a synchronized layer makes one packed all-reduce
in its forward pass and one in its backward pass, per replica (across workers each is one gloo
collective beside the gradients' buckets: an all-reduce, or for a small sum an all-gather summed locally).

Run: python benchmarks/bench_sync_batchnorm.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
from bench_fit import EpochClock  # this folder is on the path when a benchmark runs
from torch import nn

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.cli.launch import launch_local
from replicafit.strategies import collective as collective_module
from replicafit.strategies import sync_batchnorm
from replicafit.trainer import Callback, Trainer

ROWS, BATCH, EPOCHS = 2048, 64, 4


def make_model(sync: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def make_data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 3, 16, 16, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)


class StepCensus:
    """Counts, over one training step, the synchronized layers' all-reduces (per replica) and, across
    workers, the process group's collectives (by kind)."""

    def __init__(self):
        self.layer_reduces, self.collectives = 0, {}

    def __enter__(self):
        import torch.distributed as dist

        self._reduce, self._dist = sync_batchnorm._all_reduce, {}

        def counted_reduce(*args):
            self.layer_reduces += 1
            return self._reduce(*args)

        sync_batchnorm._all_reduce = counted_reduce
        # (the collective module's own single-tensor gather too: a small sum on gloo is one)
        targets = [(dist, name, name) for name in ("all_reduce", "all_gather", "broadcast")]
        targets.append((collective_module, "_all_gather_single", "all_gather_single"))
        for owner, attr, name in targets:
            original = getattr(owner, attr)
            self._dist[(owner, attr)] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.collectives[_name] = self.collectives.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(owner, attr, counted)
        return self

    def __exit__(self, *exc):
        sync_batchnorm._all_reduce = self._reduce
        for (owner, attr), original in self._dist.items():
            setattr(owner, attr, original)


class _CountStep(Callback):
    """Counts (``StepCensus``) over the second training step of the fit only."""

    def __init__(self):
        super().__init__()
        self.census = StepCensus()

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            self.census.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.census.__exit__(None, None, None)


def fit(strategy, sync: bool, census: bool = False):
    """Epoch times of the fit; with ``census`` the ``StepCensus`` of its second step instead."""
    x, y = make_data()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.05, momentum=0.9), loss="cross_entropy", seed=0)
    if census:
        counter = _CountStep()
        trainer.fit(make_model(sync), (x[:192], y[:192]), batch_size=BATCH, verbose=0, callbacks=[counter])
        return counter.census
    clock = EpochClock()
    trainer.fit(make_model(sync), (x, y), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[clock])
    return clock.times


class _DDPSyncBatchNorm(nn.Module):
    """The reference's synchronized BatchNorm on CPUs (torch's ``nn.SyncBatchNorm`` needs a GPU): one
    differentiable ``torch.distributed.nn`` all-reduce of (sum, sum of squares, count) per forward,
    autograd's in backward."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        from torch.distributed.nn.functional import all_reduce

        layer = self.layer
        if not self.training:
            return layer(x)
        dims, channels = [0, *range(2, x.dim())], x.shape[1]
        shape = (1, channels) + (1,) * (x.dim() - 2)
        count = torch.full((1,), x.numel() // channels, dtype=x.dtype)
        total = all_reduce(torch.cat([x.sum(dims), x.square().sum(dims), count]))
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:-1] / n - mean.square()
        with torch.no_grad():
            layer.num_batches_tracked.add_(1)
            layer.running_mean.lerp_(mean, layer.momentum)
            layer.running_var.lerp_(var * n / (n - 1), layer.momentum)
        scale = layer.weight * torch.rsqrt(var + layer.eps)
        return (x - mean.view(shape)) * scale.view(shape) + layer.bias.view(shape)


def ddp_loop(sync: bool) -> list:
    """The reference: DistributedDataParallel over gloo and a torch loop on each worker's share of every
    global batch (``sync``: the BatchNorm layers wrapped in ``_DDPSyncBatchNorm``)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    # (torch 2.13 marks it deprecated for a private successor; it is still the public differentiable one)
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_reduce is deprecated", FutureWarning)
    dist.init_process_group("gloo")
    rank, share = dist.get_rank(), BATCH // dist.get_world_size()
    model = make_model(False)
    if sync:
        for index, layer in enumerate(model):
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                model[index] = _DDPSyncBatchNorm(layer)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data()
    times = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for begin in range(0, ROWS, BATCH):
            rows = slice(begin + rank * share, begin + (rank + 1) * share)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x[rows]), y[rows]).backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def _mirrored():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"])


def _threads():
    ds.set_replica_execution("threads")
    return _mirrored()


VARIANTS = {
    "plain_mirrored": lambda: fit(_mirrored(), False),
    "plain_mirrored_threads": lambda: fit(_threads(), False),
    "sync_mirrored": lambda: fit(_mirrored(), True),
    "plain_workers": lambda: fit(ds.MultiWorkerMirroredStrategy(), False),
    "sync_workers": lambda: fit(ds.MultiWorkerMirroredStrategy(), True),
    "ddp_plain_workers": lambda: ddp_loop(False),
    "ddp_sync_workers": lambda: ddp_loop(True),
}
ROWS_TO_PRINT = [
    ("sync_mirrored", "plain_mirrored"),
    ("sync_mirrored", "plain_mirrored_threads"),
    ("sync_workers", "plain_workers"),
    ("ddp_sync_workers", "ddp_plain_workers"),
    ("sync_workers", "ddp_sync_workers"),
]


def child(variant: str) -> None:
    if variant.endswith("_workers") and not ds.TorchrunClusterResolver.detected():
        sys.exit(launch_local([sys.executable, os.path.abspath(__file__), "--child", variant], num_workers=2))
    torch.set_num_threads(1)
    gc.collect()
    times = VARIANTS[variant]()
    steps = -(-ROWS // BATCH)
    if not variant.endswith("_workers") or os.environ.get("RANK") == "0":
        print(steps * (len(times) - 1) / sum(times[1:]))


def census(variant: str) -> None:
    if not ds.TorchrunClusterResolver.detected():
        sys.exit(launch_local([sys.executable, os.path.abspath(__file__), "--census", variant], num_workers=2))
    torch.set_num_threads(1)
    counts = fit(ds.MultiWorkerMirroredStrategy(), variant == "sync", census=True)
    if os.environ.get("RANK") == "0":
        print(f"RESULT {counts.layer_reduces} {sum(counts.collectives.values())} {counts.collectives}")


def measure(variant: str) -> float:
    """Steps per second of ``variant`` in fresh interpreters; a failed start (a port taken by another
    process between choosing and binding it) is tried once more, then its error is shown."""
    command = [sys.executable, os.path.abspath(__file__), "--child", variant]
    for _attempt in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode == 0:
            return float(done.stdout.strip().split()[-1])
    raise RuntimeError(f"{variant} failed twice; its last error:\n{done.stderr[-3000:]}")


def print_census() -> None:
    counts = fit(_mirrored(), True, census=True)
    print(f"one step of Mirrored(2): {counts.layer_reduces} all-reduces of the 3 synchronized layers, both replicas")
    for variant in ("plain", "sync"):
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--census", variant],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            timeout=600,
        )
        line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
        _, layer, total, kinds = line.split(" ", 3)
        print(f"one step on 2 workers, {variant} BatchNorm: {total} gloo collectives per worker {kinds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="only the rows whose names contain this (e.g. workers)")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--census", choices=("plain", "sync"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.census:
        census(args.census)
        return
    if not args.only:
        print_census()
    print(f"{ROWS} images 3x16x16, global batch {BATCH}, steps/s over epochs 2-{EPOCHS}, {args.repeats} paired repeats")
    for ours, reference in ROWS_TO_PRINT:
        if args.only not in f"{ours} {reference}":
            continue
        ratios, a_rates, b_rates = [], [], []
        for repeat in range(args.repeats):
            pair = (ours, reference) if repeat % 2 == 0 else (reference, ours)
            rates = {name: measure(name) for name in pair}
            a_rates.append(rates[ours])
            b_rates.append(rates[reference])
            ratios.append(rates[reference] / rates[ours])  # step time: ours / reference
        print(
            f"{ours:>14} vs {reference:<22}: {statistics.median(a_rates):6.1f} vs {statistics.median(b_rates):6.1f} "
            f"steps/s; step time ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
