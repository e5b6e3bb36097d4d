"""Input pipeline: iterating a DistributedDataset vs the DataLoader it wraps.

MirroredStrategy(["cpu:0", "cpu:1"]), global batches of 256 float32 images 3x32x32 and
int64 labels from a ``DataLoader`` over a ``TensorDataset``, 200 steps; the reference
is the same DataLoader iterated directly (target: at most 10% slower). Each step also
touches every replica's slice (a sum), as a training step would.

Run: python benchmarks/bench_input.py [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import replicafit.strategies as ds
from replicafit import data


def make_loader(steps: int, batch: int = 256) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(steps * batch, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (steps * batch,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=batch)


def time_direct(loader) -> float:
    start = time.perf_counter()
    for images, labels in loader:
        images.sum(), labels.sum()
    return time.perf_counter() - start


def time_distributed(strategy, loader, options=None) -> float:
    dist = strategy.experimental_distribute_dataset(loader, options)
    start = time.perf_counter()
    for images, labels in dist:
        for part in strategy.experimental_local_results(images) + strategy.experimental_local_results(labels):
            part.sum()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    loader = make_loader(args.steps)
    time_direct(loader), time_distributed(strategy, loader)  # warm-up
    threaded = data.InputOptions(experimental_per_replica_buffer_size=1)
    direct, distributed, prefetched = [], [], []
    for _ in range(args.repeats):  # interleaved, so drifts of the machine hit all alike
        direct.append(time_direct(loader))
        distributed.append(time_distributed(strategy, loader))
        prefetched.append(time_distributed(strategy, loader, threaded))
    d, x, p = statistics.median(direct), statistics.median(distributed), statistics.median(prefetched)
    print(f"{args.steps} steps of 256 x (3x32x32 float32 + int64 label), MirroredStrategy(2):")
    print(f"  DataLoader directly   : {d * 1e3:8.1f} ms  ({d / args.steps * 1e3:.2f} ms/step)")
    print(f"  DistributedDataset    : {x * 1e3:8.1f} ms  ({x / args.steps * 1e3:.2f} ms/step)")
    print(f"  ratio distributed / direct: {x / d:.3f}   (target <= 1.10)")
    print(f"  with a prefetch thread (buffer 1; the default only on accelerators): {p / d:.3f}")


if __name__ == "__main__":
    main()
