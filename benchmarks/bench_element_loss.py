"""The cost of an element-level loss: the exact mean over the real tokens of the global batch.

The workload: a token tagger (embeddings of 64, a linear layer, 50 classes) on sequences of 32
tokens, 4,096 sequences, SGD with momentum, 4 epochs; the figure is the steps per second over
epochs 2-4. Rows, each printed as ours, the reference and their ratio (median and range over paired
repeats, every measurement in a fresh interpreter, the order reversed every repeat):

- element / loop: ``fit`` with ``nn.CrossEntropyLoss(ignore_index=-100)`` on padded labels (the
  element-level path: each replica's count of real tokens rides with the gradient reduction, the
  optimizer divides by the global count) against a hand-written torch loop doing the same work
  (step time ratio, default strategy).
- element / per_example: the same ``fit`` against ``fit`` with a per-example loss
  (``SparseCategoricalCrossentropy()`` on the same outputs and labels without padding): the
  element-level path's own cost (step time ratio).
- element_mirrored / per_example_mirrored: the same pair under ``MirroredStrategy(["cpu:0", "cpu:1"])``.

Run: python benchmarks/bench_element_loss.py [--repeats 5] [--batches 64 8]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from bench_fit import EpochClock  # this folder is on the path when a benchmark runs

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer, losses

VOCAB, CLASSES, LENGTH, ROWS, EPOCHS = 1000, 50, 32, 4096, 4


def make_data(padded: bool):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels = torch.randint(0, CLASSES, (ROWS, LENGTH), generator=generator)
    if padded:
        lengths = torch.randint(4, LENGTH + 1, (ROWS,), generator=generator)
        labels[torch.arange(LENGTH) >= lengths[:, None]] = -100
    return ids, labels


class Tagger(torch.nn.Module):
    def __init__(self, classes_last: bool):
        super().__init__()
        torch.manual_seed(0)
        self.classes_last = classes_last
        self.embed = torch.nn.Embedding(VOCAB, 64)
        self.out = torch.nn.Linear(64, CLASSES)

    def forward(self, ids):
        scores = self.out(torch.tanh(self.embed(ids)))
        return scores if self.classes_last else scores.transpose(1, 2)


def hand_loop(batch: int) -> list[float]:
    ids, labels = make_data(padded=True)
    model = Tagger(classes_last=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    times = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        total, count = torch.zeros(()), torch.zeros((), dtype=torch.int64)
        for begin in range(0, ROWS, batch):
            xb, yb = ids[begin : begin + batch], labels[begin : begin + batch]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb, ignore_index=-100)
            loss.backward()
            optimizer.step()
            real = (yb != -100).sum()
            total += loss.detach() * real
            count += real
        float(total / count)
        times.append(time.perf_counter() - start)
    return times


def fit(batch: int, element: bool, strategy=None) -> list[float]:
    clock = EpochClock()
    if element:
        model, loss = Tagger(classes_last=False), torch.nn.CrossEntropyLoss(ignore_index=-100)
    else:
        model, loss = Tagger(classes_last=True), losses.SparseCategoricalCrossentropy()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), loss=loss, metrics=(), seed=0)
    data = make_data(padded=element)
    trainer.fit(model, data, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[clock])
    return clock.times


def _mirrored():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"])


VARIANTS = {
    "loop": hand_loop,
    "element": lambda b: fit(b, True),
    "per_example": lambda b: fit(b, False),
    "element_mirrored": lambda b: fit(b, True, _mirrored()),
    "per_example_mirrored": lambda b: fit(b, False, _mirrored()),
}
ROWS_TO_PRINT = [("element", "loop"), ("element", "per_example"), ("element_mirrored", "per_example_mirrored")]


def child(variant: str, batch: int) -> None:
    torch.set_num_threads(1)
    gc.collect()
    times = VARIANTS[variant](batch)
    steps = -(-ROWS // batch)
    print(steps * (len(times) - 1) / sum(times[1:]))


def measure(variant: str, batch: int) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--batches", str(batch)]
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    return float(done.stdout.strip().split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batches[0])
        return
    print(f"{ROWS} sequences of {LENGTH} tokens, steps/s over epochs 2-{EPOCHS}, {args.repeats} paired repeats")
    for batch in args.batches:
        for ours, reference in ROWS_TO_PRINT:
            ratios, a_rates, b_rates = [], [], []
            for repeat in range(args.repeats):
                pair = (ours, reference) if repeat % 2 == 0 else (reference, ours)
                rates = {name: measure(name, batch) for name in pair}
                a_rates.append(rates[ours])
                b_rates.append(rates[reference])
                ratios.append(rates[reference] / rates[ours])  # step time: ours / reference
            print(
                f"batch {batch:>3} {ours:>16} vs {reference:<20}: {statistics.median(a_rates):7.0f} vs "
                f"{statistics.median(b_rates):7.0f} steps/s; step time ratio {statistics.median(ratios):.3f} "
                f"(range {min(ratios):.3f}-{max(ratios):.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
