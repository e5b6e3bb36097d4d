"""Distributed datasets: the split rule, sources, per-replica inputs (TensorFlow's split rule)."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from conftest import make_strategy, requires_gpus
from torch.utils.data import DataLoader, TensorDataset

import replicafit.strategies as ds
from replicafit import data

Example = collections.namedtuple("Example", ["features", "label"])

_STRATEGIES: dict = {}


def mirrored(count):
    """One Mirrored strategy per replica count for the whole module (strategies are cheap but not free)."""
    if count not in _STRATEGIES:
        _STRATEGIES[count] = ds.MirroredStrategy([f"cpu:{i}" for i in range(count)])
    return _STRATEGIES[count]


def reference_split(batch_size, n):
    """The split rule as data/input_lib.py states it: k = ceil(b / n); replica i gets [i*k, min((i+1)*k, b))."""
    k = math.ceil(batch_size / n)
    rows = []
    for i in range(n):
        start, stop = i * k, min((i + 1) * k, batch_size)
        rows.append(list(range(start, stop)) if start < batch_size else [])
    return rows


def local(strategy, value):
    return list(strategy.experimental_local_results(value))


def steps_as_lists(strategy, distributed):
    """Every step as a list (one entry per replica) of Python lists."""
    return [[t.tolist() for t in local(strategy, step)] for step in distributed]


def global_batches(total, batch_size, trailing=(), dtype=torch.float32):
    rows = torch.arange(total, dtype=torch.float64)
    element = rows.reshape((total,) + (1,) * len(trailing)).expand((total,) + tuple(trailing)).to(dtype)
    return [element[i : i + batch_size] for i in range(0, total, batch_size)]


# --- the split rule --------------------------------------------------------------------------------


PAIRS = [(total, batch) for total in (1, 2, 3, 5, 7, 10, 16, 17) for batch in (1, 2, 3, 4, 5, 8, 9)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_split_rule_against_the_reference(n):
    strategy = mirrored(n)
    for total, batch in PAIRS:
        batches = global_batches(total, batch)
        steps = list(strategy.experimental_distribute_dataset(batches))
        assert len(steps) == len(batches), (total, batch)
        for step, source in zip(steps, batches):
            parts = local(strategy, step)
            assert len(parts) == n
            offset = int(source[0].item())
            expected = [[float(offset + r) for r in rows] for rows in reference_split(len(source), n)]
            assert [p.tolist() for p in parts] == expected, (n, total, batch)
            if n > 1:
                assert isinstance(step, ds.PerReplica)
                assert tuple(step.devices) == strategy.extended.worker_devices
        assert data.split_sizes(batch, n) == [len(r) for r in reference_split(batch, n)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.float16])
def test_empty_replicas_keep_trailing_shape_and_dtype(n, dtype):
    strategy = mirrored(n)
    # 5 rows of shape (3, 2): a full batch of 4, then a partial batch of 1
    batches = global_batches(5, 4, trailing=(3, 2), dtype=dtype)
    steps = list(strategy.experimental_distribute_dataset(batches))
    assert len(steps) == 2
    for step, source in zip(steps, batches):
        sizes = [len(r) for r in reference_split(len(source), n)]
        parts = local(strategy, step)
        assert [p.shape for p in parts] == [torch.Size((s, 3, 2)) for s in sizes]
        assert all(p.dtype == dtype for p in parts)
        assert torch.equal(torch.cat(parts), source)
    assert 0 in [p.shape[0] for p in local(strategy, steps[1])]


@pytest.mark.parametrize(
    "n, total, batch, expected",
    [
        (2, 10, 4, [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]]),
        (3, 4, 4, [[[0, 1], [2, 3], []]]),
        (4, 1, 1, [[[0], [], [], []]]),
        (3, 6, 4, [[[0, 1], [2, 3], []], [[4], [5], []]]),
        (4, 10, 10, [[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]]),
        (3, 7, 7, [[[0, 1, 2], [3, 4, 5], [6]]]),
        (4, 6, 6, [[[0, 1], [2, 3], [4, 5], []]]),
    ],
)
def test_documented_examples(n, total, batch, expected):
    strategy = mirrored(n)
    batches = [torch.arange(total)[i : i + batch] for i in range(0, total, batch)]
    assert steps_as_lists(strategy, strategy.experimental_distribute_dataset(batches)) == expected


@pytest.mark.parametrize("batch, n, sizes", [(4, 2, [2, 2]), (2, 2, [1, 1]), (3, 2, [2, 1]), (1, 2, [1, 0]),
                                             (4, 3, [2, 2, 0]), (5, 3, [2, 2, 1]), (6, 4, [2, 2, 2, 0]),
                                             (10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1, 0]), (7, 3, [3, 3, 1]),
                                             (1, 4, [1, 0, 0, 0])])  # fmt: skip
def test_split_sizes_reference_table(batch, n, sizes):
    assert data.split_sizes(batch, n) == sizes
    strategy = mirrored(n)
    (step,) = list(strategy.experimental_distribute_dataset([torch.zeros(batch, 2)]))
    assert [p.shape[0] for p in local(strategy, step)] == sizes


# --- sources ---------------------------------------------------------------------------------------


def test_every_strategy_splits_a_dataloader(strategy):
    n = strategy.num_replicas_in_sync
    loader = DataLoader(TensorDataset(torch.arange(10.0), torch.arange(10) * 10), batch_size=4)
    steps = list(strategy.experimental_distribute_dataset(loader))
    assert len(steps) == 3
    for step, start, size in zip(steps, (0, 4, 8), (4, 4, 2)):
        assert isinstance(step, list) and len(step) == 2
        x, y = step
        expected = [[float(start + r) for r in rows] for rows in reference_split(size, n)]
        assert [t.tolist() for t in local(strategy, x)] == expected
        assert [t.tolist() for t in local(strategy, y)] == [[10 * int(v) for v in rows] for rows in expected]
        assert all(t.dtype == torch.int64 for t in local(strategy, y))
        if n == 1:
            assert isinstance(x, torch.Tensor)


def test_list_of_tensors(multi_strategy):
    batches = [torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])]
    (step,) = list(multi_strategy.experimental_distribute_dataset(batches))
    assert [t.tolist() for t in local(multi_strategy, step)] == [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0]]]


def test_numpy_arrays(multi_strategy):
    batches = [np.arange(6, dtype=np.float64).reshape(3, 2), np.arange(6, 8, dtype=np.float64).reshape(1, 2)]
    steps = list(multi_strategy.experimental_distribute_dataset(batches))
    assert len(steps) == 2
    for step in steps:
        for part in local(multi_strategy, step):
            assert isinstance(part, torch.Tensor) and part.dtype == torch.float64
    assert [t.tolist() for t in local(multi_strategy, steps[0])] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0]]]
    assert [t.tolist() for t in local(multi_strategy, steps[1])] == [[[6.0, 7.0]], []]
    assert local(multi_strategy, steps[1])[1].shape == (0, 2)


def test_nests_tuple_dict_namedtuple(multi_strategy):
    batch = (
        {"a": torch.arange(5), "b": np.arange(5, dtype=np.float32) * 100},
        Example(features=torch.arange(10.0).reshape(5, 2), label=torch.arange(5) % 2),
    )
    (step,) = list(multi_strategy.experimental_distribute_dataset([batch]))
    assert isinstance(step, tuple) and len(step) == 2
    mapping, example = step
    assert isinstance(mapping, dict) and set(mapping) == {"a", "b"}
    assert isinstance(example, Example)
    for leaf in (mapping["a"], mapping["b"], example.features, example.label):
        assert isinstance(leaf, ds.PerReplica)
    assert [t.tolist() for t in mapping["a"].values] == [[0, 1, 2], [3, 4]]
    assert [t.tolist() for t in mapping["b"].values] == [[0.0, 100.0, 200.0], [300.0, 400.0]]
    assert [t.tolist() for t in example.features.values] == [
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]],
        [[6.0, 7.0], [8.0, 9.0]],
    ]
    assert [t.tolist() for t in example.label.values] == [[0, 1, 0], [1, 0]]
    # a replica's view of the nest keeps the structure
    first, second = multi_strategy.experimental_local_results(step)
    assert isinstance(first[1], Example) and first[0]["a"].tolist() == [0, 1, 2]
    assert second[1].label.tolist() == [1, 0]


def test_object_with_iter(multi_strategy):
    class Source:
        def __iter__(self):
            yield torch.arange(4)
            yield torch.arange(4, 7)

    steps = steps_as_lists(multi_strategy, multi_strategy.experimental_distribute_dataset(Source()))
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6]]]


def test_reiteration_gives_the_same_batches(strategy):
    loader = DataLoader(TensorDataset(torch.arange(7.0)), batch_size=3)
    distributed = strategy.experimental_distribute_dataset(loader)
    first = [[t.tolist() for t in local(strategy, x)] for (x,) in distributed]
    second = [[t.tolist() for t in local(strategy, x)] for (x,) in distributed]
    assert first == second
    assert len(first) == 3
    assert sum(len(part) for step in first for part in step) == 7


def test_iterator_ends_with_stop_iteration(multi_strategy):
    iterator = iter(multi_strategy.experimental_distribute_dataset([torch.zeros(2)]))
    next(iterator)
    with pytest.raises(StopIteration):
        next(iterator)


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "element",
    [
        torch.tensor(3.0),
        np.float32(3.0),
        (torch.zeros(3), torch.tensor(1)),
        (torch.zeros(3), torch.zeros(4)),
        {"x": torch.zeros(2, 5), "y": torch.zeros(3)},
    ],
    ids=["scalar", "numpy-scalar", "scalar-leaf", "disagreeing", "disagreeing-dict"],
)
def test_unbatched_sources_raise(strategy, element):
    with pytest.raises(ValueError, match="batched"):
        list(strategy.experimental_distribute_dataset([element]))


def test_per_replica_mode_needs_distribute_datasets_from_function(strategy):
    options = data.InputOptions(experimental_replication_mode=data.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):
        strategy.experimental_distribute_dataset([torch.zeros(2)], options)


def test_next_inside_a_replica_fn_raises(multi_strategy):
    iterator = iter(multi_strategy.experimental_distribute_dataset([torch.zeros(2), torch.zeros(2)]))
    with pytest.raises(ValueError, match="outside of replica_fn"):
        multi_strategy.run(lambda: next(iterator))
    iterator = iter(multi_strategy.distribute_datasets_from_function(lambda ctx: [torch.zeros(1)] * 4))
    with pytest.raises(ValueError, match="outside of replica_fn"):
        multi_strategy.run(lambda: iterator.get_next())


# --- placement -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fetch", [True, False])
def test_fetch_to_device_on_the_host(strategy, fetch):
    options = data.InputOptions(experimental_fetch_to_device=fetch)
    source = torch.arange(6.0)
    (step,) = list(strategy.experimental_distribute_dataset([source], options))
    parts = local(strategy, step)
    assert all(p.device.type == "cpu" for p in parts)
    assert torch.equal(torch.cat(parts), source)


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.parametrize("fetch, device_type", [(True, "cuda"), (False, "cpu")])
def test_fetch_to_device_with_a_gpu(fetch, device_type):
    strategy = ds.OneDeviceStrategy("cuda:0")
    options = data.InputOptions(experimental_fetch_to_device=fetch)
    (step,) = list(strategy.experimental_distribute_dataset([torch.arange(6.0)], options))
    assert step.device.type == device_type
    dff = strategy.distribute_datasets_from_function(lambda ctx: [torch.arange(3.0)], options)
    (step,) = list(dff)
    assert step.device.type == device_type


# --- distribute_datasets_from_function ---------------------------------------------------------------


def test_from_function_per_worker_case45(multi_strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return DataLoader(torch.arange(10), batch_size=2)

    distributed = multi_strategy.distribute_datasets_from_function(dataset_fn)
    steps = steps_as_lists(multi_strategy, distributed)
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], []]]
    assert len(contexts) == 1
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)
    assert str(ctx) == "tf.distribute.InputContext(input pipeline id 0, total: 1)"
    # the empty replica batch keeps dtype and trailing shape
    last = list(distributed)[-1]
    assert last.values[1].dtype == torch.int64 and last.values[1].shape == (0,)


def test_from_function_case45_uneven(multi_strategy):
    steps = steps_as_lists(
        multi_strategy,
        multi_strategy.distribute_datasets_from_function(lambda ctx: DataLoader(torch.arange(9), batch_size=2)),
    )
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    dropped = multi_strategy.distribute_datasets_from_function(
        lambda ctx: DataLoader(torch.arange(9), batch_size=2, drop_last=True)
    )
    assert steps_as_lists(multi_strategy, dropped) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_from_function_empty_batches_keep_trailing_shape(multi_strategy):
    def dataset_fn(ctx):
        return [{"x": torch.ones(2, 3, dtype=torch.float16), "y": torch.zeros(2, dtype=torch.int32)}] * 3

    steps = list(multi_strategy.distribute_datasets_from_function(dataset_fn))
    assert len(steps) == 2
    x, y = steps[1]["x"], steps[1]["y"]
    assert x.values[1].shape == (0, 3) and x.values[1].dtype == torch.float16
    assert y.values[1].shape == (0,) and y.values[1].dtype == torch.int32


def test_from_function_per_replica(multi_strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        start = 100 * ctx.input_pipeline_id
        return [torch.tensor([start + i]) for i in range(2 + ctx.input_pipeline_id)]

    options = data.InputOptions(experimental_replication_mode=data.InputReplicationMode.PER_REPLICA)
    distributed = multi_strategy.distribute_datasets_from_function(dataset_fn, options)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [
        (2, 0, 2),
        (2, 1, 2),
    ]
    assert steps_as_lists(multi_strategy, distributed) == [[[0], [100]], [[1], [101]], [[], [102]]]


def test_from_function_over_every_strategy(strategy):
    n = strategy.num_replicas_in_sync
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [torch.full((2,), float(i)) for i in range(3 * n)]

    distributed = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    assert len(contexts) == 1 and contexts[0].num_replicas_in_sync == n
    steps = [[t.tolist() for t in local(strategy, step)] for step in distributed]
    assert steps == [[[float(s * n + r)] * 2 for r in range(n)] for s in range(3)]


def test_case42_unbatched_elements_from_function(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = ds.Variable(1.0)
    distributed = strategy.distribute_datasets_from_function(lambda ctx: [torch.tensor(2.0), torch.tensor(3.0)] * 5)
    result = None
    for x in distributed:
        result = strategy.reduce("MEAN", strategy.run(lambda x: x * x + v.read_value().detach(), args=(x,)), axis=None)
    assert result.item() == {1: 10.0, 2: 7.5}[n]


# --- InputContext / InputOptions -----------------------------------------------------------------


def test_input_context_case48():
    ctx = data.InputContext(2, 1, 6)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 6)
    assert ctx.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError, match="13"):
        ctx.get_per_replica_batch_size(13)
    assert str(data.InputContext(3, 1, 42)) == "tf.distribute.InputContext(input pipeline id 1, total: 3)"
    default = data.InputContext()
    assert (default.num_input_pipelines, default.input_pipeline_id, default.num_replicas_in_sync) == (1, 0, 1)
    assert default.get_per_replica_batch_size(7) == 7
    with pytest.raises(ValueError) as info:
        data.InputContext(1, 0, 2).get_per_replica_batch_size(5)
    assert str(info.value) == "The `global_batch_size` 5 is not divisible by `num_replicas_in_sync` 2 "


def test_input_options_defaults_and_validation():
    options = data.InputOptions()
    assert options.experimental_fetch_to_device is True
    assert options.experimental_replication_mode is data.InputReplicationMode.PER_WORKER
    assert options.experimental_per_replica_buffer_size is None  # auto: a thread only with accelerators
    with pytest.raises(ValueError, match="PER_REPLICA"):
        data.InputOptions(experimental_place_dataset_on_device=True)
    with pytest.raises(ValueError):
        data.InputOptions(
            experimental_replication_mode=data.InputReplicationMode.PER_REPLICA,
            experimental_place_dataset_on_device=True,
            experimental_fetch_to_device=True,
        )
    assert data.InputReplicationMode.PER_WORKER.value == "PER_WORKER"
    assert data.InputReplicationMode.PER_REPLICA.value == "PER_REPLICA"


# --- reference cases 38-44 ------------------------------------------------------------------------


def _concat(strategy, value):
    return torch.cat([t.reshape(-1) for t in local(strategy, value)]).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
def test_case38_evenly_divisible(strategy, drop_last):
    loader = DataLoader(torch.tensor([5.0, 6.0]), batch_size=2, drop_last=drop_last)
    steps = list(strategy.experimental_distribute_dataset(loader))
    assert len(steps) == 1
    assert _concat(strategy, steps[0]) == [5.0, 6.0]


def test_case39_not_divisible(multi_strategy):
    loader = DataLoader(torch.tensor([5.0, 6.0]), batch_size=1, drop_last=True)
    steps = list(multi_strategy.experimental_distribute_dataset(loader))
    assert len(steps) == 2
    assert [t.tolist() for t in local(multi_strategy, steps[0])] == [[5.0], []]
    assert _concat(multi_strategy, steps[0]) == [5.0]


def test_case40_partial_batch_with_mixed_outputs(multi_strategy):
    loader = DataLoader(torch.tensor([5.0]), batch_size=2)
    (x,) = list(multi_strategy.experimental_distribute_dataset(loader))
    zeros, squares = multi_strategy.run(lambda x: (torch.zeros(3), x * x), args=(x,))
    assert [t.tolist() for t in local(multi_strategy, zeros)] == [[0.0] * 3, [0.0] * 3]
    assert [t.tolist() for t in local(multi_strategy, squares)] == [[25.0], []]


def test_case41_iteration(strategy):
    loader = DataLoader(torch.tensor([5.0, 6.0, 7.0, 8.0]), batch_size=2)
    results = [
        _concat(strategy, strategy.run(lambda x: x * x, args=(x,)))
        for x in strategy.experimental_distribute_dataset(loader)
    ]
    assert results == [[25.0, 36.0], [49.0, 64.0]]


def test_case43_sum_variable_over_the_dataset(strategy):
    with strategy.scope():
        v = ds.Variable(0.0, aggregation=ds.VariableAggregation.SUM)
    iterator = iter(
        strategy.experimental_distribute_dataset(DataLoader(torch.tensor([5.0, 6.0, 7.0, 8.0]), batch_size=2))
    )
    steps = 0
    with pytest.raises(StopIteration):
        while True:
            x = next(iterator)
            strategy.run(lambda x: v.assign_add(torch.sum(x)), args=(x,))
            steps += 1
    assert steps == 2
    assert float(v.numpy()) == 26.0


def test_case44_loss_with_dynamic_shapes(multi_strategy):
    loader = DataLoader(torch.tensor([5.0, 6.0, 7.0]), batch_size=4)
    (x,) = list(multi_strategy.experimental_distribute_dataset(loader))
    assert [t.tolist() for t in local(multi_strategy, x)] == [[5.0, 6.0], [7.0]]
    losses = multi_strategy.run(lambda x: torch.sum(x * torch.ones_like(x)) / x.shape[0], args=(x,))
    assert [t.item() for t in local(multi_strategy, losses)] == [5.5, 7.0]
    # and the global mean over the partial batch is right
    assert multi_strategy.reduce("MEAN", x, axis=0).item() == 6.0


def test_quickstart_example():
    strategy = mirrored(2)
    (batch,) = list(strategy.experimental_distribute_dataset([torch.arange(5, dtype=torch.float32)]))
    squares = strategy.run(lambda x: x * x, args=(batch,))
    assert [t.tolist() for t in local(strategy, squares)] == [[0.0, 1.0, 4.0], [9.0, 16.0]]
    assert strategy.reduce("MEAN", squares, axis=0).item() == 6.0


def test_make_strategy_helper_is_consistent():
    # the fixture's strategies split like a Mirrored strategy with the same replica count
    for name, n in (("central_storage2", 2), ("mirrored2", 2), ("one_device", 1)):
        strategy = make_strategy(name)
        steps = steps_as_lists(strategy, strategy.experimental_distribute_dataset([torch.arange(3)]))
        assert steps == [[list(range(3))[r[0] : r[-1] + 1] if r else [] for r in reference_split(3, n)]]


def test_len_is_the_sources_number_of_global_batches(multi_strategy):
    """The docstring promised it; the method once sat unreachable after a return."""
    batches = [torch.randn(4, 3) for _ in range(5)]
    assert len(multi_strategy.experimental_distribute_dataset(batches)) == 5
    loader = DataLoader(TensorDataset(torch.randn(10, 3)), batch_size=4)
    assert len(multi_strategy.experimental_distribute_dataset(loader)) == 3
    unsized = multi_strategy.experimental_distribute_dataset(b for b in batches)
    with pytest.raises(TypeError, match=r"has no len\(\)"):
        len(unsized)
