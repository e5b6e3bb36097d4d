"""Every step-cost ratio against its hand-written reference, in one command, with medians and ranges.

Rows (each a ratio of ours to its reference; "paired rounds": each round measures both sides, in one fresh
process side by side (the fit and Mirrored rows, below) or in fresh processes in an order reversed every other
round, so this machine's drifts hit both alike):

- ``fit/loop b64``, ``fit/loop b8``: ``Trainer.fit`` (default strategy) step time over the hand-written torch
  loop's (``bench_fit.py``'s ``fit`` and ``loop``), targets <= 1.05 and <= 1.10. Measured interleaved: each
  round is a fresh process whose fit runs ``--pairs`` + 1 epochs of 4,096 examples, each epoch beside an epoch of
  the hand loop (before it on odd epochs, after it on even ones); the round's ratio is the median over its
  pairs. This machine's speed drifts over seconds (fit and loop in separate processes, as ``bench_fit.py``
  measures them, ``--fresh-processes``, ranged 0.78-1.44 per round and needed 100-200 rounds to resolve 5 %);
  side by side in one process the drifts cancel;
- ``mirrored/ceiling b64``, ``b8``: ``MirroredStrategy(["cpu:0", "cpu:1"])``'s throughput over OneDevice's,
  as a fraction of the ceiling ``bench_replica_floor.py`` defines (the Mirrored ratio if its framework overhead
  per step were no larger than OneDevice's: replicas never fused), target >= 0.9. Measured interleaved too: each
  round is a fresh process that ``--pairs`` + 1 times fits an epoch of OneDevice and one of Mirrored (the second
  of two, 2,048 examples) and measures the ceiling's bare passes and updates, the order alternating;
  ``--fresh-processes`` runs ``bench_replica_floor.py``'s child instead (ranges 0.59-0.89, 30-80 rounds for 5 %);
- ``mwm/ddp fit``, ``mwm/ddp step``: 2 workers on gloo, ``MultiWorkerMirroredStrategy`` through ``fit`` (C)
  and its replica step alone (B) over DDP + ``torch.optim.SGD`` (A), ``bench_multiworker.py``, target <= 1.0;
  ``..., RING``: the same with ``CommunicationImplementation.RING``, which sums the gradients with gloo's
  all-reduce as DDP does, where the default sums a small buffer by an all-gather in half its message rounds:
  the like-for-like collective, so what remains is host work (its rounds: a block of 20 steps of each variant in
  two long-lived processes, the order reversed every other round; ``--mwm-rounds``, 300 by default: the
  per-round ratios spread widely (two single-threaded workers on 2 cores, a collective each step), and their
  spread takes about 290 rounds to resolve 5 %; ordering the blocks A B C C B A in every round, or alternating
  A and B step by step, did not narrow it);
- ``fully_sharded/hand``: ``FullyShardedStrategy`` through ``fit`` over torch's ``fully_shard`` hand loop on 2
  workers (``bench_fully_sharded.py``), target <= 1.10.

For each row: the median of the per-round ratios, their range, the number of rounds, the target, and the
rounds this row's spread needs to separate a 5 % change from noise: the n at which a 5 % difference between
two medians of n rounds each is 1.96 standard errors (significant at 95 %), with s the spread of the per-round
log-ratios (their standard deviation; from 20 rounds on, 1.4826 times their median absolute deviation, which is
the same where they are normal and not swollen by a stray round, as the medians are not),
n >= (1.96 * sqrt(2) * 1.2533 * s / ln 1.05)^2 (1.2533 s / sqrt(n): the standard error of a median). To *detect* a
true 5 % change 80 % of the time takes about twice as many rounds. A row that fails is said, and the others run.

Run: python benchmarks/bench_all.py                       (every row; about 10 minutes on 2 cores)
     python benchmarks/bench_all.py --rows fit8 fit64 --rounds 15
     python benchmarks/bench_all.py --quick                (3 rounds a row: a smoke run, not figures)
     python benchmarks/bench_all.py --device cuda --rows fit8 fit64 mirrored8 mirrored64
                                       (on a GPU: the launch-bound rows, Mirrored over two logical GPUs of the
                                        one, and the host synchronisations of an untimed epoch's steady steps)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_fit  # noqa: E402
import torch  # noqa: E402

from replicafit.trainer import Callback, Trainer  # noqa: E402

TARGETS = {  # row -> (sign, target)
    "fit64": ("<=", 1.05),
    "fit8": ("<=", 1.10),
    "mirrored64": (">=", 0.9),
    "mirrored8": (">=", 0.9),
    "mwm_fit": ("<=", 1.0),
    "mwm_step": ("<=", 1.0),
    "mwm_fit_ring": ("<=", 1.0),
    "mwm_step_ring": ("<=", 1.0),
    "fully_sharded": ("<=", 1.10),
}
LABELS = {
    "fit64": "fit/loop b64",
    "fit8": "fit/loop b8",
    "mirrored64": "mirrored/ceiling b64",
    "mirrored8": "mirrored/ceiling b8",
    "mwm_fit": "mwm/ddp fit (C/A)",
    "mwm_step": "mwm/ddp step (B/A)",
    "mwm_fit_ring": "mwm/ddp fit, RING",
    "mwm_step_ring": "mwm/ddp step, RING",
    "fully_sharded": "fully_sharded/hand",
}
GROUPS = {"fit8": "fit", "fit64": "fit", "mirrored8": "floor", "mirrored64": "floor", "mwm_fit": "mwm"}
GROUPS |= {"mwm_step": "mwm", "mwm_fit_ring": "mwm", "mwm_step_ring": "mwm", "fully_sharded": "fully_sharded"}


def rounds_for_five_percent(ratios: list) -> int | None:
    """Rounds a row needs to separate a 5 % change from its noise (see the module docstring)."""
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) < 3:
        return None
    if len(logs) < 20:  # (few rounds: the MAD's estimate is low and jumpy; the standard deviation's is not)
        spread = statistics.stdev(logs)
    else:
        middle = statistics.median(logs)
        spread = 1.4826 * statistics.median(abs(value - middle) for value in logs)  # robust to a stray round
    return max(3, math.ceil((1.96 * math.sqrt(2) * 1.2533 * spread / math.log(1.05)) ** 2))


def fit_rows(batch: int, rounds: int) -> list:
    """Per round: fit's step time over the hand loop's (``bench_fit.measure`` runs each in a fresh process)."""
    args = types.SimpleNamespace(examples=8192, epochs=5, execution="auto")
    ratios = []
    for index in range(rounds):
        order = ("fit", "loop") if index % 2 == 0 else ("loop", "fit")
        rates = {name: bench_fit.measure(name, args, batch) for name in order}
        ratios.append(rates["loop"] / rates["fit"])
    return ratios


class _HandEpochs:
    """``bench_fit.hand_loop``'s epochs, one per call, on one model and optimizer kept across calls (a fresh one
    per epoch would make its momentum buffers at every first step): the reference side of the fit rows."""

    def __init__(self, xs, ys, batch: int):
        self.model = bench_fit.make_model().to(xs.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.xs, self.ys, self.batch = xs, ys, batch

    def __call__(self) -> float:
        return bench_fit.hand_epoch(self.model, self.optimizer, self.xs, self.ys, self.batch)


class _Interleaved(Callback):
    """Times each epoch of the fit it is given to, and runs an epoch of the hand loop beside each one: before it
    on odd epochs, after it on even ones (so neither side always runs first); ``ratios``: fit / hand per pair,
    from the second epoch on (the first pair warms both up)."""

    def __init__(self, xs, ys, batch: int):
        super().__init__()
        self._hand, self.ratios = _HandEpochs(xs, ys, batch), []
        self.device = xs.device

    def on_epoch_begin(self, epoch, logs=None):
        self.hand = self._hand() if epoch % 2 else None
        bench_fit.sync(self.device)
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        bench_fit.sync(self.device)
        seconds = time.perf_counter() - self.start
        hand = self.hand if self.hand is not None else self._hand()
        if epoch:
            self.ratios.append(seconds / hand)


def _data(examples: int, device: str) -> tuple:
    """The shared workload's arrays, and as tensors on ``device`` (on a GPU they are given to fit as tensors
    there, as to the hand loop: neither side copies a batch from the host)."""
    from replicafit.data import datasets

    x, y = datasets.make_classification(examples, 64, n_classes=10, seed=0)
    xs, ys = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    return (x, y) if device == "cpu" else (xs, ys), xs, ys


class _HostSyncs(Callback):
    """On a GPU: the host synchronisations torch reports (``torch.cuda.set_sync_debug_mode("warn")``) from the
    second step's ``on_train_batch_begin`` to the last step's: ``counts`` (one per epoch) over ``watched`` steps
    each, everything the loop does between two steps included. ``on_train_batch_begin`` only: a callback with
    ``on_train_batch_end`` would make fit read its logs every step."""

    def __init__(self, steps: int):
        super().__init__()
        self.last, self.watched, self.counts, self._seen = steps - 1, steps - 2, [], None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            torch.cuda.synchronize()
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        elif batch == self.last and self._seen is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catch.__exit__(None, None, None)
            self.counts.append(sum("synchroniz" in str(warning.message) for warning in self._seen))
            self._seen = None

    def on_epoch_end(self, epoch, logs=None):  # (an epoch of fewer than 3 steps watches nothing)
        self.close()

    def close(self) -> None:
        """Turns the debug mode off and stops recording warnings, if a watch is open (also after an error)."""
        if self._seen is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catch.__exit__(None, None, None)
            self._seen = None


def host_syncs(trainer, model, data, batch: int, device: str) -> dict:
    """``{"syncs": n, "watched": steps}`` of one more (untimed) epoch of ``trainer``'s fit on a GPU, else ``{}``."""
    if device == "cpu":
        return {}
    watch = _HostSyncs(-(-len(data[0]) // batch))
    try:
        trainer.fit(model, data, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[watch])
    finally:
        watch.close()
    return {"syncs": sum(watch.counts), "watched": watch.watched * len(watch.counts)}


def interleaved_child(batch: int, pairs: int, device: str) -> None:
    """One process: ``pairs + 1`` epochs of ``fit`` (the default strategy; ``OneDeviceStrategy`` on a GPU), each
    beside an epoch of the hand loop; then, on a GPU, the host synchronisations of an untimed epoch."""
    import gc

    import replicafit.strategies as ds

    data, xs, ys = _data(4096, device)
    gc.collect()  # (see bench_fit.child)
    clock = _Interleaved(xs, ys, batch)
    trainer = Trainer(
        strategy=None if device == "cpu" else ds.OneDeviceStrategy("cuda:0"),
        optimizer={"class_name": "sgd", "config": {"learning_rate": 0.01, "momentum": 0.9}},
        loss="cross_entropy",
        metrics=(),
        seed=0,
    )
    model = bench_fit.make_model()
    trainer.fit(model, data, batch_size=batch, epochs=pairs + 1, shuffle=False, verbose=0, callbacks=[clock])
    print(json.dumps({"ratios": clock.ratios, **host_syncs(trainer, model, data, batch, device)}))


def interleaved_rows(child: str, batch: int, rounds: int, pairs: int, device: str, syncs: list) -> list:
    """Per round (a fresh process running ``--<child>``): the median of its ``pairs`` interleaved ratios, both
    sides measured side by side in one process, so drifts of the machine slower than a pair cancel; on a GPU,
    each round's ``(host synchronisations, steps watched)`` is appended to ``syncs``."""
    ratios = []
    for _ in range(rounds):
        argv = [sys.executable, os.path.abspath(__file__), f"--{child}", str(batch), str(pairs), "--device", device]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{child} at batch {batch} failed:\n{done.stderr[-2000:]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        ratios.append(statistics.median(found["ratios"]))
        if "syncs" in found:
            syncs.append((found["syncs"], found["watched"]))
    return ratios


def floor_rows(batch: int, rounds: int) -> list:
    """Per round: Mirrored's measured throughput ratio over the ceiling of the same process
    (``bench_replica_floor.py``'s child: OneDevice and Mirrored fits, the bare passes and updates)."""
    import bench_replica_floor

    ratios = []
    for index in range(rounds):
        argv = [sys.executable, os.path.join(HERE, "bench_replica_floor.py"), "--child", str(batch)]
        argv += ["--reverse"] * (index % 2)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"bench_replica_floor.py at batch {batch} failed:\n{done.stderr[-2000:]}")
        figures = bench_replica_floor.ratios(json.loads(done.stdout.strip().splitlines()[-1]))
        ratios.append(figures["measured"] / figures["same overhead"])
    return ratios


def interleaved_floor_child(batch: int, pairs: int, device: str) -> None:
    """One process: ``pairs`` + 1 times, an epoch of OneDevice's fit, one of Mirrored's (the order alternating),
    and the bare passes and updates of the ceiling; prints each pair's Mirrored ratio over its ceiling. On a GPU
    Mirrored's two replicas are two logical GPUs of the one (``set_logical_device_configuration``), as the two
    logical CPUs share the cores; then the host synchronisations of an untimed Mirrored epoch."""
    import gc

    import bench_replica_floor

    import replicafit.strategies as ds

    data, xs, ys = _data(2048, device)
    gc.collect()  # (see bench_fit.child)
    steps = -(-len(xs) // batch)
    if device == "cpu":
        one, pair = "cpu:0", ["cpu:0", "cpu:1"]
    else:
        ds.set_logical_device_configuration("cuda:0", 2)
        one, pair = "cuda:0", ["cuda:0", "cuda:1"]
    sides = {}
    strategies = {"one": ds.OneDeviceStrategy(one), "mirrored": ds.MirroredStrategy(pair)}
    for name, strategy in strategies.items():
        config = {"learning_rate": 0.01, "momentum": 0.9}
        trainer = Trainer(strategy=strategy, optimizer={"class_name": "sgd", "config": config}, loss="cross_entropy",
                          metrics=(), seed=0)  # fmt: skip
        sides[name] = (trainer, bench_fit.make_model())
    ratios = []
    for index in range(pairs + 1):
        step = {}
        for name in ("one", "mirrored") if index % 2 == 0 else ("mirrored", "one"):
            trainer, model = sides[name]
            clock = bench_fit.EpochClock(xs.device)  # (the second epoch: the fit's first step set up nothing in it)
            trainer.fit(model, data, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[clock])
            step[name] = clock.times[-1] / steps * 1e6
        full = bench_replica_floor.bare_pass(xs, ys, batch, False, 200)
        halves = bench_replica_floor.bare_pass(xs, ys, batch, True, 200)
        updates = [bench_replica_floor.bare_update(copies, 400, device) for copies in (2, 1)]
        extra = halves - full + updates[0] - updates[1]
        if index:
            ratios.append((step["one"] + extra) / step["mirrored"])  # measured / same overhead
    print(json.dumps({"ratios": ratios, **host_syncs(*sides["mirrored"], data, batch, device)}))


def mwm_rows(rounds: int, implementation: str = "AUTO") -> dict:
    """``{"mwm_fit": [C/A per round], "mwm_step": [B/A per round]}`` from ``bench_multiworker.py``'s rounds, with
    MWMS on ``implementation`` (the row names end in ``_ring`` for ``RING``)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rf-bench-all-") as folder:
        path = os.path.join(folder, "ratios.json")
        seconds = 120 + 2 * rounds  # (a round takes 0.2-0.7 s on 2 cores; the workers' own bound, then ours)
        argv = [sys.executable, os.path.join(HERE, "bench_multiworker.py"), "--rounds", str(rounds), "--json", path]
        argv += ["--timeout", str(seconds), "--implementation", implementation]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
        if done.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"bench_multiworker.py failed:\n{done.stdout[-1000:]}\n{done.stderr[-2000:]}")
        with open(path) as file:
            found = json.load(file)
    tail = "_ring" if implementation == "RING" else ""
    return {f"mwm_fit{tail}": found["C/A"], f"mwm_step{tail}": found["B/A"]}


def fully_sharded_rows(rounds: int) -> list:
    """Per round: FullyShardedStrategy's step time over the ``fully_shard`` hand loop's, 2 workers."""
    argv = [sys.executable, os.path.join(HERE, "bench_fully_sharded.py"), "--workers", "2", "--rounds", str(rounds)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"bench_fully_sharded.py failed:\n{done.stdout[-1000:]}\n{done.stderr[-2000:]}")
    match = re.search(r"ratio ours / hand per round: ([\d., ]+);", done.stdout)
    if match is None:
        raise RuntimeError(f"bench_fully_sharded.py printed no ours / hand ratios:\n{done.stdout[-2000:]}")
    return [float(v) for v in match.group(1).split(",")]


def show(row: str, ratios: list) -> None:
    sign, target = TARGETS[row]
    median, low, high = statistics.median(ratios), min(ratios), max(ratios)
    needed = rounds_for_five_percent(ratios)
    spread, needed = f"range {low:.3f}-{high:.3f}", "-" if needed is None else str(needed)
    met = median <= target if sign == "<=" else median >= target
    count = len(ratios)
    print(
        f"{LABELS[row]:<22} {median:7.3f}  {spread:<22} rounds {count!s:>4}  target {sign} {target:<5} "
        f"{'met' if met else 'not met':<8} rounds for 5 %: {needed}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(TARGETS), default=list(TARGETS))
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds of the fit and mirrored rows")
    parser.add_argument("--mwm-rounds", type=int, default=300, help="bench_multiworker.py's rounds")
    parser.add_argument("--fsdp-rounds", type=int, default=3, help="bench_fully_sharded.py's rounds")
    parser.add_argument("--quick", action="store_true", help="3 rounds a row (a smoke run)")
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="the fit and Mirrored rows in separate processes (bench_fit.py's and bench_replica_floor.py's way) "
        "instead of interleaved in one",
    )
    parser.add_argument("--pairs", type=int, default=12, help="epoch pairs per process of the interleaved fit rows")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu, or cuda: the fit and Mirrored rows on the GPU (two logical GPUs of it for Mirrored), with the "
        "host synchronisations fit makes per step counted; the battery (bash .ci/gpu) runs them",
    )
    parser.add_argument("--interleaved-child", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-floor-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interleaved_child:
        interleaved_child(*args.interleaved_child, args.device)
        return
    if args.interleaved_floor_child:
        interleaved_floor_child(*args.interleaved_floor_child, args.device)
        return
    if args.quick:
        args.rounds, args.mwm_rounds, args.fsdp_rounds = 3, 6, 1
    if args.device != "cpu":
        if not torch.cuda.is_available():
            print(f"--device {args.device}: no CUDA GPU here (torch {torch.__version__}); nothing measured")
            return
        others = [row for row in args.rows if GROUPS[row] not in ("fit", "floor")]
        if set(others) == set(args.rows):
            parser.error(f"--device {args.device} measures the fit and Mirrored rows only (the multi-worker rows "
                         "need a GPU per worker); give --rows fit64 fit8 mirrored64 mirrored8")  # fmt: skip
        if others:
            print(f"(--device {args.device}: rows {', '.join(others)} left out: they need a GPU per worker)")
        args.rows = [row for row in args.rows if row not in others]
        if args.fresh_processes:
            parser.error("--fresh-processes runs the CPU scripts; leave it out with --device")
    start = time.perf_counter()
    print(f"{'row':<22} {'median':>7}  {'spread':<22} {'':>11}  {'':<17}")
    mwm, failed = {}, []
    for row in args.rows:
        try:
            measure_row(row, args, mwm)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:  # the next rows still run
            failed.append(row)
            print(f"{LABELS[row]:<22} failed: {str(error).strip()[-1500:]}", flush=True)
    load = os.getloadavg()[0]
    where = torch.cuda.get_device_name(0) if args.device != "cpu" else f"{os.cpu_count()} CPUs"
    print(f"({time.perf_counter() - start:.0f} s in all; load average {load:.2f}; {where}; torch {torch.__version__})")
    if failed:
        sys.exit(f"rows that failed: {', '.join(failed)}")


def measure_row(row: str, args, mwm: dict) -> None:
    """Measures and prints one row (``mwm``: the multi-worker rows, filled by the first of them)."""
    group, syncs = GROUPS[row], []
    if group == "fit" and args.fresh_processes:
        show(row, fit_rows(int(row[3:]), args.rounds))
    elif group == "fit":
        show(row, interleaved_rows("interleaved-child", int(row[3:]), args.rounds, args.pairs, args.device, syncs))
    elif group == "floor" and args.fresh_processes:
        show(row, floor_rows(int(row[8:]), args.rounds))
    elif group == "floor":
        child = "interleaved-floor-child"
        show(row, interleaved_rows(child, int(row[8:]), args.rounds, args.pairs, args.device, syncs))
    elif group == "mwm":
        if row not in mwm:
            mwm.update(mwm_rows(args.mwm_rounds, "RING" if row.endswith("_ring") else "AUTO"))
        show(row, mwm[row])
    else:
        show(row, fully_sharded_rows(args.fsdp_rounds))
    if syncs:
        count, watched = (sum(values) for values in zip(*syncs))
        rate = count / max(watched, 1)
        print(f"{'':<22} host synchronisations in steady steps: {count} in {watched} ({rate:.2f} a step)", flush=True)


if __name__ == "__main__":
    main()
