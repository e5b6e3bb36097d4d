"""The cluster contract (``strategy.cluster``): trivial in one process, one collective per call
across the processes of a ``MultiWorkerMirroredStrategy``."""

from __future__ import annotations

import mw_scenarios
import pytest
from conftest import make_strategy
from multiworker_harness import results, run_workers

import replicafit.strategies as ds

SCENARIOS = mw_scenarios.__file__


@pytest.mark.parametrize("name", ["default", "one_device", "mirrored2", "central_storage2", "multi_worker1x2"])
def test_one_process_is_a_cluster_of_one(name):
    strategy = make_strategy(name)
    cluster = strategy.cluster
    assert cluster is strategy.extended.cluster is strategy.cluster
    assert (cluster.is_chief, cluster.num_workers, cluster.worker_index) == (True, 1, 0)
    assert cluster.num_local_replicas == len(strategy.extended.worker_devices)
    assert cluster.first_replica_id == 0
    thing = {"a": [1, 2]}
    assert cluster.broadcast(thing) is thing
    assert cluster.all_gather(thing) == [thing]
    assert (cluster.any(1), cluster.any(0), cluster.all(True), cluster.all(None)) == (True, False, True, False)
    assert cluster.sum(5) == 5 and cluster.sum([1, 2]) == [1, 2] and cluster.sum((3,)) == [3]
    assert cluster.start_sum(4)() == 4
    assert cluster.input_channel() is cluster
    cluster.barrier("nothing to wait for")
    assert repr(cluster) == "Cluster(worker 0 of 1)"


def test_sums_refuse_what_is_not_an_int():
    cluster = ds.MirroredStrategy(["cpu:0", "cpu:1"]).cluster
    for bad in (1.5, "3", [1, 2.0], None):
        with pytest.raises(TypeError, match=r"cluster.sum\(\) sums Python ints"):
            cluster.sum(bad)


def test_a_one_worker_multi_worker_strategy_is_a_cluster_of_one():
    strategy = ds.MultiWorkerMirroredStrategy(cluster_resolver=ds.SimpleClusterResolver(1, 0, "127.0.0.1", 1))
    assert type(strategy.cluster) is ds.Cluster and strategy.cluster.num_workers == 1


@pytest.mark.timeout(120)
def test_every_call_across_three_workers():
    workers = results(run_workers(SCENARIOS, "cluster_contract", 3, timeout=90))
    for rank, out in enumerate(workers):
        assert out["facts"] == (rank == 0, 3, rank)
        assert out["replicas"] == (1, rank)
        assert out["broadcast"] == {"from": 0}
        assert out["all_gather"] == [("worker", 0), ("worker", 1), ("worker", 2)]
        assert (out["any_one"], out["all_one"], out["all_every"], out["any_none"]) == (True, False, True, False)
        assert out["sum"] == 1 + 2 + 3 and out["sum_list"] == [3, 0 + 1 + 2]
        assert out["broadcast_while_started"] == 0 and out["start_sum"] == [3, 30]
        assert out["input_all_gather"] == [0, 1, 2]


@pytest.mark.timeout(120)
def test_a_worker_that_never_reaches_the_barrier_is_an_error_naming_it():
    outcomes = run_workers(SCENARIOS, "cluster_contract", 2, timeout=60, grace=1.0, kwargs={"stop_at": 1})
    assert not outcomes[0]["ok"]
    assert "WorkerFailedError" in outcomes[0]["error"] and "end of the contract" in outcomes[0]["error"]
