"""The top entries of a cProfile of ``Trainer.fit`` steps (issue 12's before/after figure).

Fits the shared benchmark model (``bench_fit.make_model``) for one epoch of 4,096 examples, once
to warm up, then once under cProfile, and prints the wall time per step without the profiler and
the top entries by internal time. ``--execution threads`` gives each replica a thread of its own
(the runner before replicas that share a device took turns on one thread).

Run: python benchmarks/profile_step.py [--strategy mirrored] [--batch 8] [--execution auto] [--top 15]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fit import make_model  # noqa: E402

import replicafit.strategies as ds  # noqa: E402
from replicafit.data import datasets  # noqa: E402
from replicafit.trainer import Trainer  # noqa: E402

STRATEGIES = {
    "default": lambda: None,
    "one_device": lambda: ds.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="mirrored")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--execution", choices=["auto", "threads"], default="auto")
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    ds.set_replica_execution(args.execution)
    x, y = datasets.make_classification(args.examples, 64, n_classes=10, seed=0)
    steps = -(-args.examples // args.batch)

    def run() -> float:
        trainer = Trainer(
            strategy=STRATEGIES[args.strategy](),
            optimizer={"class_name": "sgd", "config": {"learning_rate": 0.01, "momentum": 0.9}},
            loss="cross_entropy",
            metrics=(),
            seed=0,
        )
        model = make_model()
        start = time.perf_counter()
        trainer.fit(model, (x, y), batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
        return time.perf_counter() - start

    run()
    seconds = run()
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"{args.strategy}, batch {args.batch}, execution {args.execution!r}: {seconds / steps * 1e6:.0f} us/step")
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    print("\n".join(line for line in lines[start - 1 :] if line.strip()))


if __name__ == "__main__":
    main()
