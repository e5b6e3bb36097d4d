"""Train an MLP on the bundled UCI digits with MultiWorkerMirroredStrategy: 2 worker processes.

Run plainly, the script starts itself twice as the workers of a local cluster (``launch_local``,
as ``replicafit fit RECIPE --workers 2`` does); under ``torchrun`` each process is one worker.
Every worker runs the same program: it loads the same data, and ``fit`` gives each worker its
share of every global batch of 64 rows; gradients are summed across the workers at every step.

Run: python examples/multiworker.py
 or: torchrun --nproc-per-node 2 examples/multiworker.py
"""

import os
import sys

import torch

import replicafit.strategies as ds
from replicafit.cli.launch import launch_local
from replicafit.recipes import datasets
from replicafit.trainer import Trainer


def train() -> None:
    # The cluster comes from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    # every worker must build the strategy: that is when they join each other.
    strategy = ds.MultiWorkerMirroredStrategy()
    data = datasets.digits(validation_split=0.2, seed=0)  # the same rows on every worker

    torch.manual_seed(0)  # worker 0's initial weights are copied to the others anyway
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    trainer = Trainer(strategy=strategy, optimizer="adam", loss="cross_entropy", metrics=["accuracy"], seed=0)
    history = trainer.fit(
        model,
        data["train"],
        batch_size=64,  # global: 32 rows per worker and step
        epochs=15,
        validation_data=data["validation"],
        verbose=2,  # one line per epoch, printed by the chief only
    )

    # Logs are global (the same on every worker); only the chief reports.
    if strategy.extended.should_checkpoint:
        best = max(history.history["val_accuracy"])
        print(f"{strategy}: best validation accuracy {best:.4f}")
        assert best >= 0.95, best


def main() -> None:
    if ds.TorchrunClusterResolver.detected():  # started by torchrun or launch_local: one worker
        train()
    else:  # started plainly: run this script as 2 local workers and return their status
        sys.exit(launch_local([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], num_workers=2))


if __name__ == "__main__":
    main()
