"""Sources of global batches: ``replicafit.data.as_global_batches``, ``ArrayBatches``, ``DatasetBatches``."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from conftest import make_strategy
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from replicafit import data

Pair = collections.namedtuple("Pair", ["features", "label"])


def to_numpy(leaf):
    """A batch leaf (tensor or array) as a NumPy array, for exact comparisons."""
    if isinstance(leaf, torch.Tensor):
        return leaf.numpy()
    assert isinstance(leaf, np.ndarray), type(leaf)
    return leaf


def rows_10():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)  # row i = [2i, 2i+1]
    y = np.arange(10, dtype=np.int64) * 10
    return x, y


def first_column(batches):
    """The row ids (x[:, 0] / 2) of every batch of an (x, y) source."""
    out = []
    for x, y in batches:
        ids = (to_numpy(x)[:, 0] / 2).astype(int).tolist()
        assert to_numpy(y).tolist() == [10 * i for i in ids], "x and y rows were separated"
        out.append(ids)
    return out


class Squares(Dataset):
    """A map-style dataset of (features, label) with features [i, i*i] and label i % 3."""

    def __init__(self, size):
        self.size = size
        self.calls = 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.calls += 1
        return torch.tensor([float(index), float(index * index)]), index % 3


class Ids(Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


class Records(Dataset):
    def __len__(self):
        return 7

    def __getitem__(self, index):
        return {"x": np.full((2,), index, dtype=np.float64), "id": index}


def assert_same_batches(got, expected):
    got, expected = list(got), list(expected)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert type(a) is type(b)
        if isinstance(b, dict):
            assert list(a) == list(b)
            a, b = list(a.values()), list(b.values())
        if isinstance(b, (list, tuple)):
            assert len(a) == len(b)
            for leaf_a, leaf_b in zip(a, b):
                assert leaf_a.dtype == leaf_b.dtype and torch.equal(leaf_a, leaf_b)
        else:
            assert a.dtype == b.dtype and torch.equal(a, b)


# --- every source kind ------------------------------------------------------------------------------


def test_single_ndarray():
    x = np.arange(30, dtype=np.float64).reshape(10, 3)
    batches = data.as_global_batches(x, batch_size=4)
    assert isinstance(batches, data.ArrayBatches)
    got = [to_numpy(b) for b in batches]
    assert [b.shape for b in got] == [(4, 3), (4, 3), (2, 3)]
    assert all(b.dtype == np.float64 for b in got)
    np.testing.assert_array_equal(np.concatenate(got), x)
    np.testing.assert_array_equal(got[1], x[4:8])


def test_single_tensor():
    x = torch.arange(10, dtype=torch.int32)
    batches = data.as_global_batches(x, batch_size=3)
    got = list(batches)
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 for b in got)
    assert [b.tolist() for b in got] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_default_batch_size_is_32():
    batches = data.as_global_batches(np.zeros((70, 2), dtype=np.float32))
    assert batches.batch_size == 32
    assert [len(b) for b in batches] == [32, 32, 6]


def test_tuple_x_y():
    x, y = rows_10()
    batches = data.as_global_batches((x, y), batch_size=4)
    got = list(batches)
    assert len(got) == 3
    for batch in got:
        assert type(batch) is tuple and len(batch) == 2
        assert to_numpy(batch[0]).dtype == np.float32 and to_numpy(batch[1]).dtype == np.int64
    assert first_column(got) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    np.testing.assert_array_equal(to_numpy(got[2][0]), x[8:])


def test_tuple_x_y_sample_weight():
    x, y = rows_10()
    w = np.linspace(0.0, 1.0, 10).astype(np.float32)
    got = list(data.as_global_batches((x, y, w), batch_size=6))
    assert len(got) == 2
    for batch, rows in zip(got, (slice(0, 6), slice(6, 10))):
        assert type(batch) is tuple and len(batch) == 3
        np.testing.assert_array_equal(to_numpy(batch[0]), x[rows])
        np.testing.assert_array_equal(to_numpy(batch[1]), y[rows])
        np.testing.assert_array_equal(to_numpy(batch[2]), w[rows])


def test_dict():
    x, y = rows_10()
    got = list(data.as_global_batches({"image": x, "label": torch.from_numpy(y)}, batch_size=4))
    assert len(got) == 3
    for batch, start in zip(got, (0, 4, 8)):
        assert type(batch) is dict and list(batch) == ["image", "label"]
        stop = min(start + 4, 10)
        np.testing.assert_array_equal(to_numpy(batch["image"]), x[start:stop])
        assert to_numpy(batch["label"]).tolist() == y[start:stop].tolist()


def test_namedtuple():
    x, y = rows_10()
    got = list(data.as_global_batches(Pair(features=x, label=y), batch_size=5))
    assert len(got) == 2
    for batch, start in zip(got, (0, 5)):
        assert type(batch) is Pair
        np.testing.assert_array_equal(to_numpy(batch.features), x[start : start + 5])
        np.testing.assert_array_equal(to_numpy(batch.label), y[start : start + 5])


def test_nested_tuple_of_dict():
    x, y = rows_10()
    got = list(data.as_global_batches(({"a": x}, y), batch_size=8))
    assert [type(b) for b in got] == [tuple, tuple]
    assert type(got[0][0]) is dict
    np.testing.assert_array_equal(to_numpy(got[1][0]["a"]), x[8:])
    np.testing.assert_array_equal(to_numpy(got[1][1]), y[8:])


@pytest.mark.parametrize("batch_size", [1, 3, 4, 10, 11])
def test_map_style_dataset_collated_like_a_dataloader(batch_size):
    dataset = Squares(10)
    batches = data.as_global_batches(dataset, batch_size=batch_size)
    assert isinstance(batches, data.DatasetBatches)
    assert len(batches) == math.ceil(10 / batch_size)
    assert_same_batches(batches, DataLoader(dataset, batch_size=batch_size))


def test_tensor_dataset_and_dict_dataset_like_a_dataloader():
    tensors = TensorDataset(torch.arange(10.0).reshape(5, 2), torch.arange(5))
    assert_same_batches(data.as_global_batches(tensors, batch_size=2), DataLoader(tensors, batch_size=2))
    records = Records()
    got = list(data.as_global_batches(records, batch_size=3))
    expected = list(DataLoader(records, batch_size=3))
    assert_same_batches(got, expected)
    assert got[-1]["id"].tolist() == [6]


def test_dataset_drop_remainder_like_dataloader_drop_last():
    dataset = Squares(10)
    batches = data.as_global_batches(dataset, batch_size=4, drop_remainder=True)
    assert len(batches) == 2
    assert_same_batches(batches, DataLoader(dataset, batch_size=4, drop_last=True))


def test_batched_sources_pass_through_unchanged():
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    assert data.as_global_batches(loader) is loader
    batches = [torch.zeros(2), torch.ones(2)]
    assert data.as_global_batches(batches) is batches
    generator = (torch.full((2,), float(i)) for i in range(3))
    assert data.as_global_batches(generator) is generator
    assert [b.tolist() for b in generator] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(3)

    stream = Stream()
    assert data.as_global_batches(stream) is stream


# --- errors ------------------------------------------------------------------------------------------


def test_dataset_without_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        data.as_global_batches(Squares(4))


def _loader():
    return DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)


def _generator():
    return (torch.zeros(2) for _ in range(2))


@pytest.mark.parametrize("make", [_loader, lambda: [torch.zeros(2)], _generator], ids=["loader", "list", "gen"])
@pytest.mark.parametrize(
    "kwargs", [{"batch_size": 4}, {"shuffle": True}, {"drop_remainder": True}], ids=["batch_size", "shuffle", "drop"]
)
def test_batched_source_rejects_batching_arguments(make, kwargs):
    with pytest.raises(ValueError):
        data.as_global_batches(make(), **kwargs)


@pytest.mark.parametrize(
    "source",
    [
        (np.zeros((10, 2)), np.zeros(9)),
        {"x": torch.zeros(4, 3), "y": torch.zeros(5)},
        Pair(np.zeros(3), np.zeros(4)),
        (np.zeros((3, 2)), np.float32(1.0)),
    ],
    ids=["tuple", "dict", "namedtuple", "scalar-leaf"],
)
def test_first_dimensions_must_agree(source):
    with pytest.raises(ValueError):
        data.as_global_batches(source, batch_size=2)


@pytest.mark.parametrize("source", [object(), 5, 3.5, None], ids=["object", "int", "float", "None"])
def test_object_without_iter(source):
    with pytest.raises(TypeError):
        data.as_global_batches(source)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True], ids=["zero", "negative", "float", "bool"])
@pytest.mark.parametrize("kind", ["ndarray", "tuple", "dataset"])
def test_bad_batch_size(kind, batch_size):
    x, y = rows_10()
    source = {"ndarray": x, "tuple": (x, y), "dataset": Squares(10)}[kind]
    with pytest.raises(ValueError):
        data.as_global_batches(source, batch_size=batch_size)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_bad_batch_size_direct(batch_size):
    with pytest.raises(ValueError):
        data.ArrayBatches(np.zeros(10), batch_size)
    with pytest.raises(ValueError):
        data.DatasetBatches(Squares(10), batch_size)


# --- ArrayBatches / DatasetBatches --------------------------------------------------------------------


def make_batched(kind, **kwargs):
    """10 rows; row i has x = [2i, 2i+1] and y = 10 i, as ArrayBatches or DatasetBatches."""
    x, y = rows_10()
    if kind == "array":
        return data.ArrayBatches((x, y), **kwargs)
    return data.DatasetBatches(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), **kwargs)


KINDS = ["array", "dataset"]


@pytest.mark.parametrize("kind", KINDS)
def test_len_with_and_without_drop_remainder(kind):
    keep = make_batched(kind, batch_size=4)
    drop = make_batched(kind, batch_size=4, drop_remainder=True)
    assert len(keep) == 3 and len(drop) == 2
    assert first_column(keep) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert first_column(drop) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert keep.num_examples == 10 and drop.num_examples == 10
    exact = make_batched(kind, batch_size=5, drop_remainder=True)
    assert len(exact) == 2 and first_column(exact) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert len(make_batched(kind, batch_size=11, drop_remainder=True)) == 0
    assert list(make_batched(kind, batch_size=11, drop_remainder=True)) == []
    assert first_column(make_batched(kind, batch_size=11)) == [list(range(10))]


@pytest.mark.parametrize("kind", KINDS)
def test_no_shuffle_keeps_order_every_epoch(kind):
    batches = make_batched(kind, batch_size=3)
    first = first_column(batches)
    assert first == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    batches.set_epoch(5)
    assert first_column(batches) == first
    assert first_column(batches.iterate(7)) == first
    assert batches.order(3) is None


@pytest.mark.parametrize("kind", KINDS)
def test_shuffle_is_a_permutation_fixed_by_seed_and_epoch(kind):
    batches = make_batched(kind, batch_size=4, shuffle=True, seed=7)
    epoch0 = first_column(batches)
    assert [len(b) for b in epoch0] == [4, 4, 2]
    flat = sum(epoch0, [])
    assert sorted(flat) == list(range(10))
    assert flat != list(range(10))
    assert flat == data.epoch_permutation(10, 7, 0).tolist()
    # same (seed, epoch): identical, also from a fresh object
    assert first_column(batches) == epoch0
    assert first_column(make_batched(kind, batch_size=4, shuffle=True, seed=7)) == epoch0
    # another epoch: another order
    batches.set_epoch(1)
    assert batches.epoch == 1
    epoch1 = first_column(batches)
    assert sorted(sum(epoch1, [])) == list(range(10))
    assert epoch1 != epoch0
    assert sum(epoch1, []) == data.epoch_permutation(10, 7, 1).tolist()
    assert first_column(batches.iterate(0)) == epoch0
    assert first_column(batches.iterate(1)) == epoch1
    batches.set_epoch(0)
    assert first_column(batches) == epoch0
    # another seed: another order
    assert first_column(make_batched(kind, batch_size=4, shuffle=True, seed=8)) != epoch0


@pytest.mark.parametrize("kind", KINDS)
def test_shuffle_without_seed_is_fresh_each_time(kind):
    x = np.arange(60)
    batches = (
        data.ArrayBatches(x, 60, shuffle=True) if kind == "array" else data.DatasetBatches(Ids(60), 60, shuffle=True)
    )
    first = to_numpy(next(iter(batches))).tolist()
    second = to_numpy(next(iter(batches))).tolist()
    assert sorted(first) == sorted(second) == list(range(60))
    assert first != second


@pytest.mark.parametrize("kind", KINDS)
def test_shuffle_with_drop_remainder_drops_the_permutations_tail(kind):
    batches = make_batched(kind, batch_size=4, shuffle=True, seed=3, drop_remainder=True)
    got = first_column(batches.iterate(2))
    assert sum(got, []) == data.epoch_permutation(10, 3, 2)[:8].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size, drop", [(4, False), (4, True), (3, False), (1, False)])
def test_iterate_resumes_at_any_batch(kind, shuffle, batch_size, drop):
    batches = make_batched(kind, batch_size=batch_size, shuffle=shuffle, seed=11, drop_remainder=drop)
    for epoch in (0, 3):
        full = first_column(batches.iterate(epoch))
        assert len(full) == len(batches)
        for start in range(len(batches) + 1):
            assert first_column(batches.iterate(epoch, start=start)) == full[start:], (epoch, start)


def test_iterate_resume_keeps_leaf_values():
    x, y = rows_10()
    batches = data.ArrayBatches((x, y), 3, shuffle=True, seed=1)
    full = list(batches.iterate(2))
    resumed = list(batches.iterate(2, start=2))
    assert len(resumed) == 2
    for (xa, ya), (xb, yb) in zip(resumed, full[2:]):
        np.testing.assert_array_equal(to_numpy(xa), to_numpy(xb))
        np.testing.assert_array_equal(to_numpy(ya), to_numpy(yb))
    order = data.epoch_permutation(10, 1, 2)
    np.testing.assert_array_equal(to_numpy(resumed[0][0]), x[order[6:9]])


def test_dataset_batches_resume_reads_only_the_needed_items():
    dataset = Squares(10)
    batches = data.DatasetBatches(dataset, 4)
    list(batches.iterate(0, start=2))
    assert dataset.calls == 2


def test_epoch_permutation_determinism():
    a = data.epoch_permutation(50, 123, 4)
    assert isinstance(a, np.ndarray) and a.shape == (50,)
    assert sorted(a.tolist()) == list(range(50))
    np.testing.assert_array_equal(a, data.epoch_permutation(50, 123, 4))
    assert not np.array_equal(a, data.epoch_permutation(50, 123, 5))
    assert not np.array_equal(a, data.epoch_permutation(50, 124, 4))
    assert data.epoch_permutation(0, 1, 0).tolist() == []
    assert data.epoch_permutation(1, 1, 0).tolist() == [0]
    # seed None: fresh every call
    assert not np.array_equal(data.epoch_permutation(50, None, 0), data.epoch_permutation(50, None, 0))


def test_order_matches_epoch_permutation():
    batches = make_batched("array", batch_size=4, shuffle=True, seed=9)
    np.testing.assert_array_equal(batches.order(2), data.epoch_permutation(10, 9, 2))
    batches.set_epoch(6)
    np.testing.assert_array_equal(batches.order(), data.epoch_permutation(10, 9, 6))


# --- end to end through a strategy ----------------------------------------------------------------------


def split_rule(b, n):
    k = math.ceil(b / n)
    return [list(range(i * k, min((i + 1) * k, b))) if i * k < b else [] for i in range(n)]


@pytest.mark.parametrize("name", ["mirrored2", "mirrored3", "central_storage2"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_distribute_global_batches_end_to_end(name, shuffle):
    strategy = make_strategy(name)
    n = strategy.num_replicas_in_sync
    x, y = rows_10()
    batches = data.as_global_batches((x, y), batch_size=4, shuffle=shuffle, seed=5)
    expected_batches = list(batches)
    steps = list(strategy.experimental_distribute_dataset(batches))
    assert len(steps) == 3
    for step, (gx, gy) in zip(steps, expected_batches):
        assert isinstance(step, tuple) and len(step) == 2
        xs = list(strategy.experimental_local_results(step[0]))
        ys = list(strategy.experimental_local_results(step[1]))
        assert len(xs) == len(ys) == n
        rows = split_rule(len(gx), n)
        for replica in range(n):
            idx = rows[replica]
            assert torch.equal(xs[replica], torch.as_tensor(to_numpy(gx))[idx]), (name, replica)
            assert torch.equal(ys[replica], torch.as_tensor(to_numpy(gy))[idx])
            assert xs[replica].shape == (len(idx), 2) and xs[replica].dtype == torch.float32
            assert ys[replica].dtype == torch.int64
        assert np.array_equal(torch.cat(xs).numpy(), to_numpy(gx))
        assert np.array_equal(torch.cat(ys).numpy(), to_numpy(gy))
    if not shuffle:
        sizes = [[len(strategy.experimental_local_results(s[0])[r]) for r in range(n)] for s in steps]
        assert sizes == {2: [[2, 2], [2, 2], [1, 1]], 3: [[2, 2, 0], [2, 2, 0], [1, 1, 0]]}[n]
        first = [t.tolist() for t in strategy.experimental_local_results(steps[0][1])]
        assert first == {2: [[0, 10], [20, 30]], 3: [[0, 10], [20, 30], []]}[n]


def test_distributed_epochs_follow_set_epoch():
    strategy = make_strategy("mirrored2")
    x, y = rows_10()
    batches = data.as_global_batches((x, y), batch_size=5, shuffle=True, seed=2)
    distributed = strategy.experimental_distribute_dataset(batches)

    def ids():
        return [
            (torch.cat(list(strategy.experimental_local_results(sx)))[:, 0] / 2).long().tolist()
            for sx, _ in distributed
        ]

    epoch0 = ids()
    assert sum(epoch0, []) == data.epoch_permutation(10, 2, 0).tolist()
    batches.set_epoch(1)
    assert sum(ids(), []) == data.epoch_permutation(10, 2, 1).tolist()


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.zeros((4, 2)), True),
        ((np.zeros((4, 2)), torch.zeros(4)), True),
        ({"x": np.zeros((4, 2)), "y": (torch.zeros(4), np.zeros(4))}, True),
        ((np.zeros((4, 2)), [np.zeros(4)]), False),  # a list inside: lists are lists of batches
        ((np.zeros((4, 2)), ()), False),  # an empty tuple holds no array
        ({"x": np.zeros(4), "y": {}}, False),
        ([np.zeros(4)], False),  # a list of batches
        ((), False),
        ((np.zeros(4), "label"), False),
    ],
)
def test_one_rule_says_what_in_memory_arrays_are(value, expected):
    """``data.is_array_nest`` is the one answer (the data layer and the trainer's recipes once had two
    that disagreed on ``(t, [t])`` and ``(t, ())``)."""
    from replicafit.recipes.datasets import training_data_form

    assert data.is_array_nest(value) is expected
    assert (training_data_form(value) == "arrays") is expected


@pytest.mark.parametrize(
    "value", [(np.zeros((4, 2)), [np.zeros(4)]), (np.zeros((4, 2)), ()), {"x": np.zeros(4), "y": {}}]
)
def test_a_tuple_or_dict_that_is_not_arrays_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"is read as arrays, such as \(x, y\)"):
        data.as_global_batches(value, batch_size=2)
