"""``fit`` with ``nn.SyncBatchNorm`` under every strategy equals plain BatchNorm on one device on the same
global batches: weights, running statistics, the history and ``evaluate`` (the exact global-batch promise)."""

from __future__ import annotations

import mw_fit_scenarios as scenarios
import pytest
import torch
from conftest import make_strategy
from multiworker_harness import results, run_workers

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer

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


def test_a_worker_without_rows_takes_part_with_zero_rows():
    """98 rows in batches of 32 on 3 workers: the last batch of 2 rows is split 1/1/0. The worker without rows
    takes part in the layers' collectives with zero rows (its statistics count nothing), not with a stand-in row
    (regression: the stand-in of sharded parameters was once used for it, and the statistics counted that row: a
    difference of 1.6 in the weights). The variance of a 2-row batch rounds a little: 2e-5 here on 2 workers too."""
    expected = scenarios.fit_sync_batch_norm(ds.OneDeviceStrategy("cpu"), "mlp", sync=False, rows=98)
    kwargs = {"kind": "mlp", "rows": 98}
    for worker, got in enumerate(
        results(run_workers(scenarios.__file__, "sync_batch_norm", 3, timeout=100, kwargs=kwargs))
    ):
        for key, value in expected["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-4, msg=f"worker {worker}: {key}")
        assert got["history"]["loss"] == pytest.approx(expected["history"]["loss"], abs=1e-5)


def test_sync_batchnorm_under_bf16_mixed_precision_agrees_to_its_resolution():
    """The layer's output is rounded to bfloat16, where last-bit differences of the statistics can flip it:
    the runs agree to bfloat16's resolution (losses within 1e-3), not to float32's."""

    def run(strategy, sync):
        model = scenarios.batch_norm_model("cnn", sync)
        x, y = scenarios.data()
        trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), precision="bf16-mixed")
        return trainer.fit(model, (x[:100], y[:100]), batch_size=32, epochs=2, shuffle=False, verbose=0).history

    expected = run(ds.OneDeviceStrategy("cpu"), sync=False)
    got = run(make_strategy("mirrored2"), sync=True)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-3)
