"""Per-replica random streams on the GPU: seeded fits with dropout are bit-identical, another seed
differs, taking turns equals threads, and a resumed run draws on where it stopped."""

from __future__ import annotations

import pytest
import torch
from conftest import InterruptAt
from gpu_support import (
    GPU,
    GPU_TESTS,
    assert_same_weights,
    cuda_determinism,  # noqa: F401 - autouse
    digits,
    logical_gpus,
    mlp,
    weights,
)

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Trainer


def _fit(strategy, seed, callbacks=(), epochs=2):
    model = mlp(dropout=0.3)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), seed=seed)
    trainer.fit(model, digits(256), batch_size=32, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return weights(model)


pytestmark = GPU_TESTS


def test_two_seeded_fits_with_dropout_are_bit_identical_on_the_gpu_and_another_seed_differs():
    first = _fit(ds.OneDeviceStrategy(GPU), seed=3)
    assert_same_weights(_fit(ds.OneDeviceStrategy(GPU), seed=3), first)
    other = _fit(ds.OneDeviceStrategy(GPU), seed=4)
    assert not all(torch.equal(other[k], first[k]) for k in first)


def test_replicas_on_logical_gpus_draw_alike_taking_turns_and_on_threads():
    with logical_gpus(2) as devices:
        turns = _fit(ds.MirroredStrategy(devices), seed=3)
        again = _fit(ds.MirroredStrategy(devices), seed=3)
        previous = ds.get_replica_execution()
        ds.set_replica_execution("threads")
        try:
            threads = _fit(ds.MirroredStrategy(devices), seed=3)
        finally:
            ds.set_replica_execution(previous)
    assert_same_weights(again, turns, "a second run")
    assert_same_weights(threads, turns, "threads")


@pytest.mark.timeout(120)
def test_a_run_resumed_from_its_backup_draws_on_where_it_stopped(tmp_path):
    """Interrupted at step 11 and resumed from its backup: the GPU streams continue exactly."""
    straight = _fit(ds.OneDeviceStrategy(GPU), seed=3, epochs=3)
    backup = BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        _fit(ds.OneDeviceStrategy(GPU), seed=3, epochs=3, callbacks=[backup, InterruptAt(11)])
    resumed = _fit(
        ds.OneDeviceStrategy(GPU), seed=3, epochs=3, callbacks=[BackupAndRestore(str(tmp_path / "backup"), save_freq=1)]
    )
    assert_same_weights(resumed, straight, "resumed")
