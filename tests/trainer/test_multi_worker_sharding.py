"""What each worker reads under ``MultiWorkerMirroredStrategy``: only its replicas' rows of every global
batch (map-style ``Dataset``s and ``DataLoader``s over them), its shard (a source with ``shard``), and the
results are one process's with the same replicas (bit for bit with 2 workers, as the other equality tests)."""

from __future__ import annotations

import mw_fit_scenarios as scenarios
import pytest
import torch
from multiworker_harness import results, run_workers

import replicafit.strategies as ds
from replicafit.data import split_sizes

SCENARIOS = scenarios.__file__


def shares(rows: int, batch: int, workers: int) -> list:
    """How many examples each worker's replicas train on in one pass (one replica per worker)."""
    out = [0] * workers
    for begin in range(0, rows, batch):
        for worker, count in enumerate(split_sizes(min(batch, rows - begin), workers)):
            out[worker] += count
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["dataset", "loader"])
def test_two_workers_read_only_their_share_and_equal_mirrored_two(kind):
    workers = results(run_workers(SCENARIOS, "sharded", 2, timeout=150, kwargs={"kind": kind}))
    expected = scenarios.sharded_run(ds.MirroredStrategy(["cpu:0", "cpu:1"]), kind)
    assert expected["reads"] == {"fit": 300, "evaluate": 150, "predict": 150}  # one process: each row once a pass
    share = shares(150, 32, 2)
    for worker, got in enumerate(workers):
        assert got["reads"] == {"fit": 2 * share[worker], "evaluate": share[worker], "predict": share[worker]}
        assert got["history"] == expected["history"], worker
        for key, value in expected["weights"].items():
            assert torch.equal(got["weights"][key], value), (worker, key)
        assert got["evaluate"] == expected["evaluate"], worker
        assert torch.equal(got["predict"], expected["predict"]), worker  # every row once, in order, everywhere


@pytest.mark.timeout(240)
def test_three_workers_with_an_uneven_last_batch_read_their_share():
    """150 rows in batches of 32: 11/11/10 rows per worker, the last batch of 22 as 8/8/6."""
    workers = results(run_workers(SCENARIOS, "sharded", 3, timeout=200, kwargs={"kind": "loader"}))
    expected = scenarios.sharded_run(ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), "loader")
    share = shares(150, 32, 3)
    assert share == [52, 52, 46]
    for worker, got in enumerate(workers):
        assert got["reads"] == {"fit": 2 * share[worker], "evaluate": share[worker], "predict": share[worker]}
        # 3 workers sum in the collective's order, not replica order: equal within rounding
        assert got["history"]["loss"] == pytest.approx(expected["history"]["loss"], rel=1e-5)
        for key, value in expected["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["predict"], expected["predict"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
def test_a_source_with_shards_is_read_once_in_total_and_one_without_warns_once():
    sharded = results(run_workers(SCENARIOS, "file_shards", 2, timeout=150))
    batches = sorted(b for got in sharded for b in got["reads"])
    assert batches == sorted(list(range(12)) * 2)  # 12 batches, each read once per epoch over both workers
    assert all(got["warnings"] == [] for got in sharded)
    whole = results(run_workers(SCENARIOS, "file_shards", 2, timeout=150, kwargs={"shardable": False}))
    for got in whole:
        assert sorted(got["reads"]) == sorted(list(range(12)) * 2)  # every worker reads every batch
        assert len(got["warnings"]) == 1 and "IterableDataset" in got["warnings"][0]


def test_one_process_reads_each_example_once_per_pass_the_first_batch_included():
    """The first batch that fit and evaluate look at is the one they train and evaluate on (regression:
    it was read twice, 2,112 reads for 2,048 rows)."""
    got = scenarios.sharded_run(ds.OneDeviceStrategy("cpu"), "dataset")
    assert got["reads"] == {"fit": 300, "evaluate": 150, "predict": 150}
    got = scenarios.sharded_run(ds.OneDeviceStrategy("cpu"), "loader")
    assert got["reads"] == {"fit": 300, "evaluate": 150, "predict": 150}


@pytest.mark.timeout(240)
def test_a_generator_less_shuffle_stays_one_order_when_the_dataset_draws_as_it_reads():
    """Each worker reads (and draws for) a different number of examples, which moved torch's generator on
    unevenly: the loader's order is agreed at the start of every pass (regression: from the second epoch
    on, rows were trained twice or never)."""
    workers = results(run_workers(SCENARIOS, "rows_per_epoch", 3, timeout=200))
    for epoch in range(3):
        rows = sorted(r for got in workers for r in got[epoch])
        assert rows == list(range(100)), epoch


@pytest.mark.timeout(180)
def test_a_distributed_sampler_loader_is_each_workers_own_and_shuffles_per_epoch():
    workers = results(run_workers(SCENARIOS, "rows_per_epoch", 2, timeout=150, kwargs={"policy": "OFF"}))
    for epoch in range(3):
        assert sorted(r for got in workers for r in got[epoch]) == list(range(100)), epoch
    assert workers[0][0] != workers[0][1]  # set_epoch: another order each epoch


@pytest.mark.timeout(180)
def test_a_problem_in_one_workers_part_of_the_first_batch_is_an_error_on_every_worker():
    workers = results(run_workers(SCENARIOS, "bad_label_on_one_worker", 2, timeout=150))
    assert "out of range" in workers[1]["error"] or "7" in workers[1]["error"]
    assert workers[0]["error"].startswith("Worker 1 found a problem in its part of the first batch of fit()")
    assert workers[0]["reads"] == 16  # each worker read its 16 rows of the first batch, once


@pytest.mark.timeout(180)
def test_uneven_shards_step_together_until_every_worker_is_out():
    workers = results(run_workers(SCENARIOS, "uneven_file_shards", 2, timeout=150))
    assert sorted(workers[0]["reads"] + workers[1]["reads"]) == list(range(11))
    assert workers[0]["steps"] == workers[1]["steps"] == 6  # the sixth step: worker 1's replica empty
    assert workers[0]["loss"] == workers[1]["loss"]
