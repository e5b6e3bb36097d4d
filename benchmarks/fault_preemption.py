"""Fault injection for saving before preemption and for resuming after a killed worker.

``sigterm``: ``replicafit fit digits_mlp`` (6 epochs, EarlyStopping, a backup every 5 steps with
``save_before_preemption: true``, each step 10 ms longer as a heavier model's would be) in one
process (``--workers 1``: Mirrored over 2 logical CPUs) or on 2 workers (``--workers 2``: the
launcher gets the signal and passes it on). Each trial sends SIGTERM at a random moment of the fit
(uniform over the uninterrupted run's training time, from its first step), then reruns the same
command. ``--targeted`` more trials send it from inside a validation step and from inside a backup
write. Counts, per landing phase (a training step, validation, a backup write, before the first
step, after the fit): the exit statuses (75 expected, or 0 when the fit had ended), the seconds
from the signal to the exit (the grace a scheduler must give), tracebacks, hangs (no exit within
60 s), backups that do not load, steps trained twice or never, and reruns whose metrics.json,
history.csv, last.pt and best.pt differ from the uninterrupted run's (bit for bit).

``sigstop``: worker 1 of the same recipe on 2 workers (``timeout_seconds: 5``) is SIGSTOPped at a random
moment; counts the runs where the launcher names worker 1 as the one that stopped arriving.

``sigkill``: the same recipe on 2 workers under ``--max-restarts 1``; worker 1 is SIGKILLed at a random
moment; the launcher restarts both from the last backup. Counts the runs whose reports and files
differ from the uninterrupted run's (EarlyStopping's state included), and the steps trained in all.

``peer``: the same recipe on 2 workers under ``--max-restarts 1`` with a backup per epoch only
(``save_freq: epoch``, ``save_on_peer_failure: true``, ``timeout_seconds: 5``); a random worker is SIGKILLed
or SIGSTOPped (alternately) at a random moment. A survivor writes the backup of the last step every worker
finished, and the restart goes on from it. Counts hangs, exit statuses, where each restart resumed from,
steps trained twice (none expected), and mismatches: final and best weights beyond 1e-6 of the uninterrupted
run's, a step never trained, validation metrics that differ (the interrupted epoch's training metrics lack the
dead worker's rows before the failure: not compared). ``--dropout 0.3`` trains the recipe with dropout: the
dead worker's masks are drawn again (``fit`` keys every replica's stream by step), so the same checks hold.

Run: python benchmarks/fault_preemption.py sigterm --workers 1 [--runs 20] [--targeted 5] [--seed 0]
     python benchmarks/fault_preemption.py sigterm --workers 2 [--runs 20] [--targeted 5]
     python benchmarks/fault_preemption.py sigkill [--runs 12]
     python benchmarks/fault_preemption.py sigstop [--runs 16]
     python benchmarks/fault_preemption.py peer [--runs 10] [--dropout 0.3]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GRACE = 60.0  # seconds a run may take to exit after the signal before it counts as a hang
EPOCHS = 6
STEP_SECONDS = 0.01  # each training and validation step 10 ms longer: a heavier model's compute


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))


def _command(
    folder: str,
    workers: int,
    restarts: int = 0,
    signal_in=None,
    seed=0,
    timeout=20,
    save_freq=5,
    peer=False,
    dropout=0.0,
) -> list:
    log, pids, backup = (os.path.join(folder, name) for name in ("log", "pids", "backup"))
    to = "launcher" if workers > 1 else "self"
    entries = [
        "{type: early_stopping, monitor: val_accuracy, patience: 2, restore_best_weights: true}",
        f"{{type: 'fault_callbacks:StepLog', path: '{log}', pid_dir: '{pids}', to: {to}, seed: {seed}, "
        f"step_seconds: {STEP_SECONDS}, every_worker: {str(peer).lower()}"
        + (", signal_in: validation}" if signal_in == "validation" else "}"),
        f"{{type: 'fault_callbacks:TimedBackup', backup_dir: '{backup}', log: '{log}', pid_dir: '{pids}', "
        f"save_freq: {save_freq}, save_before_preemption: true, save_on_peer_failure: {str(peer).lower()}, "
        f"to: {to}, seed: {seed}" + (", signal_in_write: true}" if signal_in == "write" else "}"),
    ]
    argv = [sys.executable, "-m", "replicafit", "fit", "digits_mlp", "--set", f"fit.epochs={EPOCHS}",
            "--set", "fit.verbose=0", "--set", f"callbacks=[{', '.join(entries)}]",
            "--run-dir", os.path.join(folder, "run")]  # fmt: skip
    argv += ["--set", f"model.dropout={dropout}"] if dropout else []
    if workers > 1:
        argv += ["--set", f"strategy={{type: multi_worker_mirrored, timeout_seconds: {timeout}}}"]
        argv += ["--workers", str(workers)]
        argv += ["--max-restarts", str(restarts)] if restarts else []
    return argv


def _events(folder: str) -> list:
    path = os.path.join(folder, "log")
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [line.split() for line in file if line.strip()]


def _steps(events) -> list:
    return [(int(e[1]), int(e[2])) for e in events if e[0] == "step"]


def _outcome(folder: str) -> tuple:
    """metrics.json (but the path), history.csv, and last.pt's and best.pt's weights of a finished run."""
    import torch

    run = os.path.join(folder, "run")
    with open(os.path.join(run, "metrics.json")) as file:
        metrics = {k: v for k, v in json.load(file).items() if k != "checkpoint"}
    with open(os.path.join(run, "history.csv")) as file:
        history = file.read()
    weights = [
        torch.load(os.path.join(run, "checkpoints", name), weights_only=True)["model"]
        for name in ("last.pt", "best.pt")
    ]
    return metrics, history, weights


def _same(a, b) -> bool:
    import torch

    if a[0] != b[0] or a[1] != b[1]:
        return False
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[2], b[2]))


def _phase(events, sent: float) -> str:
    """Where the signal landed: in validation, in a backup write, a training step, before the first step or
    after the fit's last event."""
    times = [float(e[-1]) for e in events if e[0] == "step"]
    if not times or sent < times[0] - 0.05:  # (the first step's end is logged; it began a little before)
        return "before the first step"
    open_phase = None
    for event in events:
        moment = float(event[-1])
        if moment > sent:
            return {"val-end": "validation", "backup-end": "a backup write"}.get(
                event[0], open_phase or "a training step"
            )
        open_phase = {"val-begin": "validation", "backup-begin": "a backup write"}.get(event[0])
    return "after the fit"


def _run(argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env())


def _wait_for_first_step(folder: str, child, deadline: float) -> bool:
    while time.monotonic() < deadline and child.poll() is None:
        if any(e[0] == "step" for e in _events(folder)):
            return True
        time.sleep(0.005)
    return False


def _backup_loads(folder: str) -> bool:
    from replicafit.trainer import checkpoint

    path = os.path.join(folder, "backup", "backup.pt")
    try:
        checkpoint.load(path, kind="backup")
        return True
    except Exception:  # noqa: BLE001 - counted
        return False


def _trial(root: str, index: int, workers: int, reference, train_seconds: float, rng, signal_in=None) -> dict:
    folder = os.path.join(root, f"trial{index}")
    os.makedirs(folder)
    argv = _command(folder, workers, signal_in=signal_in, seed=rng.randrange(2**31))
    child = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
    )
    result: dict = {"phase": None}
    try:
        if signal_in is None:
            if not _wait_for_first_step(folder, child, time.monotonic() + 120):
                result["phase"] = "no first step"
            time.sleep(rng.uniform(0.0, train_seconds))
            sent = time.time()
            child.send_signal(signal.SIGTERM)
        try:
            _, err = child.communicate(timeout=GRACE if signal_in is None else 300)
        except subprocess.TimeoutExpired:
            result.update(status="hang", err="")
            return result
        ended = time.time()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # (launched workers end with their launcher: the lifeline)
            child.wait(timeout=10)
    events = _events(folder)
    if signal_in is not None:
        marks = [float(e[-1]) for e in events if e[0] == "signal"]
        sent = marks[0] if marks else ended
        where = "validation" if signal_in == "validation" else "a backup write"
        result["phase"] = f"{where} (targeted)" if marks else f"{where} (targeted, never sent)"
    else:
        result["phase"] = result["phase"] or _phase(events, sent)
    result.update(status=child.returncode, seconds=ended - sent, traceback="Traceback" in err, err=err[-400:])
    result["backup_loads"] = _backup_loads(folder) if child.returncode == 75 else None
    first_steps = _steps(events)
    if child.returncode == 0:  # the fit had ended: its files are the run's
        result["same"] = _same(_outcome(folder), reference["outcome"]) and first_steps == reference["steps"]
        return result
    rerun = _run(argv)
    result["rerun_status"] = rerun.returncode
    if rerun.returncode == 0:
        steps = _steps(_events(folder))
        result["twice"] = len(steps) - len(set(steps))
        result["missing"] = len(set(reference["steps"]) - set(steps))
        result["same"] = _same(_outcome(folder), reference["outcome"]) and steps == reference["steps"]
    result["stopped_after"] = len(first_steps)
    return result


def sigterm(runs: int, targeted: int, workers: int, seed: int) -> int:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as root:
        reference_dir = os.path.join(root, "reference")
        os.makedirs(reference_dir)
        start = time.monotonic()
        done = _run(_command(reference_dir, workers))
        assert done.returncode == 0, done.stderr
        events = _events(reference_dir)
        step_times = [float(e[-1]) for e in events if e[0] == "step"]
        train_seconds = step_times[-1] - step_times[0]
        reference = {"outcome": _outcome(reference_dir), "steps": _steps(events)}
        print(
            f"sigterm: `replicafit fit digits_mlp` on {workers} worker(s), {EPOCHS} epochs of 23 steps, a backup every "
            f"5 steps and save_before_preemption; the uninterrupted run: {time.monotonic() - start:.1f} s, "
            f"{train_seconds:.2f} s from its first step to its last"
        )
        trials = [None] * runs + ["validation", "write"] * targeted
        results = [_trial(root, i, workers, reference, train_seconds, rng, where) for i, where in enumerate(trials)]
    return _report(results)


def _report(results) -> int:
    by_phase = collections.defaultdict(list)
    for result in results:
        by_phase[result["phase"]].append(result)
    bad = 0
    print(f"  {'where the signal landed':<32} {'trials':>6} {'exit 75':>8} {'exit 0':>7} {'other':>6} {'hangs':>6} "
          f"{'tracebacks':>10} {'bad backups':>11} {'twice':>6} {'missing':>7} {'rerun differs':>13} "
          f"{'slowest exit':>12}")  # fmt: skip
    for phase, group in sorted(by_phase.items()):
        count = collections.Counter(r["status"] for r in group)
        other = len(group) - count[75] - count[0] - count["hang"]
        tracebacks = sum(1 for r in group if r.get("traceback"))
        bad_backups = sum(1 for r in group if r.get("backup_loads") is False)
        twice = sum(r.get("twice", 0) for r in group)
        missing = sum(r.get("missing", 0) for r in group)
        differs = sum(1 for r in group if r.get("same") is False or r.get("rerun_status", 0) != 0)
        slowest = max((r.get("seconds", 0.0) for r in group), default=0.0)
        after = phase == "after the fit" or phase.endswith("never sent)")
        bad += other + count["hang"] + tracebacks + bad_backups + twice + missing + differs
        bad += 0 if after else count[0]  # a fit that ended normally although signalled mid-run
        print(f"  {phase:<32} {len(group):>6} {count[75]:>8} {count[0]:>7} {other:>6} {count['hang']:>6} "
              f"{tracebacks:>10} {bad_backups:>11} {twice:>6} {missing:>7} {differs:>13} "
              f"{slowest:>11.2f}s")  # fmt: skip
    for result in results:
        if result["status"] not in (0, 75) or result.get("traceback") or result.get("same") is False:
            print(f"  e.g. {result['phase']}: exit {result['status']}, stderr: {result.get('err', '')!r}")
            break
    print(f"  failures: {bad}")
    return 1 if bad else 0


def sigkill(runs: int, seed: int) -> int:
    rng = random.Random(seed)
    tally = collections.Counter()
    with tempfile.TemporaryDirectory() as root:
        reference_dir = os.path.join(root, "reference")
        os.makedirs(reference_dir)
        done = _run(_command(reference_dir, 2))
        assert done.returncode == 0, done.stderr
        events = _events(reference_dir)
        step_times = [float(e[-1]) for e in events if e[0] == "step"]
        reference = {"outcome": _outcome(reference_dir), "steps": _steps(events)}
        for index in range(runs):
            folder = os.path.join(root, f"trial{index}")
            os.makedirs(folder)
            argv = _command(folder, 2, restarts=1)
            child = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
            )
            try:
                _wait_for_first_step(folder, child, time.monotonic() + 120)
                time.sleep(rng.uniform(0.0, step_times[-1] - step_times[0]))
                killed = False
                try:
                    with open(os.path.join(folder, "pids", "rank1")) as file:
                        os.kill(int(file.read()), signal.SIGKILL)
                    killed = True
                except (OSError, ValueError):
                    pass
                try:
                    _, err = child.communicate(timeout=180)
                except subprocess.TimeoutExpired:
                    tally["hang"] += 1
                    continue
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait(timeout=10)
            restarted = "restarting all 2 workers" in err
            if child.returncode != 0:
                tally[f"exit {child.returncode}"] += 1
                continue
            tally["restarted" if restarted else ("finished before the kill" if killed else "not killed")] += 1
            steps = set(_steps(_events(folder)))
            if not _same(_outcome(folder), reference["outcome"]) or set(reference["steps"]) - steps:
                tally["reports or files differ"] += 1
    print(f"sigkill: worker 1 of `replicafit fit digits_mlp --workers 2 --max-restarts 1` SIGKILLed at a random "
          f"moment, {runs} runs (EarlyStopping with restore_best_weights, a backup every 5 steps)")  # fmt: skip
    for kind, count in tally.most_common():
        print(f"  {kind:<40} {count}")
    failures = sum(count for kind, count in tally.items() if kind not in ("restarted", "finished before the kill"))
    print(f"  failures: {failures}")
    return 1 if failures else 0


def _weights_gap(folder: str, reference: str) -> float:
    """The largest difference between the final and best weights of two finished runs."""
    import torch

    gap = 0.0
    for name in ("last.pt", "best.pt"):
        mine, theirs = (
            torch.load(os.path.join(f, "run", "checkpoints", name), weights_only=True)["model"]
            for f in (folder, reference)
        )
        gap = max([gap, *(float((mine[k] - theirs[k]).abs().max()) for k in theirs)])
    return gap


def peer(runs: int, seed: int, timeout: int = 5, dropout: float = 0.0) -> int:
    """A random worker SIGKILLed or SIGSTOPped at a random moment under ``--max-restarts 1`` with a backup per epoch
    only: a survivor writes the backup of the last step every worker finished, and the restart repeats no step
    (``dropout``: the recipe's dropout rate; the dead worker's masks are drawn again, keyed by step)."""
    rng = random.Random(seed)
    tally = collections.Counter()
    replayed, gaps, exits = collections.Counter(), [], []
    with tempfile.TemporaryDirectory() as root:
        reference_dir = os.path.join(root, "reference")
        os.makedirs(reference_dir)
        done = _run(_command(reference_dir, 2, save_freq="epoch", peer=True, timeout=timeout, dropout=dropout))
        assert done.returncode == 0, done.stderr
        events = _events(reference_dir)
        step_times = [float(e[-1]) for e in events if e[0] == "step"]
        reference_steps = _steps(events)
        reference = _outcome(reference_dir)
        for index in range(runs):
            how = ("SIGKILL", "SIGSTOP")[index % 2]
            rank = rng.randrange(2)
            folder = os.path.join(root, f"trial{index}")
            os.makedirs(folder)
            argv = _command(folder, 2, restarts=1, save_freq="epoch", peer=True, timeout=timeout, dropout=dropout)
            child = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
            )
            try:
                _wait_for_first_step(folder, child, time.monotonic() + 120)
                time.sleep(rng.uniform(0.0, step_times[-1] - step_times[0]))
                try:
                    with open(os.path.join(folder, "pids", f"rank{rank}")) as file:
                        os.kill(int(file.read()), getattr(signal, how))
                    hit = time.monotonic()
                except (OSError, ValueError):
                    hit = None
                try:
                    _, err = child.communicate(timeout=240)
                except subprocess.TimeoutExpired:
                    tally[f"{how}: hang"] += 1
                    continue
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait(timeout=10)
            if child.returncode != 0:
                tally[f"{how}: exit {child.returncode}"] += 1
                continue
            if "restarting all 2 workers" not in err:
                tally[f"{how}: finished before the fault" if hit is None or not err else f"{how}: not restarted"] += 1
                continue
            said = [line for line in err.splitlines() if "WorkerFailedError" in line or "backup" in line]
            if "wrote the backup of the last step every worker finished" in err:
                tally[f"{how}: restarted from a survivor's backup"] += 1
            elif "was written before the failure" in err:
                tally[f"{how}: restarted from the periodic backup of that step"] += 1
            else:
                tally[f"{how}: restarted, no survivor's backup: {said[-1:]}"] += 1
            steps = _steps(_events(folder))
            twice = len(steps) - len(set(steps))
            for rank_log in range(1, 2):  # a step the chief died in after its update is the other worker's to log
                path = os.path.join(folder, f"log.{rank_log}")
                if os.path.exists(path):
                    with open(path) as file:
                        steps += _steps([line.split() for line in file if line.strip()])
            replayed[twice] += 1
            gap = _weights_gap(folder, reference_dir)
            gaps.append(gap)
            exits.append(hit)
            metrics = _outcome(folder)[0]
            val_same = all(
                abs(metrics["final"][k] - reference[0]["final"][k]) <= 1e-6 for k in reference[0]["final"] if "val" in k
            )
            never = sorted(set(reference_steps) - set(steps))
            if gap > 1e-6 or never or not val_same:
                tally[f"mismatches: weights {gap:.1e}, never trained {never}, validation alike {val_same}"] += 1
    print(f"peer: a random worker of `replicafit fit digits_mlp --workers 2 --max-restarts 1` (timeout_seconds: "
          f"{timeout}, a backup per epoch only, dropout {dropout}) SIGKILLed or SIGSTOPped at a random moment, "
          f"{runs} runs")  # fmt: skip
    for kind, count in sorted(tally.items()):
        print(f"  {kind:<72} {count}")
    print(f"  steps trained twice per restarted run: {dict(sorted(replayed.items()))}")
    if gaps:
        print(f"  largest weight difference from the uninterrupted run: {max(gaps):.2e}")
    failures = sum(count for kind, count in tally.items() if "hang" in kind or "exit" in kind or "mismatch" in kind)
    failures += sum(count for twice, count in replayed.items() if twice)
    print(f"  failures: {failures}")
    return 1 if failures else 0


def sigstop(runs: int, seed: int, timeout: int = 5) -> int:
    """SIGSTOP worker 1 at a random moment (no restarts): the launcher must name worker 1, within the
    collective timeout and the launcher's grace."""
    rng = random.Random(seed)
    tally = collections.Counter()
    slowest = 0.0
    with tempfile.TemporaryDirectory() as root:
        for index in range(runs):
            folder = os.path.join(root, f"trial{index}")
            os.makedirs(folder)
            argv = _command(folder, 2, timeout=timeout)
            child = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
            )
            try:
                _wait_for_first_step(folder, child, time.monotonic() + 120)
                time.sleep(rng.uniform(0.0, 2.0))
                with open(os.path.join(folder, "pids", "rank1")) as file:
                    os.kill(int(file.read()), signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    _, err = child.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    tally["hang"] += 1
                    continue
                slowest = max(slowest, time.monotonic() - stopped)
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait(timeout=10)
            if "worker 1 (stopped by a signal) stopped arriving" in err:
                tally["worker 1 named as stopped"] += 1
            elif child.returncode == 0:
                tally["finished before the stop"] += 1
            elif "worker 0 failed first" in err:
                tally["worker 0 blamed"] += 1
            else:
                tally[f"other (exit {child.returncode}): {err.strip().splitlines()[-1:]}"] += 1
    print(f"sigstop: worker 1 of `replicafit fit digits_mlp --workers 2` (timeout_seconds: {timeout}) SIGSTOPped "
          f"at a random moment, {runs} runs; slowest exit after the stop: {slowest:.1f} s")  # fmt: skip
    for kind, count in tally.most_common():
        print(f"  {kind:<40} {count}")
    failures = sum(count for kind, count in tally.items() if kind not in ("worker 1 named as stopped",
                                                                          "finished before the stop"))  # fmt: skip
    print(f"  failures: {failures}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    term = commands.add_parser("sigterm")
    term.add_argument("--workers", type=int, choices=(1, 2), default=1)
    term.add_argument("--runs", type=int, default=20)
    term.add_argument(
        "--targeted", type=int, default=5, help="trials signalled from inside validation and a write, each"
    )
    term.add_argument("--seed", type=int, default=0)
    kill = commands.add_parser("sigkill")
    kill.add_argument("--runs", type=int, default=12)
    kill.add_argument("--seed", type=int, default=0)
    lost = commands.add_parser("peer")
    lost.add_argument("--runs", type=int, default=10)
    lost.add_argument("--seed", type=int, default=0)
    lost.add_argument("--dropout", type=float, default=0.0, help="the recipe's dropout rate (model.dropout)")
    stop = commands.add_parser("sigstop")
    stop.add_argument("--runs", type=int, default=16)
    stop.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "sigterm":
        return sigterm(args.runs, args.targeted, args.workers, args.seed)
    if args.command == "peer":
        return peer(args.runs, args.seed, dropout=args.dropout)
    return sigkill(args.runs, args.seed) if args.command == "sigkill" else sigstop(args.runs, args.seed)


if __name__ == "__main__":
    sys.exit(main())
