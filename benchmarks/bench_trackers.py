"""What an experiment tracker adds to a fit's wall time when its store is healthy, unreachable or hung.

One process per case (a fresh interpreter: mlflow's import and store set-up are counted, as a user pays them),
each timing only ``trainer.fit`` of an MLP (8,192 rows of 64 features, 64-512-2, batch 64, ``--epochs`` epochs, the
default strategy) with, as its only tracker:

* ``none``: no tracker (the reference);
* ``sqlite``: ``MLflowLogger`` with its default store, a SQLite file in a fresh run directory (created on first use);
* ``closed port``: ``MLflowLogger("http://127.0.0.1:<a closed port>")``: nothing listens;
* ``hung server``: a local socket that accepts connections and never answers (MLflow's client would wait and retry
  for minutes): what is left is bounded by ``flush_timeout`` (10 s by default);
* ``wandb offline``: ``WandbLogger`` in offline mode.

Targets: an unreachable server adds a few seconds at most (it is found with one quick connection, off the training
thread); a hung one adds ``flush_timeout`` at most; no case stops the fit. The script prints the median fit time of
each case over the rounds and its difference from ``none``.

A fit shorter than the tracker's start (importing mlflow, creating a SQLite store: seconds) waits for it at its end;
``--epochs 0`` shows that floor, the default a fit of a few seconds.

Run: ``python benchmarks/bench_trackers.py [--rounds 3] [--epochs 10]`` (needs mlflow and wandb; no network).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading

CASES = ("none", "sqlite", "closed port", "hung server", "wandb offline")

CHILD = """
import sys, time, warnings
import torch
from replicafit.trainer import MLflowLogger, Trainer, WandbLogger

case, uri, run_dir, EPOCHS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
x = torch.randn(8192, 64)
y = (x[:, :8].sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2))
callbacks = {
    "none": [],
    "sqlite": [MLflowLogger(run_dir=run_dir)],
    "closed port": [MLflowLogger(uri, run_dir=run_dir)],
    "hung server": [MLflowLogger(uri, run_dir=run_dir)],
    "wandb offline": [WandbLogger(run_dir=run_dir, mode="offline")],
}[case]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.perf_counter()
    trainer = Trainer(optimizer="adam", seed=0)
    history = trainer.fit(model, (x, y), batch_size=64, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    elapsed = time.perf_counter() - start
assert len(history.history["loss"]) == EPOCHS
ours = [str(w.message) for w in caught if "Logger:" in str(w.message)]
print(f"{elapsed:.3f}\\t{len(ours)}")
"""


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hung_server() -> tuple:
    """A listening socket whose accepted connections are held open and never answered."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, held


def run(case: str, uri: str, epochs: int) -> tuple:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, case, uri, os.path.join(folder, "run"), str(epochs)],
            capture_output=True,
            text=True,
            env=env,
            cwd=folder,
            timeout=300,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{case}: {done.stderr[-2000:]}")
    seconds, warned = done.stdout.strip().splitlines()[-1].split("\t")
    return float(seconds), int(warned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    server, _ = hung_server()
    uris = {
        "closed port": f"http://127.0.0.1:{closed_port()}",
        "hung server": f"http://127.0.0.1:{server.getsockname()[1]}",
    }
    times = {case: [] for case in CASES}
    warnings = {}
    for _ in range(args.rounds):
        for case in CASES:  # interleaved, so that a busy machine weighs on every case alike
            seconds, warnings[case] = run(case, uris.get(case, "-"), args.epochs)
            times[case].append(seconds)
    server.close()
    reference = statistics.median(times["none"])
    print(f"{'case':<15}{'fit (s)':>10}{'added (s)':>12}{'warnings':>10}")
    for case in CASES:
        median = statistics.median(times[case])
        print(f"{case:<15}{median:>10.2f}{median - reference:>12.2f}{warnings[case]:>10}")


if __name__ == "__main__":
    main()
