"""Sharded optimizer states vs whole ones: peak memory per worker and step time, N gloo workers.

``MultiWorkerMirroredStrategy(shard_optimizer_states=True)`` against the same strategy without it, both
through ``Trainer.fit`` with ``optimizers.Adam`` on the same synthetic data, in N worker processes over
127.0.0.1 with one intra-op thread each:

* ``--model large``: an MLP 16 -> 3072 -> 3072 -> 7 -> 4 (9,514,023 parameters, 99 % of them in one weight),
  global batch 64: Adam's two slots are 76 MB per worker unsharded;
* ``--model small``: the shared small workload of ``bench_multiworker.py`` (64 -> 256 -> 256 -> 10, 85,002
  parameters), global batch 64.

Each round starts a fresh process group per mode (the order alternating between rounds, so drifts hit both
alike); every worker runs ``--warmup`` steps then ``--steps`` timed steps (from one ``on_train_batch_end`` to
the next) and reports its median step time, its peak resident memory (``ru_maxrss``), the data collectives per
step and their bytes, and the optimizer state it holds. The script prints, per mode, the medians over rounds of
the slower worker's step time and of the largest peak memory, the ratio sharded / whole of the step times, and
what sharding saved in memory against what the slots it no longer holds weigh.

Targets (issue 31): peak memory lower by at least 80 % of the slots no longer held (>= 30 MB for the large model
on 2 workers); step time sharded / whole <= 1.15x, at both models. Buckets under ``StateShards.min_bytes``
(1 MiB) stay whole, so the small model is not cut at all by default; ``--min-bytes 0`` cuts every bucket, to see
what that would cost.

Run: python benchmarks/bench_shard_states.py [--workers 2] [--model large] [--rounds 3] [--steps 20] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

MODELS = {"large": (16, 3072, 3072, 7, 4), "small": (64, 256, 256, 10)}


def _mlp(widths):
    import torch

    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def worker(rank, workers, port, mode, model, steps, warmup, batch, min_bytes=None, ema=False) -> dict:
    import torch

    torch.set_num_threads(1)
    import replicafit.strategies as ds
    from replicafit import optimizers
    from replicafit.strategies.state_sharding import StateShards
    from replicafit.trainer import Callback, Trainer

    if min_bytes is not None:
        StateShards.min_bytes = min_bytes

    resolver = ds.SimpleClusterResolver(workers, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(timeout_seconds=120.0)
    strategy = ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=mode == "sharded")
    widths = MODELS[model]
    torch.manual_seed(0)
    net = _mlp(widths)
    generator = torch.Generator().manual_seed(1)
    rows = (warmup + steps) * batch
    x = torch.randn(rows, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (rows,), generator=generator)
    collective = strategy.extended._collective

    class Clock(Callback):
        leaves_variables_alone = True  # a timer: the step's gather may run on through it

        def __init__(self):
            self.times, self.operations = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())
            self.operations.append(collective.operations)

    clock = Clock()
    optimizer = optimizers.Adam(1e-3, use_ema=ema)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss="cross_entropy", metrics=(), seed=0)
    trainer.fit(net, (x, y), batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    timed = [b - a for a, b in zip(clock.times[warmup - 1 : -1], clock.times[warmup:])]
    swaps = []
    for _ in range(5 if ema else 0):  # what SwapEMAWeights does around each validation: averages in, then out
        collective.barrier("timing a swap")
        start = time.perf_counter()
        with optimizer.averaged_weights():
            pass
        swaps.append(time.perf_counter() - start)
    operations = (clock.operations[-1] - clock.operations[warmup - 1]) / len(timed)
    layout = optimizer._layout  # the optimizer's state layout: StateShards where the strategy cut the variables
    shards = layout if layout is not None and layout.slices_variables else None
    slot_bytes = sum(s.value().numel() * s.value().element_size() for s in optimizer.variables[1:])  # the slots
    params = sum(p.numel() for p in net.parameters())
    if shards is None:
        moved = {"all_reduce": 4 * params}
    else:
        sizes = [shards.plan.padded_length(k) * shards.dtypes[k].itemsize for k in range(len(shards.dtypes))]
        cut = sum(size for k, size in enumerate(sizes) if k not in shards.plan.whole)
        kept = sum(sizes) - cut  # buckets under StateShards.min_bytes: all-reduced, every worker keeps them whole
        if collective.lean_scatter:  # NCCL: reduce-scatter and all-gather
            moved = {"all_reduce": kept, "reduce_scatter": cut, "all_gather": cut}
        else:  # gloo: all-reduces (a worker keeps its part, then the parts are summed with zeros elsewhere)
            moved = {"all_reduce": sum(sizes) + cut}
    return {
        "step": statistics.median(timed),
        "swap": statistics.median(swaps) if swaps else None,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "collectives": operations,
        "bytes": moved,
        "slot_bytes": slot_bytes,
        "segments": None
        if shards is None
        else f"{len(shards.plan.segments) - len(shards.plan.whole)} cut, {len(shards.plan.whole)} whole",
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _round(args, mode: str) -> list:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), "--port", str(port), "--mode", mode, *_passed(args)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for rank in range(args.workers)
    ]
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"a {mode} worker failed (exit {proc.returncode})")
            outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def _passed(args) -> list:
    passed = [
        "--workers", str(args.workers), "--model", args.model, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch", str(args.batch),
    ]  # fmt: skip
    return (
        passed
        + (["--min-bytes", str(args.min_bytes)] if args.min_bytes is not None else [])
        + (["--ema"] if args.ema else [])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ema", action="store_true", help="Adam(use_ema=True); time a swap of the averages in and out")
    parser.add_argument(
        "--min-bytes", type=int, default=None, help="StateShards.min_bytes (default: the library's, 1 MiB; 0 cuts all)"
    )
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="whole", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first timed step starts at a warm-up step's end)")
    if args.worker is not None:
        result = worker(
            args.worker, args.workers, args.port, args.mode, args.model, args.steps, args.warmup, args.batch,
            args.min_bytes, args.ema,
        )  # fmt: skip
        print(json.dumps(result), flush=True)
        return
    rounds: dict = {"whole": [], "sharded": []}
    for number in range(args.rounds):
        for mode in ("whole", "sharded") if number % 2 == 0 else ("sharded", "whole"):
            rounds[mode].append(_round(args, mode))
    print(
        f"{args.workers} workers, model {args.model} ({'-'.join(map(str, MODELS[args.model]))}), {args.rounds} rounds"
    )
    summary = {}
    for mode, runs in rounds.items():
        step = statistics.median(max(w["step"] for w in run) for run in runs)
        rss = statistics.median(max(w["rss"] for w in run) for run in runs)
        first = runs[0][0]
        summary[mode] = (step, rss, max(w["slot_bytes"] for w in runs[0]))
        moved = ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in first["bytes"].items())
        if first["swap"] is not None:
            swap = statistics.median(max(w["swap"] for w in run) for run in runs)
            print(f"  {mode:8s} swapping the moving averages in and out (averaged_weights): {swap * 1e3:.1f} ms")
        print(
            f"  {mode:8s} step {step * 1e3:8.2f} ms   peak RSS {rss / 1e6:8.1f} MB   "
            f"slots held {summary[mode][2] / 1e6:6.1f} MB   data collectives/step {first['collectives']:.1f} "
            f"({moved}; segments {first['segments']})"
        )
    ratios = [max(w["step"] for w in s) / max(w["step"] for w in u) for s, u in zip(rounds["sharded"], rounds["whole"])]
    print("  per round, step time sharded / whole: " + ", ".join(f"{r:.3f}x" for r in ratios))
    print(f"  median of the rounds' ratios: {statistics.median(ratios):.3f}x (target <= 1.15x)")
    (step_w, rss_w, slots_w), (step_s, rss_s, slots_s) = summary["whole"], summary["sharded"]
    saved, released = rss_w - rss_s, slots_w - slots_s
    print(f"  ratio of the median step times: {step_s / step_w:.3f}x")
    if released:
        print(
            f"  peak RSS saved: {saved / 1e6:.1f} MB of {released / 1e6:.1f} MB of slots no longer held "
            f"({saved / released:.0%}; target >= 80 %)"
        )
    else:
        print(f"  no slot was sharded (every bucket under StateShards.min_bytes); peak RSS saved: {saved / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
