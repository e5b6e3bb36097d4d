"""``MultiWorkerMirroredStrategy`` on CUDA: one worker (and NCCL's collectives at world size one),
and two worker processes sharing the one GPU over gloo (``CommunicationImplementation.RING``), equal
to ``MirroredStrategy`` over two logical GPUs in one process."""

from __future__ import annotations

import mw_gpu_scenarios as scenarios
import pytest
import torch
from gpu_support import (
    GPU,
    GPU_TESTS,
    GPU_TYPE,
    HAVE_CUDA,
    assert_close_weights,
    cuda_determinism,  # noqa: F401 - autouse
    cuda_only,
    logical_gpus,
)
from multiworker_harness import results, run_workers

import replicafit.strategies as ds

pytestmark = GPU_TESTS

SCENARIOS = scenarios.__file__
ENV = scenarios.WORKER_ENV


def test_one_worker_on_the_gpu_equals_mirrored_on_it():
    strategy = ds.MultiWorkerMirroredStrategy(cluster_resolver=ds.SimpleClusterResolver(1, 0, devices=[GPU]))
    assert strategy.extended.worker_devices == (GPU,)
    got = scenarios.fit_run(strategy)
    expected = scenarios.fit_run(ds.MirroredStrategy([GPU]))
    assert got["device"].startswith(GPU_TYPE)
    assert_close_weights(got["weights"], expected["weights"], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(150)
def test_objects_with_gpu_tensors_arrive_on_each_workers_own_device():
    """An object collective's GPU tensors travel through the host and land on the receiver's device (the
    workers' device here: both share the GPU), its host tensors stay on the host."""
    outcomes = results(run_workers(SCENARIOS, "gpu_objects", 2, timeout=120, env=ENV))
    for got in outcomes:
        assert got["host_objects"] == HAVE_CUDA
        for worker, (rank, state, device, host) in enumerate(got["gathered"]):
            assert rank == worker and torch.equal(state, torch.full((3,), float(worker)))
            assert device.startswith(GPU_TYPE) and host == "cpu"
        rank, state, device = got["broadcast"]
        assert rank == 0 and torch.equal(state, torch.zeros(3)) and device.startswith(GPU_TYPE)
        assert got["onto_host"] == "cpu"


@cuda_only
@pytest.mark.timeout(150)
def test_nccl_collectives_on_cuda_tensors():
    (got,) = results(run_workers(SCENARIOS, "nccl_collectives", 1, timeout=120, env=ENV))
    assert got["backend"] == "nccl"
    assert torch.equal(got["sum"][0], torch.arange(5.0)) and torch.equal(got["sum"][1], torch.ones(3))
    assert got["gathered_device"].startswith("cuda") and torch.equal(got["gathered"][0], torch.zeros(2, 2))
    assert torch.equal(got["broadcast"], torch.full((4,), 7.0))
    assert got["ints"] == [1]


@pytest.mark.timeout(180)
def test_two_workers_share_the_gpu_over_gloo_and_equal_mirrored_over_two_logical_gpus():
    workers = results(run_workers(SCENARIOS, "fit", 2, timeout=150, env=ENV))
    with logical_gpus(2) as devices:
        expected = scenarios.fit_run(ds.MirroredStrategy(devices))
    for index, got in enumerate(workers):
        assert got["backend"] == "gloo" and got["device"].startswith(GPU_TYPE)
        assert_close_weights(got["weights"], expected["weights"], what=f"worker {index}")
        for key, values in expected["history"].items():
            assert got["history"][key] == pytest.approx(values, rel=1e-4, abs=1e-6), key


@cuda_only
@pytest.mark.timeout(150)
def test_two_workers_on_one_gpu_over_nccl_are_told_to_use_ring():
    for message in results(run_workers(SCENARIOS, "nccl_on_one_gpu", 2, timeout=120, env=ENV)):
        assert message is not None and "same GPU" in message and "RING" in message


@pytest.mark.timeout(240)
def test_preemption_on_two_workers_sharing_the_gpu_stops_both_at_one_step_and_resumes(tmp_path):
    """The flags' total lives on the GPU: it is read one step late (no host wait per step); both workers
    still stop after the same step, and the rerun equals the uninterrupted run."""
    workers = results(run_workers(SCENARIOS, "preempted", 2, timeout=210, env=ENV, kwargs={"outdir": str(tmp_path)}))
    # Flagged after step 5, carried by step 6: read at once where the total is on the host (the dry run on the
    # CPU), one step late where it is on the GPU.
    assert workers[0]["stop"] == workers[1]["stop"]
    assert workers[0]["stop"] in (((0, 6), (0, 7)) if HAVE_CUDA else ((0, 6),))
    for index, got in enumerate(workers):
        assert_close_weights(got["resumed"]["weights"], got["reference"]["weights"], what=f"worker {index}")
        assert got["resumed"]["history"] == got["reference"]["history"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scatter", [None, True], ids=["all-reduces", "reduce-scatter"])
def test_sharded_optimizer_states_on_the_gpu_equal_the_unsharded_run(scatter):
    workers = results(run_workers(SCENARIOS, "sharded_fit", 2, timeout=150, env=ENV, kwargs={"scatter": scatter}))
    for index, got in enumerate(workers):
        assert got[True]["device"].startswith(GPU_TYPE)
        assert_close_weights(got[True]["weights"], got[False]["weights"], rtol=1e-6, atol=1e-7, what=f"worker {index}")
