"""``nn.SyncBatchNorm`` on the GPU: two worker processes sharing it (gloo) take the steps of plain BatchNorm
on one device; logical GPUs of one GPU are refused with the fix (their backward passes share one thread)."""

from __future__ import annotations

import mw_gpu_scenarios as scenarios
import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    GPU_TYPE,
    assert_close_weights,
    cuda_determinism,  # noqa: F401 - autouse
    cuda_only,
    logical_gpus,
)
from multiworker_harness import results, run_workers

import replicafit.strategies as ds

pytestmark = GPU_TESTS

ENV = scenarios.WORKER_ENV


@pytest.mark.timeout(180)
def test_sync_batchnorm_on_two_workers_sharing_the_gpu_equals_plain_batchnorm_on_one_device():
    workers = results(run_workers(scenarios.__file__, "sync_batch_norm", 2, timeout=150, env=ENV))
    expected = scenarios.batch_norm_fit(ds.OneDeviceStrategy(GPU), sync=False)
    for index, got in enumerate(workers):
        assert got["device"].startswith(GPU_TYPE)
        assert_close_weights(got["weights"], expected["weights"], what=f"worker {index}")
        for key, values in expected["history"].items():
            assert got["history"][key] == pytest.approx(values, abs=1e-5), key


def test_sync_batchnorm_with_one_replica_on_the_gpu_is_plain_batchnorm():
    got = scenarios.batch_norm_fit(ds.OneDeviceStrategy(GPU))
    expected = scenarios.batch_norm_fit(ds.OneDeviceStrategy(GPU), sync=False)
    assert_close_weights(got["weights"], expected["weights"], rtol=0, atol=0)


@cuda_only
@pytest.mark.timeout(60)
def test_sync_batchnorm_on_logical_gpus_of_one_gpu_is_refused_with_the_fix():
    with logical_gpus(2) as devices:
        with pytest.raises(RuntimeError, match="share cuda:0.*one replica per GPU"):
            scenarios.batch_norm_fit(ds.MirroredStrategy(devices))
    assert torch.cuda.is_available()
