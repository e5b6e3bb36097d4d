"""A worker under ``torchrun --nproc-per-node 2 --max-restarts 1`` (test_torchrun_restart.py): joins the cluster
through ``MultiWorkerMirroredStrategy``'s torchrun resolver and sums a value over the workers 20 times; in the
first attempt worker 1 kills itself (SIGKILL) at the sixth sum, so torchrun restarts both workers."""

from __future__ import annotations

import os
import signal
import sys

import torch

import replicafit.strategies as ds

resolver = ds.TorchrunClusterResolver()
strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=20), resolver)
for step in range(20):
    total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(())), axis=None)
    assert float(total) == 2.0, float(total)
    if resolver.attempt == 0 and resolver.worker_index == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"worker {resolver.worker_index} attempt {resolver.attempt} done", flush=True)
sys.exit(0)
