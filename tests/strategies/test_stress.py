"""Stress: an 8-replica MirroredStrategy over many steps, failures, and thread lifetime."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch

import replicafit.strategies as ds

N = 8
DEVICES = [f"cpu:{i}" for i in range(N)]
MERGE_MISMATCH = "Some replicas made a different number of replica_context().merge_call() calls."


class _Boom(Exception):
    pass


def _merge_fn(strategy, value, step):
    # sum over the replicas, in cross-replica context, once per merge_call
    assert ds.in_cross_replica_context() and ds.get_replica_context() is None
    return strategy.reduce("SUM", value, axis=None) + step


def _step(step):
    ctx = ds.get_replica_context()
    r = ctx.replica_id_in_sync_group
    a = ctx.merge_call(_merge_fn, args=(torch.tensor(float(r)), step))
    b = ctx.merge_call(_merge_fn, args=(a * (r + 1), 0))
    c = ctx.merge_call(lambda st, x: x, args=(torch.tensor([float(r)]),))
    total = ctx.all_reduce("SUM", torch.tensor([float(r + step), 1.0]))
    return r, a, b, c, total


def _expected(step):
    a = N * (N - 1) / 2 + step
    b = a * N * (N + 1) / 2
    return a, b, [N * (N - 1) / 2 + N * step, float(N)]


def _check(strategy, out, step):
    ids, a, b, c, total = out
    a_expected, b_expected, total_expected = _expected(step)
    assert strategy.experimental_local_results(ids) == tuple(range(N))
    for value in strategy.experimental_local_results(a):
        assert float(value) == a_expected
    for value in strategy.experimental_local_results(b):
        assert float(value) == b_expected
    assert isinstance(c, ds.PerReplica)
    assert [float(v) for v in c.values] == [float(r) for r in range(N)]
    assert isinstance(total, ds.PerReplica) and len(total.values) == N
    for value in total.values:
        assert value.tolist() == total_expected


def _settle(seconds=5.0):
    """Collects garbage and waits until threads of strategies from earlier tests are gone."""
    deadline = time.monotonic() + seconds
    gc.collect()
    last, stable_since = _active_count(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - stable_since < 0.2:
        time.sleep(0.02)
        gc.collect()
        if _active_count() != last:
            last, stable_since = _active_count(), time.monotonic()


@pytest.mark.timeout(60)
def test_many_steps_with_merge_calls_and_all_reduce(replica_threads):
    _settle()
    before = set(threading.enumerate())
    strategy = ds.MirroredStrategy(DEVICES)
    assert strategy.num_replicas_in_sync == N
    _check(strategy, strategy.run(_step, args=(0,)), 0)  # warm-up: threads started
    threads_after_warmup = _active_count()
    workers = set(threading.enumerate()) - before
    assert len(workers) >= N - 1
    for step in range(200):
        _check(strategy, strategy.run(_step, args=(step,)), step)
    assert _active_count() == threads_after_warmup
    assert set(threading.enumerate()) - before == workers


@pytest.mark.timeout(60)
def test_many_steps_taking_turns_start_no_thread():
    _settle()
    before = set(threading.enumerate())
    strategy = ds.MirroredStrategy(DEVICES)
    for step in range(200):
        _check(strategy, strategy.run(_step, args=(step,)), step)
    assert {t.name for t in set(threading.enumerate()) - before} <= {"replicafit-stall-monitor"}


def _active_count() -> int:
    """Live threads but the stall monitor (it comes and goes with replicas that take turns)."""
    return sum(1 for t in threading.enumerate() if t.name != "replicafit-stall-monitor")


def _failing_step(plan):
    kind, bad = plan
    ctx = ds.get_replica_context()
    r = ctx.replica_id_in_sync_group
    if kind == "raise_before" and r == bad:
        raise _Boom(f"replica {r} before")
    ctx.merge_call(lambda st: None)
    if kind == "raise_between" and r == bad:
        raise _Boom(f"replica {r} between")
    if kind == "merge_fn":
        ctx.merge_call(lambda st: (_ for _ in ()).throw(_Boom("merge_fn")))
    if kind == "missing_merge" and r == bad:
        return r
    ctx.merge_call(lambda st: None)
    ctx.all_reduce("SUM", torch.tensor(1.0))
    if kind == "extra_merge" and r == bad:
        ctx.merge_call(lambda st: None)  # the others have returned
    return r


@pytest.mark.timeout(60)
def test_random_failures_never_hang_and_strategy_stays_usable():
    strategy = ds.MirroredStrategy(DEVICES)
    rng = random.Random(1234)
    kinds = ["raise_before", "raise_between", "merge_fn", "extra_merge", "missing_merge"]
    strategy.run(_step, args=(0,))
    failures = 0
    for step in range(60):
        if step % 3 == 0:
            _check(strategy, strategy.run(_step, args=(step,)), step)
            continue
        plan = (rng.choice(kinds), rng.randrange(N))
        kind = plan[0]
        start = time.monotonic()
        if kind in ("raise_before", "raise_between", "merge_fn"):
            with pytest.raises(_Boom):
                strategy.run(_failing_step, args=(plan,))
        else:
            with pytest.raises(RuntimeError) as info:
                strategy.run(_failing_step, args=(plan,))
            assert str(info.value) == MERGE_MISMATCH
        failures += 1
        assert time.monotonic() - start < 10
        # the very next step is correct
        _check(strategy, strategy.run(_step, args=(step,)), step)
    assert failures == 40


@pytest.mark.timeout(60)
def test_thread_count_stable_after_failures():
    _settle()
    strategy = ds.MirroredStrategy(DEVICES)
    strategy.run(_step, args=(0,))
    baseline = _active_count()
    for bad in range(N):
        with pytest.raises(_Boom):
            strategy.run(_failing_step, args=(("raise_between", bad),))
        _check(strategy, strategy.run(_step, args=(1,)), 1)
    assert _active_count() == baseline


def _wait_until_gone(threads, seconds=5.0) -> list:
    deadline = time.monotonic() + seconds
    alive = [t for t in threads if t.is_alive()]
    while alive and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
        alive = [t for t in alive if t.is_alive()]
    return alive


@pytest.mark.timeout(60)
def test_replica_threads_exit_when_strategy_is_collected(replica_threads):
    _settle()
    baseline = _active_count()
    before = set(threading.enumerate())
    strategy = ds.MirroredStrategy(DEVICES)
    for step in range(5):
        _check(strategy, strategy.run(_step, args=(step,)), step)
    workers = set(threading.enumerate()) - before
    assert len(workers) >= N - 1  # the replica threads exist
    del strategy
    gc.collect()
    assert _wait_until_gone(workers) == []
    assert _active_count() == baseline


@pytest.mark.timeout(60)
def test_replica_threads_exit_after_nested_runs_and_failures(replica_threads):
    _settle()
    baseline = _active_count()
    before = set(threading.enumerate())
    strategy = ds.MirroredStrategy(DEVICES[:4])

    def nested():
        return ds.get_replica_context().merge_call(lambda st: st.run(lambda: 1))

    def failing():
        if ds.get_replica_context().replica_id_in_sync_group == 2:
            raise _Boom()
        ds.get_replica_context().merge_call(lambda st: None)

    assert strategy.run(nested) == 1
    try:
        strategy.run(failing)
    except _Boom:
        pass
    else:
        raise AssertionError("run did not raise")
    workers = set(threading.enumerate()) - before
    assert len(workers) >= 6  # two crews of three: the nested run needed its own
    del strategy, nested, failing
    gc.collect()
    assert _wait_until_gone(workers) == []
    assert _active_count() == baseline
