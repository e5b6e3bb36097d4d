"""What torchmetrics metrics add to a step of ``fit``, where the logs are read at every step.

Two worker processes on gloo (``MultiWorkerMirroredStrategy``, one replica each) or one process with
``MirroredStrategy`` over two logical CPUs fit the same MLP (32 -> 64 -> 10, global batch 64, 200 steps) with
a callback that reads the logs at every step (as a progress bar does). Across workers every worker then
reads the metrics at every step. The variants:

  A. ``metrics=["accuracy"]`` (the trainer's own, ``SyncOnRead`` accumulators);
  B. A + ``MulticlassF1Score`` (sum states: ``SyncOnRead`` variables, read in the logs' one batched reduction);
  C. A + ``MulticlassAUROC`` without thresholds (``cat`` states: gathered at every read, growing with the
     epoch: the median step is at mid-epoch);
  D. A + ``MulticlassAUROC(thresholds=200)`` (fixed-size sum states, as B).

Each variant runs in every round (the order rotated), the step time is the median of the steps after the
first 20, and the script prints the per-variant medians over the rounds with their ranges, and each one's
ratio to A.

Run: python benchmarks/bench_torch_metrics.py [--rounds 3] [--mode workers|mirrored]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

VARIANTS = ("A accuracy", "B + F1 (sum states)", "C + AUROC (cat states)", "D + AUROC(thresholds=200)")


def _metrics(variant: str):
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    extra = {
        VARIANTS[0]: [],
        VARIANTS[1]: [MulticlassF1Score(num_classes=10)],
        VARIANTS[2]: [MulticlassAUROC(num_classes=10)],
        VARIANTS[3]: [MulticlassAUROC(num_classes=10, thresholds=200)],
    }[variant]
    return ["accuracy", *extra]


def _step_times(strategy, variant: str) -> float:
    import torch

    from replicafit import optimizers
    from replicafit.trainer import LambdaCallback, Trainer

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 200, 32, generator=generator)
    y = torch.randint(0, 10, (64 * 200,), generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    trainer = Trainer(
        strategy=strategy, optimizer=optimizers.SGD(0.01), loss="cross_entropy", metrics=_metrics(variant)
    )
    stamps = []
    reader = LambdaCallback(on_train_batch_end=lambda batch, logs: stamps.append(time.perf_counter()))
    trainer.fit(model, (x, y), batch_size=64, epochs=1, verbose=0, callbacks=[reader])
    return statistics.median(b - a for a, b in zip(stamps[20:], stamps[21:]))


def rounds_in_workers(rank, num_workers, port, rounds):
    """In each worker process: every variant, every round (the order rotated)."""
    import torch

    import replicafit.strategies as ds

    torch.set_num_threads(1)
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=60), resolver)
    return _rounds(lambda: strategy, rounds)


def _rounds(make_strategy, rounds) -> dict:
    times = {variant: [] for variant in VARIANTS}
    for index in range(rounds):
        order = VARIANTS[index % len(VARIANTS) :] + VARIANTS[: index % len(VARIANTS)]
        for variant in order:
            times[variant].append(_step_times(make_strategy(), variant))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("workers", "mirrored"), default="workers")
    args = parser.parse_args()
    if args.mode == "workers":
        from multiworker_harness import results, run_workers

        outcomes = results(run_workers(__file__, "rounds_in_workers", 2, timeout=1800, kwargs={"rounds": args.rounds}))
        # a step's time is the slower worker's
        times = {v: [max(w[v][i] for w in outcomes) for i in range(args.rounds)] for v in VARIANTS}
    else:
        import torch

        import replicafit.strategies as ds

        torch.set_num_threads(1)
        times = _rounds(lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]), args.rounds)
    base = statistics.median(times[VARIANTS[0]])
    print(f"{args.mode}: the logs read at every step; ms per step, median over {args.rounds} rounds [range]")
    for variant in VARIANTS:
        values = times[variant]
        median = statistics.median(values)
        print(
            f"  {variant:28s} {median * 1e3:7.2f} [{min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}]"
            f"   ratio to A {median / base:.2f}   added {(median - base) * 1e3:+.2f} ms"
        )


if __name__ == "__main__":
    main()
