"""Synchronized BatchNorm: the shipped ``digits_cnn`` recipe (``batch_norm: true``, ``sync_batchnorm: true``)
under Mirrored(2) and on 2 worker processes takes the steps of plain BatchNorm on one device.

A BatchNorm layer normalizes with the mean and variance of its batch. Under a strategy each replica
sees only its share of the global batch, so plain ``nn.BatchNorm2d`` normalizes with the statistics
of 32 rows instead of 64 (TensorFlow's default, kept). ``nn.SyncBatchNorm`` (here from the recipe's
``sync_batchnorm: true``; in Python ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``) normalizes with
the statistics of the whole global batch, across replicas and workers. The script trains two epochs
four ways from the same initial weights, without dropout (its masks are drawn per replica), and
prints how far each run's weights and running statistics end from one device's:

    one device, plain BatchNorm           (the reference)
    Mirrored(2), SyncBatchNorm            rounding apart
    2 workers, SyncBatchNorm              rounding apart
    Mirrored(2), plain BatchNorm          per-replica statistics: visibly apart

Run: python examples/digits_cnn_sync_batchnorm.py
"""

import os
import sys
import tempfile

import torch

import replicafit.strategies as ds
from replicafit import recipes
from replicafit.cli.launch import launch_local

SETTINGS = ["fit.epochs=2", "model.dropout=0"]


def train(*overrides: str) -> tuple:
    """The recipe's run with ``overrides``: its final state, its history and whether this is the chief."""
    run = recipes.build(recipes.load(recipes.locate("digits_cnn"), overrides=SETTINGS + list(overrides)))
    history = run.trainer.fit(run.model, run.train, verbose=0, **run.fit_kwargs)
    state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    return state, history.history, run.strategy.cluster.is_chief


def distance(state: dict, reference: dict) -> float:
    return max((state[k].double() - reference[k].double()).abs().max().item() for k in reference)


def worker(out_path: str) -> None:
    """One of the 2 workers: the recipe under MultiWorkerMirroredStrategy; the chief saves the result."""
    state, history, chief = train("strategy=multi_worker_mirrored")
    if chief:
        torch.save({"state": state, "history": history}, out_path)


def main() -> None:
    if ds.TorchrunClusterResolver.detected():  # started by launch_local below: one worker
        worker(sys.argv[1])
        return
    reference, reference_history, _ = train("strategy=one_device", "model.sync_batchnorm=false")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "workers.pt")
        status = launch_local([sys.executable, os.path.abspath(__file__), out], num_workers=2)
        if status:
            sys.exit(status)
        workers = torch.load(out, weights_only=True)
    runs = {
        "Mirrored(2), SyncBatchNorm": train()[:2],
        "2 workers, SyncBatchNorm": (workers["state"], workers["history"]),
        "Mirrored(2), plain BatchNorm": train("model.sync_batchnorm=false")[:2],
    }
    print(f"{'one device, plain BatchNorm':30s} loss per epoch {[round(v, 6) for v in reference_history['loss']]}")
    for name, (state, history) in runs.items():
        losses = [round(v, 6) for v in history["loss"]]
        print(f"{name:30s} loss per epoch {losses}, max |weights - one device's| {distance(state, reference):.1e}")
    for name in ("Mirrored(2), SyncBatchNorm", "2 workers, SyncBatchNorm"):
        assert distance(runs[name][0], reference) < 1e-4, name
    assert distance(runs["Mirrored(2), plain BatchNorm"][0], reference) > 1e-3


if __name__ == "__main__":
    main()
