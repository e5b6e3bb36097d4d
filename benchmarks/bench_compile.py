"""What ``torch.compile`` costs and gains on CPU under ``Trainer.fit``: a small GPT-2 trained on its own loss.

Variants, each in a fresh interpreter (dynamo's caches live in the process) with a fresh inductor cache directory
(inductor also caches compiled graphs on disk, which would make every run after the first look cheap):

- ``eager``: the model as it is;
- ``inductor``: ``torch.compile(model)`` (inductor's C++ code for the CPU; needs a C++ compiler);
- ``aot_eager``: ``torch.compile(model, backend="aot_eager")`` (dynamo's graphs and AOTAutograd, no code
  generation: what the tests use).

Figures per variant: the first step (from ``fit``'s call to the end of its first step: the first-batch checks'
probe and the first training step, so every compile a fit's start triggers) and the median step time over the
steps after ``--warmup`` (later recompiles, for the partial last batch say, fall outside it). Printed with each
compiled variant's ratio to eager (below 1: faster). The model: GPT-2 of ``--layers`` layers, width
``--width``, 4 heads, vocabulary 512, sequences of ``--length``, batches of ``--batch``; SGD, no dropout;
``--strategy mirrored2`` runs it under ``MirroredStrategy(["cpu:0", "cpu:1"])`` (each replica an
``OptimizedModule``; the replicas share dynamo's graphs).

Run: python benchmarks/bench_compile.py [--variants eager inductor aot_eager] [--layers 2] [--width 128]
     [--length 64] [--batch 16] [--steps 40] [--warmup 10] [--strategy default|mirrored2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("eager", "inductor", "aot_eager")


def child(args) -> dict:
    """One variant's fit in this process: ``{"first": seconds, "step": median seconds}``."""
    import torch
    import transformers

    import replicafit.strategies as ds
    from replicafit import optimizers
    from replicafit.trainer import Callback, Trainer

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers,
        n_head=4,
        n_embd=args.width,
        vocab_size=512,
        n_positions=args.length,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config.loss_type = "ForCausalLM"  # named: no warning (a logging call, which breaks dynamo's graphs)
    model = transformers.GPT2LMHeadModel(config)
    if args.variant != "eager":
        model = torch.compile(model, **({} if args.variant == "inductor" else {"backend": args.variant}))
    rows = args.batch * args.steps
    ids = torch.randint(0, 512, (rows, args.length), generator=torch.Generator().manual_seed(1))
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"]) if args.strategy == "mirrored2" else ds.get_strategy()

    class Clock(Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    clock = Clock()
    trainer = Trainer(strategy, optimizers.SGD(0.01), loss=None, metrics=[], seed=0)
    start = time.perf_counter()
    data = {"input_ids": ids, "labels": ids}
    trainer.fit(model, data, batch_size=args.batch, shuffle=False, verbose=0, callbacks=[clock])
    steps = [b - a for a, b in zip(clock.ends[args.warmup :], clock.ends[args.warmup + 1 :])]
    return {"first": clock.ends[0] - start, "step": statistics.median(steps)}


def run(variant: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant]
    for name in ("layers", "width", "length", "batch", "steps", "warmup", "strategy", "threads"):
        command += [f"--{name}", str(getattr(args, name))]
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)  # cold: nothing compiled before
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--strategy", default="default", choices=("default", "mirrored2"))
    parser.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.variant = args.child
        print(json.dumps(child(args)))
        return
    print(
        f"GPT-2 {args.layers} layers, width {args.width}, sequences {args.length}, batch {args.batch}, "
        f"{args.steps} steps, {args.strategy}, {args.threads} threads"
    )
    figures = {variant: run(variant, args) for variant in ["eager"] + [v for v in args.variants if v != "eager"]}
    eager = figures["eager"]
    print(f"{'variant':<10} {'first step s':>13} {'step ms':>9} {'step / eager':>13} {'first / eager':>14}")
    for variant, got in figures.items():
        print(
            f"{variant:<10} {got['first']:>13.2f} {got['step'] * 1e3:>9.2f} {got['step'] / eager['step']:>13.2f} "
            f"{got['first'] / eager['first']:>14.1f}"
        )
    compiled = [v for v in figures if v != "eager"]
    for variant in compiled:  # when the compile pays for itself: its extra first-step time over the saving per step
        saving = eager["step"] - figures[variant]["step"]
        extra = figures[variant]["first"] - eager["first"]
        verdict = f"after {extra / saving:.0f} steps" if saving > 0 else "never (no faster per step)"
        print(f"{variant}: the compile pays for itself {verdict}")


if __name__ == "__main__":
    main()
