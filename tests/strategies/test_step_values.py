"""Step values (``step_values.py``): small per-step sums that ride with the step's gradient
reduction, exact, with no collective of their own; against plain sums and a run without them."""

from __future__ import annotations

import mw_scenarios
import pytest
import torch
from conftest import make_strategy
from multiworker_harness import results, run_workers

import replicafit.strategies as ds
from replicafit import optimizers

SCENARIOS = mw_scenarios.__file__
STRATEGIES = ["default", "one_device", "mirrored2", "mirrored3", "central_storage2", "multi_worker1x2"]


def _reduce_grads(strategy, grads_fn, carry=None):
    """One step: each replica adds its values (``carry(ctx)``), then the gradients are reduced."""

    def step():
        ctx = ds.get_replica_context()
        if carry is not None:
            carry(ctx)
        grads = grads_fn(ctx.replica_id_in_sync_group)

        def merge(s, grads):
            reduced = s.extended.batch_reduce_to("SUM", [(grads, s.extended.worker_devices)])[0]
            return reduced.values[0] if isinstance(reduced, ds.DistributedValues) else reduced

        return ctx.merge_call(merge, args=(grads,))

    with strategy.scope():
        return strategy.experimental_local_results(strategy.run(step))[0]


@pytest.mark.parametrize("name", STRATEGIES)
def test_values_ride_with_the_reduction_exactly_and_change_no_gradient(name):
    strategy = make_strategy(name)
    n = strategy.num_replicas_in_sync
    grads = lambda rid: torch.randn(5, generator=torch.Generator().manual_seed(rid))  # noqa: E731

    def carry(ctx):
        rid = ctx.replica_id_in_sync_group
        strategy.cluster.add_to_step("rows", 10 + rid)
        strategy.cluster.add_to_step("rows", 1)  # adds up within a replica
        strategy.cluster.add_to_step("large", 2**35 + rid)  # beyond float32's 2**24: exact still
        strategy.cluster.add_to_step("flag", torch.tensor(rid == n - 1))
        strategy.cluster.add_to_step("tensor", torch.tensor([rid * 1000], dtype=torch.int32))

    plain = _reduce_grads(strategy, grads)
    carried = _reduce_grads(strategy, grads, carry)
    assert torch.equal(plain, carried)
    total = lambda key: int(strategy.cluster.step_total(key))  # noqa: E731
    assert total("rows") == sum(11 + r for r in range(n))
    assert total("large") == sum(2**35 + r for r in range(n))
    assert total("flag") == 1
    assert total("tensor") == 1000 * sum(range(n))
    assert strategy.cluster.step_total("rows").dtype == torch.int64


def test_in_cross_replica_context_the_worker_adds_once():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        strategy.cluster.add_to_step("stop", 1)
        values = strategy.run(lambda: torch.ones(2))
        strategy.extended.batch_reduce_to("SUM", [(values, "cpu:0")])
    assert int(strategy.cluster.step_total("stop")) == 1


@pytest.mark.parametrize("name", ["mirrored2", "central_storage2"])
def test_no_pack_of_their_own_where_the_gradients_are_float32(monkeypatch, name):
    """The limbs join the gradients' float32 pack: as many packs with them as without."""
    from replicafit.strategies import cross_device_ops

    strategy = make_strategy(name)
    packs = []
    original = cross_device_ops._packs

    def counting(*args, **kwargs):
        made = original(*args, **kwargs)
        packs.append(len(made))
        return made

    monkeypatch.setattr(cross_device_ops, "_packs", counting)
    grads = lambda rid: torch.randn(7)  # noqa: E731
    _reduce_grads(strategy, grads)
    plain = sum(packs)
    _reduce_grads(strategy, grads, lambda ctx: strategy.cluster.add_to_step("rows", 4))
    assert sum(packs) - plain == plain == 1


def test_bfloat16_gradients_still_give_exact_totals():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    grads = lambda rid: torch.ones(3, dtype=torch.bfloat16)  # noqa: E731
    _reduce_grads(strategy, grads, lambda ctx: strategy.cluster.add_to_step("rows", 300 + ctx.replica_id_in_sync_group))
    assert int(strategy.cluster.step_total("rows")) == 601


def test_the_optimizers_gradient_reduction_carries_them():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        w = ds.Variable(torch.zeros(3))
        optimizer = optimizers.SGD(0.1)

    def step():
        ctx = ds.get_replica_context()
        strategy.cluster.add_to_step("rows", 2 + ctx.replica_id_in_sync_group)
        optimizer.apply_gradients([(torch.ones(3), w)])

    strategy.run(step)
    assert int(strategy.cluster.step_total("rows")) == 5
    assert torch.allclose(w.read_value(), torch.full((3,), -0.2))


def test_a_total_asked_for_before_any_reduction_is_reduced_then():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        strategy.run(lambda: strategy.cluster.add_to_step("rows", 6))
        assert int(strategy.cluster.step_total("rows")) == 12


def test_bad_values_are_clear_errors():
    cluster = ds.MirroredStrategy(["cpu:0", "cpu:1"]).cluster
    with pytest.raises(ValueError, match=r"non-negative integer below 2\*\*36"):
        cluster.add_to_step("rows", -1)
    with pytest.raises(ValueError, match=r"non-negative integer below 2\*\*36"):
        cluster.add_to_step("rows", 2**36)
    with pytest.raises(TypeError, match="a tensor of one element"):
        cluster.add_to_step("rows", torch.tensor([1.5, 2.0]))
    cluster.add_to_step("rows", 1)
    with pytest.raises(TypeError, match="one name keeps one kind"):
        cluster.add_to_step("rows", 1.5)
    with pytest.raises(TypeError, match="name must be a str"):
        cluster.add_to_step(3, 1)
    for name in "abc":
        cluster.add_to_step(name, 1)
    with pytest.raises(ValueError, match="At most 4 step values"):
        cluster.add_to_step("e", 1)
    with pytest.raises(KeyError, match="No step value 'never'"):
        cluster.step_total("never")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("buckets", [False, True], ids=["packed", "buckets"])
def test_across_workers_no_collective_of_their_own(buckets):
    """2 workers × 2 logical CPUs: the totals are exact and the step makes as many collectives with
    step values as without; the gradients are the same."""
    workers = results(run_workers(SCENARIOS, "step_values", 2, timeout=90, kwargs={"buckets": buckets}))
    for out in workers:
        plain, carried, plain_again, carried_again = out["operations"]
        assert plain == carried == plain_again == carried_again and plain >= 1
        assert out["totals"] == [[3 + 4 + 5 + 6, 4 * (2**35 + 1), 1]] * 2
        for grads in out["grads"][1:]:
            for a, b in zip(out["grads"][0], grads):
                assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_across_workers_bfloat16_buckets_take_one_reduction_more():
    workers = results(
        run_workers(SCENARIOS, "step_values", 2, timeout=90, kwargs={"buckets": True, "dtype": "bfloat16"})
    )
    for out in workers:
        plain, carried, plain_again, carried_again = out["operations"]
        assert carried == carried_again == plain + 1 and plain_again == plain
        assert out["totals"] == [[3 + 4 + 5 + 6, 4 * (2**35 + 1), 1]] * 2


@pytest.mark.parametrize("name", STRATEGIES)
def test_floating_values_sum_as_their_carrier_sums(name):
    """A sum of class weights: one element of the carrier, summed in replica order."""
    strategy = make_strategy(name)
    n = strategy.num_replicas_in_sync
    weights = [0.1 * (r + 1) for r in range(n)]

    def carry(ctx):
        rid = ctx.replica_id_in_sync_group
        strategy.cluster.add_to_step("weights", torch.tensor(weights[rid], dtype=torch.float32))
        strategy.cluster.add_to_step("rows", 2)

    _reduce_grads(strategy, lambda rid: torch.ones(4), carry)
    total = strategy.cluster.step_total("weights")
    assert total.dtype == torch.float64
    expected = torch.tensor(weights, dtype=torch.float32).sum()
    assert abs(float(total) - float(expected)) <= 1e-6
    assert int(strategy.cluster.step_total("rows")) == 2 * n


def test_totals_add_up_over_the_reductions_that_carried_them_until_read():
    """An accumulation window's count: steps carried by other reductions (a read of the metrics) and by the
    window's own reduction add up; a read starts the next count from zero."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    grads = lambda rid: torch.ones(3)  # noqa: E731
    _reduce_grads(strategy, grads, lambda ctx: strategy.cluster.add_to_step("tokens", 3))  # 6
    with strategy.scope():
        strategy.run(lambda: strategy.cluster.add_to_step("tokens", 5))  # 10, pending
        values = strategy.run(lambda: torch.ones(2))
        strategy.extended.batch_reduce_to("SUM", [(values, "cpu:0")])  # another reduction carries them
    _reduce_grads(strategy, grads, lambda ctx: strategy.cluster.add_to_step("tokens", 1))  # 2
    assert int(strategy.cluster.step_total("tokens")) == 18
    assert int(strategy.cluster.step_total("tokens")) == 0
    _reduce_grads(strategy, grads, lambda ctx: strategy.cluster.add_to_step("tokens", 4))
    assert int(strategy.cluster.step_total("tokens")) == 8


def test_discarding_forgets_what_an_unfinished_step_added_and_a_read_name_may_change_kind():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        strategy.run(lambda: strategy.cluster.add_to_step("count", 6))  # a step that never reduced
    strategy.cluster.discard_step_value("count")
    _reduce_grads(strategy, lambda rid: torch.ones(2), lambda ctx: strategy.cluster.add_to_step("count", 1))
    assert int(strategy.cluster.step_total("count")) == 2
    _reduce_grads(strategy, lambda rid: torch.ones(2), lambda ctx: strategy.cluster.add_to_step("count", 0.5))
    assert float(strategy.cluster.step_total("count")) == 1.0
