"""Collectives and run overhead on logical CPU devices.

1. ``batch_reduce_to`` of 200 tensors of 64x64 float32 vs 200 separate ``reduce_to``
   calls on MirroredStrategy(2) (target: the batched call at least 5x faster).
2. The per-call cost of ``strategy.run`` with a trivial function on MirroredStrategy(2)
   vs OneDeviceStrategy (microseconds and the ratio).

``--workers N`` measures instead the two ways ``MultiWorkerMirroredStrategy`` can sum a flat float32 buffer
across N worker processes on gloo (127.0.0.1, one intra-op thread each, bounded by ``--timeout`` and ended by
their ids), at several sizes: gloo's all-reduce (the reference: what DDP and ``CommunicationImplementation.RING``
use) and one all-gather with a local sum in worker order (what ``AUTO`` uses up to
``Collective.gather_sum_bytes`` gathered). Each round times a block of ``--steps`` sums of every way, the order
reversed every other round; a block's time is the slower worker's. It prints the medians, the median of the
per-round ratios gathered / all-reduce, and which way ``AUTO`` takes at that size; before timing, each size is
summed both ways and compared (bit for bit on 2 workers, within rounding on more).

Run: python benchmarks/bench_collectives.py [--repeats 30]
     python benchmarks/bench_collectives.py --workers 2 [--rounds 40] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
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


SIZES_KIB = (9, 64, 332, 512, 1024, 2048)  # per worker; 332 KiB: the shared MLP's gradients (85,002 float32)


def sum_worker(rank: int, port: int, args, outdir: str) -> None:
    """One worker of ``--workers``: every size's rounds of both ways; writes its block times."""
    torch.set_num_threads(1)
    resolver = ds.SimpleClusterResolver(args.workers, rank, "127.0.0.1", port)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=60), resolver)
    collective = strategy.extended._collective
    auto_bound = collective.gather_sum_bytes
    ways = {"all_reduce": 0, "gathered": 1 << 62}  # gather_sum_bytes forcing each way
    out = {"bound": auto_bound, "sizes": {}}
    for kib in SIZES_KIB:
        buffer = torch.randn(kib * 256, generator=torch.Generator().manual_seed(rank))
        total = buffer.numel() * buffer.element_size() * args.workers
        blocks = {way: [] for way in ways}

        def block(way, steps, buffer=buffer):
            collective.gather_sum_bytes = ways[way]
            for _ in range(steps):
                collective.wait_work(collective.start_all_reduce(buffer, "a sum"), "a sum")

        sums, source = {}, buffer.clone()
        for way in ways:  # both ways give the same sum (bit for bit on 2 workers), then a warm-up
            collective.gather_sum_bytes = ways[way]
            sums[way] = source.clone()
            collective.wait_work(collective.start_all_reduce(sums[way], "a checked sum"), "a checked sum")
            block(way, 3)
        if args.workers == 2 and not torch.equal(sums["all_reduce"], sums["gathered"]):
            raise AssertionError(f"{kib} KiB: the gathered sum differs from the all-reduce's")
        torch.testing.assert_close(sums["gathered"], sums["all_reduce"])
        for r in range(args.rounds):
            for way in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                strategy.cluster.barrier("a round")
                begin = time.perf_counter()
                block(way, args.steps)
                blocks[way].append((time.perf_counter() - begin) / args.steps)
        out["sizes"][kib] = {"blocks": blocks, "auto_gathers": total <= auto_bound}
    collective.gather_sum_bytes = auto_bound
    with open(os.path.join(outdir, f"out-{rank}.json.tmp"), "w") as file:
        json.dump(out, file)
    os.replace(os.path.join(outdir, f"out-{rank}.json.tmp"), os.path.join(outdir, f"out-{rank}.json"))
    strategy.cluster.barrier("end")


def report_sums(outcomes, args) -> None:
    print(
        f"a sum of a float32 buffer across {args.workers} workers (gloo, 127.0.0.1, 1 thread each); {args.rounds} "
        f"rounds x {args.steps} sums; the slower worker, us per sum; AUTO gathers up to {outcomes[0]['bound']} "
        "bytes gathered"
    )
    print(f"  {'per worker':>10} {'all-reduce':>11} {'gathered':>9} {'gathered/all-reduce':>20}  range        AUTO")
    for kib in SIZES_KIB:
        rows = [o["sizes"][str(kib)] for o in outcomes]
        slower = {w: [max(r["blocks"][w][k] for r in rows) for k in range(args.rounds)] for w in rows[0]["blocks"]}
        ratios = sorted(g / a for a, g in zip(slower["all_reduce"], slower["gathered"]))
        way = "gathered" if rows[0]["auto_gathers"] else "all-reduce"
        print(
            f"  {kib:>6} KiB {statistics.median(slower['all_reduce']) * 1e6:11.0f} "
            f"{statistics.median(slower['gathered']) * 1e6:9.0f} {statistics.median(ratios):20.3f}  "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}    {way}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--workers", type=int, default=0, help="time the sums across this many worker processes")
    parser.add_argument("--rounds", type=int, default=40, help="with --workers")
    parser.add_argument("--steps", type=int, default=10, help="with --workers: sums per block")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --workers: seconds before they are ended")
    parser.add_argument("--_worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        rank, port, outdir = args._worker
        sum_worker(int(rank), int(port), args, outdir)
        return
    if args.workers:
        if args.workers < 2:
            parser.error("--workers needs at least 2")
        from bench_multiworker import launch

        report_sums(launch(args, sys.argv[1:], __file__, args.workers), args)
        return
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
