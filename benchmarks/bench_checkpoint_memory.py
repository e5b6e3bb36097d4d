"""What saving a checkpoint adds to each worker's peak memory, per strategy and format.

Two gloo workers on 127.0.0.1 (one thread each) train the 9.5M-parameter MLP of ``bench_shard_states.py``
(16-3072-3072-7-4, Adam: 38 MB of parameters, 76 MB of slots) for one epoch of 10 steps, then save once. Each
worker reports, from ``/proc/self/status``: the peak resident memory of training (``VmHWM``), the resident
memory after ``fit``, and, the peak reset (``/proc/self/clear_refs``), the peak during the save. Variants:

* ``mirrored``: ``MultiWorkerMirroredStrategy``, ``trainer.save_checkpoint(file)`` (the chief writes one file);
* ``zero1 file`` / ``zero1 dir``: ``shard_optimizer_states=True``, the file (slots gathered whole on every
  worker) or ``save_checkpoint(dir, sharded=True)`` (every worker writes its chunks, nothing gathered);
* ``fsdp export`` / ``fsdp dir``: ``FullyShardedStrategy`` (each ``Linear`` a unit), the consolidated export
  (``save_checkpoint(file)``: each tensor gathered onto the chief alone) or the sharded directory.

Targets (issue 41): MultiWorkerMirrored's save adds one copy of what it writes (not two); the consolidated export
after a sharded fit raises no worker's peak above what MultiWorkerMirrored training alone reaches.

Run: ``python benchmarks/bench_checkpoint_memory.py [--rounds 3]`` (about a minute a round on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("mirrored", "zero1 file", "zero1 dir", "fsdp export", "fsdp dir")


def _status(field: str) -> float:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(rank, num_workers, port, variant="mirrored", folder=None):
    import torch

    import replicafit.strategies as ds
    from replicafit import optimizers
    from replicafit.trainer import Trainer

    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    options = ds.CommunicationOptions(timeout_seconds=120.0)
    if variant.startswith("fsdp"):
        strategy = ds.FullyShardedStrategy(options, resolver, shard_units=["Linear"])
    else:
        strategy = ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=variant.startswith("zero1"))
    torch.manual_seed(0)
    widths = (16, 3072, 3072, 7, 4)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(640, 16, generator=generator), torch.randint(0, 4, (640,), generator=generator)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-3), loss="cross_entropy", metrics=(), seed=0)
    trainer.fit(model, (x, y), batch_size=64, epochs=1, verbose=0)
    out = {"train": _status("VmHWM"), "after fit": _status("VmRSS")}
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # the peak from here on
    sharded = variant.endswith("dir")
    trainer.save_checkpoint(os.path.join(folder, "ckpt" if sharded else "ckpt.pt"), sharded=sharded)
    out["save"] = _status("VmHWM")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from multiworker_harness import results, run_workers

    runs: dict = {variant: [] for variant in VARIANTS}
    for index in range(args.rounds):
        order = VARIANTS if index % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            with tempfile.TemporaryDirectory() as folder:
                outcome = run_workers(
                    __file__, "worker", 2, timeout=args.timeout, kwargs={"variant": variant, "folder": folder}
                )
                runs[variant].append(results(outcome))
    print("2 workers, gloo; the 9.5M-parameter Adam MLP (38 MB of parameters, 76 MB of slots); MB, median over rounds")
    header = ("variant", "worker", "train peak", "after fit", "save peak", "save adds")
    print("  {:12s} {:>6s} {:>11s} {:>10s} {:>10s} {:>10s}".format(*header))
    for variant in VARIANTS:
        for rank in range(2):
            rows = [run[rank] for run in runs[variant]]
            train, after, save = (statistics.median(r[k] for r in rows) for k in ("train", "after fit", "save"))
            print(f"  {variant:12s} {rank:6d} {train:11.1f} {after:10.1f} {save:10.1f} {save - after:10.1f}")
    mirrored_train = max(statistics.median(run[rank]["train"] for run in runs["mirrored"]) for rank in range(2))
    export = max(statistics.median(run[rank]["save"] for run in runs["fsdp export"]) for rank in range(2))
    verdict = "met" if export <= mirrored_train else "NOT met"
    print(
        f"the consolidated export's peak {export:.1f} MB against MultiWorkerMirrored training's "
        f"{mirrored_train:.1f} MB: {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
