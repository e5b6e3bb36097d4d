"""One optimizer step on 100 parameter tensors (50 x Linear(64, 64)): ours vs torch.optim.

Our SGD (momentum 0.9) and Adam against ``torch.optim`` with ``foreach=True`` (the
reference; target: at most 1.2x its time on one device), and for scale against torch's
per-tensor loop (``foreach=False``) and its fused kernels (``fused=True``). Ours runs on
the default strategy (one device, ``apply_gradients`` outside any scope) and on
MirroredStrategy(2) (a full replica step: ``strategy.run`` whose replicas call
``apply_gradients``: merge_call, one batched SUM of the gradients, the update on both
copies).

Run: python benchmarks/bench_optimizers.py [--steps 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import replicafit.strategies as ds
from replicafit import optimizers


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(50)])


def make_grads(params) -> list:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(p.shape, generator=generator) * 1e-3 for p in params]


def time_steps(step, steps: int, repeats: int) -> float:
    step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples)


def torch_step(kind: str, variant: dict, steps: int, repeats: int) -> float:
    params = list(make_model().parameters())
    grads = make_grads(params)
    for p, g in zip(params, grads):
        p.grad = g
    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, **variant)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-3, eps=1e-7, **variant)
    return time_steps(optimizer.step, steps, repeats)


def ours(kind: str):
    return optimizers.SGD(0.01, momentum=0.9) if kind == "sgd" else optimizers.Adam(1e-3)


def ours_default(kind: str, steps: int, repeats: int) -> float:
    params = list(make_model().parameters())
    grads = make_grads(params)
    optimizer = ours(kind)
    pairs = list(zip(grads, params))
    return time_steps(lambda: optimizer.apply_gradients(pairs), steps, repeats)


def ours_mirrored(kind: str, steps: int, repeats: int) -> float:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    model = strategy.distribute_module(make_model())
    variables = model.trainable_variables
    grads = make_grads([v.value() for v in variables])
    with strategy.scope():
        optimizer = ours(kind)

    def replica_step():
        optimizer.apply_gradients(zip(grads, variables))

    return time_steps(lambda: strategy.run(replica_step), steps, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n, r = args.steps, args.repeats
    print("one step, 100 tensors (50 x Linear(64, 64)), microseconds per step")
    for kind in ("sgd", "adam"):
        foreach = torch_step(kind, {"foreach": True}, n, r)
        loop = torch_step(kind, {"foreach": False}, n, r)
        fused = torch_step(kind, {"fused": True}, n, r)
        default = ours_default(kind, n, r)
        mirrored = ours_mirrored(kind, n, r)
        label = "SGD(momentum=0.9)" if kind == "sgd" else "Adam"
        print(f"{label}:")
        print(f"  torch foreach     : {foreach * 1e6:8.1f}")
        print(f"  torch per-tensor  : {loop * 1e6:8.1f}  ({loop / foreach:.2f}x foreach)")
        print(f"  torch fused       : {fused * 1e6:8.1f}  ({fused / foreach:.2f}x foreach)")
        print(
            f"  ours, default     : {default * 1e6:8.1f}  ({default / foreach:.2f}x foreach, "
            f"{default / fused:.2f}x fused)   target <= 1.2x foreach"
        )
        print(
            f"  ours, Mirrored(2) : {mirrored * 1e6:8.1f}  ({mirrored / foreach:.2f}x one-device foreach; "
            "a whole replica step: run + merge_call + batched SUM + both copies)"
        )


if __name__ == "__main__":
    main()
