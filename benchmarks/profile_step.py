"""Where a training step's host time goes: a cProfile of ``Trainer.fit`` steps, by stage or by function.

Fits the shared benchmark model (``bench_fit.make_model``, SGD momentum, cross entropy, the loss
metric only) for one epoch of 4,096 examples, once to warm up, once timed without the profiler,
then once under cProfile. ``--execution threads`` gives each replica a thread of its own.

``--stages`` (the default view) sums the profile's own time (``tottime``) of every function by
the stage of the step it belongs to, and prints each stage's microseconds per step and share:

- replicafit's Python, by the file it is in: the fit loop, callbacks, the input path, the replica
  scheduler (runner, cooperative switching), ``merge_call``'s rendezvous, reductions, values and
  variables, random streams, the optimizer pipeline, the loss, metrics, the model call;
- torch's Python (``nn.Module.__call__``, ``autograd.grad``, ``torch.optim``) as "torch (Python)";
- a built-in function (torch's kernels and bindings, ``dict.get``, ...) is the stage of its caller:
  called from ``nn.Linear.forward`` it is torch's; a torch built-in called from replicafit's code is
  listed apart as "<stage>: torch calls" (the optimizer's ``torch._foreach_*`` kernels: work any loop
  does, and the Python around them is the stage's own). Its time is split among its callers by what
  each call edge took.

The profiler's own overhead per Python call inflates Python-heavy stages, so the shares are a
guide to where to look, not figures to add up: the unprofiled step time is printed beside them.
The per-step figures divide the whole profiled ``fit`` (its setup, the Trainer and model built) by
the epoch's steps: negligible at batch 8 (512 steps), less so at large batches. Under Mirrored on
logical CPUs the replicas take turns as greenlets, and cProfile may charge time spent on one
replica's stack to the other's frames across a switch: the stages' own times there are a guide,
the call counts exact.
``--loop`` profiles the hand-written torch loop of ``bench_fit.py`` the same way (the reference's
floor: the torch stages are what any loop pays). ``--top N`` prints the N functions of the largest
own time instead.

Run: python benchmarks/profile_step.py [--strategy mirrored] [--batch 8] [--execution auto]
     python benchmarks/profile_step.py --strategy default --batch 8     (fit on the default strategy)
     python benchmarks/profile_step.py --loop --batch 8                  (the hand loop's profile)
     python benchmarks/profile_step.py --strategy mirrored --top 25      (by function)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fit import hand_loop, make_model  # noqa: E402

import replicafit.strategies as ds  # noqa: E402
import replicafit.trainer as _trainer_package  # noqa: E402
from replicafit.data import datasets  # noqa: E402
from replicafit.trainer import Trainer  # noqa: E402

STRATEGIES = {
    "default": lambda: None,
    "one_device": lambda: ds.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0"),
}

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(_trainer_package.__file__)))  # the source folders' parent
# (folder, file or None for the whole folder) -> stage, first match wins
STAGES = [
    (("trainer", "callbacks"), "callbacks"),
    (("trainer", "fit_loop.py"), "fit loop"),
    (("trainer", "trainer.py"), "fit loop"),
    (("trainer", "training_state.py"), "fit loop"),
    (("trainer", "inputs.py"), "input path"),
    (("trainer", "compile_metrics.py"), "metrics"),
    (("trainer", "metrics.py"), "metrics"),
    (("trainer", "torch_metrics.py"), "metrics"),
    (("trainer", "compile_loss.py"), "loss"),
    (("trainer", "losses.py"), "loss"),
    (("trainer", "model_io.py"), "model call"),
    (("trainer",), "fit loop"),
    (("data",), "input path"),
    (("optimizers",), "optimizer pipeline"),
    (("strategies", "runner.py"), "replica scheduler"),
    (("strategies", "cooperative.py"), "replica scheduler"),
    (("strategies", "thread_state.py"), "replica scheduler"),
    (("strategies", "context.py"), "replica scheduler"),
    (("strategies", "replica_context.py"), "merge_call"),
    (("strategies", "rendezvous.py"), "merge_call"),
    (("strategies", "merge_fns.py"), "merge_call"),
    (("strategies", "cross_device_ops.py"), "reductions"),
    (("strategies", "collective.py"), "reductions"),
    (("strategies", "buckets.py"), "reductions"),
    (("strategies", "reduce_util.py"), "reductions"),
    (("strategies", "step_values.py"), "reductions"),
    (("strategies", "foreach.py"), "optimizer pipeline"),
    (("strategies", "rng.py"), "random streams"),
    (("strategies",), "values, variables, strategy"),
]


def stage_of(filename: str) -> str | None:
    """The stage of a function defined in ``filename``; None for a built-in (its caller's stage)."""
    if filename == "~" or filename.startswith("<"):
        return None
    path = os.path.realpath(filename)
    if os.sep + "torch" + os.sep in path:
        return "torch (Python)"
    if os.path.dirname(path) == os.path.dirname(os.path.abspath(__file__)):
        return "benchmark harness"
    if not path.startswith(ROOT + os.sep):
        return "other Python"
    parts = os.path.relpath(path, ROOT).split(os.sep)
    for prefix, stage in STAGES:
        if tuple(parts[: len(prefix)]) == prefix:
            return stage
    return "other replicafit"


def by_stage(stats: pstats.Stats) -> dict:
    """Seconds of own time per stage; a built-in's time goes to its callers' stages (split by call edge)."""
    totals: dict = collections.Counter()
    for (filename, _, name), (_, _, own, _, callers) in stats.stats.items():
        stage = stage_of(filename)
        if stage is not None:
            totals[stage] += own
            continue
        edges = {key: edge[2] for key, edge in callers.items()}
        spread = sum(edges.values())
        if not edges or spread <= 0:
            totals["built-in, caller unknown"] += own
            continue
        torch_call = "torch" in name  # ("{built-in method torch._foreach_add_}", "{method 'add_' of 'torch._C...'}")
        for (caller_file, _, _), seconds in edges.items():
            caller = stage_of(caller_file) or "built-in, caller unknown"
            if torch_call and caller != "torch (Python)":
                caller += ": torch calls"
            totals[caller] += own * seconds / spread
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="mirrored")
    parser.add_argument("--loop", action="store_true", help="profile the hand-written torch loop instead")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--execution", choices=["auto", "threads"], default="auto")
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--top", type=int, default=0, help="the N functions of the largest own time, not stages")
    parser.add_argument("--within", help="with --top: only the functions of this stage (built-ins by caller)")
    args = parser.parse_args()
    ds.set_replica_execution(args.execution)
    x, y = datasets.make_classification(args.examples, 64, n_classes=10, seed=0)
    steps = -(-args.examples // args.batch)

    def run() -> float:
        if args.loop:
            return hand_loop(x, y, args.batch, 1)[0]
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
    profiled = run()
    profile.disable()
    name = "hand loop" if args.loop else f"{args.strategy}, execution {args.execution!r}"
    print(
        f"{name}, batch {args.batch}: {seconds / steps * 1e6:.0f} us/step "
        f"({profiled / steps * 1e6:.0f} under the profiler)"
    )
    stats = pstats.Stats(profile)
    if args.within and not args.top:
        parser.error("--within lists a stage's functions: give --top N too")
    if args.top and args.within:
        rows = []
        for (filename, line, name), (_, calls, own, cumulative, callers) in stats.stats.items():
            stage = stage_of(filename)
            if stage is None:  # a built-in: the share of its time and calls that this stage's callers took
                torch_call = "torch" in name
                edges = callers
                spread = sum(edge[2] for edge in edges.values()) or 1.0
                mine = [
                    edge
                    for key, edge in edges.items()
                    if (stage_of(key[0]) or "") + (": torch calls" if torch_call else "") == args.within
                    or (stage_of(key[0]) == args.within == "torch (Python)")
                ]
                if not mine:
                    continue
                own = own * sum(edge[2] for edge in mine) / spread
                calls, cumulative = sum(edge[1] for edge in mine), sum(edge[3] for edge in mine)
            elif stage != args.within:
                continue
            rows.append((own, calls, cumulative, f"{os.path.basename(filename)}:{line}({name})"))
        for own, calls, cumulative, where in sorted(rows, reverse=True)[: args.top]:
            print(f"{own / steps * 1e6:8.1f} us/step own {cumulative / steps * 1e6:8.1f} cumulative {calls:>7} {where}")
        return
    if args.top:
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("tottime").print_stats(args.top)
        lines = out.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print("\n".join(line for line in lines[start - 1 :] if line.strip()))
        return
    totals = by_stage(stats)
    whole = sum(totals.values())
    print(f"{'stage':<32}{'us/step':>10}{'share':>8}   (profiled own time, built-ins with their callers)")
    for stage, own in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{stage:<32}{own / steps * 1e6:>10.1f}{own / whole:>8.1%}")


if __name__ == "__main__":
    main()
