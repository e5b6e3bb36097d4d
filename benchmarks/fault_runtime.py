"""Fault injection for the replica runtime: stuck replicas under a timeout, and Ctrl-C mid-fit.

``timeouts``: ``MirroredStrategy`` over three logical CPUs, ``run`` with
``CommunicationOptions(timeout_seconds=T)`` while one replica sleeps for 1000 s, in all four
placements (replica 0 or the last replica stuck, with or without a collective after the
point where it sticks), ``--runs`` times each. Counts the calls that raised ``TimeoutError``
within ``T + 1`` s, the slow ones, the other outcomes and the hangs (a watchdog alarm at
``T + 20`` s), and checks after each call that the strategy still runs a normal step.

``interrupts``: ``replicafit fit digits_mlp`` (``MirroredStrategy(["cpu:0", "cpu:1"])``) in a
child process, SIGINT at a random moment of its fit, ``--runs`` times. Counts the exit statuses:
130 with the single line ``interrupted`` is the expected one; SIGABRT ("terminate called without
an active exception"), a traceback, or a child that does not end within 60 s are failures.

Run: python benchmarks/fault_runtime.py timeouts [--runs 20] [--timeout 0.5]
     python benchmarks/fault_runtime.py interrupts [--runs 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time


def timeouts(runs: int, timeout: float) -> int:
    import torch

    import replicafit.strategies as ds

    class Hang(Exception):
        pass

    def alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    options = ds.CommunicationOptions(timeout_seconds=timeout)
    counts: dict = collections.OrderedDict()
    worst: dict = {}
    for stuck in ("replica 0", "last replica"):
        for collective in (True, False):
            stuck_id = 0 if stuck == "replica 0" else 2
            key = f"{stuck} stuck, {'with' if collective else 'without'} a collective"
            tally = counts[key] = collections.Counter()

            def fn(stuck_id=stuck_id, collective=collective):
                ctx = ds.get_replica_context()
                if ctx.replica_id_in_sync_group == stuck_id:
                    time.sleep(1000)
                if collective:
                    ctx.all_reduce("SUM", torch.ones(4))
                return ctx.replica_id_in_sync_group

            for _ in range(runs):
                start = time.monotonic()
                signal.setitimer(signal.ITIMER_REAL, timeout + 20)
                try:
                    strategy.run(fn, options=options)
                    outcome = "returned (no timeout)"
                except TimeoutError:
                    outcome = "TimeoutError"
                except Hang:
                    outcome = "hang"
                except Exception as error:  # noqa: BLE001 - counted, not raised
                    outcome = f"{type(error).__name__}"
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                elapsed = time.monotonic() - start
                if outcome == "TimeoutError" and elapsed > timeout + 1.0:
                    outcome = "TimeoutError, late"
                tally[outcome] += 1
                worst[key] = max(worst.get(key, 0.0), elapsed)
                out = strategy.run(lambda: ds.get_replica_context().all_reduce("SUM", torch.ones(())))
                tally["usable after"] += [float(v) for v in strategy.experimental_local_results(out)] == [3.0] * 3
    print(f"timeouts: T = {timeout} s, {runs} runs per placement, MirroredStrategy over 3 logical CPUs")
    bad = 0
    for key, tally in counts.items():
        ok = tally["TimeoutError"]
        bad += runs - ok + tally["hang"]
        print(
            f"  {key:<40} TimeoutError within T+1 s: {ok}/{runs}   hangs: {tally['hang']}   "
            f"other: {runs - ok - tally['hang']}   slowest: {worst[key]:.2f} s   "
            f"usable after: {tally['usable after']}/{runs}"
        )
    return 1 if bad else 0


def interrupts(runs: int, seed: int) -> int:
    rng = random.Random(seed)
    tally: collections.Counter = collections.Counter()
    details = []
    for index in range(runs):
        with tempfile.TemporaryDirectory() as run_dir:
            argv = [sys.executable, "-m", "replicafit", "fit", "digits_mlp", "--set", "fit.epochs=200",
                    "--set", "callbacks=[]",  # no early stop: the signal lands inside the fit
                    "--set", "fit.verbose=0", "--run-dir", run_dir]  # fmt: skip
            child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                # Wait until training runs (the model summary is printed first), then a random moment of it.
                first = child.stdout.readline()
                time.sleep(rng.uniform(0.0, 2.0))
                child.send_signal(signal.SIGINT)
                try:
                    out, err = child.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    tally["hang"] += 1
                    continue
            finally:
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGKILL)
                    child.wait()
            status = child.returncode
            if status == -signal.SIGABRT or "terminate called" in err:
                kind = "SIGABRT"
            elif "Traceback" in err:
                kind = f"traceback (exit {status})"
            elif status == 130 and err.strip().splitlines()[-1:] == ["interrupted"]:
                kind = "exit 130, 'interrupted'"
            elif status == 0:
                kind = "finished before the signal"
            else:
                kind = f"exit {status}"
            tally[kind] += 1
            if kind not in ("exit 130, 'interrupted'", "finished before the signal"):
                details.append((index, status, (first + out)[-200:], err[-600:]))
    print(f"interrupts: {runs} SIGINTs at random moments of `replicafit fit digits_mlp` (Mirrored over 2 CPUs)")
    for kind, count in tally.most_common():
        print(f"  {kind:<36} {count}")
    for index, status, _out, err in details[:5]:
        print(f"  run {index}: exit {status}\n    stderr: {err!r}")
    failures = sum(count for kind, count in tally.items() if kind not in ("exit 130, 'interrupted'",
                                                                         "finished before the signal"))  # fmt: skip
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    stuck = commands.add_parser("timeouts")
    stuck.add_argument("--runs", type=int, default=20)
    stuck.add_argument("--timeout", type=float, default=0.5)
    interrupted = commands.add_parser("interrupts")
    interrupted.add_argument("--runs", type=int, default=40)
    interrupted.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "timeouts":
        return timeouts(args.runs, args.timeout)
    return interrupts(args.runs, args.seed)


if __name__ == "__main__":
    sys.exit(main())
