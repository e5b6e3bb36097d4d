"""extended.reduce_to / batch_reduce_to, packing, CommunicationOptions and the cross-device ops.

StrategyExtended.reduce_to/batch_reduce_to as TensorFlow 2.21 behaves, and bytes_per_pack packing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_strategy, requires_gpus

import replicafit.strategies as ds
from replicafit.strategies.cross_device_ops import group_by_size


def distribute(strategy, values):
    assert len(values) == strategy.num_replicas_in_sync
    return strategy.experimental_distribute_values_from_function(lambda ctx: values[ctx.replica_id_in_sync_group])


def mirrored(count=2, cross_device_ops=None):
    return ds.MirroredStrategy([f"cpu:{i}" for i in range(count)], cross_device_ops=cross_device_ops)


def components(result):
    return result.values if isinstance(result, ds.DistributedValues) else (result,)


def assert_reduced(result, expected, devices):
    """``result`` is a plain tensor on one device, or a ``Mirrored`` on ``devices``, holding ``expected``."""
    if len(devices) == 1:
        assert isinstance(result, torch.Tensor), f"one destination must give a tensor, got {type(result).__name__}"
    else:
        assert isinstance(result, ds.Mirrored), f"several destinations must give a Mirrored, got {result!r}"
        assert tuple(result.devices) == tuple(devices)
        assert len(result.values) == len(devices)
    for tensor in components(result):
        assert isinstance(tensor, torch.Tensor)
        np.testing.assert_array_equal(tensor.numpy(), np.asarray(expected))


# --- destinations ----------------------------------------------------------------------------------


@pytest.fixture
def two():
    return mirrored(2)


def _pr(strategy):
    return distribute(strategy, [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])


@pytest.mark.parametrize(
    "destinations, devices",
    [
        ("cpu:1", ("cpu:1",)),
        ("/device:CPU:1", ("cpu:1",)),
        (torch.device("cpu"), ("cpu:0",)),
        (["cpu:1"], ("cpu:1",)),
        (["cpu:0", "cpu:1"], ("cpu:0", "cpu:1")),
        (["cpu:1", "CPU:0"], ("cpu:1", "cpu:0")),
        (("cpu:0", "cpu:1"), ("cpu:0", "cpu:1")),
    ],
)
@pytest.mark.parametrize("op, expected", [("SUM", [4.0, 6.0]), ("MEAN", [2.0, 3.0])])
def test_reduce_to_device_strings(two, destinations, devices, op, expected):
    result = two.extended.reduce_to(op, _pr(two), destinations)
    assert_reduced(result, expected, devices)


def test_reduce_to_a_mirrored_variable(two):
    with two.scope():
        v = ds.Variable([0.0, 0.0])
    assert_reduced(two.extended.reduce_to("SUM", _pr(two), v), [4.0, 6.0], ("cpu:0", "cpu:1"))
    assert_reduced(two.extended.reduce_to("MEAN", _pr(two), v), [2.0, 3.0], ("cpu:0", "cpu:1"))
    # the destination variable is not written
    assert [c.numpy().tolist() for c in two.experimental_local_results(v)] == [[0.0, 0.0], [0.0, 0.0]]


def test_reduce_to_a_distributed_value(two):
    dest = two.run(lambda: torch.zeros(2))
    assert isinstance(dest, ds.PerReplica)
    assert_reduced(two.extended.reduce_to("SUM", _pr(two), dest), [4.0, 6.0], tuple(dest.devices))
    assert tuple(dest.devices) == ("cpu:0", "cpu:1")


def test_reduce_to_the_mirrored_result_of_update(two):
    with two.scope():
        v = ds.Variable([0.0, 0.0])
    grouped = two.extended.update(v, lambda c: c.read_value() + 1.0)
    assert isinstance(grouped, ds.Mirrored)
    # a Mirrored made by update lives on the variable's devices, wherever it is used later
    assert tuple(grouped.devices) == ("cpu:0", "cpu:1")
    assert_reduced(two.extended.reduce_to("SUM", _pr(two), grouped), [4.0, 6.0], ("cpu:0", "cpu:1"))


def test_reduce_to_a_central_storage_variable():
    strategy = make_strategy("central_storage2")
    with strategy.scope():
        v = ds.Variable([0.0, 0.0])
    result = strategy.extended.reduce_to("SUM", _pr(strategy), v)
    assert_reduced(result, [4.0, 6.0], ("cpu:0",))


def test_reduce_to_one_device_variable():
    strategy = make_strategy("one_device")
    with strategy.scope():
        v = ds.Variable([0.0, 0.0])
    value = torch.tensor([1.0, 2.0])
    for op in ("SUM", "MEAN"):
        assert_reduced(strategy.extended.reduce_to(op, value, v), [1.0, 2.0], ("cpu:0",))


def test_empty_destinations(two):
    with pytest.raises(ValueError, match="empty"):
        two.extended.reduce_to("SUM", _pr(two), [])
    with pytest.raises(ValueError, match="empty"):
        two.extended.batch_reduce_to("SUM", [(_pr(two), [])])


@pytest.mark.parametrize("destinations", [5, None, 1.5, {"a": "cpu:0"}, ["cpu:0", 3], object()])
def test_bad_destinations(two, destinations):
    with pytest.raises(ValueError, match="destinations"):
        two.extended.reduce_to("SUM", _pr(two), destinations)
    with pytest.raises(ValueError, match="destinations"):
        two.extended.batch_reduce_to("SUM", [(_pr(two), "cpu:0"), (_pr(two), destinations)])


def test_unknown_destination_device(two):
    with pytest.raises(ValueError, match="tpu"):
        two.extended.reduce_to("SUM", _pr(two), "tpu:0")


# --- non-distributed values ------------------------------------------------------------------------


def test_non_distributed_sum_with_several_replicas_raises(multi_strategy):
    with pytest.raises(ValueError, match="non-DistributedValues"):
        multi_strategy.extended.reduce_to("SUM", torch.tensor(1.0), "cpu:0")
    with pytest.raises(ValueError, match="non-DistributedValues"):
        multi_strategy.extended.batch_reduce_to("SUM", [(torch.tensor(1.0), "cpu:0")])


def test_non_distributed_mean_is_the_value(strategy):
    t = torch.tensor([1.0, 2.0])
    assert_reduced(strategy.extended.reduce_to("MEAN", t, "cpu:0"), [1.0, 2.0], ("cpu:0",))
    assert_reduced(strategy.extended.reduce_to("MEAN", t, ["cpu:0", "cpu:1"]), [1.0, 2.0], ("cpu:0", "cpu:1"))


@pytest.mark.parametrize("name", ["default", "one_device"])
def test_non_distributed_sum_with_one_replica_is_the_value(name):
    strategy = make_strategy(name)
    t = torch.tensor([1.0, 2.0])
    assert_reduced(strategy.extended.reduce_to("SUM", t, "cpu:0"), [1.0, 2.0], ("cpu:0",))
    (result,) = strategy.extended.batch_reduce_to("SUM", [(t, "cpu:0")])
    assert_reduced(result, [1.0, 2.0], ("cpu:0",))


def test_mirrored_mean_is_the_value(two):
    value = ds.Mirrored((torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])), ("cpu:0", "cpu:1"))
    assert_reduced(two.extended.reduce_to("MEAN", value, ["cpu:0", "cpu:1"]), [1.0, 2.0], ("cpu:0", "cpu:1"))


# --- batch_reduce_to ---------------------------------------------------------------------------------


def test_batch_reduce_returns_one_result_per_pair(two):
    with two.scope():
        v = ds.Variable([0.0, 0.0])
    pr = _pr(two)
    results = two.extended.batch_reduce_to("SUM", [(pr, v), (pr, "cpu:1"), (pr, ["cpu:0", "cpu:1"])])
    assert isinstance(results, list) and len(results) == 3
    assert_reduced(results[0], [4.0, 6.0], ("cpu:0", "cpu:1"))
    assert_reduced(results[1], [4.0, 6.0], ("cpu:1",))
    assert_reduced(results[2], [4.0, 6.0], ("cpu:0", "cpu:1"))
    assert two.extended.batch_reduce_to("SUM", []) == []


@pytest.mark.parametrize("count", [2, 4])
def test_case34_batch_reduce_dense(count):
    strategy = mirrored(count)
    value = distribute(strategy, [torch.tensor([2.0 * i + 1, 2.0 * i + 2]) for i in range(count)])
    with strategy.scope():
        v = ds.Variable([0.0, 0.0])
    devices = tuple(f"cpu:{i}" for i in range(count))
    expected_sum = {2: [4.0, 6.0], 4: [16.0, 20.0]}[count]
    expected_mean = {2: [2.0, 3.0], 4: [4.0, 5.0]}[count]
    (total,) = strategy.extended.batch_reduce_to("SUM", [(value, v)])
    (mean,) = strategy.extended.batch_reduce_to("MEAN", [(value, v)])
    assert_reduced(total, expected_sum, devices)
    assert_reduced(mean, expected_mean, devices)


@pytest.mark.parametrize(
    "op, expected", [("mean", [2.0, 3.0]), ("MEAN", [2.0, 3.0]), ("sum", [4.0, 6.0]), ("SUM", [4.0, 6.0])]
)
def test_case49_string_ops(two, op, expected):
    pr = _pr(two)
    np.testing.assert_array_equal(two.reduce(op, pr, axis=None).numpy(), expected)
    assert_reduced(two.extended.reduce_to(op, pr, "cpu:0"), expected, ("cpu:0",))
    (result,) = two.extended.batch_reduce_to(op, [(pr, "cpu:0")])
    assert_reduced(result, expected, ("cpu:0",))


def test_bad_ops(two):
    pr = _pr(two)
    with pytest.raises(ValueError):
        two.extended.reduce_to("MAX", pr, "cpu:0")
    with pytest.raises(TypeError):
        two.extended.batch_reduce_to(ds.VariableAggregation.SUM, [(pr, "cpu:0")])


def test_reduce_to_inside_replica_fn_raises(multi_strategy):
    pr = _pr(multi_strategy)
    with pytest.raises(RuntimeError):
        multi_strategy.run(lambda: multi_strategy.extended.reduce_to("SUM", pr, "cpu:0"))
    with pytest.raises(RuntimeError):
        multi_strategy.run(lambda: multi_strategy.extended.batch_reduce_to("SUM", [(pr, "cpu:0")]))


def test_reduce_to_inside_merge_fn_works(two):
    def merge_fn(strategy, value):
        return strategy.extended.reduce_to("SUM", value, "cpu:0")

    out = two.run(lambda: ds.get_replica_context().merge_call(merge_fn, args=(torch.tensor([1.0, 2.0]),)))
    for tensor in two.experimental_local_results(out):
        np.testing.assert_array_equal(tensor.numpy(), [2.0, 4.0])


def _random_values(strategy, shapes, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    count = strategy.num_replicas_in_sync
    out = []
    for shape in shapes:
        if dtype.is_floating_point:
            parts = [torch.randn(shape, generator=gen).to(dtype) for _ in range(count)]
        else:
            parts = [torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype) for _ in range(count)]
        out.append(distribute(strategy, parts))
    return out


SHAPES = [(3,), (5, 7), (), (64,), (2, 3, 4), (1,), (17,)]


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_batch_reduce_bit_identical_to_per_pair_reduce_to(count, op):
    strategy = mirrored(count)
    destinations = ["cpu:0", [f"cpu:{i}" for i in range(count)], "cpu:1"]
    pairs = []
    for i, value in enumerate(_random_values(strategy, SHAPES, torch.float32, seed=count)):
        pairs.append((value, destinations[i % len(destinations)]))
    batched = strategy.extended.batch_reduce_to(op, pairs)
    assert len(batched) == len(pairs)
    for (value, dest), result in zip(pairs, batched):
        single = strategy.extended.reduce_to(op, value, dest)
        assert type(single) is type(result)
        for a, b in zip(components(result), components(single), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        # and the value: replica-order sum (oracle in float64, tolerance for float32 rounding)
        parts = np.stack([c.numpy().astype(np.float64) for c in value.values])
        expected = parts.sum(axis=0) / (count if op == "MEAN" else 1)
        for tensor in components(result):
            np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5, atol=1e-6)


# --- packing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, budget, packs",
    [
        ([4, 8, 12, 16, 20], 24, [[0, 1, 2], [3], [4]]),
        ([4, 8, 12, 16, 20], 0, [[0, 1, 2, 3, 4]]),
        ([4, 8, 12, 16, 20], 1, [[0], [1], [2], [3], [4]]),
        ([4, 8, 12, 16, 20], 8, [[0], [1], [2], [3], [4]]),
        ([4, 8, 12, 16, 20], 12, [[0, 1], [2], [3], [4]]),
        ([4, 8, 12, 16, 20], 36, [[0, 1, 2], [3, 4]]),
        ([4, 8, 12, 16, 20], 40, [[0, 1, 2, 3], [4]]),
        ([4, 8, 12, 16, 20], 60, [[0, 1, 2, 3, 4]]),
        ([4, 100, 4], 24, [[0], [1], [2]]),
        ([100, 4, 4], 24, [[0], [1, 2]]),
        ([4, 4, 100], 24, [[0, 1], [2]]),
        ([24, 24], 24, [[0], [1]]),
        ([], 24, []),
    ],
)
def test_group_by_size_at_most(nbytes, budget, packs):
    result = group_by_size(nbytes, budget)
    assert result == packs
    # at-most semantics: every pack of more than one tensor fits the budget
    if budget:
        for pack in result:
            assert len(pack) == 1 or sum(nbytes[i] for i in pack) <= budget
    assert [i for pack in result for i in pack] == list(range(len(nbytes)))


# --- CommunicationOptions ----------------------------------------------------------------------------


def test_communication_options_defaults():
    options = ds.CommunicationOptions()
    assert options.bytes_per_pack == 0
    assert options.timeout_seconds is None
    assert options.implementation is ds.CommunicationImplementation.AUTO


def test_communication_options_validation():
    with pytest.raises(ValueError, match="must be >=0"):
        ds.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError):
        ds.CommunicationOptions(implementation="MAGIC")
    for spelling in ("ring", "RING", ds.CommunicationImplementation.RING):
        assert ds.CommunicationOptions(implementation=spelling).implementation is ds.CommunicationImplementation.RING
    assert ds.CommunicationOptions(implementation="nccl").implementation is ds.CommunicationImplementation.NCCL
    assert ds.CommunicationOptions(bytes_per_pack=50 * 2**20).bytes_per_pack == 52428800


def test_communication_options_merge():
    base = ds.CommunicationOptions(bytes_per_pack=100, timeout_seconds=5.0, implementation="RING")
    merged = base.merge(ds.CommunicationOptions())
    assert (merged.bytes_per_pack, merged.timeout_seconds, merged.implementation) == (
        100,
        5.0,
        ds.CommunicationImplementation.RING,
    )
    merged = base.merge(ds.CommunicationOptions(bytes_per_pack=7))
    assert (merged.bytes_per_pack, merged.timeout_seconds, merged.implementation) == (
        7,
        5.0,
        ds.CommunicationImplementation.RING,
    )
    merged = base.merge(ds.CommunicationOptions(timeout_seconds=1.0, implementation="NCCL"))
    assert (merged.bytes_per_pack, merged.timeout_seconds, merged.implementation) == (
        100,
        1.0,
        ds.CommunicationImplementation.NCCL,
    )
    merged = ds.CommunicationOptions().merge(base)
    assert (merged.bytes_per_pack, merged.timeout_seconds, merged.implementation) == (
        100,
        5.0,
        ds.CommunicationImplementation.RING,
    )
    # merge never mutates either side
    assert (base.bytes_per_pack, base.timeout_seconds, base.implementation) == (
        100,
        5.0,
        ds.CommunicationImplementation.RING,
    )
    merged = base.merge(None)
    assert (merged.bytes_per_pack, merged.timeout_seconds) == (100, 5.0)


MIXED_DTYPES = [torch.float32, torch.float64, torch.int64]


def _mixed_pairs(strategy):
    pairs = []
    for i, dtype in enumerate(MIXED_DTYPES):
        for value in _random_values(strategy, SHAPES, dtype, seed=10 + i):
            pairs.append((value, strategy.extended.worker_devices))
    # interleave dtypes so that packs have to be formed per dtype
    return [pairs[j] for i in range(len(SHAPES)) for j in range(i, len(pairs), len(SHAPES))]


def _expected(value, op, count):
    parts = [c.numpy() for c in value.values]
    total = parts[0].copy()
    for p in parts[1:]:
        total = total + p  # replica order, same dtype as the inputs
    return total if op == "SUM" else total / count


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_batch_reduce_pack_sizes_give_the_same_results(count, op):
    strategy = mirrored(count)
    pairs = _mixed_pairs(strategy)
    reference = None
    for budget in [0, 1, 8, 24, 100, 256, 4096, 10**9]:
        options = ds.CommunicationOptions(bytes_per_pack=budget)
        results = strategy.extended.batch_reduce_to(op, pairs, options=options)
        assert len(results) == len(pairs)
        flat = [t for r in results for t in components(r)]
        if reference is None:
            reference = flat
            for (value, _), result in zip(pairs, results):
                assert isinstance(result, ds.Mirrored)
                expected = _expected(value, op, count)
                for tensor in result.values:
                    if op == "MEAN":
                        assert tensor.is_floating_point()
                    np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-6, atol=1e-6)
                    if op == "SUM":
                        assert tensor.dtype == value.values[0].dtype
        else:
            assert len(flat) == len(reference)
            for a, b in zip(flat, reference):
                assert a.dtype == b.dtype and torch.equal(a, b), f"bytes_per_pack={budget} changed a result"


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("budget", [0, 24, 4096])
def test_flat_buffer_path_equals_multi_tensor_path(monkeypatch, count, op, budget):
    ops = ds.ReductionToOneDevice()
    strategy = mirrored(count, cross_device_ops=ops)
    pairs = _mixed_pairs(strategy) + [
        (v, "cpu:0") for v in _random_values(strategy, [(4, 4), (9,)], torch.float32, seed=99)
    ]
    options = ds.CommunicationOptions(bytes_per_pack=budget)
    fast = strategy.extended.batch_reduce_to(op, pairs, options=options)
    monkeypatch.setattr(ops, "_force_flat", True)
    flat = strategy.extended.batch_reduce_to(op, pairs, options=options)
    assert len(fast) == len(flat) == len(pairs)
    for a, b in zip(fast, flat):
        assert type(a) is type(b)
        for x, y in zip(components(a), components(b), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)


def test_mean_of_ints_is_floating(two):
    value = distribute(two, [torch.tensor([1, 2], dtype=torch.int64), torch.tensor([2, 5], dtype=torch.int64)])
    for result in (
        two.extended.reduce_to("MEAN", value, "cpu:0"),
        two.extended.batch_reduce_to("MEAN", [(value, ["cpu:0", "cpu:1"])])[0],
    ):
        for tensor in components(result):
            assert tensor.is_floating_point()
            np.testing.assert_allclose(tensor.numpy(), [1.5, 3.5])
    total = two.extended.reduce_to("SUM", value, "cpu:0")
    assert total.dtype == torch.int64
    assert total.tolist() == [3, 7]


# --- the cross-device ops themselves ----------------------------------------------------------------


def test_reduction_to_one_device_on_another_device():
    ops = ds.ReductionToOneDevice(reduce_to_device="cpu:1")
    assert ops.reduce_to_device == "cpu:1"
    assert ds.ReductionToOneDevice(reduce_to_device="/device:CPU:1").reduce_to_device == "cpu:1"
    strategy = mirrored(2, cross_device_ops=ops)
    pr = _pr(strategy)
    assert_reduced(strategy.extended.reduce_to("SUM", pr, ["cpu:0", "cpu:1"]), [4.0, 6.0], ("cpu:0", "cpu:1"))
    assert_reduced(strategy.extended.reduce_to("MEAN", pr, "cpu:0"), [2.0, 3.0], ("cpu:0",))
    np.testing.assert_array_equal(strategy.reduce("SUM", pr, axis=None).numpy(), [4.0, 6.0])
    with pytest.raises(ValueError):
        ds.ReductionToOneDevice(reduce_to_device="tpu:0")


def test_cross_device_ops_docstring_example():
    ops = ds.ReductionToOneDevice()
    value = ds.PerReplica((torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])), ("cpu:0", "cpu:1"))
    result = ops.reduce("SUM", value, destinations=["cpu:0", "cpu:1"])
    assert_reduced(result, [4.0, 6.0], ("cpu:0", "cpu:1"))
    results = ops.batch_reduce("MEAN", [(value, "cpu:0"), (value, "cpu:1")])
    assert_reduced(results[0], [2.0, 3.0], ("cpu:0",))
    assert_reduced(results[1], [2.0, 3.0], ("cpu:1",))
    broadcast = ops.broadcast(torch.tensor([7.0]), ["cpu:0", "cpu:1"])
    assert_reduced(broadcast, [7.0], ("cpu:0", "cpu:1"))


def test_mirrored_strategy_rejects_a_non_cross_device_ops():
    with pytest.raises(ValueError):
        ds.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops="nccl")


def test_nccl_num_packs_validation():
    with pytest.raises(ValueError, match="num_packs >= 0"):
        ds.NcclAllReduce(num_packs=-1)
    assert ds.NcclAllReduce(num_packs=0).num_packs == 0
    assert ds.NcclAllReduce().num_packs == 1


def test_nccl_falls_back_on_cpu_values():
    ops = ds.NcclAllReduce()
    value = ds.PerReplica((torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])), ("cpu:0", "cpu:1"))
    assert_reduced(ops.reduce("SUM", value, ["cpu:0", "cpu:1"]), [4.0, 6.0], ("cpu:0", "cpu:1"))
    assert_reduced(ops.reduce("MEAN", value, "cpu:0"), [2.0, 3.0], ("cpu:0",))


@pytest.mark.gpu
@requires_gpus(2)
@pytest.mark.parametrize("num_packs", [0, 1, 2])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_nccl_all_reduce_on_gpus(num_packs, op):
    ops = ds.NcclAllReduce(num_packs=num_packs)
    strategy = ds.MirroredStrategy(["cuda:0", "cuda:1"], cross_device_ops=ops)
    shapes = [(3,), (5, 7), (64,), (1,)]
    gen = torch.Generator().manual_seed(0)
    host = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    pairs = []
    for i in range(len(shapes)):
        value = distribute(strategy, [host[0][i].to("cuda:0"), host[1][i].to("cuda:1")])
        pairs.append((value, strategy.extended.worker_devices))
    results = strategy.extended.batch_reduce_to(op, pairs, options=ds.CommunicationOptions(bytes_per_pack=64))
    for i, result in enumerate(results):
        assert isinstance(result, ds.Mirrored)
        expected = (host[0][i].double() + host[1][i].double()) / (2 if op == "MEAN" else 1)
        for device, tensor in zip(("cuda:0", "cuda:1"), result.values):
            assert str(tensor.device) == device
            np.testing.assert_allclose(tensor.cpu().double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    # a CPU destination falls back to ReductionToOneDevice
    cpu = strategy.extended.reduce_to(op, pairs[0][0], "cpu:0")
    assert cpu.device.type == "cpu"


@pytest.mark.parametrize("budget, calls", [(0, 3), (1, 3 * len(SHAPES)), (10**9, 3)])
def test_bytes_per_pack_controls_how_many_reductions_run(monkeypatch, budget, calls):
    import replicafit.strategies.cross_device_ops as cdo

    seen = []
    original = cdo._sum_packed_foreach

    def counting(per_replica, reduce_op, count):
        seen.append(len(per_replica[0]))
        return original(per_replica, reduce_op, count)

    monkeypatch.setattr(cdo, "_sum_packed_foreach", counting)
    strategy = mirrored(2)
    pairs = _mixed_pairs(strategy)
    strategy.extended.batch_reduce_to("SUM", pairs, options=ds.CommunicationOptions(bytes_per_pack=budget))
    # 0 (or a huge budget): one pack per dtype and device set; 1 byte: one tensor per pack
    assert len(seen) == calls
    assert sum(seen) == len(pairs)
