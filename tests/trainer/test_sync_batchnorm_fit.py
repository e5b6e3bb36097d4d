"""``fit`` with ``nn.SyncBatchNorm`` under every strategy equals plain BatchNorm on one device on the same
global batches: weights, running statistics, the history and ``evaluate`` (the exact global-batch promise)."""

from __future__ import annotations

import mw_fit_scenarios as scenarios
import pytest
import torch
from conftest import make_strategy
from multiworker_harness import results, run_workers

import replicafit.strategies as ds

pytestmark = pytest.mark.timeout(120)


def _close(got: dict, expected: dict, what: str) -> None:
    for key, value in expected["state"].items():
        torch.testing.assert_close(got["state"][key].to("cpu"), value, rtol=0, atol=1e-5, msg=f"{what}: {key}")
    for key, values in expected["history"].items():
        assert got["history"][key] == pytest.approx(values, abs=1e-5), f"{what}: {key}"
    assert got["evaluate"] == pytest.approx(expected["evaluate"], abs=1e-5), what


@pytest.fixture(scope="module")
def one_device():
    strategy = ds.OneDeviceStrategy("cpu")
    return {kind: scenarios.fit_sync_batch_norm(strategy, kind, sync=False) for kind in ("mlp", "cnn")}


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("strategy", ["mirrored2", "mirrored3", "central_storage2", "one_device"])
def test_sync_batchnorm_under_a_strategy_equals_plain_batchnorm_on_one_device(one_device, kind, strategy):
    """Mirrored(3) splits 32 rows 11/11/10 and the last batch of 4 rows 2/2/0 (an empty replica)."""
    got = scenarios.fit_sync_batch_norm(make_strategy(strategy), kind)
    _close(got, one_device[kind], strategy)


def test_plain_batchnorm_under_mirrored_keeps_per_replica_statistics(one_device):
    got = scenarios.fit_sync_batch_norm(make_strategy("mirrored2"), "mlp", sync=False)
    difference = (got["state"]["1.running_mean"] - one_device["mlp"]["state"]["1.running_mean"]).abs().max()
    assert difference > 1e-3  # each replica normalized with its own slice (TensorFlow's default)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_sync_batchnorm_on_two_workers_equals_plain_batchnorm_on_one_device(one_device, kind):
    workers = results(run_workers(scenarios.__file__, "sync_batch_norm", 2, timeout=90, kwargs={"kind": kind}))
    for worker, got in enumerate(workers):
        _close(got, one_device[kind], f"worker {worker}")
        for key, value in workers[0]["state"].items():
            assert torch.equal(got["state"][key], value), f"worker {worker}: {key}"  # identical on every worker
