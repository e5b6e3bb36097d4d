"""Input that scales out: an input-bound epoch, one process against 2 workers against DDP.

The workload: a map-style ``Dataset`` of 2,048 examples whose ``__getitem__`` costs 0.5 ms of CPU (as
decoding a small image would), a linear model, global batches of 64, 2 epochs; the figure is the
seconds of the second epoch. Three runs per round, each in fresh interpreters, their order rotated
every round:

- ``one``: replicafit in one process (``OneDeviceStrategy``);
- ``two``: replicafit on 2 workers (``MultiWorkerMirroredStrategy``, gloo over 127.0.0.1; each worker
  reads only its replicas' rows, ``AutoShardPolicy.AUTO``);
- ``ddp``: ``DistributedDataParallel`` on 2 processes with a ``DistributedSampler(shuffle=True)`` and
  batches of 32 per process (the same global batch).

for three sources: ``dataset`` (``fit(model, dataset, batch_size=64)``; DDP: a ``DataLoader`` without
worker processes), ``loader0`` and ``loader2`` (``DataLoader(dataset, batch_size=64, shuffle=True,
num_workers=0 or 2)``; DDP's with the same ``num_workers``). Printed per source: the medians, the ratios
two/ddp (target <= 1.05) and two/one (target <= 0.6), and each process's ``__getitem__`` calls per epoch
(its share: 1,024 of 2,048).

Run: python benchmarks/bench_input_sharding.py [--rounds 3] [--sources dataset loader0 loader2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

import torch

ROWS, BATCH, FEATURES, CLASSES, COST = 2048, 64, 32, 10, 0.0005
SOURCES = ("dataset", "loader0", "loader2")


class SlowDataset(torch.utils.data.Dataset):
    """``(x[i], y[i])``, each read costing ``COST`` seconds of CPU; counts the reads of this process."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(ROWS, FEATURES, generator=generator)
        self.y = torch.randint(0, CLASSES, (ROWS,), generator=generator)
        self.reads = multiprocessing.Value("q", 0)  # loader worker processes (forked) count here too

    def __len__(self):
        return ROWS

    def __getitem__(self, index):
        end = time.perf_counter() + COST
        while time.perf_counter() < end:
            pass
        with self.reads.get_lock():
            self.reads.value += 1
        return self.x[index], self.y[index]


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, CLASSES)


def _loader(dataset, source: str, batch: int, sampler=None):
    workers = 2 if source == "loader2" else 0
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch, shuffle=sampler is None, sampler=sampler, num_workers=workers
    )


def ours(source: str, strategy) -> dict:
    """replicafit's fit: the second epoch's seconds and this process's reads in it."""
    from replicafit.trainer import Callback, Trainer

    dataset = SlowDataset()

    class Clock(Callback):
        # It never stops training: no per-step agreement on stop_training across workers (which a user's
        # callback that might gets, and DDP's loop has no counterpart of).
        _decides_from_logs = True

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    clock = Clock()
    trainer = Trainer(strategy=strategy, optimizer="sgd", loss="cross_entropy", metrics=(), seed=0)
    data = dataset if source == "dataset" else _loader(dataset, source, BATCH)
    kwargs = {"batch_size": BATCH} if source == "dataset" else {}
    trainer.fit(_model(), data, epochs=2, verbose=0, callbacks=[clock], **kwargs)
    return {"seconds": clock.seconds, "reads": dataset.reads.value // 2}  # per epoch (a pass's loader reads ahead)


def ddp(source: str) -> dict:
    """The reference: DDP with a DistributedSampler, a torch loop; the second epoch's seconds and reads."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dataset = SlowDataset()
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = _loader(dataset, source, BATCH // world, sampler)
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = 0.0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"seconds": seconds, "reads": dataset.reads.value // 2}


def child(variant: str, source: str) -> None:
    import replicafit.strategies as ds
    from replicafit.cli.launch import launch_local

    if variant != "one" and not ds.TorchrunClusterResolver.detected():
        command = [sys.executable, os.path.abspath(__file__), "--child", variant, source]
        sys.exit(launch_local(command, num_workers=2))
    torch.set_num_threads(1)
    if variant == "one":
        result = ours(source, ds.OneDeviceStrategy("cpu"))
    elif variant == "two":
        result = ours(source, ds.MultiWorkerMirroredStrategy())
    else:
        result = ddp(source)
    print("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", 0)), **result}), flush=True)


def measure(variant: str, source: str) -> list:
    """Each process's result (a failed start, a port taken between choosing and binding it, is tried once
    more)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, source]
    for _attempt in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode == 0:
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            return sorted((json.loads(line[7:]) for line in lines), key=lambda r: r["rank"])
    raise RuntimeError(f"{variant} {source} failed twice; its last error:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"{ROWS} examples at {COST * 1e3:.1f} ms each, global batch {BATCH}, the second epoch, {args.rounds} rounds")
    for source in args.sources:
        seconds = {"one": [], "two": [], "ddp": []}
        reads = {}
        for round_ in range(args.rounds):
            order = ["one", "two", "ddp"][round_ % 3 :] + ["one", "two", "ddp"][: round_ % 3]
            for variant in order:
                results = measure(variant, source)
                seconds[variant].append(max(r["seconds"] for r in results))  # the slower process's epoch
                reads[variant] = [r["reads"] for r in results]
        median = {k: statistics.median(v) for k, v in seconds.items()}
        two_ddp = [t / d for t, d in zip(seconds["two"], seconds["ddp"])]
        two_one = [t / o for t, o in zip(seconds["two"], seconds["one"])]
        print(
            f"{source:8s} one {median['one']:.3f} s, two workers {median['two']:.3f} s, DDP {median['ddp']:.3f} s; "
            f"two/ddp {statistics.median(two_ddp):.3f} (range {min(two_ddp):.3f}-{max(two_ddp):.3f}), "
            f"two/one {statistics.median(two_one):.3f} (range {min(two_one):.3f}-{max(two_one):.3f}); "
            f"__getitem__ calls per process: one {reads['one']}, two {reads['two']}, ddp {reads['ddp']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
