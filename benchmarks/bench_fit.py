"""``Trainer.fit`` vs a hand-written torch loop doing the same work.

The same MLP 64 -> 256 -> 256 -> 10 (ReLU), SGD (lr 0.01, momentum 0.9), the same data
(4096 examples, 64 features, 10 classes) and the same number of steps, at batch 8 and
batch 64. The hand-written loop batches the arrays itself, computes the cross entropy,
calls ``backward()`` and ``optimizer.step()``, and keeps the epoch's mean loss as fit
does. Targets: fit at most 1.10x the loop at batch 8 and 1.05x at batch 64 (default
strategy). Also reported: MirroredStrategy(2) and CentralStorageStrategy(2) vs
OneDeviceStrategy.

Run: python benchmarks/bench_fit.py [--examples 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    x, y = datasets.make_classification(args.examples, 64, n_classes=10, seed=0)
    for batch in (8, 64):
        steps = -(-args.examples // batch)
        loop, ours = [], []
        for _ in range(args.repeats):  # interleaved, so drifts of the machine hit both alike
            loop.append(hand_loop(x, y, batch))
            ours.append(fit(x, y, batch))
        loop_t, fit_t = statistics.median(loop), statistics.median(ours)
        target = 1.10 if batch == 8 else 1.05
        print(f"batch {batch} ({steps} steps):")
        print(f"  hand-written loop : {loop_t * 1e3:8.1f} ms ({loop_t / steps * 1e6:.0f} us/step)")
        print(
            f"  Trainer.fit       : {fit_t * 1e3:8.1f} ms ({fit_t / steps * 1e6:.0f} us/step)  "
            f"ratio {fit_t / loop_t:.3f} (target <= {target})"
        )
        one = statistics.median(fit(x, y, batch, ds.OneDeviceStrategy("cpu:0")) for _ in range(args.repeats))
        mirrored = statistics.median(
            fit(x, y, batch, ds.MirroredStrategy(["cpu:0", "cpu:1"])) for _ in range(args.repeats)
        )
        central = statistics.median(
            fit(x, y, batch, ds.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0")) for _ in range(args.repeats)
        )
        print(
            f"  OneDevice {one * 1e3:.1f} ms; Mirrored(2) {mirrored * 1e3:.1f} ms ({mirrored / one:.2f}x); "
            f"CentralStorage(2) {central * 1e3:.1f} ms ({central / one:.2f}x)"
        )


if __name__ == "__main__":
    main()
