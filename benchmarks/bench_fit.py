"""``Trainer.fit`` against its references, on the shared benchmark workload.

The workload (issue 12): an MLP 64 -> 256 -> 256 -> 10 (ReLU), SGD (lr 0.01, momentum 0.9),
8,192 examples of 64 features and 10 classes, 5 epochs; the figure is the steps per second over
epochs 2-5 (epoch 1 warms up), at batch 64 and batch 8. Rows, each printed as ours, the
reference and their ratio (median and range over the paired repeats):

- fit / loop: ``Trainer.fit`` (default strategy) step time against a hand-written torch loop
  doing the same work; target <= 1.05 at batch 64, <= 1.10 at batch 8.
- mirrored: ``MirroredStrategy(["cpu:0", "cpu:1"])`` throughput against
  ``OneDeviceStrategy("cpu:0")``; target >= 0.8 at batch 64, >= 0.6 at batch 8.
- central_storage: ``CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0")`` throughput against
  OneDevice; the same targets.

- bf16 / 16-mixed / accumulation: the cost of each issue-13 feature on the default strategy,
  ``fit(precision="bf16-mixed")``, ``fit(precision="16-mixed")`` (autocast plus loss scaling:
  one host read per step for the finite check) and SGD with ``gradient_accumulation_steps=4``,
  each against the same ``fit`` in float32 without accumulation (step time ratio; no target:
  bfloat16 and float16 on a CPU without half-precision units are expected to be slower).
- ema / ema_mirrored: the cost of issue 14's moving averages, SGD with ``use_ema=True`` (one
  multiply and one add per parameter copy per step, plus one host read of ``iterations``) against
  the same ``fit`` without, on the default strategy and under Mirrored(2) (step time ratio).

``--execution threads`` runs the two-replica strategies with a thread per replica (the runner
before replicas that share a device took turns on one thread), for the before/after figure.

Every measurement runs in a fresh interpreter, and the repeats are paired (A B A B, the order
reversed every repeat), so drifts of this shared machine hit both sides alike: a process that has
run replica threads keeps them (and their OpenMP state), which slows later work in it. Each
measurement collects garbage before it starts (see ``child``).

Run: python benchmarks/bench_fit.py [--repeats 5] [--examples 8192] [--epochs 5] [--batches 64 8]
     python benchmarks/bench_fit.py --rows bf16 16-mixed accumulation    (issue 13's costs)
     python benchmarks/bench_fit.py --rows ema ema_mirrored               (issue 14's cost)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import replicafit.strategies as ds
from replicafit.data import datasets
from replicafit.trainer import Callback, Trainer


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


def sync(device: torch.device) -> None:
    """Waits for ``device``'s queued work where it has any (a GPU): what a clock reads around it is then done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_epoch(model, optimizer, xs, ys, batch: int) -> float:
    """One epoch of the reference loop over the tensors ``xs``, ``ys`` (on the model's device); its seconds (on a
    GPU from a synchronised start: the epoch's end is its read of the mean loss)."""
    sync(xs.device)
    start = time.perf_counter()
    total, count = torch.zeros((), device=xs.device), 0
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


def hand_loop(x, y, batch: int, epochs: int) -> list[float]:
    """The reference: batches the arrays itself, cross entropy, backward, step; keeps the epoch's
    mean loss as fit does. Returns each epoch's seconds."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    return [hand_epoch(model, optimizer, xs, ys, batch) for _ in range(epochs)]


class EpochClock(Callback):
    """Each epoch's seconds (``times``), from ``on_epoch_begin`` to ``on_epoch_end`` (``device``: a GPU synchronised
    at both ends)."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.times: list[float] = []
        self.device = device

    def on_epoch_begin(self, epoch, logs=None):
        if self.device is not None:
            sync(self.device)
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if self.device is not None:
            sync(self.device)
        self.times.append(time.perf_counter() - self._start)


def fit(x, y, batch: int, epochs: int, strategy=None, precision="32", accumulation=None, ema=False) -> list[float]:
    clock = EpochClock()
    config = {"learning_rate": 0.01, "momentum": 0.9, "gradient_accumulation_steps": accumulation, "use_ema": ema}
    trainer = Trainer(
        strategy=strategy,
        optimizer={"class_name": "sgd", "config": config},
        loss="cross_entropy",
        metrics=(),
        seed=0,
        precision=precision,
    )
    trainer.fit(make_model(), (x, y), batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[clock])
    return clock.times


VARIANTS = {
    "loop": lambda x, y, b, e: hand_loop(x, y, b, e),
    "fit": lambda x, y, b, e: fit(x, y, b, e),
    "one_device": lambda x, y, b, e: fit(x, y, b, e, ds.OneDeviceStrategy("cpu:0")),
    "mirrored": lambda x, y, b, e: fit(x, y, b, e, ds.MirroredStrategy(["cpu:0", "cpu:1"])),
    "central_storage": lambda x, y, b, e: fit(x, y, b, e, ds.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0")),
    "bf16": lambda x, y, b, e: fit(x, y, b, e, precision="bf16-mixed"),
    "16-mixed": lambda x, y, b, e: fit(x, y, b, e, precision="16-mixed"),
    "accumulation": lambda x, y, b, e: fit(x, y, b, e, accumulation=4),
    "ema": lambda x, y, b, e: fit(x, y, b, e, ema=True),
    "ema_mirrored": lambda x, y, b, e: fit(x, y, b, e, ds.MirroredStrategy(["cpu:0", "cpu:1"]), ema=True),
}
# (ours, reference, kind, target at batch 64, target at batch 8)
ROWS = [
    ("fit", "loop", "step time", 1.05, 1.10),
    ("mirrored", "one_device", "throughput", 0.8, 0.6),
    ("central_storage", "one_device", "throughput", 0.8, 0.6),
    ("bf16", "fit", "cost", None, None),
    ("16-mixed", "fit", "cost", None, None),
    ("accumulation", "fit", "cost", None, None),
    ("ema", "fit", "cost", None, None),
    ("ema_mirrored", "mirrored", "cost", None, None),
]
DEFAULT_ROWS = ["fit", "mirrored", "central_storage"]


def child(variant: str, batch: int, examples: int, epochs: int, execution: str) -> None:
    """One measurement in this (fresh) process: prints the steps per second over epochs 2..N."""
    ds.set_replica_execution(execution)
    x, y = datasets.make_classification(examples, 64, n_classes=10, seed=0)
    # The imports leave a full garbage collection due (~75 ms over torch's objects). Left alone it
    # runs at whichever step first allocates enough: early in the hand loop (whose steps allocate
    # hundreds of tracked objects), inside the timed epochs of fit (whose steps allocate almost
    # none), which read as +15-20% per step at batch 64. Collected here, it runs before either.
    gc.collect()
    times = VARIANTS[variant](x, y, batch, epochs)
    steps = -(-examples // batch)
    print(steps * (len(times) - 1) / sum(times[1:]))


def measure(variant: str, args, batch: int) -> float:
    argv = [sys.executable, os.path.abspath(__file__), "--child", variant, "--batches", str(batch)]
    argv += ["--examples", str(args.examples), "--epochs", str(args.epochs), "--execution", args.execution]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at batch {batch} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=[r[0] for r in ROWS])
    parser.add_argument("--execution", choices=["auto", "threads"], default="auto")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batches[0], args.examples, args.epochs, args.execution)
        return
    print(
        f"{args.examples} examples, steps/s over epochs 2-{args.epochs}, {args.repeats} paired repeats, "
        f"replica execution {args.execution!r}"
    )
    for batch in args.batches:
        for ours, reference, kind, target64, target8 in ROWS:
            if ours not in args.rows:
                continue
            ratios, a_rates, b_rates = [], [], []
            for repeat in range(args.repeats):
                pair = (ours, reference) if repeat % 2 == 0 else (reference, ours)
                rates = {name: measure(name, args, batch) for name in pair}
                a_rates.append(rates[ours])
                b_rates.append(rates[reference])
                # throughput: ours/reference steps per second; step time: reference/ours
                a, b = rates[ours], rates[reference]
                ratios.append(a / b if kind == "throughput" else b / a)
            target = target64 if batch == 64 else target8
            sign = ">=" if kind == "throughput" else "<="
            goal = f"target {sign} {target}" if target is not None else "the feature's cost, no target"
            kind = "step time" if kind == "cost" else kind
            print(
                f"batch {batch:>3} {ours:>15} vs {reference:<10}: {statistics.median(a_rates):8.0f} vs "
                f"{statistics.median(b_rates):8.0f} steps/s; {kind} ratio {statistics.median(ratios):.3f} "
                f"(range {min(ratios):.3f}-{max(ratios):.3f}; {goal})",
                flush=True,
            )


if __name__ == "__main__":
    main()
