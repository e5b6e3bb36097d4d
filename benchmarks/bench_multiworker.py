"""Two worker processes on gloo: torch DDP vs ``MultiWorkerMirroredStrategy``, one step at a time.

The same MLP 64 -> 256 -> 256 -> 10 (ReLU; 85,002 parameters in 6 tensors), the same synthetic
data (global batch 64 by default: 32 rows per worker) and the same steps, in 2 processes over
127.0.0.1 with one intra-op thread each:

  A. ``DistributedDataParallel`` + ``torch.optim.SGD(momentum=0.9)``: forward, mean loss,
     ``backward()``, ``step()``, ``zero_grad()``.
  B. ``MultiWorkerMirroredStrategy`` + ``optimizers.SGD(momentum=0.9)``: the Trainer's replica
     step, ``strategy.run(step_fn, args=(x, y))`` where ``step_fn`` takes the loss sum over the
     global batch, ``torch.autograd.grad`` over the distributed module's trainable variables
     and ``apply_gradients``.
  C. B through ``Trainer.fit`` (the data layer, the global-batch agreement, the loss metric);
     its steps are timed from one ``on_train_batch_end`` to the next, so fit's setup is left out.

Both processes hold every variant (DDP runs on the default group the strategy created), and
each round runs a block of ``--steps`` steps of every variant, the order reversed every other
round, so the machine's drifts hit all alike. A step's time is the slower worker's block time
divided by the steps; the script prints medians, quartiles, the median of the per-round ratios
B/A and C/A, and the collectives issued per step (B: the strategy's counter of data
collectives, plus a census of every ``torch.distributed`` call by group; DDP: a counting comm
hook around ``allreduce_hook`` on a separate copy, and its bucket sizes). Before timing, A and B
are checked to give the same weights after 3 steps from the same initial values.

Target (issue 12): B and C <= 1.0x A on CPU gloo, and one data
collective per step.

With ``--model large`` (64 -> 2048 -> 2048 -> 1024 -> 10: 26.5 MB of gradients, several buckets) and
``--without-communication``, it also times A0 (DDP inside ``no_sync()``) and B0 (B's step with a
local update) and prints what communication adds to each step: B's gradient buckets start during
backward, so that figure smaller than DDP's shows the overlap. ``--no-overlap`` reduces after
backward instead, for comparison.

Run: python benchmarks/bench_multiworker.py [--rounds 150] [--steps 20] [--warmup 20] [--batch 64]
     python benchmarks/bench_multiworker.py --model large --without-communication --rounds 10 --steps 3 --no-fit
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WORLD = 2
FEATURES, CLASSES = 64, 10
LEARNING_RATE = 0.01
DISTINCT_BATCHES = 8  # the synthetic data: this many global batches, cycled


# --- the worker side ---------------------------------------------------------------------------
WIDTHS = {"mlp": (256, 256), "large": (2048, 2048, 1024)}  # "large": 6.6M parameters, 26.5 MB of gradients
MODEL = "mlp"


def make_model():
    import torch

    torch.manual_seed(0)  # the same initial values in every variant and on every worker
    layers, width = [], FEATURES
    for hidden in WIDTHS[MODEL]:
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, CLASSES))


class _Census:
    """Counts every torch.distributed collective this process calls, by process group."""

    NAMES = ("all_reduce", "all_gather", "broadcast", "all_gather_object", "broadcast_object_list", "monitored_barrier")
    # The single-tensor gather and reduce-scatter, which the collective module calls by names of its own.
    OWN = {"_all_gather_single": "all_gather_single", "_reduce_scatter_single": "reduce_scatter_single"}

    def __init__(self, collective):
        import torch.distributed as dist

        import replicafit.strategies.collective as module

        self.targets = [(dist, name, name) for name in self.NAMES]
        self.targets += [(module, attr, name) for attr, name in self.OWN.items()]
        self.counts, self.saved = {}, []
        self.groups = {id(collective.control_group): "control", id(collective.input_group): "input"}
        self.groups[id(collective.bucket_group)] = "bucket"

    def __enter__(self):
        for owner, attr, name in self.targets:
            original = getattr(owner, attr)
            self.saved.append((owner, attr, original))

            def counted(*args, _name=name, _original=original, **kwargs):
                group = self.groups.get(id(kwargs.get("group")), "data")
                key = f"{_name}[{group}]"
                self.counts[key] = self.counts.get(key, 0) + 1
                return _original(*args, **kwargs)

            setattr(owner, attr, counted)
        return self

    def __exit__(self, *exc):
        for owner, attr, original in self.saved:
            setattr(owner, attr, original)


def worker(rank: int, port: int, args, outdir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import replicafit.strategies as ds
    from replicafit import optimizers
    from replicafit.trainer import Trainer, callbacks

    torch.set_num_threads(1)
    resolver = ds.SimpleClusterResolver(WORLD, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(
        timeout_seconds=60, bytes_per_pack=int(args.bucket_mb * 2**20), implementation=args.implementation
    )
    strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    collective = strategy.extended._collective
    global_batch, per_worker = args.batch, args.batch // WORLD

    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(DISTINCT_BATCHES, global_batch, FEATURES, generator=generator)
    ys = torch.randint(0, CLASSES, (DISTINCT_BATCHES, global_batch), generator=generator)
    rows = slice(rank * per_worker, (rank + 1) * per_worker)
    batches = [(xs[i, rows].contiguous(), ys[i, rows].contiguous()) for i in range(DISTINCT_BATCHES)]

    # A: DDP on the default group (the strategy's data group) + torch.optim.
    model_a = make_model()
    ddp = DistributedDataParallel(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=LEARNING_RATE, momentum=0.9)

    def step_a(x, y):
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt_a.step()
        opt_a.zero_grad()

    # B: the strategy's distributed module + our optimizer, the Trainer's replica step.
    dm = strategy.distribute_module(make_model())
    variables = dm.trainable_variables
    with strategy.scope():
        opt_b = optimizers.SGD(LEARNING_RATE, momentum=0.9)

    def replica_step(x, y):
        loss = F.cross_entropy(dm(x), y, reduction="none").sum() / global_batch
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        opt_b.apply_gradients(zip(grads, variables))

    overlap = strategy.extended.gradient_step

    def step_b(x, y):
        # As Trainer.fit runs its built-in step: gradient buckets started during backward.
        with overlap(variables) if args.overlap else contextlib.nullcontext():
            strategy.run(replica_step, args=(x, y))

    # A0 and B0: the same steps without communication (DDP inside no_sync(); B with its bucket
    # all-reduces skipped): (X - X0) is what communication adds to a step.

    def step_a0(x, y):
        with ddp.no_sync():
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
        opt_a.step()
        opt_a.zero_grad()

    class _Done:
        def wait(self):
            return True

    def step_b0(x, y):
        start = collective.start_all_reduce
        collective.start_all_reduce = lambda buffer, what: _Done()  # every bucket "reduced" at once
        try:
            step_b(x, y)
        finally:
            collective.start_all_reduce = start

    # The check: the same weights after 3 steps from the same initial values.
    for x, y in batches[:3]:
        step_a(x, y)
        step_b(x, y)
    diffs = [(pa.detach() - v.value().detach()).abs().max().item() for pa, v in zip(model_a.parameters(), variables)]
    same = all(
        torch.allclose(pa.detach(), v.value().detach(), rtol=1e-5, atol=1e-6)
        for pa, v in zip(model_a.parameters(), variables)
    )
    check = {"allclose": same, "max_abs_diff": max(diffs)}

    # C: Trainer.fit over the same data; a callback stamps the end of every step.
    class StepClock(callbacks.Callback):
        _decides_from_logs = True  # reads no logs, never stops training: no per-step agreement

        def __init__(self):
            super().__init__()
            self.stamps, self.operations = [], []

        def _wants_logs(self, hook):
            return False  # so fit reads no metrics per step

        def on_train_batch_end(self, batch, logs=None):
            self.stamps.append(time.perf_counter())
            self.operations.append(collective.operations)

    model_c = make_model()
    trainer = Trainer(
        strategy=strategy, optimizer=optimizers.SGD(LEARNING_RATE, momentum=0.9), loss="cross_entropy", metrics=()
    )
    fit_x, fit_y = xs.reshape(-1, FEATURES), ys.reshape(-1)  # every worker passes the global data

    def fit_block(steps):
        clock = StepClock()
        rows_needed = (steps + 1) * global_batch
        reps = -(-rows_needed // len(fit_x))
        x, y = fit_x.repeat(reps, 1)[:rows_needed], fit_y.repeat(reps)[:rows_needed]
        trainer.fit(model_c, (x, y), batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
        return clock

    # Collectives per step, counted outside the timed blocks.
    census = {}
    steps = 5
    start = collective.operations
    with _Census(collective) as counter:
        for k in range(steps):
            step_b(*batches[k % DISTINCT_BATCHES])
    census["B_data_ops_per_step"] = (collective.operations - start) / steps
    census["B_calls_per_step"] = {k: v / steps for k, v in counter.counts.items()}
    fit_block(1)  # the first fit distributes the model; the census counts later fits
    fits = {}
    for n in (steps, 2 * steps):  # the difference of two fits: the calls per step and per fit
        with _Census(collective) as counter:
            clock = fit_block(n)
        fits[n] = counter.counts
    ops = clock.operations
    census["C_data_ops_per_step"] = (ops[-1] - ops[0]) / (len(ops) - 1)
    keys = sorted(set(fits[steps]) | set(fits[2 * steps]))
    per_step = {k: (fits[2 * steps].get(k, 0) - fits[steps].get(k, 0)) / steps for k in keys}
    census["C_calls_per_step"] = per_step
    census["C_calls_per_fit"] = {k: fits[steps].get(k, 0) - (steps + 1) * per_step[k] for k in keys}
    hooked = DistributedDataParallel(make_model())
    hook_calls = [0]

    def counting_hook(state, bucket):
        hook_calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    hooked.register_comm_hook(None, counting_hook)
    opt_h = torch.optim.SGD(hooked.parameters(), lr=LEARNING_RATE, momentum=0.9)
    for k in range(steps):
        x, y = batches[k % DISTINCT_BATCHES]
        F.cross_entropy(hooked(x), y).backward()
        opt_h.step()
        opt_h.zero_grad()
    census["A_hook_calls_per_step"] = hook_calls[0] / steps
    census["A_bucket_sizes"] = hooked._get_ddp_logging_data().get("bucket_sizes")

    # Warm-up, then the interleaved rounds.
    for k in range(args.warmup):
        step_a(*batches[k % DISTINCT_BATCHES])
        step_b(*batches[k % DISTINCT_BATCHES])
    if not args.no_fit:
        fit_block(args.warmup)
    order = ["A", "B"] + ([] if args.no_fit else ["C"]) + (["A0", "B0"] if args.without_communication else [])
    blocks: dict = {name: [] for name in order}
    step_fns = {"A": step_a, "B": step_b, "A0": step_a0, "B0": step_b0}
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            dist.barrier()
            if name == "C":
                stamps = fit_block(args.steps).stamps
                blocks[name].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                continue
            fn = step_fns[name]
            begin = time.perf_counter()
            for k in range(args.steps):
                fn(*batches[k % DISTINCT_BATCHES])
            blocks[name].append((time.perf_counter() - begin) / args.steps)
    result = {"check": check, "census": census, "blocks": blocks}
    with open(os.path.join(outdir, f"out-{rank}.json.tmp"), "w") as file:
        json.dump(result, file)
    os.replace(os.path.join(outdir, f"out-{rank}.json.tmp"), os.path.join(outdir, f"out-{rank}.json"))
    strategy.cluster.barrier("end")


# --- the launcher side --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, argv, script: str = __file__, world: int = WORLD) -> list:
    """Starts ``world`` workers (fresh interpreters of ``script`` with ``argv`` and ``--_worker RANK PORT OUTDIR``),
    waits at most ``args.timeout`` s, ends any left by pid; returns each one's ``out-RANK.json``."""
    port, outdir = _free_port(), tempfile.mkdtemp(prefix="rf-bench-mw-")
    try:
        return _launch_in(outdir, port, args, argv, script, world)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def _launch_in(outdir, port, args, argv, script, world) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script), *argv, "--_worker", str(rank), str(port), outdir],
            env=env,
            start_new_session=True,  # a process group of its own, ended by its pid below
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers were still running after {args.timeout} s")
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # the other worker's error, if any, reaches stderr first
                raise RuntimeError(f"a worker failed: exit codes {[p.poll() for p in procs]}")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    outcomes = []
    for rank in range(world):
        with open(os.path.join(outdir, f"out-{rank}.json")) as file:
            outcomes.append(json.load(file))
    return outcomes


def _quartiles(values) -> tuple:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def report(outcomes, args) -> None:
    checks = [o["check"] for o in outcomes]
    ok = all(c["allclose"] for c in checks)
    worst = max(c["max_abs_diff"] for c in checks)
    print(f"check: A and B weights after 3 steps from the same init: allclose={ok} (max |diff| {worst:.2e})")
    names = list(outcomes[0]["blocks"])
    # Per round, the slower worker's step time.
    slower = {n: [max(o["blocks"][n][r] for o in outcomes) for r in range(args.rounds)] for n in names}
    labels = {
        "A": "A  DDP + torch.optim.SGD",
        "B": "B  MWMS replica step + optimizers.SGD",
        "C": "C  MWMS through Trainer.fit",
        "A0": "A0 DDP step inside no_sync()",
        "B0": "B0 B with its all-reduces skipped",
    }
    shape = "-".join(str(w) for w in (FEATURES, *WIDTHS[MODEL], CLASSES))
    print(
        f"2 workers x 1 thread, gloo on 127.0.0.1, MLP {shape}, overlap={args.overlap}, MWMS implementation "
        f"{args.implementation}, batch {args.batch} "
        f"({args.batch // WORLD}/worker); {args.rounds} rounds x {args.steps} steps; the slower worker, ms/step"
    )
    print(f"  {'variant':<40} {'median':>8} {'p25':>8} {'p75':>8}")
    for n in names:
        q1, q2, q3 = _quartiles(slower[n])
        print(f"  {labels[n]:<40} {q2 * 1e3:8.3f} {q1 * 1e3:8.3f} {q3 * 1e3:8.3f}")
    if "A0" in names:
        comm_a = statistics.median(slower["A"]) - statistics.median(slower["A0"])
        comm_b = statistics.median(slower["B"]) - statistics.median(slower["B0"])
        print(
            f"  what communication adds to a step (median X - X0): DDP {comm_a * 1e3:.3f} ms, MWMS {comm_b * 1e3:.3f} "
            f"ms (overlap visible when MWMS's is the smaller: {comm_b < comm_a})"
        )
    per_round = {}
    for n in [n for n in names[1:] if n in ("B", "C")]:
        ratios = per_round[f"{n}/A"] = [b / a for a, b in zip(slower["A"], slower[n])]
        q1, q2, q3 = _quartiles(ratios)
        of_medians = statistics.median(slower[n]) / statistics.median(slower["A"])
        target = "  (target <= 1.0)" if n in ("B", "C") else ""
        print(
            f"  ratio {n}/A: median of per-round ratios {q2:.3f} (p25 {q1:.3f}, p75 {q3:.3f}); "
            f"of the medians {of_medians:.3f}{target}"
        )
    if args.json:  # every round's ratios, for benchmarks/bench_all.py
        with open(args.json, "w") as file:
            json.dump(per_round, file)
    census = outcomes[0]["census"]
    print("collectives per step:")
    print(
        f"  A (DDP): {census['A_hook_calls_per_step']:g} all_reduce per step (a counting comm hook around "
        f"allreduce_hook); bucket sizes {census['A_bucket_sizes']}"
    )
    calls = ", ".join(f"{k} {v:g}" for k, v in sorted(census["B_calls_per_step"].items()))
    print(
        f"  B (MWMS): {census['B_data_ops_per_step']:g} data collective(s) per step "
        f"(extended._collective.operations); every torch.distributed call per step: {calls}"
    )
    per_step = ", ".join(f"{k} {v:g}" for k, v in census["C_calls_per_step"].items() if v)
    per_fit = ", ".join(f"{k} {v:g}" for k, v in census["C_calls_per_fit"].items() if v)
    print(
        f"  C (fit): {census['C_data_ops_per_step']:g} data collective(s) per step; every torch.distributed "
        f"call per step: {per_step}; per fit call besides (setup and epoch end): {per_fit}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps of each variant first")
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over 2 workers)")
    parser.add_argument("--no-fit", action="store_true", help="leave out C (Trainer.fit)")
    parser.add_argument("--bucket-mb", type=float, default=0, help="MWMS bytes_per_pack in MiB (0: 25 MiB buckets)")
    parser.add_argument("--model", choices=sorted(WIDTHS), default="mlp", help="large: 26.5 MB of gradients")
    parser.add_argument(
        "--implementation",
        choices=("AUTO", "RING"),
        default="AUTO",
        help="MWMS's CommunicationImplementation: RING sums with gloo's all-reduce, as DDP does, at every size",
    )
    parser.add_argument(
        "--no-overlap", dest="overlap", action="store_false", help="B reduces after backward (no hook-started buckets)"
    )
    parser.add_argument(
        "--without-communication", action="store_true", help="also time A0 and B0, the steps without communication"
    )
    parser.add_argument("--json", help="write every round's ratios B/A and C/A to this file")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the workers are ended")
    parser.add_argument("--_worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch % WORLD or args.batch < WORLD:
        parser.error(f"--batch must be a positive multiple of {WORLD}")
    global MODEL
    MODEL = args.model
    if args._worker:
        rank, port, outdir = args._worker
        worker(int(rank), int(port), args, outdir)
        return
    argv = sys.argv[1:]
    start = time.perf_counter()
    outcomes = launch(args, argv)
    report(outcomes, args)
    print(f"({time.perf_counter() - start:.1f} s in all)")


if __name__ == "__main__":
    main()
