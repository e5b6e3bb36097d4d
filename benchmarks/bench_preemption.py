"""What saving before preemption costs while nothing is preempted: 2 gloo workers, ``Trainer.fit`` with
``BackupAndRestore(save_before_preemption=True)`` against the same fit with ``False``.

The workload: an MLP 32 -> 256 -> 256 -> 10 on synthetic data, 2,048 training rows and 1,024
validation rows in global batches of 64 (32 training and 16 validation steps an epoch), one intra-op
thread per worker, 2 epochs per fit. Both fits run in the same 2 processes, alternately (the order
reversed every other round), ``--rounds`` times. Timed from the chief's callbacks: the training steps
of an epoch (first ``on_train_batch_begin`` to last ``on_train_batch_end``) and its validation
(``on_test_begin`` to ``on_test_end``); per fit, the second epoch's. Prints medians and the ratios
on/off: training steps ride on the gradient reduction (no collective of their own), validation
adds one pipelined 8-byte sum per step.

Run: python benchmarks/bench_preemption.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROWS, VALIDATION, FEATURES, BATCH = 2048, 1024, 32, 64


def worker(outdir: str, rounds: int) -> None:
    import torch

    import replicafit.strategies as ds
    from replicafit import optimizers
    from replicafit.trainer import BackupAndRestore, Callback, Trainer

    torch.set_num_threads(1)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=60))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS + VALIDATION, FEATURES, generator=generator)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 0.5).long()
    train, validation = (x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])

    class Clock(Callback):
        def __init__(self):
            super().__init__()
            self.marks = {}

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.marks["train_begin"] = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.marks["train_end"] = time.perf_counter()

        def on_test_begin(self, logs=None):
            self.marks["val_begin"] = time.perf_counter()

        def on_test_end(self, logs=None):
            self.marks["val_end"] = time.perf_counter()

    def one_fit(save_before_preemption: bool, folder: str) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )  # fmt: skip
        trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-3), loss="cross_entropy", seed=0)
        clock = Clock()
        backup = BackupAndRestore(os.path.join(outdir, folder), save_before_preemption=save_before_preemption)
        trainer.fit(model, train, batch_size=BATCH, epochs=2, validation_data=validation, verbose=0,
                    callbacks=[clock, backup])  # fmt: skip
        marks = clock.marks  # the second epoch's (each epoch overwrites them)
        return {"train": marks["train_end"] - marks["train_begin"], "val": marks["val_end"] - marks["val_begin"]}

    times: dict = {"off": [], "on": []}
    for round_index in range(rounds + 1):  # round 0 warms up
        order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
        for name in order:
            got = one_fit(name == "on", f"backup-{name}")
            if round_index:
                times[name].append(got)
    if strategy.cluster.is_chief:
        with open(os.path.join(outdir, "times.json"), "w") as file:
            json.dump(times, file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        worker(args._worker[0], int(args._worker[1]))
        return 0
    from replicafit.cli.launch import launch_local

    with tempfile.TemporaryDirectory() as outdir:
        command = [sys.executable, os.path.abspath(__file__), "--_worker", outdir, str(args.rounds)]
        status = launch_local(command, 2, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if status:
            return status
        with open(os.path.join(outdir, "times.json")) as file:
            times = json.load(file)
    print(f"save_before_preemption on 2 gloo workers: {args.rounds} rounds, the second epoch of each fit "
          f"({ROWS // BATCH} training steps, {VALIDATION // BATCH} validation steps of {BATCH} rows)")  # fmt: skip
    for part, steps in (("train", ROWS // BATCH), ("val", VALIDATION // BATCH)):
        off = statistics.median(t[part] for t in times["off"])
        on = statistics.median(t[part] for t in times["on"])
        ratios = [b[part] / a[part] for a, b in zip(times["off"], times["on"])]
        print(
            f"  {'training steps' if part == 'train' else 'validation':<15} off {1e3 * off / steps:6.2f} ms/step   "
            f"on {1e3 * on / steps:6.2f} ms/step   on/off {on / off:.3f} (median of per-round ratios "
            f"{statistics.median(ratios):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
