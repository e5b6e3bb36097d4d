"""Strategy / StrategyExtended members: update, call_for_each_replica, devices, the v1 members.

The members of Strategy and StrategyExtended, as TensorFlow 2.21 behaves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import data


def replica_id():
    return ds.get_replica_context().replica_id_in_sync_group


def numpy_of(value):
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value.numpy())


# --- extended.update --------------------------------------------------------------------------------


def test_update_group_true_returns_mirrored():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(5.0)
    result = strategy.extended.update(v, lambda c, x: c.read_value() + x, args=(1.0,))
    assert isinstance(result, ds.Mirrored)
    assert tuple(result.devices) == ("cpu:0", "cpu:1")
    assert [t.item() for t in result.values] == [6.0, 6.0]


def test_update_assign_add_writes_every_copy():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(5.0)
    result = strategy.extended.update(v, lambda c, x: c.assign_add(x), args=(1.0,))
    assert [float(c.numpy()) for c in strategy.experimental_local_results(v)] == [6.0, 6.0]
    # fn returned each component: the container comes back
    assert result is v


def test_update_returning_the_component_gives_the_variable(strategy):
    with strategy.scope():
        v = ds.Variable([1.0, 2.0])
    assert strategy.extended.update(v, lambda c: c) is v


def test_update_fn_returning_none(strategy):
    with strategy.scope():
        v = ds.Variable(1.0)
    calls = []
    assert strategy.extended.update(v, lambda c: calls.append(c.device)) is None
    assert len(calls) == len(strategy.experimental_local_results(v))


def test_update_group_false_gives_a_tuple_per_component():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(1.0)
    result = strategy.extended.update(v, lambda c: c.read_value() * 2, group=False)
    assert isinstance(result, tuple) and len(result) == 2
    assert [t.item() for t in result] == [2.0, 2.0]

    # as TensorFlow: (tensor, 3) per replica -> ((t0, t1), (3,))
    result = strategy.extended.update(v, lambda c: (c.read_value() + 1, 3), group=False)
    assert isinstance(result, tuple) and len(result) == 2
    tensors, constant = result
    assert isinstance(tensors, tuple) and [t.item() for t in tensors] == [2.0, 2.0]
    assert constant == (3,)


def test_update_unwraps_mirrored_and_per_replica_args():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable([0.0, 0.0])
    seen = []

    def fn(component, delta, *, scale):
        seen.append((component.device, float(delta), float(scale)))
        return component.read_value() + delta * scale

    delta = ds.Mirrored((torch.tensor(1.0), torch.tensor(2.0)), ("cpu:0", "cpu:1"))
    scale = ds.PerReplica((torch.tensor(10.0), torch.tensor(100.0)), ("cpu:0", "cpu:1"))
    result = strategy.extended.update(v, fn, args=(delta,), kwargs={"scale": scale})
    assert seen == [("cpu:0", 1.0, 10.0), ("cpu:1", 2.0, 100.0)]
    assert [numpy_of(t).tolist() for t in result.values] == [[10.0, 10.0], [200.0, 200.0]]


def test_update_reads_each_component_of_another_mirrored_variable():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(0.0)
        w = ds.Variable(3.0)
    strategy.extended.update(w, lambda c: c.assign(4.0))
    result = strategy.extended.update(v, lambda c, other: c.assign_add(other), args=(w,))
    assert result is v
    assert [float(c.numpy()) for c in strategy.experimental_local_results(v)] == [4.0, 4.0]


def test_update_inside_a_replica_fn_raises(multi_strategy):
    with multi_strategy.scope():
        v = ds.Variable(1.0)
    with pytest.raises(RuntimeError):
        multi_strategy.run(lambda: multi_strategy.extended.update(v, lambda c: c))


def test_update_from_merge_fn_works():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(1.0)

    def merge_fn(strategy, grad):
        total = strategy.extended.reduce_to("SUM", grad, v)
        return strategy.extended.update(v, lambda c, g: c.assign_sub(g), args=(total,))

    strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn, args=(torch.tensor(0.25),)))
    assert [float(c.numpy()) for c in strategy.experimental_local_results(v)] == [0.5, 0.5]


@pytest.mark.parametrize("name", ["default", "one_device"])
def test_single_device_update_calls_fn_once(name):
    strategy = make_strategy(name)
    with strategy.scope():
        v = ds.Variable(2.0)
    calls = []

    def fn(component, x):
        calls.append(component)
        return component.read_value() * x

    result = strategy.extended.update(v, fn, args=(3.0,))
    assert len(calls) == 1 and calls[0] is v
    assert isinstance(result, torch.Tensor) and result.item() == 6.0  # plain with one component
    result = strategy.extended.update(v, fn, args=(3.0,), group=False)
    assert len(calls) == 2
    assert isinstance(result, tuple) and len(result) == 1 and result[0].item() == 6.0


def test_central_storage_update_calls_fn_once_on_the_stored_variable():
    strategy = make_strategy("central_storage2")
    with strategy.scope():
        v = ds.Variable(2.0)
    calls = []

    def fn(component, x):
        calls.append(component.device)
        return component.assign_add(x)

    result = strategy.extended.update(v, fn, args=(ds.Mirrored((torch.tensor(1.0), torch.tensor(5.0))),))
    assert calls == ["cpu:0"]
    assert result is v
    assert float(v.numpy()) == 3.0
    # the replicas read the new value
    out = strategy.run(lambda: v.read_value().detach() * 1.0)
    assert [t.item() for t in strategy.experimental_local_results(out)] == [3.0, 3.0]


# --- call_for_each_replica, devices, static shapes -------------------------------------------------


def test_call_for_each_replica_equals_run(strategy):
    count = strategy.num_replicas_in_sync
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group))
    )

    def fn(x, *, offset):
        return {"id": replica_id(), "y": x * 2 + offset}

    via_run = strategy.run(fn, args=(value,), kwargs={"offset": 1.0})
    via_extended = strategy.extended.call_for_each_replica(fn, args=(value,), kwargs={"offset": 1.0})
    assert type(via_run) is type(via_extended) is dict
    run_results = strategy.experimental_local_results(via_run)
    ext_results = strategy.experimental_local_results(via_extended)
    assert len(run_results) == len(ext_results) == count
    for a, b, i in zip(run_results, ext_results, range(count)):
        assert a["id"] == b["id"] == i
        assert float(a["y"]) == float(b["y"]) == 2.0 * i + 1.0
    assert type(via_run["y"]) is type(via_extended["y"])


DEVICES = {
    "default": (("cpu:0",), ("cpu:0",)),
    "one_device": (("cpu:0",), ("cpu:0",)),
    "mirrored2": (("cpu:0", "cpu:1"), ("cpu:0", "cpu:1")),
    "central_storage2": (("cpu:0", "cpu:1"), ("cpu:0",)),
}


@pytest.mark.parametrize("name", list(DEVICES))
def test_worker_and_parameter_devices(name):
    strategy = make_strategy(name)
    workers, parameters = DEVICES[name]
    assert isinstance(strategy.extended.worker_devices, tuple)
    assert isinstance(strategy.extended.parameter_devices, tuple)
    assert strategy.extended.worker_devices == workers
    assert strategy.extended.parameter_devices == parameters
    assert strategy.num_replicas_in_sync == len(workers)
    assert strategy.extended.experimental_require_static_shapes is False


def test_central_storage_parameter_device_choices():
    assert ds.CentralStorageStrategy(["cpu:1", "cpu:2"], parameter_device="CPU:3").extended.parameter_devices == (
        "cpu:3",
    )
    assert ds.CentralStorageStrategy(["cpu:1", "cpu:2"]).extended.parameter_devices == ("cpu:0",)
    single = ds.CentralStorageStrategy(["cpu:2"])
    assert single.extended.parameter_devices == ("cpu:2",)
    assert single.extended.worker_devices == ("cpu:2",)


def test_central_storage_variable_lives_on_the_parameter_device():
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu:2")
    with strategy.scope():
        v = ds.Variable(1.0)
    assert v.device == "cpu:2"
    assert [c.device for c in strategy.experimental_local_results(v)] == ["cpu:2"]


def test_one_device_on_another_logical_cpu():
    strategy = ds.OneDeviceStrategy("cpu:3")
    assert strategy.extended.worker_devices == ("cpu:3",)
    assert strategy.extended.parameter_devices == ("cpu:3",)
    assert strategy.run(lambda: ds.get_replica_context().devices) == ("cpu:3",)


# --- v1 members ------------------------------------------------------------------------------------


def test_experimental_run_with_make_dataset_iterator(strategy):
    count = strategy.num_replicas_in_sync
    batches = [torch.arange(4.0), torch.arange(4.0, 8.0)]
    iterator = strategy.make_dataset_iterator(batches)
    assert iterator.initialize() == []
    first = strategy.experimental_run(lambda x: x * 2, iterator)
    second = strategy.experimental_run(lambda x: x * 2, iterator)
    gathered = [torch.cat(list(strategy.experimental_local_results(r))) for r in (first, second)]
    np.testing.assert_array_equal(gathered[0].numpy(), [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_array_equal(gathered[1].numpy(), [8.0, 10.0, 12.0, 14.0])
    if count == 2:
        assert [t.tolist() for t in strategy.experimental_local_results(first)] == [[0.0, 2.0], [4.0, 6.0]]
    with pytest.raises(StopIteration):
        iterator.get_next()
    iterator.initialize()  # restarts
    np.testing.assert_array_equal(
        torch.cat(list(strategy.experimental_local_results(iterator.get_next()))).numpy(), [0.0, 1.0, 2.0, 3.0]
    )


def test_experimental_run_without_iterator(strategy):
    out = strategy.experimental_run(lambda: replica_id())
    assert list(strategy.experimental_local_results(out)) == list(range(strategy.num_replicas_in_sync))


def test_make_input_fn_iterator_per_worker(strategy):
    count = strategy.num_replicas_in_sync
    contexts = []

    def input_fn(ctx):
        contexts.append(ctx)
        return [torch.tensor([float(i)]) for i in range(2 * count)]

    iterator = strategy.make_input_fn_iterator(input_fn, data.InputReplicationMode.PER_WORKER)
    assert len(contexts) == 1
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, count)
    iterator.initialize()
    first = strategy.experimental_local_results(iterator.get_next())
    second = strategy.experimental_local_results(iterator.get_next())
    assert [float(t) for t in first] == [float(i) for i in range(count)]
    assert [float(t) for t in second] == [float(i) for i in range(count, 2 * count)]
    # the default replication mode is PER_WORKER
    default_mode = strategy.make_input_fn_iterator(input_fn)
    assert [float(t) for t in strategy.experimental_local_results(default_mode.get_next())] == [
        float(i) for i in range(count)
    ]


def test_make_input_fn_iterator_per_replica_is_not_supported(strategy):
    with pytest.raises(ValueError, match="Input replication mode not supported"):
        strategy.make_input_fn_iterator(lambda ctx: [], data.InputReplicationMode.PER_REPLICA)


def test_unwrap_is_experimental_local_results(strategy):
    value = strategy.run(lambda: torch.tensor(float(replica_id())))
    assert strategy.unwrap(value) == strategy.experimental_local_results(value)
    assert [float(t) for t in strategy.unwrap(value)] == [float(i) for i in range(strategy.num_replicas_in_sync)]


def test_group_returns_none(strategy):
    value = strategy.run(lambda: torch.ones(2))
    assert strategy.group(value) is None
    assert strategy.group(torch.ones(1)) is None
    assert strategy.group([value, 3]) is None


def test_configure_is_a_validated_no_op(strategy):
    assert strategy.configure() is None
    assert strategy.configure(session_config={"allow_soft_placement": True}) is None
    assert strategy.configure(cluster_spec={"worker": ["localhost:2222"]}, task_type="worker", task_id=0) is None
    with pytest.raises((TypeError, ValueError)):
        strategy.configure(session_config=42)
    with pytest.raises(ValueError):
        strategy.configure(cluster_spec={"worker": ["host1:2222", "host2:2222"]}, task_type="worker", task_id=0)
    with pytest.raises(ValueError):
        strategy.configure(task_id=-1)
    with pytest.raises(ValueError):
        strategy.configure(task_type=7)
    # nothing changed
    assert strategy.num_replicas_in_sync in (1, 2)


def test_update_config_proto_returns_a_copy(strategy):
    config = {"intra_op_parallelism_threads": 2, "nested": {"a": [1, 2]}}
    snapshot = {"intra_op_parallelism_threads": 2, "nested": {"a": [1, 2]}}
    result = strategy.update_config_proto(config)
    assert result is not config
    assert config == snapshot
    assert isinstance(result, dict)
    assert result["intra_op_parallelism_threads"] == 2
    # mutating the result never reaches the argument
    result["nested"]["a"].append(3)
    result["new"] = 1
    assert config == snapshot


def test_initialize_and_finalize_return_empty_lists(strategy):
    assert strategy.experimental_initialize() == []
    assert strategy.experimental_finalize() == []
    assert isinstance(strategy.experimental_initialize(), list)


def test_experimental_run_v2_is_run(strategy):
    out = strategy.experimental_run_v2(lambda x: x + replica_id(), args=(torch.tensor(1.0),))
    assert [float(t) for t in strategy.experimental_local_results(out)] == [
        1.0 + i for i in range(strategy.num_replicas_in_sync)
    ]
    assert type(strategy).experimental_run_v2 is type(strategy).run


@pytest.mark.parametrize("name, count", [("default", 1), ("one_device", 1), ("mirrored2", 2), ("central_storage2", 2)])
def test_num_replicas_in_sync(name, count):
    strategy = make_strategy(name)
    assert strategy.num_replicas_in_sync == count
    out = strategy.run(lambda: ds.get_replica_context().num_replicas_in_sync)
    assert set(strategy.experimental_local_results(out)) == {count}


def test_case1_num_replicas_of_mirrored():
    assert ds.MirroredStrategy(["cpu:0", "cpu:1"]).num_replicas_in_sync == 2
    assert ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"]).num_replicas_in_sync == 4


def test_repr(strategy):
    text = repr(strategy)
    assert isinstance(text, str) and text
    if strategy is not ds.get_strategy():
        assert type(strategy).__name__ in text
        for device in strategy.extended.worker_devices:
            assert device in text
    mirrored = make_strategy("mirrored2")
    assert repr(mirrored) == "MirroredStrategy(devices=('cpu:0', 'cpu:1'))"
    assert "parameter_device='cpu:0'" in repr(make_strategy("central_storage2"))


def test_experimental_make_numpy_dataset(strategy):
    arrays = {"x": np.arange(15, dtype=np.float32).reshape(5, 3), "y": np.arange(5)}
    dataset = strategy.experimental_make_numpy_dataset(arrays)
    assert isinstance(dataset, torch.utils.data.Dataset)
    assert len(dataset) == 5
    item = dataset[2]
    assert set(item) == {"x", "y"}
    assert isinstance(item["x"], torch.Tensor) and isinstance(item["y"], torch.Tensor)
    assert item["x"].device.type == "cpu" and item["y"].device.type == "cpu"
    assert item["x"].tolist() == [6.0, 7.0, 8.0] and item["x"].dtype == torch.float32
    assert item["y"].item() == 2 and item["y"].shape == ()
    # unbatched: a DataLoader batches it
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    batches = list(loader)
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]

    plain = strategy.experimental_make_numpy_dataset(np.arange(4.0))
    assert len(plain) == 4
    assert isinstance(plain[1], torch.Tensor) and plain[1].item() == 1.0

    pair = strategy.experimental_make_numpy_dataset((np.zeros((3, 2)), np.ones(3)))
    assert len(pair) == 3
    assert isinstance(pair[0], tuple) and pair[0][1].item() == 1.0


def test_value_context():
    assert str(ds.ValueContext(0, 2)) == "tf.distribute.ValueContext(replica id 0,  total replicas in sync: 2)"
    assert str(ds.ValueContext()) == "tf.distribute.ValueContext(replica id 0,  total replicas in sync: 1)"
    ctx = ds.ValueContext(1, 3)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (1, 3)


def test_values_from_function_passes_value_contexts(strategy):
    count = strategy.num_replicas_in_sync
    seen = []

    def value_fn(ctx):
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return ctx.replica_id_in_sync_group * 10

    value = strategy.experimental_distribute_values_from_function(value_fn)
    assert seen == [(i, count) for i in range(count)]
    assert strategy.experimental_local_results(value) == tuple(i * 10 for i in range(count))
    if count > 1:
        assert isinstance(value, ds.PerReplica)
        # always wrapped, even when every replica returns the same object (as TensorFlow does)
        same = strategy.experimental_distribute_values_from_function(lambda _: 5)
        assert isinstance(same, ds.PerReplica) and same.values == (5,) * count
    else:
        assert value == 0
