"""A fit that torchrun's elastic agents run (test_torchrun_elastic.py): ``python elastic_worker.py OUTDIR``.

MultiWorkerMirrored over whatever cluster torchrun describes, a backup per epoch that saves before preemption
(the agent's SIGTERM when a node joins) and on a peer's failure, each step a little slower than its compute
(so that the test's faults land mid-epoch). Each start appends ``start RANK WORLD_SIZE EPOCH STEP`` to
``OUTDIR/starts.txt`` (where the fit resumed), each step ``step RANK WORLD_SIZE ITERATION`` to
``OUTDIR/steps.txt``, its pid to ``OUTDIR/pids/<its agent's pid>``; the chief writes the final weights to
``OUTDIR/final.pt``.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer, callbacks

ROWS, BATCH, EPOCHS = 96, 8, 5
STEP_SECONDS = 0.15


class Trace(callbacks.Callback):
    def __init__(self, outdir):
        super().__init__()
        self.outdir = outdir

    def _write(self, name, line):
        with open(os.path.join(self.outdir, name), "a") as file:
            file.write(line + "\n")

    def on_train_begin(self, logs=None):
        os.makedirs(os.path.join(self.outdir, "pids"), exist_ok=True)  # (a node's loss ends its agent and workers)
        with open(os.path.join(self.outdir, "pids", str(os.getppid())), "a") as file:
            file.write(f"{os.getpid()}\n")
        cluster = self.trainer.strategy.cluster
        iterations = int(self.trainer.optimizer.iterations)
        self._write("starts.txt", f"start {cluster.worker_index} {cluster.num_workers} {iterations} {time.time():.2f}")

    def on_train_batch_end(self, batch, logs=None):
        cluster = self.trainer.strategy.cluster
        iterations = int(self.trainer.optimizer.iterations)
        self._write("steps.txt", f"step {cluster.worker_index} {cluster.num_workers} {iterations} {time.time():.2f}")
        time.sleep(STEP_SECONDS)


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 6, generator=generator)
    y = (x[:, :2].sum(dim=1) > 0).long() + (x[:, 2] > 0.5).long()
    return x, y


def main(outdir, timeout=10.0, elastic=True):
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=timeout))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.05, momentum=0.9), loss="cross_entropy", seed=11)
    cbs = [callbacks.BackupAndRestore(os.path.join(outdir, "backup"), save_before_preemption=elastic)]
    if elastic:
        cbs.append(Trace(outdir))
    trainer.fit(model, data(), epochs=EPOCHS, batch_size=BATCH, callbacks=cbs, verbose=0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.write_on_chief("final weights", lambda: torch.save(state, os.path.join(outdir, "final.pt")))


if __name__ == "__main__":
    main(sys.argv[1], elastic=sys.argv[2:] != ["--straight"])
