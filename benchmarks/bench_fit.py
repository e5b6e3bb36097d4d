"""``Trainer.fit`` vs a hand-written torch loop doing the same work.

The same MLP 64 -> 256 -> 256 -> 10 (ReLU), SGD (lr 0.01, momentum 0.9), the same data
(4096 examples, 64 features, 10 classes) and the same number of steps, at batch 8 and
batch 64. The hand-written loop batches the arrays itself, computes the cross entropy,
calls ``backward()`` and ``optimizer.step()``, and keeps the epoch's mean loss as fit
does. Targets: fit at most 1.10x the loop at batch 8 and 1.05x at batch 64 (default
strategy). Also reported: MirroredStrategy(2) and CentralStorageStrategy(2) vs
OneDeviceStrategy.

Every measurement runs in a fresh interpreter, the variants interleaved repeat by repeat: a
process that has run replica threads keeps them (and their OpenMP state) until they are
collected, and torch's OpenMP runtime then stops spin-waiting on the main thread, which slowed a
later OneDevice fit in the same process by about 2x on a 2-core machine.

Run: python benchmarks/bench_fit.py [--examples 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import replicafit.strategies as ds
from replicafit.data import datasets
from replicafit.trainer import Trainer


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


def hand_loop(x, y, batch: int) -> float:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    start = time.perf_counter()
    total, count = torch.zeros(()), 0
    for begin in range(0, len(xs), batch):
        xb, yb = xs[begin : begin + batch], ys[begin : begin + batch]
        optimizer.zero_grad(set_to_none=True)
        losses = F.cross_entropy(model(xb), yb, reduction="none")
        (losses.sum() / len(xb)).backward()
        optimizer.step()
        total += losses.detach().sum()
        count += len(xb)
    float(total / count)
    return time.perf_counter() - start


def fit(x, y, batch: int, strategy=None) -> float:
    model = make_model()
    trainer = Trainer(
        strategy=strategy,
        optimizer={"class_name": "sgd", "config": {"learning_rate": 0.01, "momentum": 0.9}},
        loss="cross_entropy",
        metrics=(),
        seed=0,
    )
    start = time.perf_counter()
    trainer.fit(model, (x, y), batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


VARIANTS = {
    "loop": lambda x, y, batch: hand_loop(x, y, batch),
    "fit": lambda x, y, batch: fit(x, y, batch),
    "one_device": lambda x, y, batch: fit(x, y, batch, ds.OneDeviceStrategy("cpu:0")),
    "mirrored": lambda x, y, batch: fit(x, y, batch, ds.MirroredStrategy(["cpu:0", "cpu:1"])),
    "central_storage": lambda x, y, batch: fit(x, y, batch, ds.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0")),
}


def child(variant: str, batch: int, examples: int) -> None:
    """One measurement in this (fresh) process: a warm-up run, then the timed one; prints seconds."""
    x, y = datasets.make_classification(examples, 64, n_classes=10, seed=0)
    VARIANTS[variant](x, y, batch)
    print(VARIANTS[variant](x, y, batch))


def measure(variant: str, batch: int, examples: int) -> float:
    argv = [sys.executable, os.path.abspath(__file__), "--child", variant, "--batch", str(batch)]
    done = subprocess.run(argv + ["--examples", str(examples)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at batch {batch} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch, args.examples)
        return
    for batch in (8, 64):
        steps = -(-args.examples // batch)
        times: dict = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):  # interleaved (order reversed every repeat): drifts hit all alike
            order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                times[name].append(measure(name, batch, args.examples))
        loop_t, fit_t = statistics.median(times["loop"]), statistics.median(times["fit"])
        target = 1.10 if batch == 8 else 1.05
        print(f"batch {batch} ({steps} steps):")
        print(f"  hand-written loop : {loop_t * 1e3:8.1f} ms ({loop_t / steps * 1e6:.0f} us/step)")
        print(
            f"  Trainer.fit       : {fit_t * 1e3:8.1f} ms ({fit_t / steps * 1e6:.0f} us/step)  "
            f"ratio {fit_t / loop_t:.3f} (target <= {target})"
        )
        one = statistics.median(times["one_device"])
        mirrored = statistics.median(times["mirrored"])
        central = statistics.median(times["central_storage"])
        print(
            f"  OneDevice {one * 1e3:.1f} ms; Mirrored(2) {mirrored * 1e3:.1f} ms ({mirrored / one:.2f}x); "
            f"CentralStorage(2) {central * 1e3:.1f} ms ({central / one:.2f}x)"
        )


if __name__ == "__main__":
    main()
