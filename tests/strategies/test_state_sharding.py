"""The partition of sharded optimizer states (``strategies/state_sharding.py``) and the two collectives it
rides on (``Collective.start_reduce_scatter`` and ``start_all_gather_in_place``), on 2 and 3 gloo workers."""

from __future__ import annotations

import mw_scenarios as scenarios
import pytest
import torch
from multiworker_harness import results, run_workers

from replicafit.strategies.state_sharding import ShardPlan, dtype_segments, owned_bytes

SCENARIOS = scenarios.__file__


def coverage(plan: ShardPlan) -> dict:
    """``{variable: sorted (start, stop) of every piece of every worker}``."""
    seen: dict = {}
    for worker in range(plan.num_workers):
        for piece in plan.owned(worker):
            seen.setdefault(piece.variable, []).append((piece.start, piece.stop))
    return {v: sorted(ranges) for v, ranges in seen.items()}


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_every_element_is_owned_once_and_each_chunk_is_the_buffer_part_a_reduce_scatter_gives(workers):
    shapes = [(16, 3072), (3072,), (3072, 3072), (3072,), (7, 3072), (7,), (4, 7), (4,)]  # the MLP
    tensors = [torch.empty(shape) for shape in shapes]
    segments, _ = dtype_segments(tensors)
    plan = ShardPlan(segments, workers)
    for variable, ranges in coverage(plan).items():  # end to end, no gap, no overlap
        assert ranges[0][0] == 0 and ranges[-1][1] == tensors[variable].numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    flat = torch.cat([t.reshape(-1) for t in (torch.randn(s) for s in shapes)])
    values = [part for part in flat.split([t.numel() for t in tensors])]
    chunk = plan.chunk_lengths[0]
    padded = torch.cat([flat, flat.new_zeros(plan.padded_length(0) - flat.numel())])
    for worker in range(workers):
        mine = padded[worker * chunk : (worker + 1) * chunk]
        for piece in plan.owned(worker):
            assert torch.equal(
                mine[piece.offset : piece.offset + piece.size], values[piece.variable][piece.start : piece.stop]
            )


def test_the_partition_is_balanced_by_bytes_and_cuts_the_large_matrix():
    tensors = [torch.empty(3072, 3072), torch.empty(7, dtype=torch.float64), torch.empty(5, 3, dtype=torch.bfloat16)]
    segments, dtypes = dtype_segments(tensors)
    assert dtypes == [torch.float32, torch.float64, torch.bfloat16]
    plan = ShardPlan(segments, 3)
    total = sum(t.numel() * t.element_size() for t in tensors)
    shares = [owned_bytes(plan, dtypes, w) for w in range(3)]
    assert sum(shares) == total
    padding = sum(c * d.itemsize for c, d in zip(plan.chunk_lengths, dtypes))
    assert max(shares) - min(shares) <= padding
    assert {p.variable for w in range(3) for p in plan.owned(w) if p.variable == 0} == {0}
    assert all(any(p.variable == 0 for p in plan.owned(w)) for w in range(3))  # every worker holds a slice of it


def test_a_bucket_that_holds_part_of_a_variable():
    plan = ShardPlan([[(1, 4, 10), (0, 0, 2)], [(1, 0, 4)]], 2)  # two reductions, variable 1 cut between them
    assert plan.lengths == [8, 4] and plan.chunk_lengths == [4, 2]
    assert [(p.segment, p.variable, p.start, p.stop, p.offset) for p in plan.owned(0)] == [
        (0, 1, 4, 8, 0),
        (1, 1, 0, 2, 0),
    ]
    assert [(p.segment, p.variable, p.start, p.stop, p.offset) for p in plan.owned(1)] == [
        (0, 1, 8, 10, 0),
        (0, 0, 0, 2, 2),
        (1, 1, 2, 4, 0),
    ]


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        ShardPlan([], 0)
    with pytest.raises(ValueError, match="empty or reversed range"):
        ShardPlan([[(0, 3, 3)]], 2)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers, length, dtype", [(2, 11, "float32"), (3, 11, "float64"), (3, 3, "float32")])
def test_reduce_scatter_and_all_gather_on_gloo(workers, length, dtype):
    got = results(
        run_workers(SCENARIOS, "sharded_reductions", workers, timeout=60, kwargs={"length": length, "dtype": dtype})
    )
    kind = getattr(torch, dtype)
    total = torch.arange(length, dtype=kind) * sum(range(1, workers + 1))
    chunk = -(-length // workers)
    padded = torch.cat([total, total.new_zeros(chunk * workers - length)])
    for rank, outcome in enumerate(got):
        assert torch.equal(outcome["chunk"], padded[rank * chunk : (rank + 1) * chunk]), rank
        assert torch.equal(outcome["whole"], 2 * total)
        assert not outcome["warnings"], outcome["warnings"]  # (no deprecated name on torch 2.13)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [2, 3])
def test_step_values_reach_every_worker_in_the_same_reduce_scatter(workers):
    """A per-step value (the real-element count, the preemption flag) must reach every worker, while the
    gradients are only reduce-scattered: each part carries a copy of the values."""
    got = results(run_workers(SCENARIOS, "sharded_with_step_values", workers, timeout=60))
    total = sum(torch.arange(10, dtype=torch.float32) + r for r in range(workers))
    chunk = -(-10 // workers)
    padded = torch.cat([total, total.new_zeros(chunk * workers - 10)])
    carried = torch.tensor([sum(range(1, workers + 1)), 2.0 * workers, 0.5 * workers])
    for rank, (part, values) in enumerate(got):
        assert torch.equal(part, padded[rank * chunk : (rank + 1) * chunk])
        assert torch.equal(values, carried)
