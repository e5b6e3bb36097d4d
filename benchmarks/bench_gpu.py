"""``Trainer.fit`` on one GPU against a hand-written torch loop and Lightning's ``Trainer.fit``.

Workloads: an MLP (784 -> 1024 -> 1024 -> 10, ReLU) and a small CNN (3x32x32 images: two 3x3
convolutions of 32 and 64 channels with ReLU and pooling, then 4096 -> 10), Adam (lr 1e-3), in
float32 (TF32 off, as the GPU tests run) and in bfloat16 autocast (``precision="bf16-mixed"``;
the loop and Lightning autocast alike), at batch 64, 512 and 4096. The data are random tensors
already on the GPU, the same for every side, read in order (no shuffle).

Each configuration warms every side up for one epoch, then runs ``--rounds`` paired rounds (the
order of the sides rotates every round); a round times one epoch of each side between
``torch.cuda.synchronize()`` calls, from the epoch's start to its end (fit's end-of-epoch read of
the loss included; the loop reads its loss once per epoch too). Printed per configuration: the
loop's step time, the ratios fit/loop and fit/Lightning (median and range over the rounds) and
the peak GPU memory each side allocates beyond the data (``torch.cuda.max_memory_allocated``),
with fit's peak over the loop's.

Run: python benchmarks/bench_gpu.py [--rounds 3] [--models mlp cnn] [--batches 64 512 4096]
                                    [--precisions 32 bf16-mixed] [--markdown report.md]
     python benchmarks/bench_gpu.py --device cpu --batches 64 --rows 2048   (a check of the script)
Without a GPU (and no ``--device cpu``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

SIDES = ("fit", "loop", "lightning")


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(784, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 8 * 8, 10),
    )


def make_data(kind: str, rows: int, device: torch.device):
    generator = torch.Generator(device="cpu").manual_seed(1)
    shape = (rows, 784) if kind == "mlp" else (rows, 3, 32, 32)
    x = torch.randn(shape, generator=generator).to(device)
    y = torch.randint(0, 10, (rows,), generator=generator).to(device)
    return x, y


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, precision: str):
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Runner:
    """One side of a configuration: ``epoch()`` runs one epoch and returns its seconds."""

    def __init__(self, side, kind, precision, batch, data, device):
        self.side, self.kind, self.precision, self.batch, self.device = side, kind, precision, batch, device
        self.x, self.y = data
        self.steps = (len(self.x) + batch - 1) // batch
        getattr(self, f"_build_{side}")()

    # --- the hand-written loop -------------------------------------------------------------------
    def _build_loop(self):
        self.model = make_model(self.kind).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def _epoch_loop(self):
        model, optimizer, batch = self.model, self.optimizer, self.batch
        total = torch.zeros((), device=self.device)
        for begin in range(0, len(self.x), batch):
            xb, yb = self.x[begin : begin + batch], self.y[begin : begin + batch]
            with _autocast(self.device, self.precision):
                losses = F.cross_entropy(model(xb), yb, reduction="none")
            optimizer.zero_grad(set_to_none=True)
            (losses.float().sum() / len(xb)).backward()
            optimizer.step()
            total += losses.detach().float().sum()
        float(total / len(self.x))  # the epoch's mean loss, read once, as fit reads its logs

    # --- replicafit ------------------------------------------------------------------------------
    def _build_fit(self):
        import replicafit.strategies as ds
        from replicafit.trainer import Callback, Trainer

        device = self.device

        class Clock(Callback):
            def on_epoch_begin(self, epoch, logs=None):
                _sync(device)
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                _sync(device)
                self.seconds = time.perf_counter() - self.start

        self.model = make_model(self.kind)
        self.clock = Clock()
        strategy = ds.OneDeviceStrategy(str(device) if device.type != "cpu" else "cpu")
        self.trainer = Trainer(strategy=strategy, optimizer="adam", metrics=[], precision=self.precision, seed=0)

    def _epoch_fit(self):
        self.trainer.fit(
            self.model, (self.x, self.y), batch_size=self.batch, shuffle=False, verbose=0, callbacks=[self.clock]
        )
        return self.clock.seconds

    # --- Lightning -------------------------------------------------------------------------------
    def _build_lightning(self):
        import lightning as L

        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # its banners and tips
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="lightning")

        kind, device = self.kind, self.device

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = make_model(kind)

            def training_step(self, batch, batch_index):
                xb, yb = batch
                return F.cross_entropy(self.net(xb), yb)

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)

        class Clock(L.Callback):
            def on_train_epoch_start(self, trainer, module):
                _sync(device)
                self.start = time.perf_counter()

            def on_train_epoch_end(self, trainer, module):
                _sync(device)
                self.seconds = time.perf_counter() - self.start

        batches = [(self.x[b : b + self.batch], self.y[b : b + self.batch]) for b in range(0, len(self.x), self.batch)]
        self.loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)  # batches already on the GPU
        self.module, self.clock, self.lightning = Module(), Clock(), L

    def _epoch_lightning(self):
        trainer = self.lightning.Trainer(
            accelerator="gpu" if self.device.type == "cuda" else "cpu",
            devices=1,
            max_epochs=1,
            precision="bf16-mixed" if self.precision == "bf16-mixed" else "32-true",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[self.clock],
        )
        trainer.fit(self.module, self.loader)
        return self.clock.seconds

    # --- measuring -------------------------------------------------------------------------------
    def epoch(self) -> float:
        gc.collect()
        _sync(self.device)
        start = time.perf_counter()
        seconds = getattr(self, f"_epoch_{self.side}")()
        _sync(self.device)
        return seconds if seconds is not None else time.perf_counter() - start

    def peak_bytes(self) -> int:
        """What one epoch allocates at its peak beyond what was allocated before it (the data)."""
        if self.device.type != "cuda":
            return 0
        _sync(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.epoch()
        return torch.cuda.max_memory_allocated(self.device) - before


def lightning_available() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def measure(kind, precision, batch, rows, rounds, device, sides) -> dict:
    data = make_data(kind, rows, device)
    runners = {side: Runner(side, kind, precision, batch, data, device) for side in sides}
    peaks = {side: runner.peak_bytes() for side, runner in runners.items()}  # the warm-up epoch
    times = {side: [] for side in sides}
    for r in range(rounds):
        order = list(sides[r % len(sides) :] + sides[: r % len(sides)])
        for side in order:
            times[side].append(runners[side].epoch() / runners[side].steps)
    del runners, data
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"times": times, "peaks": peaks}


def ratio(a: list, b: list) -> tuple:
    values = [x / y for x, y in zip(a, b)]
    return statistics.median(values), min(values), max(values)


def row(kind, precision, batch, result) -> str:
    times, peaks = result["times"], result["peaks"]
    loop_ms = statistics.median(times["loop"]) * 1e3
    fit_loop = "{:.3f} ({:.3f}-{:.3f})".format(*ratio(times["fit"], times["loop"]))
    fit_lightning = (
        "{:.3f} ({:.3f}-{:.3f})".format(*ratio(times["fit"], times["lightning"])) if "lightning" in times else "n/a"
    )
    if peaks["loop"] > 0:
        memory = f"{peaks['fit'] / 2**20:.0f} / {peaks['loop'] / 2**20:.0f} MB = {peaks['fit'] / peaks['loop']:.2f}"
    else:
        memory = "n/a (CPU)"
    label = "fp32" if precision == "32" else "bf16"
    return f"| {kind} | {label} | {batch} | {loop_ms:.3f} | {fit_loop} | {fit_lightning} | {memory} |"


HEADER = (
    "| model | precision | batch | loop ms/step | fit / loop | fit / Lightning | peak memory fit / loop |\n"
    "| --- | --- | --- | --- | --- | --- | --- |"
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--precisions", nargs="+", default=["32", "bf16-mixed"], choices=["32", "bf16-mixed"])
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 512, 4096])
    parser.add_argument(
        "--rows", type=int, default=None, help="examples per epoch (default: 32 steps, at least 16,384)"
    )
    parser.add_argument(
        "--device", default=None, help="cuda (default when there is one) or cpu (a check of the script)"
    )
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--seconds", type=float, default=None, help="start no configuration after this many seconds")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.device is None and not torch.cuda.is_available():
        print(
            "bench_gpu: skipped: no CUDA device here (torch.cuda.is_available() is False); "
            "--device cpu checks the script"
        )
        return 0
    device = torch.device(args.device or "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    sides = SIDES if lightning_available() else SIDES[:2]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"bench_gpu on {name}, torch {torch.__version__}; Adam; {args.rounds} paired rounds"
        + ("" if "lightning" in sides else "; Lightning not installed"),
        "",
        HEADER,
    ]
    print("\n".join(lines), flush=True)
    for kind in args.models:
        for precision in args.precisions:
            for batch in args.batches:
                if args.seconds is not None and time.monotonic() - started > args.seconds:
                    label = "fp32" if precision == "32" else "bf16"
                    lines.append(
                        f"| {kind} | {label} | {batch} | not measured: past the {args.seconds:.0f} s budget |||||"
                    )
                    print(lines[-1], flush=True)
                    continue
                rows = args.rows or max(32 * batch, 16384)
                result = measure(kind, precision, batch, rows, args.rounds, device, sides)
                lines.append(row(kind, precision, batch, result))
                print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
