"""strategy.reduce / gather / experimental_local_results (TensorFlow 2.21's results)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds

Pair = collections.namedtuple("Pair", ["first", "second"])


def distribute(strategy, values):
    """One value per replica as the strategy's distributed value (plain with one replica)."""
    assert len(values) == strategy.num_replicas_in_sync
    return strategy.experimental_distribute_values_from_function(lambda ctx: values[ctx.replica_id_in_sync_group])


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def replica_id():
    return ds.get_replica_context().replica_id_in_sync_group


def assert_tensor_equal(actual, expected, dtype=None):
    assert isinstance(actual, torch.Tensor), f"expected a torch.Tensor, got {type(actual).__name__}: {actual!r}"
    if dtype is not None:
        assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    np.testing.assert_array_equal(actual.detach().cpu().numpy(), np.asarray(expected))


# --- TensorFlow 2.21's results for two replicas ---------------------------------

TABLE = [
    # values per replica, op, axis, expected
    ([[1.0, 2.0], [3.0, 4.0]], "SUM", None, [4.0, 6.0]),
    ([[1.0, 2.0], [3.0, 4.0]], "SUM", 0, 10.0),
    ([[1.0, 2.0], [3.0, 4.0]], "MEAN", None, [2.0, 3.0]),
    ([[1.0, 2.0], [3.0, 4.0]], "MEAN", 0, 2.5),
    ([[1.0, 2.0], [3.0]], "SUM", 0, 6.0),
    ([[1.0, 2.0], [3.0]], "MEAN", 0, 2.0),
    ([[5.0], []], "SUM", 0, 5.0),
    ([[5.0], []], "MEAN", 0, 5.0),
    ([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0]]], "SUM", 0, [9.0, 12.0]),
    ([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0]]], "MEAN", 0, [3.0, 4.0]),
    ([[], []], "SUM", 0, 0.0),
]


@pytest.mark.parametrize("values, op, axis, expected", TABLE)
def test_reference_table(multi_strategy, values, op, axis, expected):
    value = distribute(multi_strategy, [f32(v) for v in values])
    result = multi_strategy.reduce(op, value, axis=axis)
    assert_tensor_equal(result, expected, torch.float32)


def test_mean_of_two_empty_replicas_is_nan(multi_strategy):
    value = distribute(multi_strategy, [f32([]), f32([])])
    result = multi_strategy.reduce("MEAN", value, axis=0)
    assert isinstance(result, torch.Tensor)
    assert result.shape == ()
    assert torch.isnan(result).item()


def test_int32_sum_stays_integer_and_mean_is_floating(multi_strategy):
    value = distribute(
        multi_strategy, [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)]
    )
    assert_tensor_equal(multi_strategy.reduce("SUM", value, axis=None), [3, 5], torch.int32)
    total = multi_strategy.reduce("SUM", value, axis=0)
    assert not total.is_floating_point() and total.dtype in (torch.int32, torch.int64)
    assert total.item() == 8
    mean = multi_strategy.reduce("MEAN", value, axis=None)
    assert mean.is_floating_point()
    np.testing.assert_allclose(mean.numpy(), [1.5, 2.5])
    mean0 = multi_strategy.reduce("MEAN", value, axis=0)
    assert mean0.is_floating_point()
    assert mean0.item() == 2.0


# --- NumPy oracle over every strategy ---------------------------------------------------------


@pytest.fixture(
    params=["default", "one_device", "mirrored2", "central_storage2", "mirrored3", "mirrored4", "multi_worker1x2"]
)
def any_strategy(request):
    return make_strategy(request.param)


def _arrays(count, rows, cols=3, seed=0):
    rng = np.random.default_rng(seed)
    # Integer-valued floats: every sum is exact, so results must be equal, not just close.
    return [rng.integers(-50, 50, size=(r, cols)).astype(np.float32) for r in rows[:count]]


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_axis0_uneven_batches_match_numpy(any_strategy, op):
    count = any_strategy.num_replicas_in_sync
    arrays = _arrays(count, [4, 2, 0, 3])
    value = distribute(any_strategy, [torch.from_numpy(a) for a in arrays])
    everything = np.concatenate(arrays, axis=0)
    expected = everything.sum(axis=0) if op == "SUM" else everything.sum(axis=0) / everything.shape[0]
    result = any_strategy.reduce(op, value, axis=0)
    assert isinstance(result, torch.Tensor)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_axis1_matches_numpy(any_strategy, op):
    count = any_strategy.num_replicas_in_sync
    arrays = _arrays(count, [3] * count, cols=5, seed=1)
    value = distribute(any_strategy, [torch.from_numpy(a) for a in arrays])
    stacked = np.stack(arrays)  # (replicas, rows, cols)
    expected = stacked.sum(axis=(0, 2))
    if op == "MEAN":
        expected = expected / (count * 5)
    np.testing.assert_allclose(any_strategy.reduce(op, value, axis=1).numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_axis_none_matches_numpy(any_strategy, op):
    count = any_strategy.num_replicas_in_sync
    arrays = _arrays(count, [2] * count, seed=2)
    value = distribute(any_strategy, [torch.from_numpy(a) for a in arrays])
    expected = np.sum(arrays, axis=0)
    if op == "MEAN":
        expected = expected / count
    result = any_strategy.reduce(op, value, axis=None)
    assert result.shape == (2, 3)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)


def test_batch_split_4_2_mean_divides_by_six(multi_strategy):
    value = distribute(multi_strategy, [torch.arange(4.0), torch.arange(4.0, 6.0)])
    # The global mean of 0..5 is 2.5; averaging the replicas' means would give 3.0.
    assert multi_strategy.reduce("MEAN", value, axis=0).item() == 2.5
    assert multi_strategy.reduce("SUM", value, axis=0).item() == 15.0


# --- plain (non-distributed) values ----------------------------------------------------------


def test_plain_value_is_the_same_on_every_replica(strategy):
    count = strategy.num_replicas_in_sync
    t = f32([1.0, 2.0])
    assert_tensor_equal(strategy.reduce("SUM", t, axis=None), [1.0 * count, 2.0 * count])
    assert_tensor_equal(strategy.reduce("MEAN", t, axis=None), [1.0, 2.0])
    assert_tensor_equal(strategy.reduce("SUM", t, axis=0), 3.0 * count)
    assert_tensor_equal(strategy.reduce("MEAN", t, axis=0), 1.5)


def test_plain_python_number(strategy):
    count = strategy.num_replicas_in_sync
    total = strategy.reduce("SUM", 3.0, axis=None)
    assert isinstance(total, torch.Tensor)
    assert total.item() == 3.0 * count
    mean = strategy.reduce("MEAN", 3.0, axis=None)
    assert isinstance(mean, torch.Tensor)
    assert mean.item() == 3.0


def test_plain_2d_value_along_axis1(strategy):
    count = strategy.num_replicas_in_sync
    t = f32([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert_tensor_equal(strategy.reduce("SUM", t, axis=1), [6.0 * count, 15.0 * count])
    assert_tensor_equal(strategy.reduce("MEAN", t, axis=1), [2.0, 5.0])


# --- nests, errors, op spellings -------------------------------------------------------------


def test_nests_are_reduced_per_leaf(strategy):
    count = strategy.num_replicas_in_sync
    ones = distribute(strategy, [torch.tensor(1.0)] * count)
    twos = distribute(strategy, [torch.tensor(2.0)] * count)
    result = strategy.reduce("SUM", (ones, twos), axis=None)
    assert isinstance(result, tuple) and len(result) == 2
    assert [r.item() for r in result] == [1.0 * count, 2.0 * count]

    rows = distribute(strategy, [f32([[float(i), 1.0]] * (i + 1)) for i in range(count)])
    nested = strategy.reduce("SUM", {"a": ones, "b": [twos, 5.0]}, axis=None)
    assert set(nested) == {"a", "b"} and isinstance(nested["b"], list) and len(nested["b"]) == 2
    assert nested["a"].item() == count
    assert nested["b"][0].item() == 2.0 * count
    assert nested["b"][1].item() == 5.0 * count

    pair = strategy.reduce("MEAN", Pair(first=rows, second=rows), axis=0)
    assert isinstance(pair, Pair)
    everything = np.concatenate([np.array([[float(i), 1.0]] * (i + 1), np.float32) for i in range(count)])
    for leaf in pair:
        np.testing.assert_allclose(leaf.numpy(), everything.mean(axis=0), rtol=1e-6)


def test_shape_mismatch_without_axis_is_a_helpful_value_error(multi_strategy):
    value = distribute(multi_strategy, [f32([1.0, 2.0]), f32([3.0])])
    with pytest.raises(ValueError) as info:
        multi_strategy.reduce("SUM", value, axis=None)
    message = str(info.value)
    assert "shape" in message
    assert "(2,)" in message and "(1,)" in message
    assert "axis" in message  # points at the fix: reduce along an axis


@pytest.mark.parametrize("op", ["sum", "SUM", "Sum", ds.ReduceOp.SUM])
def test_sum_spellings(strategy, op):
    value = distribute(strategy, [f32([1.0, 2.0])] * strategy.num_replicas_in_sync)
    expected = [1.0 * strategy.num_replicas_in_sync, 2.0 * strategy.num_replicas_in_sync]
    assert_tensor_equal(strategy.reduce(op, value, axis=None), expected)


@pytest.mark.parametrize("op", ["mean", "MEAN", ds.ReduceOp.MEAN])
def test_mean_spellings(strategy, op):
    value = distribute(strategy, [f32([1.0, 2.0])] * strategy.num_replicas_in_sync)
    assert_tensor_equal(strategy.reduce(op, value, axis=0), 1.5)


@pytest.mark.parametrize("axis", [None, 0])
def test_bad_reduce_ops(strategy, axis):
    value = distribute(strategy, [f32([1.0])] * strategy.num_replicas_in_sync)
    with pytest.raises(ValueError, match="MAX"):
        strategy.reduce("MAX", value, axis=axis)
    with pytest.raises(TypeError):
        strategy.reduce(ds.VariableAggregation.SUM, value, axis=axis)
    with pytest.raises(TypeError):
        strategy.reduce(ds.VariableAggregation.MEAN, value, axis=axis)


def test_reduce_inside_replica_fn_raises(multi_strategy):
    def fn():
        multi_strategy.reduce("SUM", torch.tensor(1.0), axis=None)

    with pytest.raises(RuntimeError):
        multi_strategy.run(fn)


def test_result_is_a_host_tensor(strategy):
    out = strategy.run(lambda: replica_id())
    for op in ("SUM", "MEAN"):
        result = strategy.reduce(op, out, axis=None)
        assert type(result) is torch.Tensor
        assert result.device.type == "cpu"
    result = strategy.reduce("SUM", strategy.run(lambda: torch.ones(2)), axis=0)
    assert type(result) is torch.Tensor


def test_reduce_inside_and_outside_scope_agree(strategy):
    value = strategy.run(lambda: torch.tensor([1.0, 2.0]) * (replica_id() + 1))
    outside = strategy.reduce("SUM", value, axis=None)
    with strategy.scope():
        inside = strategy.reduce("SUM", value, axis=None)
    assert torch.equal(outside, inside)
    count = strategy.num_replicas_in_sync
    factor = sum(range(1, count + 1))
    assert_tensor_equal(outside, [1.0 * factor, 2.0 * factor])


# --- distributed variables --------------------------------------------------------------------


def test_mirrored_variable():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable([1.0, 2.0])
    assert_tensor_equal(strategy.reduce("SUM", v, axis=None), [2.0, 4.0])
    assert_tensor_equal(strategy.reduce("MEAN", v, axis=None), [1.0, 2.0])
    assert_tensor_equal(strategy.reduce("SUM", v, axis=0), 6.0)
    assert_tensor_equal(strategy.reduce("MEAN", v, axis=0), 1.5)


def test_sync_on_read_variable_sum():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(0.0, synchronization=ds.VariableSynchronization.ON_READ, aggregation="SUM")
    strategy.run(lambda: v.assign(11.0 + replica_id()))
    assert [float(c.numpy()) for c in strategy.experimental_local_results(v)] == [11.0, 12.0]
    assert strategy.reduce("SUM", v, axis=None).item() == 23.0
    assert strategy.reduce("MEAN", v, axis=None).item() == 11.5


# --- the seed's / docstring examples and reference cases 5, 6, 31, 32 -------------------------


def test_case5_replica_ids_sum(any_strategy):
    count = any_strategy.num_replicas_in_sync
    out = any_strategy.run(lambda: replica_id())
    result = any_strategy.reduce("SUM", out, axis=None)
    assert isinstance(result, torch.Tensor)
    assert result.item() == sum(range(count))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_case6_reduce_axis(any_strategy, dtype):
    count = any_strategy.num_replicas_in_sync
    out = any_strategy.run(lambda: torch.full((replica_id() + 1,), replica_id(), dtype=dtype))
    expected_sum = sum(r * (r + 1) for r in range(count))
    expected_count = sum(r + 1 for r in range(count))
    total = any_strategy.reduce("SUM", out, axis=0)
    assert total.item() == expected_sum
    mean = any_strategy.reduce("MEAN", out, axis=0)
    assert mean.is_floating_point()
    assert mean.item() == pytest.approx(expected_sum / expected_count, rel=1e-6)


def test_case31_values_from_function_sum(any_strategy):
    count = any_strategy.num_replicas_in_sync
    value = any_strategy.experimental_distribute_values_from_function(lambda _: 1.0)
    assert any_strategy.reduce("SUM", value, axis=None).item() == count
    with any_strategy.scope():
        assert any_strategy.reduce("SUM", value, axis=None).item() == count


def test_case32_run_then_reduce_axis(any_strategy):
    count = any_strategy.num_replicas_in_sync
    out = any_strategy.run(lambda: torch.tensor([1.0, 2.0]))
    assert any_strategy.reduce("MEAN", out, axis=0).item() == 1.5
    assert any_strategy.reduce("SUM", out, axis=0).item() == 3.0 * count


def test_values_from_function_then_run(any_strategy):
    count = any_strategy.num_replicas_in_sync
    value = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group))
    )
    if count > 1:
        assert isinstance(value, ds.PerReplica)
    out = any_strategy.run(lambda x: x + 1.0, args=(value,))
    results = any_strategy.experimental_local_results(out)
    assert [float(r) for r in results] == [float(i + 1) for i in range(count)]
    assert any_strategy.reduce("SUM", out, axis=None).item() == sum(i + 1 for i in range(count))


def test_module_docstring_example():
    strategy = make_strategy("mirrored2")
    out = strategy.run(lambda: torch.tensor([1.0, 2.0]) * (replica_id() + 1))
    assert_tensor_equal(strategy.reduce("SUM", out, axis=None), [3.0, 6.0])


# --- gather --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parts, axis",
    [
        ([[1.0, 2.0], [3.0]], 0),
        ([[5.0], []], 0),
        ([[[1.0, 2.0]], [[3.0, 4.0], [5.0, 6.0]]], 0),
        ([[[1.0], [2.0]], [[3.0, 4.0], [5.0, 6.0]]], 1),
    ],
)
def test_gather_uneven_sizes_match_numpy(multi_strategy, parts, axis):
    arrays = [np.array(p, dtype=np.float32) for p in parts]
    value = distribute(multi_strategy, [torch.from_numpy(a) for a in arrays])
    result = multi_strategy.gather(value, axis)
    assert isinstance(result, torch.Tensor)
    np.testing.assert_array_equal(result.numpy(), np.concatenate(arrays, axis=axis))


def test_gather_over_every_strategy(any_strategy):
    count = any_strategy.num_replicas_in_sync
    parts = [np.full((i + 1, 2), i, dtype=np.float32) for i in range(count)]
    value = distribute(any_strategy, [torch.from_numpy(p) for p in parts])
    np.testing.assert_array_equal(any_strategy.gather(value, 0).numpy(), np.concatenate(parts))


def test_gather_plain_value_is_returned_unchanged(strategy):
    t = f32([1.0, 2.0])
    assert strategy.gather(t, 0) is t
    assert strategy.gather(7, 0) == 7


def test_gather_mirrored_variable_gives_one_copy_per_replica():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable([1.0, 2.0])
    assert_tensor_equal(strategy.gather(v, 0), [1.0, 2.0, 1.0, 2.0])


def test_gather_inside_replica_fn_raises(multi_strategy):
    with pytest.raises(RuntimeError):
        multi_strategy.run(lambda: multi_strategy.gather(torch.ones(1), 0))


# --- experimental_local_results / unwrap --------------------------------------------------------


@pytest.mark.parametrize("method", ["experimental_local_results", "unwrap"])
def test_local_results_of_plain_values(strategy, method):
    t = f32([1.0])
    result = getattr(strategy, method)(t)
    assert isinstance(result, tuple) and len(result) == 1 and result[0] is t
    assert getattr(strategy, method)(3.0) == (3.0,)


@pytest.mark.parametrize("method", ["experimental_local_results", "unwrap"])
def test_local_results_of_per_replica(any_strategy, method):
    count = any_strategy.num_replicas_in_sync
    parts = [torch.tensor(float(i)) for i in range(count)]
    value = distribute(any_strategy, parts)
    result = getattr(any_strategy, method)(value)
    assert isinstance(result, tuple) and len(result) == count
    assert all(r is p for r, p in zip(result, parts))


def test_local_results_of_a_nest_repeat_plain_leaves(multi_strategy):
    a = distribute(multi_strategy, [torch.tensor(1.0), torch.tensor(2.0)])
    result = multi_strategy.experimental_local_results({"a": a, "b": 1})
    assert isinstance(result, tuple) and len(result) == 2
    assert result[0] == {"a": a.values[0], "b": 1}
    assert result[1]["a"] is a.values[1] and result[1]["b"] == 1
    pair = multi_strategy.unwrap(Pair(a, "x"))
    assert pair == (Pair(a.values[0], "x"), Pair(a.values[1], "x"))
    assert all(isinstance(p, Pair) for p in pair)


def test_local_results_of_mirrored_variable():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(3.0)
    result = strategy.experimental_local_results(v)
    assert len(result) == 2
    assert [c.device for c in result] == ["cpu:0", "cpu:1"]
    assert all(isinstance(c, ds.Variable) and float(c.numpy()) == 3.0 for c in result)
    assert all(strategy.extended.value_container(c) is v for c in result)


def test_local_results_of_central_storage_variable():
    strategy = make_strategy("central_storage2")
    with strategy.scope():
        v = ds.Variable([1.0, 2.0])
    result = strategy.experimental_local_results(v)
    assert isinstance(result, tuple) and len(result) == 1
    (stored,) = result
    assert isinstance(stored, ds.Variable) and stored is not v
    assert stored.device == "cpu:0"
    np.testing.assert_array_equal(stored.numpy(), [1.0, 2.0])
    assert strategy.extended.value_container(stored) is v
    assert strategy.unwrap(v) == result


def test_local_results_one_device_variable():
    strategy = make_strategy("one_device")
    with strategy.scope():
        v = ds.Variable(1.0)
    result = strategy.experimental_local_results(v)
    assert len(result) == 1 and result[0] is v


def test_bool_values_are_counted_not_or_ed():
    strategy = make_strategy("mirrored2")
    flags = ds.PerReplica((torch.tensor([True, True]), torch.tensor([True, False])))
    assert strategy.reduce("SUM", flags, axis=None).tolist() == [2, 1]
    assert strategy.reduce("MEAN", flags, axis=None).tolist() == [1.0, 0.5]
    assert strategy.reduce("SUM", flags, axis=0).item() == 3
    out = strategy.run(lambda f: ds.get_replica_context().all_reduce("SUM", f), args=(flags,))
    assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[2, 1], [2, 1]]
