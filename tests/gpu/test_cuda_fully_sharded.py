"""``FullyShardedStrategy`` on CUDA: one worker on the GPU equals the default strategy; with two GPUs, two workers
over NCCL equal one process on the same global batches, gather bfloat16 under ``bf16-mixed``, and each holds
less GPU memory than a ``MultiWorkerMirroredStrategy`` worker; two workers sharing one GPU over gloo are refused
with a message (fully_shard's collectives on CUDA tensors are NCCL's)."""

from __future__ import annotations

import fsdp_gpu_scenarios as scenarios
import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    HAVE_CUDA,
    assert_close_weights,
    cuda_determinism,  # noqa: F401 - autouse
    cuda_only,
)
from multiworker_harness import results, run_workers

import replicafit.strategies as ds

pytestmark = GPU_TESTS

SCENARIOS = scenarios.__file__
ENV = scenarios.WORKER_ENV

two_gpus = pytest.mark.skipif(
    HAVE_CUDA and torch.cuda.device_count() < 2,
    reason="needs two GPUs: NCCL gives each worker a GPU of its own (a dry run checks the logic on the CPU)",
)


def test_one_worker_on_the_gpu_equals_the_default_strategy():
    strategy = ds.FullyShardedStrategy(cluster_resolver=ds.SimpleClusterResolver(1, 0, devices=[GPU]))
    got = scenarios.fit_run(strategy)
    expected = scenarios.fit_run(ds.OneDeviceStrategy(GPU))
    assert_close_weights(got["weights"], expected["weights"], rtol=0, atol=0)


@two_gpus
@pytest.mark.timeout(240)
def test_two_workers_over_nccl_equal_one_process_and_hold_less_memory():
    sharded = results(run_workers(SCENARIOS, "fit", 2, timeout=200, env=ENV, kwargs={"width": 512}))
    mirrored = results(run_workers(SCENARIOS, "fit", 2, timeout=200, env=ENV, kwargs={"width": 512, "kind": "mw"}))
    expected = scenarios.fit_run(ds.OneDeviceStrategy(GPU), width=512)
    for index, got in enumerate(sharded):
        assert_close_weights(got["weights"], expected["weights"], what=f"worker {index}")
        if HAVE_CUDA:  # 4 blocks of 512x512 with AdamW: each worker holds about half the state
            assert got["peak"] < mirrored[index]["peak"], (got["peak"], mirrored[index]["peak"])


@two_gpus
@pytest.mark.timeout(240)
def test_bf16_mixed_gathers_bfloat16_over_nccl():
    for got in results(run_workers(SCENARIOS, "fit", 2, timeout=200, env=ENV, kwargs={"precision": "bf16-mixed"})):
        assert got["forward"] == ["torch.bfloat16"]
        assert all(v.dtype == torch.float32 for v in got["weights"].values() if v.is_floating_point())
        assert all(torch.isfinite(torch.tensor(loss)) for loss in got["history"]["loss"])


@cuda_only
@pytest.mark.timeout(120)
def test_two_workers_sharing_one_gpu_over_gloo_are_refused():
    for message in results(run_workers(SCENARIOS, "refused_on_a_shared_gpu", 2, timeout=90, env=ENV)):
        assert message is not None and "NCCL" in message and "MultiWorkerMirroredStrategy" in message
