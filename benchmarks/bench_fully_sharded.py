"""FullyShardedStrategy vs MultiWorkerMirroredStrategy vs torch's own fully_shard loop: memory, step time, collectives.

The same model, data and steps in N worker processes (``--workers 2,3``: N = 2, then N = 3) started fresh on
gloo over 127.0.0.1, one intra-op thread each: by default (``--blocks``, ``--width``) 8 equal blocks
``x + tanh(Linear(1000, 1000)(x))`` and a head ``Linear(1000, 10)`` (8,018,010 parameters, 32.1 MB of float32),
Adam (lr 1e-3), cross-entropy, global batch 64 cut by TensorFlow's split rule (each worker the same contiguous
slice of every global batch: 32/32 rows on 2 workers, 22/22/20 on 3). Three variants:

* ``sharded`` (ours): ``FullyShardedStrategy(shard_units=["Block"])`` + ``optimizers.Adam`` through ``Trainer.fit``;
* ``mirrored``: ``MultiWorkerMirroredStrategy`` + ``optimizers.Adam`` through ``Trainer.fit``;
* ``hand``: a hand-written torch loop: ``fully_shard`` on each block, then on the model (``reshard_after_forward``
  True for the blocks, False for the root, as the strategy does), over ``init_device_mesh("cpu", (N,))`` passed
  explicitly; ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` on every
  ``FSDPModule`` (the same sum reduction as ours); loss = sum of per-example losses / global batch; backward;
  ``torch.optim.Adam(lr=1e-3, eps=1e-7)`` (Keras's epsilon; torch's defaults otherwise); ``zero_grad()``.

Each round starts fresh processes for each variant, the order of the variants reversed every other round (so the
machine's drifts hit all alike). Every worker builds the model (``torch.manual_seed(0)``), runs ``--warmup``
steps, ``--steps`` timed steps (from one step's end to the next: ``on_train_batch_end`` under ``fit``), then
``--count-steps`` steps in which it counts its collectives. The script prints, per N:

1. memory per worker (the largest worker's): ``VmRSS`` after setup (imports, process group, data), the peak
   ``VmHWM`` once the model is built (whole, on every worker), then, the peak reset (``/proc/self/clear_refs``),
   the peak over training (sharding, fit's setup, the steps); the process peak is the larger of the two. Measured
   twice: (a) in one run per variant of ``MEMORY_STEPS`` steps with ``MALLOC_MMAP_THRESHOLD_=65536``, where every
   allocation of 64 KiB or more is a mapping of its own, returned on free, so the peak follows the live tensors;
   (b) in the timed runs, under glibc's defaults (its mmap threshold grows to the largest block freed, after which
   the gather and reduce-scatter buffers of ``fully_shard`` come from heaps that fragment: the peak grows over the
   first ~10 steps, by ~150-200 MB here, in the hand loop as in ours; ``MALLOC_*`` or ``GLIBC_TUNABLES`` set in
   the environment apply to the timed runs, and (b) says so). Target, on (a): FullySharded's process peak below
   MultiWorkerMirrored's by at least 70 % of (parameters + gradients + Adam's two slots) x (1 - 1/N), less one
   unit's (one block's) parameter bytes: what no longer lives whole on a worker, less the unit gathered at a time.
   The file-backed part of the RSS at the end (the libraries' pages read in) is printed beside it.
2. step time: the median of each worker's timed steps, the slower worker's per round; per variant the median over
   rounds [range], and the per-round ratios ours / hand (target <= 1.10) and ours / MultiWorkerMirrored, median
   [range].
3. collectives per step over the counted steps, on rank 0 of the first round: every call of ``torch.distributed``'s
   ``all_gather_single``, ``all_gather_into_tensor``, ``reduce_scatter_single``, ``reduce_scatter_tensor``,
   ``all_reduce``, ``broadcast`` (and ``all_gather``, ``reduce_scatter``, ``all_reduce_coalesced``,
   ``all_to_all_single``, the barriers and object collectives), wrapped, by process group, with the bytes of the
   whole buffer (all-gather: its output; reduce-scatter: its input; all-reduce, broadcast: the tensor).
   ``fully_shard`` on torch 2.13 calls ``dist.all_gather_single`` and ``dist.reduce_scatter_single``
   (``_fsdp_collectives.py``), looked up at call time, so the wrappers see them. As a check, a ``TorchDispatchMode``
   counts every ``c10d`` and ``_c10d_functional`` op reaching the dispatcher in the same steps (functional
   collectives, and calls through names bound before the wrappers were installed, included).

Last, a check that the variants train alike: the largest difference between their final weights (worker 0, first
round) after the same steps from the same initial values. FullySharded and MultiWorkerMirrored run the same Adam
(equal up to the order of the sums); Keras's Adam adds epsilon before the bias correction, torch's after, so the
hand loop differs where gradients are small (a fraction of the change in training, expected).

The default run starts 24 runs of fresh interpreters (3 rounds x 3 variants + 3 memory runs, per N): about 4-5
minutes on an idle 2-core machine (from its CPU time), 6-7 measured with other processes on the cores; ``--quick``
about 1 minute. With 3 workers on 2 cores the workers share cores: compare ratios, not absolute times.

Run: python benchmarks/bench_fully_sharded.py [--workers 2,3] [--rounds 3] [--steps 20] [--warmup 3] [--batch 64]
     python benchmarks/bench_fully_sharded.py --quick     # a smoke run: 2 workers, 1 round, 1 + 2 + 1 steps
"""

from __future__ import annotations

import argparse
import datetime
import inspect
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

VARIANTS = ("sharded", "mirrored", "hand")
LABELS = {
    "sharded": "FullySharded (fit)",
    "mirrored": "MultiWorkerMirrored (fit)",
    "hand": "torch fully_shard loop",
}
CLASSES = 10
SEED_DATA = 1


# --- the worker side ---------------------------------------------------------------------------
def make_model(width: int, blocks: int):
    import torch

    class Block(torch.nn.Module):  # the unit: shard_units=["Block"]
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(width, width)

        def forward(self, x):
            return x + torch.tanh(self.linear(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(blocks)])
            self.head = torch.nn.Linear(width, CLASSES)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)  # the same initial values in every variant and on every worker
    return Net()


def _status(field: str) -> int:
    """``field`` of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux: ``5`` into /proc/self/clear_refs); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def _nbytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class Census:
    """Counts this process's collectives between ``start()`` and ``stop()``: ``torch.distributed``'s functions
    wrapped (by name and process group, with bytes), and every c10d op reaching the dispatcher."""

    #: function -> the argument whose size is the collective's whole buffer (None: no tensor of data).
    SIZED = {
        "all_gather_single": "output_tensor",
        "all_gather_into_tensor": "output_tensor",
        "all_gather": "tensor_list",
        "reduce_scatter_single": "input",
        "reduce_scatter_tensor": "input",
        "reduce_scatter": "input_list",
        "all_reduce": "tensor",
        "all_reduce_coalesced": "tensors",
        "broadcast": "tensor",
        "all_to_all_single": "input",
        "barrier": None,
        "monitored_barrier": None,
        "all_gather_object": None,
        "broadcast_object_list": None,
    }
    #: dispatcher ops that are bookkeeping of the functional collectives, not collectives
    NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")

    def __init__(self, groups: dict):
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        self.dist, self.groups = dist, groups  # id(process group) -> label
        self.calls: dict = {}  # "name[group]" -> [count, bytes]
        self.ops: dict = {}  # dispatcher op -> count
        self.saved: dict = {}
        self.marks: list = []
        census = self

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if name.startswith(("c10d.", "_c10d_functional.")) and not any(
                    part in name for part in census.NOT_COLLECTIVES
                ):
                    census.ops[name] = census.ops.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = _Ops()

    def _label(self, group) -> str:
        if group is None:
            return self.groups.get("default", "default")
        return self.groups.get(id(group), "other")

    def start(self) -> None:
        for name, sized in self.SIZED.items():
            original = getattr(self.dist, name, None)
            if original is None:
                continue
            self.saved[name] = original
            signature = inspect.signature(original)

            def counted(*args, _name=name, _sized=sized, _original=original, _signature=signature, **kwargs):
                bound = _signature.bind_partial(*args, **kwargs).arguments
                key = f"{_name}[{self._label(bound.get('group'))}]"
                entry = self.calls.setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] += _nbytes(bound.get(_sized)) if _sized else 0
                return _original(*args, **kwargs)

            setattr(self.dist, name, counted)
        self.mode.__enter__()
        self.mark()

    def mark(self) -> None:
        """A snapshot of the counts (at a step's end)."""
        self.marks.append(({k: list(v) for k, v in self.calls.items()}, dict(self.ops)))

    def stop(self) -> None:
        self.mode.__exit__(None, None, None)
        for name, original in self.saved.items():
            setattr(self.dist, name, original)
        self.saved = {}

    def per_step(self) -> dict:
        """Counts and bytes per step between the first and the last mark."""
        (calls0, ops0), (calls1, ops1) = self.marks[0], self.marks[-1]
        steps = len(self.marks) - 1
        calls = {
            k: [(v[0] - calls0.get(k, [0, 0])[0]) / steps, (v[1] - calls0.get(k, [0, 0])[1]) / steps]
            for k, v in sorted(calls1.items())
        }
        ops = {k: (v - ops0.get(k, 0)) / steps for k, v in sorted(ops1.items())}
        return {"calls": {k: v for k, v in calls.items() if v[0]}, "ops": {k: v for k, v in ops.items() if v}}


def _group_labels(default, **named) -> dict:
    """id(group) -> label; groups that are one object get both names (``default=mesh``)."""
    labels: dict = {}
    for label, group in [("default", default), *named.items()]:
        if group is None:
            continue
        labels[id(group)] = f"{labels[id(group)]}={label}" if id(group) in labels else label
    labels["default"] = labels[id(default)]
    return labels


def _save_weights(state: dict, rank: int, args) -> None:
    """With ``--_save``, worker 0 writes the whole final weights (sharded ones gathered: every worker takes part)."""
    if not args._save:
        return
    import torch

    tensor = sys.modules.get("torch.distributed.tensor")  # imported where anything is sharded (it takes a second)
    sharded = tensor.DTensor if tensor is not None else ()
    whole = {k: (v.full_tensor() if isinstance(v, sharded) else v).detach().clone() for k, v in state.items()}
    if rank == 0:
        torch.save(whole, args._save + ".tmp")
        os.replace(args._save + ".tmp", args._save)


def _data(args, total_steps: int):
    import torch

    generator = torch.Generator().manual_seed(SEED_DATA)
    rows = total_steps * args.batch
    x = torch.randn(rows, args.width, generator=generator)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return x, y


def _split(batch: int, workers: int) -> list:
    """TensorFlow's split rule: ``k = ceil(b / n)`` rows each, the last ones fewer."""
    chunk = -(-batch // workers)
    return [max(0, min(chunk, batch - i * chunk)) for i in range(workers)]


def worker(rank: int, port: int, variant: str, args, outdir: str) -> None:
    import torch

    torch.set_num_threads(1)
    total = args.warmup + args.steps + args.count_steps
    if variant == "hand":
        result = _hand_worker(rank, port, args, total)
    else:
        result = _fit_worker(rank, port, variant, args, total)
    path = os.path.join(outdir, f"{variant}-{rank}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(result, file)
    os.replace(path + ".tmp", path)


def _timed(stamps: list, args) -> float:
    """The median of the timed steps: from the end of the last warm-up step on, ``--steps`` of them."""
    ends = stamps[args.warmup - 1 : args.warmup + args.steps]
    return statistics.median(b - a for a, b in zip(ends[:-1], ends[1:]))


def _hand_worker(rank: int, port: int, args, total: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    workers = args.num_workers
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=workers,
        timeout=datetime.timedelta(seconds=args.collective_timeout),
    )
    x, y = _data(args, total)
    sizes = _split(args.batch, workers)
    start = sum(sizes[:rank])
    rows = [slice(k * args.batch + start, k * args.batch + start + sizes[rank]) for k in range(total)]
    batches = [(x[r].contiguous(), y[r].contiguous()) for r in rows]
    memory = {"setup": _status("VmRSS")}
    model = make_model(args.width, args.blocks)
    memory["build"] = _status("VmHWM")
    memory["reset"] = _reset_peak()
    # Imported here, as the strategy imports them inside fit: the peak of training counts them in both.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (workers,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    census = Census(_group_labels(dist.group.WORLD, mesh=mesh.get_group()))
    stamps = []
    for k, (xb, yb) in enumerate(batches):
        if k == args.warmup + args.steps:
            census.start()
        loss = F.cross_entropy(model(xb), yb, reduction="sum") / args.batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
        if k >= args.warmup + args.steps:
            census.mark()
    census.stop()
    memory["fit"], memory["file"] = _status("VmHWM"), _status("RssFile")
    _save_weights(model.state_dict(), rank, args)
    dist.barrier()
    dist.destroy_process_group()
    return {"step": _timed(stamps, args), "memory": memory, "census": census.per_step()}


def _fit_worker(rank: int, port: int, variant: str, args, total: int) -> dict:
    import replicafit.strategies as ds
    from replicafit import optimizers
    from replicafit.trainer import Callback, Trainer

    resolver = ds.SimpleClusterResolver(args.num_workers, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(timeout_seconds=args.collective_timeout)
    if variant == "sharded":
        strategy = ds.FullyShardedStrategy(options, resolver, shard_units=["Block"])
    else:
        strategy = ds.MultiWorkerMirroredStrategy(options, resolver)
    x, y = _data(args, total)
    memory = {"setup": _status("VmRSS")}
    model = make_model(args.width, args.blocks)
    memory["build"] = _status("VmHWM")
    memory["reset"] = _reset_peak()
    import torch.distributed as dist

    collective = strategy.extended._collective  # private: the process groups, to name them in the census
    census_at = args.warmup + args.steps

    class Clock(Callback):
        leaves_variables_alone = True  # a timer: touches no variable
        _decides_from_logs = True  # private: never stops training, so fit adds no per-step agreement for it

        def __init__(self):
            super().__init__()
            self.stamps, self.census = [], None

        def _wants_logs(self, hook):  # private: so fit reads no metrics per step for it
            return False

        def on_train_batch_end(self, batch, logs=None):
            self.stamps.append(time.perf_counter())
            if len(self.stamps) == census_at:
                mesh = strategy.extended.device_mesh if variant == "sharded" else None
                groups = {
                    "control": collective.control_group,
                    "input": collective.input_group,
                    "bucket": collective.bucket_group,
                }
                if mesh is not None:
                    groups["mesh"] = mesh.get_group()
                self.census = Census(_group_labels(dist.group.WORLD, **groups))
                self.census.start()
            elif self.census is not None:
                self.census.mark()

    clock = Clock()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-3), loss="cross_entropy", metrics=(), seed=0)
    try:
        trainer.fit(model, (x, y), batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    finally:
        if clock.census is not None:
            clock.census.stop()
    memory["fit"], memory["file"] = _status("VmHWM"), _status("RssFile")
    if len(clock.stamps) != total:
        raise RuntimeError(f"fit ran {len(clock.stamps)} steps, not {total}")
    _save_weights(trainer.model_state_dict(), rank, args)
    strategy.cluster.barrier("end")
    return {"step": _timed(clock.stamps, args), "memory": memory, "census": clock.census.per_step()}


# --- the launcher side --------------------------------------------------------------------------
#: The memory runs' allocator setting: every allocation of 64 KiB or more a mapping of its own, returned on free.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MEMORY_STEPS = (2, 2, 1)  # the memory runs' warm-up, "timed" and counted steps: the peak is reached in step 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(file.readlines()[-lines:])
    except OSError:
        return "(no output)"


def launch(args, workers: int, variant: str, outdir: str, memory: bool = False, save: str | None = None) -> list:
    """Starts ``workers`` fresh interpreters for ``variant``; waits at most ``--timeout`` s; ends any left by pid.
    ``memory``: a memory run (``FIXED_MMAP``, ``MEMORY_STEPS``). ``save``: worker 0 writes the final weights there.
    A failed worker: the tail of its output printed, and the script exits with 1."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(FIXED_MMAP if memory else {}))
    warmup, steps, count = MEMORY_STEPS if memory else (args.warmup, args.steps, args.count_steps)
    passed = [
        "--batch", str(args.batch), "--steps", str(steps), "--warmup", str(warmup), "--count-steps", str(count),
        "--width", str(args.width), "--blocks", str(args.blocks), "--collective-timeout", str(args.collective_timeout),
    ] + (["--_save", save] if save else [])  # fmt: skip
    procs, logs = [], []
    for rank in range(workers):
        log = os.path.join(outdir, f"{variant}-{rank}.log")
        logs.append(log)
        with open(log, "w") as output:
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), *passed,
                     "--_worker", str(rank), str(workers), str(port), variant, outdir],
                    env=env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a process group of its own, ended by its pid below
                )
            )  # fmt: skip
    deadline = time.monotonic() + args.timeout
    failure = None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failure = f"the {variant} workers were still running after {args.timeout:g} s"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # the others' errors, if any, reach their logs first
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    codes = [p.returncode for p in procs]
    results = [os.path.join(outdir, f"{variant}-{rank}.json") for rank in range(workers)]
    if failure is None and any(codes):
        failure = f"a {variant} worker failed: exit codes {codes}"
    if failure is None and not all(os.path.exists(path) for path in results):
        failure = f"a {variant} worker wrote no result: exit codes {codes}"
    if failure is not None:
        print(f"FAILED ({workers} workers{', memory run' if memory else ''}): {failure}", file=sys.stderr)
        for rank, (code, log) in enumerate(zip(codes, logs)):
            if code != 0:
                print(f"--- {variant} worker {rank} (exit {code}), the tail of its output:", file=sys.stderr)
                print(_tail(log), file=sys.stderr)
        raise SystemExit(1)
    outcomes = []
    for path in results:
        with open(path) as file:
            outcomes.append(json.load(file))
        os.remove(path)
    return outcomes


def _mid(values, scale: float = 1.0) -> str:
    """median [min - max]"""
    values = [v * scale for v in values]
    return f"{statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]"


def _size(width: int, blocks: int) -> tuple:
    unit = width * width + width
    return blocks * unit + width * CLASSES + CLASSES, unit


def _memory(runs: dict, target: float, heading: str) -> bool:
    """The memory table of ``runs`` (variant -> rounds of workers' results); whether the saving meets ``target``."""
    print(heading)
    print(
        f"  {'variant':<27} {'after setup (RSS)':>22} {'peak after build':>22} {'peak of training':>22} "
        f"{'process peak':>22} {'file-backed (end)':>22}"
    )
    peak: dict = {}
    for variant in VARIANTS:
        rounds = runs[variant]
        columns = [
            [max(w["memory"]["setup"] for w in run) for run in rounds],
            [max(w["memory"]["build"] for w in run) for run in rounds],
            [max(w["memory"]["fit"] for w in run) for run in rounds],
            [max(max(w["memory"]["build"], w["memory"]["fit"]) for w in run) for run in rounds],
            [max(w["memory"]["file"] for w in run) for run in rounds],
        ]
        peak[variant] = columns[3]
        print(f"  {LABELS[variant]:<27} " + " ".join(f"{_mid(c, 1e-6):>22}" for c in columns))
    if not all(w["memory"]["reset"] for rounds in runs.values() for run in rounds for w in run):
        print("  (the peak could not be reset after the build: 'peak of training' is the process's peak)")
    saved = [(m - s) / 1e6 for m, s in zip(peak["mirrored"], peak["sharded"])]
    met = statistics.median(saved) >= target
    by_hand = [(h - s) / 1e6 for h, s in zip(peak["hand"], peak["sharded"])]
    print(
        f"  process peak, MultiWorkerMirrored - FullySharded: {_mid(saved)} MB (target >= {target:.1f} MB: "
        f"{'met' if met else 'NOT met'}); torch loop - FullySharded: {_mid(by_hand)} MB"
    )
    return met


def _compare_weights(paths: dict) -> None:
    import torch

    weights = {variant: torch.load(path) for variant, path in paths.items()}
    for variant, reference in (("sharded", "hand"), ("sharded", "mirrored"), ("mirrored", "hand")):
        a, b = weights[variant], weights[reference]
        if sorted(a) != sorted(b):
            print(f"  final weights, {variant} vs {reference}: different parameter names {sorted(a)} / {sorted(b)}")
            continue
        diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
        scale = max(b[k].abs().max().item() for k in b)
        moved = max((b[k].double() - weights["initial"][k].double()).abs().max().item() for k in b)
        print(
            f"  final weights, {LABELS[variant]} vs {LABELS[reference]}: largest |difference| {diff:.2e} "
            f"(largest |weight| {scale:.2e}, largest change in training {moved:.2e})"
        )


def report(args, workers: int, rounds: dict, memory: dict, weights: dict) -> dict:
    parameters, unit = _size(args.width, args.blocks)
    p_bytes, unit_bytes = 4 * parameters, 4 * unit
    state = 4 * p_bytes  # parameters, gradients, Adam's two slots
    target = (0.7 * state * (1 - 1 / workers) - unit_bytes) / 1e6
    sizes = _split(args.batch, workers)
    print()
    print(
        f"{workers} workers x 1 thread, gloo on 127.0.0.1; {args.blocks} blocks x + tanh(Linear({args.width}, "
        f"{args.width})(x)), head Linear({args.width}, {CLASSES}): {parameters:,} parameters ({p_bytes / 1e6:.1f} MB); "
        f"Adam; global batch {args.batch} ({'/'.join(map(str, sizes))} rows per worker); {args.rounds} round(s) x "
        f"{args.steps} timed steps after {args.warmup} warm-up"
    )
    print(
        f"1. memory per worker, MB (the largest worker's). Target: FullySharded's process peak below "
        f"MultiWorkerMirrored's by >= 0.7 x {state / 1e6:.1f} MB (parameters + gradients + slots) x (1 - 1/{workers}) "
        f"- {unit_bytes / 1e6:.1f} MB (one unit) = {target:.1f} MB"
    )
    setting = " ".join(f"{k}={v}" for k, v in FIXED_MMAP.items())
    met_memory = _memory(
        memory, target, f"  a. {setting} (the peak of live memory), one run of {sum(MEMORY_STEPS)} steps per variant:"
    )
    inherited = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    allocator = inherited or "glibc's defaults"
    met_default = _memory(rounds, target, f"  b. {allocator} (the timed runs; median over rounds [min - max]):")
    # 2. step time: per round the slower worker's median step
    print("2. step time, ms (the slower worker's median step; median over rounds [min - max]):")
    step = {v: [max(w["step"] for w in run) * 1e3 for run in rounds[v]] for v in VARIANTS}
    for variant in VARIANTS:
        print(f"  {LABELS[variant]:<27} {_mid(step[variant])}")
    vs_hand = [s / h for s, h in zip(step["sharded"], step["hand"])]
    vs_mirrored = [s / m for s, m in zip(step["sharded"], step["mirrored"])]
    met_time = statistics.median(vs_hand) <= 1.10
    print(
        f"  ratio ours / hand per round: {', '.join(f'{r:.3f}' for r in vs_hand)}; median {_mid(vs_hand)} "
        f"(target <= 1.10: {'met' if met_time else 'NOT met'})"
    )
    per_round = ", ".join(f"{r:.3f}" for r in vs_mirrored)
    print(f"  ratio ours / MultiWorkerMirrored per round: {per_round}; median {_mid(vs_mirrored)}")
    # 3. collectives per step, rank 0 of the first round
    print(f"3. collectives per step (rank 0, first round, over {args.count_steps} step(s) after the timed ones):")
    for variant in ("hand", "sharded", "mirrored"):
        census = rounds[variant][0][0]["census"]
        calls = census["calls"]
        total_count = sum(v[0] for v in calls.values())
        total_mb = sum(v[1] for v in calls.values()) / 1e6
        print(f"  {LABELS[variant]}: {total_count:g} calls, {total_mb:.2f} MB")
        for key, (count, size) in calls.items():
            print(f"    {key:<40} {count:6g} {size / 1e6:10.2f} MB")
        ops = ", ".join(f"{k} {v:g}" for k, v in census["ops"].items())
        print(f"    at the dispatcher: {sum(census['ops'].values()):g} c10d ops ({ops})")
    print("check: the weights after the same steps from the same initial values (the first round, worker 0):")
    _compare_weights(weights)
    return {"memory": met_memory, f"memory ({allocator})": met_default, "step time": met_time}


def _initial_weights(args, path: str) -> None:
    import torch

    torch.save({k: v.detach().clone() for k, v in make_model(args.width, args.blocks).state_dict().items()}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,3", help="worker counts, comma-separated (default 2,3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--count-steps", type=int, default=2, help="steps after the timed ones, collectives counted")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--width", type=int, default=1000, help="each block's Linear(width, width)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 workers, 1 round, 1 + 2 + 1 steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run's workers are ended")
    parser.add_argument("--collective-timeout", type=float, default=120.0, help="seconds a collective may wait")
    parser.add_argument("--_worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--_save", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        rank, workers, port, variant, outdir = args._worker
        args.num_workers = int(workers)
        worker(int(rank), int(port), variant, args, outdir)
        return
    if args.quick:
        args.workers, args.rounds, args.warmup, args.steps, args.count_steps = "2", 1, 1, 2, 1
    counts = [int(w) for w in args.workers.split(",")]
    if min(counts) < 2:
        parser.error("--workers: every count must be at least 2 (one worker shards nothing)")
    if min(args.warmup, args.steps, args.count_steps, args.rounds) < 1:
        parser.error("--warmup, --steps, --count-steps and --rounds must be at least 1")
    if args.batch < max(counts):
        parser.error("--batch must give every worker a row")
    start = time.perf_counter()
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())} ({os.cpu_count()} CPUs)")
    outdir = tempfile.mkdtemp(prefix="rf-bench-fsdp-")
    met = {}
    try:
        weights = {"initial": os.path.join(outdir, "initial.pt")}
        _initial_weights(args, weights["initial"])
        for workers in counts:
            rounds: dict = {v: [] for v in VARIANTS}
            for number in range(args.rounds):
                for variant in VARIANTS if number % 2 == 0 else VARIANTS[::-1]:
                    save = os.path.join(outdir, f"{variant}-{workers}.pt") if number == 0 else None
                    rounds[variant].append(launch(args, workers, variant, outdir, save=save))
                    if save:
                        weights[variant] = save
            memory = {v: [launch(args, workers, v, outdir, memory=True)] for v in VARIANTS}
            met[workers] = report(args, workers, rounds, memory, weights)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    print()
    for workers, verdicts in met.items():
        verdict = ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in verdicts.items())
        print(f"targets, {workers} workers: {verdict}")
    print(
        f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
        f"{time.perf_counter() - start:.1f} s in all"
    )


if __name__ == "__main__":
    main()
