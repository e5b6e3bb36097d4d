"""Collectives and run overhead on logical CPU devices.

1. ``batch_reduce_to`` of 200 tensors of 64x64 float32 vs 200 separate ``reduce_to``
   calls on MirroredStrategy(2) (target: the batched call at least 5x faster).
2. The per-call cost of ``strategy.run`` with a trivial function on MirroredStrategy(2)
   vs OneDeviceStrategy (microseconds and the ratio).

Run: python benchmarks/bench_collectives.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch

import replicafit.strategies as ds


def _median_seconds(fn, repeats: int, inner: int = 1) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def bench_batch_reduce(repeats: int, count: int = 200, shape=(64, 64)) -> tuple[float, float]:
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        variables = [ds.Variable(torch.zeros(shape), name=f"w{i}") for i in range(count)]
    torch.manual_seed(0)
    grads = [ds.PerReplica((torch.randn(shape), torch.randn(shape))) for _ in range(count)]
    pairs = list(zip(grads, variables))
    extended = strategy.extended

    def batched():
        with strategy.scope():
            extended.batch_reduce_to(ds.ReduceOp.SUM, pairs)

    def separate():
        with strategy.scope():
            for grad, var in pairs:
                extended.reduce_to(ds.ReduceOp.SUM, grad, var)

    # Same answers both ways before timing anything.
    with strategy.scope():
        a = extended.batch_reduce_to(ds.ReduceOp.SUM, pairs)
        b = [extended.reduce_to(ds.ReduceOp.SUM, g, v) for g, v in pairs]
    assert all(torch.equal(x.values[1], y.values[1]) for x, y in zip(a, b))
    firsts = [g.values[0] for g in grads]
    seconds = [g.values[1] for g in grads]
    floor = _median_seconds(lambda: torch._foreach_add(firsts, seconds), repeats)
    return _median_seconds(batched, repeats), _median_seconds(separate, repeats), floor


def bench_run(repeats: int, inner: int = 200) -> tuple[float, float]:
    mirrored = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    one = ds.OneDeviceStrategy("cpu:0")

    def trivial():
        return None

    t_mirrored = _median_seconds(lambda: mirrored.run(trivial), repeats, inner)
    t_one = _median_seconds(lambda: one.run(trivial), repeats, inner)
    return t_mirrored, t_one, _thread_round_trip(repeats, inner)


def _thread_round_trip(repeats: int, inner: int) -> float:
    """The platform floor of one replica hop: a bare ping-pong between two threads."""
    requests, replies = queue.SimpleQueue(), queue.SimpleQueue()

    def echo():
        while (item := requests.get()) is not None:
            replies.put(item)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()

    def ping():
        requests.put(1)
        replies.get()

    try:
        return _median_seconds(ping, repeats, inner)
    finally:
        requests.put(None)
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    batched, separate, floor = bench_batch_reduce(args.repeats)
    print("batch_reduce_to, 200 x 64x64 float32, MirroredStrategy(2):")
    print(f"  one batch_reduce_to call : {batched * 1e3:8.3f} ms")
    print(f"  200 reduce_to calls      : {separate * 1e3:8.3f} ms")
    print(f"  speed-up (separate / batched): {separate / batched:.1f}x   (target >= 5x)")
    print(
        f"  floor: bare torch._foreach_add of the same 200 pairs: {floor * 1e3:.3f} ms "
        f"(batched overhead above it: {(batched - floor) * 1e3:.3f} ms)"
    )

    t_mirrored, t_one, hop = bench_run(args.repeats)
    print("strategy.run(trivial fn) per call:")
    print(f"  MirroredStrategy(2) : {t_mirrored * 1e6:8.1f} us")
    print(f"  OneDeviceStrategy   : {t_one * 1e6:8.1f} us")
    print(f"  ratio Mirrored(2) / OneDevice: {t_mirrored / t_one:.1f}x")
    print(f"  floor: bare thread round trip (SimpleQueue ping-pong): {hop * 1e6:.1f} us")


if __name__ == "__main__":
    main()
