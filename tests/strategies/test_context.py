"""Contexts and the context stack, as TensorFlow 2.21 behaves (get_strategy, get_replica_context, scopes)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds

DEFAULT = ds.get_strategy()


def _snapshot():
    """The five context queries at this point, as a dict."""
    return {
        "replica_context": ds.get_replica_context(),
        "in_cross": ds.in_cross_replica_context(),
        "strategy": ds.get_strategy(),
        "has_strategy": ds.has_strategy(),
        "cross_ctx": ds.get_cross_replica_context(),
    }


def _assert_default_context():
    snap = _snapshot()
    ctx = snap["replica_context"]
    assert isinstance(ctx, ds.ReplicaContext)
    assert type(ctx.replica_id_in_sync_group) is int
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert ctx.strategy is DEFAULT
    assert snap["in_cross"] is False
    assert snap["strategy"] is DEFAULT
    assert snap["has_strategy"] is False
    assert snap["cross_ctx"] is None


def _is_default(strategy) -> bool:
    return strategy is DEFAULT


# --- the contexts table -----------------------------------------------------------------


def test_default_context():
    _assert_default_context()
    assert DEFAULT.num_replicas_in_sync == 1
    assert ds.get_strategy() is ds.get_strategy()  # one default strategy


def test_default_replica_context_is_the_same_object_every_time():
    assert ds.get_replica_context() is ds.get_replica_context()


def test_inside_scope(strategy):
    with strategy.scope() as entered:
        assert entered is strategy
        snap = _snapshot()
        assert snap["strategy"] is strategy
        assert snap["has_strategy"] is (not _is_default(strategy))
        if not _is_default(strategy):
            assert snap["replica_context"] is None
            assert snap["in_cross"] is True
            assert snap["cross_ctx"] is strategy
    _assert_default_context()


def test_inside_run(strategy):
    seen = {}
    lock = threading.Lock()

    def fn():
        snap = _snapshot()
        ctx = snap["replica_context"]
        with lock:
            seen[ctx.replica_id_in_sync_group] = snap

    strategy.run(fn)
    n = strategy.num_replicas_in_sync
    assert sorted(seen) == list(range(n))
    for rid, snap in seen.items():
        ctx = snap["replica_context"]
        assert isinstance(ctx, ds.ReplicaContext)
        assert type(ctx.replica_id_in_sync_group) is int
        assert ctx.replica_id_in_sync_group == rid
        assert ctx.num_replicas_in_sync == n
        assert ctx.strategy is strategy
        assert tuple(ctx.devices) == (strategy.extended.worker_devices[rid],)
        assert snap["in_cross"] is False
        assert snap["strategy"] is strategy
        assert snap["has_strategy"] is (not _is_default(strategy))
        assert snap["cross_ctx"] is None
    _assert_default_context()


def test_replica_contexts_are_distinct_per_replica(multi_strategy):
    contexts = multi_strategy.run(lambda: ds.get_replica_context())
    values = multi_strategy.experimental_local_results(contexts)
    assert len({id(c) for c in values}) == multi_strategy.num_replicas_in_sync
    assert [c.replica_id_in_sync_group for c in values] == [0, 1]


def test_inside_merge_fn(strategy):
    seen = []

    def merge_fn(st):
        seen.append((st, _snapshot()))
        return "ok"

    out = strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn))
    assert len(seen) == 1
    st, snap = seen[0]
    assert st is strategy
    assert snap["replica_context"] is None
    assert snap["in_cross"] is True
    assert snap["strategy"] is strategy
    assert snap["has_strategy"] is (not _is_default(strategy))
    assert snap["cross_ctx"] is strategy
    assert out == "ok"
    _assert_default_context()


def test_default_strategy_merge_call():
    """Reference case 47 (testMergeCall)."""
    seen = []

    def merge_fn(dist, s):
        seen.append(_snapshot())
        assert dist is DEFAULT
        return s + "_bar"

    assert ds.get_replica_context().merge_call(merge_fn, args=("foo",)) == "foo_bar"
    assert len(seen) == 1
    snap = seen[0]
    assert snap["strategy"] is DEFAULT
    assert snap["replica_context"] is None
    assert snap["in_cross"] is True
    assert snap["has_strategy"] is False
    assert snap["cross_ctx"] is DEFAULT
    _assert_default_context()


def test_default_strategy_merge_call_kwargs():
    out = ds.get_replica_context().merge_call(lambda dist, a, b=0: (dist, a, b), args=(1,), kwargs={"b": 2})
    assert out == (DEFAULT, 1, 2)


def test_fresh_thread_starts_in_default_context(multi_strategy):
    seen = []
    with multi_strategy.scope():
        thread = threading.Thread(target=lambda: seen.append((ds.get_strategy(), ds.has_strategy())))
        thread.start()
        thread.join(5)
    assert seen == [(DEFAULT, False)]


# --- nesting rules ----------------------------------------------------------------------


def test_same_strategy_scope_nesting(strategy):
    """Reference case 46."""
    with strategy.scope():
        with strategy.scope():
            assert ds.get_strategy() is strategy
            with ds.get_strategy().scope():
                assert ds.get_strategy() is strategy
            assert ds.get_strategy() is strategy
        assert ds.get_strategy() is strategy
        if not _is_default(strategy):
            assert ds.in_cross_replica_context()
    _assert_default_context()


@pytest.mark.parametrize("outer", ["one_device", "mirrored2", "central_storage2"])
@pytest.mark.parametrize("inner", ["one_device", "mirrored2", "central_storage2"])
def test_mixing_different_strategies_raises(outer, inner):
    s1, s2 = make_strategy(outer), make_strategy(inner)
    with s1.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            with s2.scope():
                pass
        # the failed entry left the outer scope intact
        assert ds.get_strategy() is s1
        assert ds.in_cross_replica_context()
    _assert_default_context()


def test_mixing_two_strategies_of_the_same_class_raises():
    s1, s2 = make_strategy("mirrored2"), make_strategy("mirrored2")
    with s1.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            with s2.scope():
                pass
    _assert_default_context()


def test_default_scope_inside_another_raises(strategy):
    if _is_default(strategy):
        pytest.skip("the default strategy's own scope nests in itself")
    with strategy.scope():
        with pytest.raises(RuntimeError, match="Must not nest"):
            with DEFAULT.scope():
                pass
        assert ds.get_strategy() is strategy
    _assert_default_context()


def test_run_of_other_strategy_inside_scope_raises():
    s1, s2 = make_strategy("mirrored2"), make_strategy("one_device")
    with s1.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            s2.run(lambda: 1)
        assert ds.get_strategy() is s1
    _assert_default_context()


def test_run_of_other_strategy_inside_run_raises():
    s1, s2 = make_strategy("mirrored2"), make_strategy("mirrored2")

    def fn():
        s2.run(lambda: 1)

    with pytest.raises(RuntimeError, match="Mixing different"):
        s1.run(fn)
    _assert_default_context()


@pytest.mark.parametrize("name", ["one_device", "mirrored2", "central_storage2"])
@pytest.mark.parametrize("action", ["scope", "run", "reduce", "reduce_to", "batch_reduce_to"])
def test_cross_replica_methods_inside_replica_raise(name, action):
    strategy = make_strategy(name)

    def fn():
        if action == "scope":
            with strategy.scope():
                pass
        elif action == "run":
            strategy.run(lambda: 1)
        elif action == "reduce":
            strategy.reduce("SUM", torch.tensor(1.0), axis=None)
        elif action == "reduce_to":
            strategy.extended.reduce_to("MEAN", torch.tensor(1.0), "cpu:0")
        else:
            strategy.extended.batch_reduce_to("MEAN", [(torch.tensor(1.0), "cpu:0")])
        return "no error"

    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(fn)
    _assert_default_context()


@pytest.mark.parametrize("name", ["one_device", "mirrored2", "central_storage2"])
def test_gather_inside_replica_raises(name):
    strategy = make_strategy(name)

    def fn():
        return strategy.gather(torch.zeros(2), axis=0)

    with pytest.raises(RuntimeError, match="cross-replica context.*all_gather"):
        strategy.run(fn)
    _assert_default_context()


# --- experimental_set_strategy ---------------------------------------------------------


def test_experimental_set_strategy_sets_and_clears(strategy):
    try:
        ds.experimental_set_strategy(strategy)
        assert ds.get_strategy() is strategy
        assert ds.has_strategy() is (not _is_default(strategy))
        if not _is_default(strategy):
            assert ds.in_cross_replica_context() is True
            assert ds.get_replica_context() is None
            v = ds.Variable(1.0)
            assert v.distribute_strategy is strategy
            # run under the set strategy works and gives back the set strategy afterwards
            out = strategy.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
            assert strategy.experimental_local_results(out) == tuple(range(strategy.num_replicas_in_sync))
            assert ds.get_strategy() is strategy
            # its own scope may be entered on top
            with strategy.scope():
                assert ds.get_strategy() is strategy
            assert ds.get_strategy() is strategy
    finally:
        ds.experimental_set_strategy(None)
    _assert_default_context()


def test_experimental_set_strategy_replaces_a_set_strategy():
    s1, s2 = make_strategy("mirrored2"), make_strategy("one_device")
    try:
        ds.experimental_set_strategy(s1)
        ds.experimental_set_strategy(s2)
        assert ds.get_strategy() is s2
        ds.experimental_set_strategy(None)
        _assert_default_context()
    finally:
        ds.experimental_set_strategy(None)


def test_experimental_set_strategy_then_other_scope_raises():
    s1, s2 = make_strategy("mirrored2"), make_strategy("one_device")
    try:
        ds.experimental_set_strategy(s1)
        with pytest.raises(RuntimeError, match="Mixing different"):
            with s2.scope():
                pass
        assert ds.get_strategy() is s1
    finally:
        ds.experimental_set_strategy(None)
    _assert_default_context()


@pytest.mark.parametrize("target", ["none", "same", "other"])
def test_experimental_set_strategy_inside_scope_raises(target):
    strategy = make_strategy("mirrored2")
    arg = {"none": None, "same": strategy, "other": make_strategy("one_device")}[target]
    with strategy.scope():
        with pytest.raises(RuntimeError, match="Must not be called inside"):
            ds.experimental_set_strategy(arg)
        assert ds.get_strategy() is strategy
        assert ds.in_cross_replica_context()
    _assert_default_context()


def test_experimental_set_strategy_inside_replica_raises(multi_strategy):
    def fn():
        ds.experimental_set_strategy(None)

    with pytest.raises(RuntimeError, match="Must not be called inside"):
        multi_strategy.run(fn)
    _assert_default_context()


# --- the stack is restored after exceptions ---------------------------------------------


class _Boom(Exception):
    pass


def test_scope_restored_after_exception(strategy):
    with pytest.raises(_Boom):
        with strategy.scope():
            with strategy.scope():
                raise _Boom()
    _assert_default_context()


def test_run_restores_context_after_replica_exception(strategy):
    def fn():
        raise _Boom("from every replica")

    with pytest.raises(_Boom):
        strategy.run(fn)
    _assert_default_context()
    # the replica threads are clean too: the next run sees the right contexts
    out = strategy.run(lambda: (ds.get_replica_context().replica_id_in_sync_group, ds.in_cross_replica_context()))
    ids, cross = out
    assert strategy.experimental_local_results(ids) == tuple(range(strategy.num_replicas_in_sync))
    assert strategy.experimental_local_results(cross) == (False,)


def test_merge_fn_exception_restores_context(strategy):
    def merge_fn(st):
        raise _Boom()

    with strategy.scope():
        with pytest.raises(_Boom):
            strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn))
        assert ds.get_strategy() is strategy
        if not _is_default(strategy):
            assert ds.in_cross_replica_context()
            assert ds.get_replica_context() is None
    _assert_default_context()

    def check():
        return (ds.in_cross_replica_context(), ds.get_replica_context().replica_id_in_sync_group)

    cross, ids = strategy.run(check)
    assert strategy.experimental_local_results(cross) == (False,)
    assert strategy.experimental_local_results(ids) == tuple(range(strategy.num_replicas_in_sync))


def test_default_merge_call_exception_restores_context():
    def merge_fn(dist):
        raise _Boom()

    with pytest.raises(_Boom):
        ds.get_replica_context().merge_call(merge_fn)
    _assert_default_context()


def test_exception_in_scope_of_set_strategy_keeps_the_set_strategy():
    strategy = make_strategy("mirrored2")
    try:
        ds.experimental_set_strategy(strategy)
        with pytest.raises(_Boom):
            with strategy.scope():
                raise _Boom()
        assert ds.get_strategy() is strategy
    finally:
        ds.experimental_set_strategy(None)
    _assert_default_context()


def test_captured_replica_context_merge_call_outside_raises(strategy):
    if _is_default(strategy):
        pytest.skip("outside any scope the default replica context is current again")
    ctx = strategy.run(lambda: ds.get_replica_context())
    ctx0 = strategy.experimental_local_results(ctx)[0]
    with pytest.raises(RuntimeError):
        ctx0.merge_call(lambda st: None)
    with strategy.scope(), pytest.raises(RuntimeError, match="call_for_each_replica"):
        ctx0.merge_call(lambda st: None)
    _assert_default_context()


def test_captured_replica_context_merge_call_inside_merge_fn_raises(multi_strategy):
    def fn():
        ctx = ds.get_replica_context()
        return ctx.merge_call(lambda st: ctx.merge_call(lambda st2: None))

    with pytest.raises(RuntimeError, match="call_for_each_replica"):
        multi_strategy.run(fn)
    _assert_default_context()
