"""MultiWorkerMirroredStrategy across 2-3 worker processes (gloo over 127.0.0.1), and one worker in-process.

Two workers × one replica must equal ``MirroredStrategy(["cpu:0", "cpu:1"])`` bit for bit (a
two-rank gloo sum adds the same two numbers as the replica-order sum); two workers × two
logical CPUs equal Mirrored(4) within float tolerance.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time

import mw_scenarios
import pytest
import torch
from multiworker_harness import free_port, results, run_workers

import replicafit.strategies as ds

SCENARIOS = mw_scenarios.__file__


def _assert_same(expected: dict, got: dict, exact: bool, what: str) -> None:
    for key, value in expected.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            if exact:
                assert torch.equal(value, other), f"{what}: {key}: {value} != {other}"
            else:
                torch.testing.assert_close(other, value, msg=f"{what}: {key}")
        else:
            assert value == other, f"{what}: {key}: {value!r} != {other!r}"


@pytest.fixture(scope="module")
def two_workers():
    return results(run_workers(SCENARIOS, "basics", 2, timeout=90))


@pytest.mark.timeout(120)
def test_two_workers_equal_mirrored_bit_for_bit(two_workers):
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    for worker, got in enumerate(two_workers):
        _assert_same(expected, got, exact=True, what=f"worker {worker}")


@pytest.mark.timeout(120)
def test_gathers_staged_through_the_host_give_the_same_values():
    """The branch CUDA tensors take on gloo (``CommunicationImplementation.RING``), forced on the CPU."""
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    for worker, got in enumerate(results(run_workers(SCENARIOS, "basics", 2, timeout=90, kwargs={"staged": True}))):
        _assert_same(expected, got, exact=True, what=f"worker {worker}")


@pytest.mark.timeout(120)
def test_two_workers_local_view(two_workers):
    assert [r["local_results"] for r in two_workers] == [1, 1]
    assert [r["should_checkpoint"] for r in two_workers] == [True, False]
    assert two_workers[1]["repr"].startswith("MultiWorkerMirroredStrategy(worker 1 of 2")
    assert two_workers[0]["ids"].tolist() == [0, 1]


@pytest.mark.timeout(120)
def test_two_workers_of_two_logical_cpus_equal_mirrored_four():
    got = results(run_workers(SCENARIOS, "basics", 2, timeout=90, kwargs={"devices": ["cpu:0", "cpu:1"]}))
    ds.set_logical_cpu_count(max(8, ds.get_logical_cpu_count()))
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"]))
    for worker, result in enumerate(got):
        _assert_same(expected, result, exact=False, what=f"worker {worker}")
    assert got[1]["ids"].tolist() == [0, 1, 2, 3]
    assert torch.equal(got[0]["w_after"], got[1]["w_after"])


@pytest.fixture(scope="module")
def three_workers():
    return results(run_workers(SCENARIOS, "basics", 3, timeout=90))


@pytest.mark.timeout(120)
def test_three_workers_are_identical_on_every_worker_and_close_to_mirrored_three(three_workers):
    got = three_workers
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]))
    for worker, result in enumerate(got):
        # Three ranks need not add in replica order (gloo's ring), so only within rounding ...
        _assert_same(expected, result, exact=False, what=f"worker {worker}")
        # ... but every worker always holds the very same values.
        _assert_same({k: got[0][k] for k in expected}, result, exact=True, what=f"worker {worker} vs worker 0")


@pytest.mark.timeout(120)
def test_three_workers_small_sums_add_in_worker_order_as_mirrored_three_does(three_workers):
    """A small sum on gloo is an all-gather and a local sum in worker order, ``(w0 + w1) + w2``: the order
    Mirrored adds its replicas in, so three workers equal Mirrored(3) bit for bit (gloo's ring does not)."""
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]))
    for worker, result in enumerate(three_workers):
        _assert_same(expected, result, exact=True, what=f"worker {worker}")


@pytest.mark.timeout(120)
def test_ring_sums_by_gloo_all_reduce_alike_on_every_worker():
    """``CommunicationImplementation.RING``: gloo's all-reduce at every size; two workers still equal
    Mirrored(2) bit for bit, three are identical on every worker and close to Mirrored(3)."""
    kwargs = {"implementation": "RING"}
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    for worker, got in enumerate(results(run_workers(SCENARIOS, "basics", 2, timeout=90, kwargs=kwargs))):
        _assert_same(expected, got, exact=True, what=f"worker {worker}")
    got = results(run_workers(SCENARIOS, "basics", 3, timeout=90, kwargs=kwargs))
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]))
    for worker, result in enumerate(got):
        _assert_same(expected, result, exact=False, what=f"worker {worker}")
        _assert_same({k: got[0][k] for k in expected}, result, exact=True, what=f"worker {worker} vs worker 0")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_small_sums_gather_and_add_in_worker_order_up_to_the_bound(implementation):
    outcomes = results(run_workers(SCENARIOS, "small_sums", 3, timeout=90, kwargs={"implementation": implementation}))
    for length in (3, 4, 5):
        rows = [torch.randn(length, generator=torch.Generator().manual_seed(7 + rank)) for rank in range(3)]
        in_order = (rows[0] + rows[1]) + rows[2]
        gathers = implementation == "AUTO" and length <= 4
        for worker, out in enumerate(outcomes):
            for way in ("bucket", "flat"):
                key = f"{way} {length}"
                assert out["calls"][key] == ["gather" if gathers else "all_reduce"], (worker, key)
                if gathers:
                    assert torch.equal(out[key], in_order), (worker, key)
                else:
                    torch.testing.assert_close(out[key], in_order)
                assert torch.equal(out[key], outcomes[0][key]), (worker, key)
    for out in outcomes:
        way = ["gather"] if implementation == "AUTO" else ["all_reduce"]
        assert out["calls"]["sum_ints"] == way and out["calls"]["start_sum_ints"] == way
        assert out["sum_ints"] == [0 + 1 + 2, 3] and out["start_sum_ints"] == [1 + 2 + 3, 6]
        assert out["calls"]["requires grad"] == way and out["calls"]["inference mode"] == way
        assert torch.equal(out["requires grad"], torch.full((3,), 6.0)) and out["inference mode"] == [3, 3]
        assert not out["failed"]


def test_a_gathered_sum_waited_by_two_threads_adds_once():
    """The prefetch thread's input sum and ``_drain`` may wait for one sum at once: the rows are added once."""
    import threading

    from replicafit.strategies.collective import _GatheredSum

    class SlowWork:
        def wait(self):
            time.sleep(0.01)
            return True

    for _ in range(20):
        buffer = torch.zeros(4)
        gathered = torch.cat([torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 4.0)])
        pending = _GatheredSum(SlowWork(), gathered, buffer)
        threads = [threading.Thread(target=pending.wait) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert torch.equal(buffer, torch.full((4,), 7.0))


def test_objects_carry_tensors_off_the_host_as_host_copies_for_the_receivers_device():
    """An object's tensors on an accelerator are pickled as host copies, marked, and unpickled onto the
    receiver's device: here float64 tensors stand in for the accelerator's, and "meta" for the receiver's."""
    from replicafit.strategies import collective

    class Marked(collective._HostPickler):
        def _off_host(self, tensor):
            return tensor.dtype == torch.float64

    weights = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    sent = {"grads": [weights, torch.arange(3)], "step": 4, "pair": (weights.detach() * 2, "w")}
    got = collective.from_host_bytes(collective.host_bytes(sent, Marked), "meta")
    assert got["step"] == 4 and got["pair"][1] == "w"
    marked, counts, doubled = got["grads"][0], got["grads"][1], got["pair"][0]
    assert marked.device.type == "meta" and doubled.device.type == "meta"  # on the receiver's device
    assert marked.requires_grad and not doubled.requires_grad and marked.dtype == torch.float64
    assert counts.device.type == "cpu" and torch.equal(counts, torch.arange(3))  # host tensors stay as they are
    parameter = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    (back,) = collective.from_host_bytes(collective.host_bytes([parameter], Marked), "cpu")
    assert isinstance(back, torch.nn.Parameter) and back.requires_grad and torch.equal(back, parameter)
    (meta,) = collective.from_host_bytes(collective.host_bytes([torch.empty(2, device="meta")]), "cpu")
    assert meta.device.type == "meta"  # no data to copy: pickled as it is
    twice = collective.from_host_bytes(collective.host_bytes([weights, {"again": weights}], Marked), "meta")
    assert twice[0] is twice[1]["again"]  # one tensor met twice arrives as one, as plain pickling keeps it
    plain = collective.from_host_bytes(collective.host_bytes(sent, Marked), "cpu")
    assert torch.equal(plain["grads"][0], weights.detach()) and torch.equal(plain["pair"][0], weights.detach() * 2)
    with pytest.raises(pickle.UnpicklingError, match="unknown persistent id"):

        class Other(pickle.Pickler):
            def persistent_id(self, obj):
                return ("something else",) if isinstance(obj, torch.Tensor) else None

        collective.from_host_bytes(collective.host_bytes(sent, Other), "cpu")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host_workers", [(), (0,), (1,)], ids=["accelerators", "chief_on_host", "worker_on_host"])
def test_object_collectives_through_host_bytes_give_every_worker_the_objects(host_workers):
    """The bytes path that workers on accelerators take, forced on the CPU (float64 tensors standing in for
    theirs, marked as they cross): the same objects, worker 0's broadcast kept as its own object; also where
    one worker is on the host and sends its objects as they are (each receiver unpickles what was sent)."""
    outcomes = results(run_workers(SCENARIOS, "host_objects", 2, timeout=60, kwargs={"host_workers": host_workers}))
    for rank, out in enumerate(outcomes):
        gathered = out["gathered"]
        assert [g["rank"] for g in gathered] == [0, 1]
        for worker, part in enumerate(gathered):
            assert torch.equal(part["values"][0], torch.full((2,), float(worker), dtype=torch.float64))
            assert torch.equal(part["values"][1], torch.arange(worker + 1))
            assert part["again"] is part["values"][0]
        assert out["broadcast"]["rank"] == 0 and torch.equal(out["broadcast"]["values"][1], torch.arange(1))
        assert out["kept_own"] == (rank == 0)


@pytest.mark.timeout(120)
def test_module_initial_values_come_from_worker_0():
    states = results(run_workers(SCENARIOS, "module_broadcast", 2, timeout=60))
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).state_dict()
    for worker, state in enumerate(states):
        for key, value in reference.items():
            assert torch.equal(state[key], value), f"worker {worker}: {key}"


@pytest.mark.timeout(120)
def test_first_replica_reads_of_a_state_dict_are_one_broadcast_per_dtype():
    """Nine ONLY_FIRST_REPLICA buffers (three synchronized BatchNorm layers' statistics and step counts)
    read in one state dict: two broadcasts (float32, int64), not one per buffer; every worker gets worker 0's."""
    outcomes = results(run_workers(SCENARIOS, "first_replica_reads", 2, timeout=60))
    for worker, outcome in enumerate(outcomes):
        assert outcome["broadcasts"] == 2, worker
        buffers = {k: v for k, v in outcome["state"].items() if "running" in k or "batches" in k}
        assert len(buffers) == 9 and all(torch.equal(v, torch.ones_like(v)) for v in buffers.values()), worker


@pytest.mark.timeout(120)
def test_different_module_shapes_are_an_error_on_every_worker():
    outcomes = run_workers(SCENARIOS, "module_mismatch", 2, timeout=60)
    for outcome in outcomes:
        assert not outcome["ok"]
        assert "every worker must create the same variables and modules" in outcome["error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sleep", "kill"])
def test_a_stuck_or_killed_worker_is_an_error_on_the_other(mode):
    timeout = 2.0
    outcomes = run_workers(
        SCENARIOS, "stuck_or_killed", 2, timeout=60, grace=1.0, kwargs={"mode": mode, "timeout": timeout}
    )
    survivor = outcomes[0]
    assert survivor["ok"], survivor["error"]
    found = survivor["result"]
    assert found["step"] == 3
    limit = timeout + 1.0 if mode == "sleep" else 1.0
    assert found["waited"] < limit, found
    assert "another worker died or stopped arriving during" in found["message"]
    # one line of ours: what the backend's text means, without its source location and sign-off
    meaning = "no peer answered within the communication timeout" if mode == "sleep" else "connection to a peer closed"
    assert meaning in found["message"], found["message"]
    assert "GLHF" not in found["message"] and ".cc:" not in found["message"] and "\n" not in found["message"]


def test_a_backends_error_reads_as_one_line_of_ours():
    from replicafit.strategies.collective import backend_failure

    gloo = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:39306: Connection "
        "reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the "
        "logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
    )
    assert (
        backend_failure(gloo)
        == "its connection to a peer closed (Read error [127.0.0.1]:39306: Connection reset by peer)"
    )
    refused = RuntimeError("[c10d/TCPStore.cpp:120] Connection refused\nmore lines")
    assert backend_failure(refused) == "a peer refused the connection (Connection refused)"
    assert backend_failure(RuntimeError("NCCL error in: x.cpp:1, unhandled system error. Last error: y")) == (
        "NCCL error in: x.cpp:1, unhandled system error"
    )
    assert backend_failure(RuntimeError("")) == "RuntimeError"


def test_one_worker_in_process_is_mirrored():
    strategy = ds.MultiWorkerMirroredStrategy(cluster_resolver=ds.SimpleClusterResolver(1, 0))
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.should_checkpoint
    expected = mw_scenarios.ops(ds.OneDeviceStrategy("cpu:0"))
    _assert_same(expected, mw_scenarios.ops(strategy), exact=True, what="one worker")


def test_one_worker_with_two_logical_cpus_is_mirrored_two():
    strategy = ds.MultiWorkerMirroredStrategy(
        cluster_resolver=ds.SimpleClusterResolver(1, 0, devices=["cpu:0", "cpu:1"])
    )
    assert strategy.num_replicas_in_sync == 2
    expected = mw_scenarios.ops(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    _assert_same(expected, mw_scenarios.ops(strategy), exact=True, what="one worker, two replicas")


def test_the_environment_decides_without_a_resolver(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    strategy = ds.MultiWorkerMirroredStrategy()
    assert strategy.cluster.num_workers == 1
    assert strategy.extended.worker_devices == ("cpu:0",)


def test_bad_arguments():
    with pytest.raises(ValueError, match="communication_options"):
        ds.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 1})
    with pytest.raises(ValueError, match="cluster_resolver"):
        ds.MultiWorkerMirroredStrategy(cluster_resolver="localhost:1234")
    with pytest.raises(ValueError, match="NCCL needs CUDA"):
        ds.MultiWorkerMirroredStrategy(
            ds.CommunicationOptions(implementation="NCCL"), cluster_resolver=ds.SimpleClusterResolver(1, 0)
        )


def test_worker_failed_error_is_a_runtime_error():
    assert issubclass(ds.WorkerFailedError, RuntimeError)


_EXIT_AFTER_FAILURE = """
import os, sys, torch
import replicafit.strategies as ds
rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
resolver = ds.SimpleClusterResolver(2, rank, "127.0.0.1", port)
strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=10), resolver)
collective = strategy.extended._collective
for step in range(10):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), 9)
    finish = collective.start_sum_ints([1], "the input agreement")  # left pending by the failure below
    try:
        strategy.cluster.any(False)
    except ds.WorkerFailedError as error:  # the error keeps the failed collective's frames alive until exit
        print(error, file=sys.stderr)
        sys.exit(1)
    finish()
"""


@pytest.mark.timeout(60)
def test_a_survivor_exits_with_its_status_not_an_abort_when_collectives_were_pending():
    # torch aborts a process that exits with a started collective not waited for ("terminate called
    # without an active exception", exit -6): the collective drains them after a failure.
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _EXIT_AFTER_FAILURE, str(rank), str(port)], stderr=subprocess.PIPE)
        for rank in range(2)
    ]
    try:
        codes = [p.wait(timeout=45) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [1, -9], (codes, procs[0].stderr.read().decode()[-500:])


def test_the_implementation_chooses_the_backend():
    """gloo for CPU devices, NCCL for CUDA devices; RING asks for gloo on CUDA too (several worker
    processes on one GPU: NCCL refuses two ranks on one device)."""
    from replicafit.strategies.collective import backend_for

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert backend_for(cpu) == backend_for(cpu, "RING") == "gloo"
    assert backend_for(cuda) == backend_for(cuda, "NCCL") == "nccl"
    assert backend_for(cuda, "RING") == "gloo"
    with pytest.raises(ValueError, match="NCCL needs CUDA"):
        backend_for(cpu, "NCCL")
    with pytest.raises(ValueError, match="no collective backend"):
        backend_for(torch.device("meta"))


def test_workers_sharing_a_gpu_over_nccl_are_told_the_fix():
    from replicafit.strategies.multi_worker_mirrored import _check_gpus_not_shared

    _check_gpus_not_shared([("GPU-a",), ("GPU-b",)], ("cuda:0",))  # a GPU each: fine
    _check_gpus_not_shared([(), ()], ("cpu:0",))  # nothing to compare
    with pytest.raises(
        ValueError, match=r"Workers \[0, 2\].*same GPU.*implementation=CommunicationImplementation.RING"
    ):
        _check_gpus_not_shared([("GPU-a",), ("GPU-b",), ("GPU-a",)], ("cuda:0",))
