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

``--strategy multi_worker`` runs 2 local worker processes on gloo (one intra-op thread each, bounded by
``--timeout`` and ended by their ids), ``MultiWorkerMirroredStrategy`` through ``fit`` over the global batch,
and prints worker 0's profile; with ``--loop`` its reference, ``DistributedDataParallel`` + ``torch.optim.SGD``
over each worker's rows. There "reductions: torch calls" is mostly the wait for the step's all-reduce, which
in DDP's profile is inside backward ("torch (Python)").

``--model tiny`` fits one ``Linear(64, 10)`` instead: its compute is a few small kernels, so the unprofiled step
time is almost all host work, and strategies compare by what they add (the profile itself cannot tell this under
Mirrored, above); ``--compare`` times fit under every strategy and the hand loop side by side in one process
(separate processes differ by this machine's drift). ``--calls`` times ``strategy.run`` of a function that does
nothing, and of one that makes one ``merge_call`` of nothing, under OneDevice and Mirrored: the replica
scheduler and the rendezvous alone.

Run: python benchmarks/profile_step.py [--strategy mirrored] [--batch 8] [--execution auto]
     python benchmarks/profile_step.py --strategy default --batch 8     (fit on the default strategy)
     python benchmarks/profile_step.py --loop --batch 8                  (the hand loop's profile)
     python benchmarks/profile_step.py --strategy mirrored --top 25      (by function)
     python benchmarks/profile_step.py --strategy multi_worker [--loop]  (2 workers; --loop: DDP)
     python benchmarks/profile_step.py --strategy mirrored --model tiny  (the host work alone)
     python benchmarks/profile_step.py --calls                           (run and merge_call alone)
     python benchmarks/profile_step.py --compare --model tiny            (every strategy, one process)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_fit import hand_epoch, make_model  # noqa: E402

import replicafit.strategies as ds  # noqa: E402
import replicafit.trainer as _trainer_package  # noqa: E402
from replicafit.data import datasets  # noqa: E402
from replicafit.trainer import Trainer  # noqa: E402

WORKERS = 2  # --strategy multi_worker: this many local processes on gloo
STRATEGIES = {
    "default": lambda: None,
    "one_device": lambda: ds.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"], "cpu:0"),
    "multi_worker": None,  # made in each worker (see worker())
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


def tiny_model():
    """``--model tiny``: one ``Linear(64, 10)``, whose compute is a few small kernels: a step's time is then
    almost all the loop's own host work (the framework's, or torch.optim's and autograd's in the hand loop)."""
    torch.manual_seed(0)
    return torch.nn.Linear(64, 10)


MODELS = {"mlp": make_model, "tiny": tiny_model}


def ddp_epoch(x, y, batch: int, rank: int, make=make_model) -> float:
    """The multi-worker reference: an epoch of ``DistributedDataParallel`` + ``torch.optim.SGD`` over this
    worker's rows of each global batch (``bench_fit.hand_epoch``'s loop, the gradients averaged by DDP)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per = batch // WORKERS
    mine = [row for begin in range(0, len(x), batch) for row in range(begin + rank * per, begin + (rank + 1) * per)]
    return hand_epoch(model, optimizer, torch.from_numpy(x[mine]), torch.from_numpy(y[mine]), per)


def profile_fits(args, x, y, strategy_factory, rank: int = 0):
    """Three fits of one epoch (or hand-loop epochs): warm-up, timed, profiled; ``(profile, seconds, profiled)``."""

    make = MODELS[args.model]

    def run() -> float:
        if args.loop and args.strategy == "multi_worker":
            return ddp_epoch(x, y, args.batch, rank, make)
        if args.loop:
            model = make()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            return hand_epoch(model, optimizer, torch.from_numpy(x), torch.from_numpy(y), args.batch)
        trainer = Trainer(
            strategy=strategy_factory(),
            optimizer={"class_name": "sgd", "config": {"learning_rate": 0.01, "momentum": 0.9}},
            loss="cross_entropy",
            metrics=(),
            seed=0,
        )
        model = make()
        start = time.perf_counter()
        trainer.fit(model, (x, y), batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
        return time.perf_counter() - start

    run()
    seconds = run()
    profile = cProfile.Profile()
    profile.enable()
    profiled = run()
    profile.disable()
    return profile, seconds, profiled


def worker(rank: int, port: int, outdir: str, args, x, y) -> None:
    """One of ``WORKERS`` processes of ``--strategy multi_worker``: profiles its fits; worker 0 writes the profile."""
    torch.set_num_threads(1)
    resolver = ds.SimpleClusterResolver(WORKERS, rank, "127.0.0.1", port)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=60), resolver)
    profile, seconds, profiled = profile_fits(args, x, y, lambda: strategy, rank)
    if rank == 0:
        profile.dump_stats(os.path.join(outdir, "profile.tmp"))
        os.replace(os.path.join(outdir, "profile.tmp"), os.path.join(outdir, "profile"))
        with open(os.path.join(outdir, "seconds.json"), "w") as file:
            json.dump([seconds, profiled], file)
    strategy.cluster.barrier("end")


def launch_workers(argv: list, timeout: float) -> tuple:
    """Runs ``WORKERS`` copies of this script as workers (fresh interpreters, one intra-op thread each), bounded
    by ``timeout`` seconds and ended by their process groups' ids; worker 0's ``(stats, seconds, profiled)``."""
    from bench_multiworker import _free_port  # (the same local port)

    port = _free_port()
    outdir = tempfile.mkdtemp(prefix="rf-profile-mw-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), *argv, "--worker"]
    procs = [
        subprocess.Popen([*command, str(rank), str(port), outdir], env=env, start_new_session=True)
        for rank in range(WORKERS)
    ]
    deadline = time.monotonic() + timeout
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # (so that the finally below ends the workers)
    try:
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers were still running after {timeout:.0f} s")
            if any(proc.poll() not in (None, 0) for proc in procs):
                raise RuntimeError(f"a worker failed: exit codes {[proc.poll() for proc in procs]}")
            time.sleep(0.05)
        with open(os.path.join(outdir, "seconds.json")) as file:
            seconds, profiled = json.load(file)
        return pstats.Stats(os.path.join(outdir, "profile")), seconds, profiled
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(outdir, ignore_errors=True)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def time_calls() -> None:
    """``--calls``: the replica scheduler and the rendezvous alone, per strategy: ``strategy.run`` of a function
    that does nothing, and of one that makes a ``merge_call`` of nothing (microseconds a call, best of 5)."""
    import timeit

    def nothing():
        return None

    def merge_nothing():
        return ds.get_replica_context().merge_call(lambda strategy: None)

    for name in ("one_device", "mirrored"):
        strategy = STRATEGIES[name]()
        for label, fn in (("run(nothing)", nothing), ("run(merge_call of nothing)", merge_nothing)):
            strategy.run(fn)
            best = min(timeit.repeat(lambda: strategy.run(fn), number=2000, repeat=5)) / 2000  # noqa: B023
            print(f"{name:<11} {label:<28} {best * 1e6:7.1f} us")


def compare(args, x, y) -> None:
    """``--compare``: the unprofiled step time of fit under the default strategy, OneDevice and Mirrored, and of
    the hand loop, side by side in one process (rounds of an epoch each, the order rotating; the medians), with
    ``--model``'s model: with ``tiny`` the differences are what each strategy's host work adds."""
    import statistics

    from bench_fit import EpochClock

    make, steps = MODELS[args.model], -(-len(x) // args.batch)
    names = ["default", "one_device", "mirrored"]
    sides = {}
    for name in names:
        config = {"learning_rate": 0.01, "momentum": 0.9}
        trainer = Trainer(strategy=STRATEGIES[name](), optimizer={"class_name": "sgd", "config": config},
                          loss="cross_entropy", metrics=(), seed=0)  # fmt: skip
        sides[name] = (trainer, make())
    hand = make()
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.01, momentum=0.9)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    times: dict = {name: [] for name in [*names, "hand loop"]}
    for index in range(args.rounds):
        order = [*names, "hand loop"]
        for name in order[index % len(order) :] + order[: index % len(order)]:
            if name == "hand loop":
                times[name].append(hand_epoch(hand, optimizer, xs, ys, args.batch) / steps)
                continue
            trainer, model = sides[name]
            clock = EpochClock()  # (the second epoch: the first set up the fit)
            trainer.fit(model, (x, y), batch_size=args.batch, epochs=2, shuffle=False, verbose=0, callbacks=[clock])
            times[name].append(clock.times[-1] / steps)
    print(f"{args.model} model, batch {args.batch}, one process, {args.rounds} rounds: median us/step (range)")
    for name, values in times.items():
        print(f"  {name:<12} {statistics.median(values) * 1e6:7.0f}  ({min(values) * 1e6:.0f}-{max(values) * 1e6:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="mirrored")
    parser.add_argument("--loop", action="store_true", help="profile the hand-written torch loop instead")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--execution", choices=["auto", "threads"], default="auto")
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp", help="tiny: one Linear(64, 10)")
    parser.add_argument("--top", type=int, default=0, help="the N functions of the largest own time, not stages")
    parser.add_argument("--within", help="with --top: only the functions of this stage (built-ins by caller)")
    parser.add_argument("--timeout", type=float, default=600.0, help="multi_worker: seconds before the workers end")
    parser.add_argument("--calls", action="store_true", help="time strategy.run and merge_call alone instead")
    parser.add_argument("--compare", action="store_true", help="step times of every strategy in one process")
    parser.add_argument("--rounds", type=int, default=5, help="with --compare")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls:
        ds.set_replica_execution(args.execution)
        time_calls()
        return
    if args.within and not args.top:
        parser.error("--within lists a stage's functions: give --top N too")
    if args.strategy == "multi_worker" and (args.batch % WORKERS or args.examples % args.batch):
        parser.error(
            f"--strategy multi_worker splits every global batch evenly over {WORKERS} workers (so that fit and the "
            "DDP loop run the same steps): give an even --batch that divides --examples"
        )
    ds.set_replica_execution(args.execution)
    x, y = datasets.make_classification(args.examples, 64, n_classes=10, seed=0)
    steps = -(-args.examples // args.batch)
    if args.compare:
        compare(args, x, y)
        return
    if args.worker:
        rank, port, outdir = args.worker
        worker(int(rank), int(port), outdir, args, x, y)
        return
    if args.strategy == "multi_worker":
        stats, seconds, profiled = launch_workers(sys.argv[1:], args.timeout)
    else:
        profile, seconds, profiled = profile_fits(args, x, y, STRATEGIES[args.strategy])
        stats = pstats.Stats(profile)
    name = "hand loop" if args.loop else f"{args.strategy}, execution {args.execution!r}"
    name = "DDP hand loop, worker 0 of 2" if args.loop and args.strategy == "multi_worker" else name
    name += ", worker 0 of 2" if args.strategy == "multi_worker" and not args.loop else ""
    print(
        f"{name}, {args.model} model, batch {args.batch}: {seconds / steps * 1e6:.0f} us/step "
        f"({profiled / steps * 1e6:.0f} under the profiler)"
    )
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
