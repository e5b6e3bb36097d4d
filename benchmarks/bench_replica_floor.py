"""How close two replicas on one physical device can get to one device: the ceiling of issue 12's
Mirrored/OneDevice throughput row, measured.

Two logical CPUs share the same cores, so one would expect a limit near 1.0x. But each replica
runs its own forward and backward on half the batch, and at the benchmark's sizes a step is
mostly per-operation overhead, so two half-batch passes cost much more than one full-batch pass
before anything distributed happens. This script measures, on the shared benchmark workload
(``bench_fit.make_model``, SGD momentum, cross entropy), in one fresh process per repeat:

- ``fit``: ``Trainer.fit`` microseconds per step under ``OneDeviceStrategy("cpu:0")`` and
  ``MirroredStrategy(["cpu:0", "cpu:1"])`` (epochs 2-5 of 8,192 examples, the two fits in alternating order);
- ``pass``: the bare forward + ``autograd.grad`` of the model at the full batch, and of two
  half batches one after the other (what two replicas must compute, whatever the runtime);
- ``update``: the SGD-momentum update as multi-tensor kernels over one copy of the parameters
  and over two (Mirrored keeps a copy per replica).

and prints three ratios (median and range over the repeats):

- ``measured``: OneDevice / Mirrored step time (the benchmark row of ``bench_fit.py``);
- ``same overhead``: the Mirrored ratio if its per-step framework overhead were no larger than
  OneDevice's (only the extra compute of two replicas added) — the best a runtime that keeps
  per-replica computation and bit-identical results can do;
- ``compute only``: the ratio of the bare computations (no framework on either side).

Run: python benchmarks/bench_replica_floor.py [--repeats 3] [--batches 64 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fit import fit, make_model, sync  # noqa: E402

import replicafit.strategies as ds  # noqa: E402
from replicafit.data import datasets  # noqa: E402


def bare_pass(x, y, batch: int, halves: bool, reps: int) -> float:
    """Microseconds for a forward + autograd.grad at ``batch`` (or two at ``batch // 2``), on ``x``'s device."""
    model = make_model().to(x.device)
    params = list(model.parameters())
    parts = (
        [(x[: batch // 2], y[: batch // 2]), (x[batch // 2 : batch], y[batch // 2 : batch])]
        if halves
        else [(x[:batch], y[:batch])]
    )

    def once():
        for xb, yb in parts:
            torch.autograd.grad(F.cross_entropy(model(xb), yb, reduction="none").sum() / batch, params)

    for _ in range(reps // 10):
        once()
    sync(x.device)
    start = time.perf_counter()
    for _ in range(reps):
        once()
    sync(x.device)
    return (time.perf_counter() - start) / reps * 1e6


def bare_update(copies: int, reps: int, device: str = "cpu") -> float:
    """Microseconds for SGD momentum's three multi-tensor kernels over ``copies`` parameter copies."""
    device = torch.device(device)
    params = [p.detach().to(device) for _ in range(copies) for p in make_model().parameters()]
    buffers = [torch.zeros_like(p) for p in params]
    grads = [torch.full_like(p, 1e-3) for p in params]
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        torch._foreach_mul_(buffers, 0.9)
        torch._foreach_sub_(buffers, grads, alpha=0.01)
        torch._foreach_add_(params, buffers)
    sync(device)
    return (time.perf_counter() - start) / reps * 1e6


def child(batch: int, examples: int, epochs: int, reverse: bool) -> None:
    x, y = datasets.make_classification(examples, 64, n_classes=10, seed=0)
    gc.collect()  # the full collection the imports leave due runs now, not inside a timed epoch (bench_fit.child)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    steps = -(-examples // batch)
    out = {}
    order = [
        ("one", lambda: ds.OneDeviceStrategy("cpu:0")),
        ("mirrored", lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"])),
    ]
    for name, make in reversed(order) if reverse else order:  # paired: the order alternates per repeat
        times = fit(x, y, batch, epochs, make())
        out[f"fit_{name}"] = sum(times[1:]) / (steps * (len(times) - 1)) * 1e6
    out["pass_full"] = bare_pass(xs, ys, batch, False, 2000)
    out["pass_halves"] = bare_pass(xs, ys, batch, True, 2000)
    out["update_1"] = bare_update(1, 4000)
    out["update_2"] = bare_update(2, 4000)
    print(json.dumps(out))


def ratios(f: dict) -> dict:
    extra = (f["pass_halves"] - f["pass_full"]) + (f["update_2"] - f["update_1"])
    return {
        "measured": f["fit_one"] / f["fit_mirrored"],
        "same overhead": f["fit_one"] / (f["fit_one"] + extra),
        "compute only": (f["pass_full"] + f["update_1"]) / (f["pass_halves"] + f["update_2"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--examples", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.examples, args.epochs, args.reverse)
        return
    for batch in args.batches:
        runs = []
        for repeat in range(args.repeats):
            argv = [sys.executable, os.path.abspath(__file__), "--child", str(batch)] + ["--reverse"] * (repeat % 2)
            argv += ["--examples", str(args.examples), "--epochs", str(args.epochs)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"batch {batch} failed:\n{done.stderr[-2000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        figures = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"batch {batch:>3}: fit {figures['fit_one']:.0f} (one device) vs {figures['fit_mirrored']:.0f} us/step "
            f"(mirrored); pass {figures['pass_full']:.0f} (full batch) vs {figures['pass_halves']:.0f} us (two "
            f"halves); update {figures['update_1']:.0f} (1 copy) vs {figures['update_2']:.0f} us (2 copies)"
        )
        per_run = [ratios(r) for r in runs]
        for name in per_run[0]:
            values = [r[name] for r in per_run]
            print(
                f"          Mirrored/OneDevice throughput, {name:>13}: {statistics.median(values):.3f} "
                f"(range {min(values):.3f}-{max(values):.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
