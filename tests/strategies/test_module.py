"""``strategy.distribute_module``: replicas, distributed variables, state dicts, training parity.

Reference: the README's "A taste" (distribute_module) and TensorFlow 2.21's observed behaviour for module variables.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_strategy
from torch import nn

import replicafit.strategies as ds
from replicafit.strategies import VariableAggregation as Agg
from replicafit.strategies import VariableSynchronization as Sync

pytestmark = pytest.mark.timeout(60)

PARAM_NAMES = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
BUFFER_NAMES = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def rid() -> int:
    return ds.get_replica_context().replica_id_in_sync_group


def split(strategy, batch: torch.Tensor):
    """``batch`` split evenly into consecutive per-replica slices (plain with one replica)."""
    count = strategy.num_replicas_in_sync
    size = batch.shape[0] // count
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: batch[ctx.replica_id_in_sync_group * size : (ctx.replica_id_in_sync_group + 1) * size]
    )


def slices(strategy, batch: torch.Tensor) -> list:
    count = strategy.num_replicas_in_sync
    size = batch.shape[0] // count
    return [batch[i * size : (i + 1) * size] for i in range(count)]


def param_kind(strategy):
    if strategy.num_replicas_in_sync == 1:
        return ds.LocalVariable
    if isinstance(strategy, ds.CentralStorageStrategy):
        return ds.CentralStorageVariable
    return ds.MirroredVariable


def buffer_kind(strategy):
    return ds.LocalVariable if strategy.num_replicas_in_sync == 1 else ds.SyncOnReadVariable


def local(strategy, value) -> list:
    return list(strategy.experimental_local_results(value))


# --- structure ----------------------------------------------------------------------------
def test_replica_zero_is_the_users_module(strategy):
    model = make_model()
    dm = strategy.distribute_module(model)
    assert dm.module is model
    assert dm.replicas[0] is model
    assert len(dm.replicas) == strategy.num_replicas_in_sync
    assert dm.strategy is strategy
    for replica in dm.replicas[1:]:
        assert replica is not model
        for (name, p), (_, q) in zip(model.named_parameters(), replica.named_parameters()):
            assert p is not q, name
            assert torch.equal(p, q), name
        for (name, b), (_, c) in zip(model.named_buffers(), replica.named_buffers()):
            assert b is not c, name
            assert torch.equal(b, c), name


def test_distribute_module_rejects_non_modules(strategy):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        strategy.distribute_module(lambda x: x)


def test_variable_kinds_and_aggregations(strategy):
    dm = strategy.distribute_module(make_model())
    named = dm.named_variables()
    assert list(named) == PARAM_NAMES + BUFFER_NAMES
    assert [v.name for v in dm.trainable_variables] == PARAM_NAMES
    assert [v.name for v in dm.non_trainable_variables] == BUFFER_NAMES
    assert [v.name for v in dm.variables] == PARAM_NAMES + BUFFER_NAMES
    for v in dm.trainable_variables:
        assert type(v) is param_kind(strategy), v.name
        assert isinstance(v, ds.Variable)
        assert v.trainable is True
        assert v.synchronization in (Sync.ON_WRITE, Sync.AUTO)
    for v in dm.non_trainable_variables:
        assert type(v) is buffer_kind(strategy), v.name
        assert v.trainable is False
        assert v.synchronization is Sync.ON_READ
    assert named["1.running_mean"].aggregation is Agg.MEAN
    assert named["1.running_var"].aggregation is Agg.MEAN
    assert named["1.num_batches_tracked"].aggregation is Agg.ONLY_FIRST_REPLICA
    assert named["1.num_batches_tracked"].dtype == torch.int64
    for v in dm.variables:
        assert strategy.extended.variable_created_in_scope(v), v.name


def test_frozen_parameter_is_non_trainable(strategy):
    model = make_model()
    model[0].weight.requires_grad_(False)
    dm = strategy.distribute_module(model)
    assert [v.name for v in dm.trainable_variables] == PARAM_NAMES[1:]
    assert [v.name for v in dm.non_trainable_variables] == ["0.weight"] + BUFFER_NAMES
    frozen = dm.named_variables()["0.weight"]
    assert type(frozen) is param_kind(strategy)
    assert frozen.trainable is False
    assert all(not r.get_parameter("0.weight").requires_grad for r in dm.replicas)


def test_variables_are_the_modules_tensors(strategy):
    model = make_model()
    dm = strategy.distribute_module(model)
    named = dm.named_variables()
    # replica r reads replica r's own parameter (no copy per step)
    out = strategy.run(lambda: named["0.weight"].value() is dm.local_module().get_parameter("0.weight"))
    assert all(local(strategy, out))
    out = strategy.run(lambda: named["1.running_mean"].value() is dm.local_module().get_buffer("1.running_mean"))
    assert all(local(strategy, out))
    # the user's module parameter is the primary copy
    assert strategy.experimental_local_results(named["0.weight"])[0].value() is model.get_parameter("0.weight")


# --- calling -------------------------------------------------------------------------------
@pytest.mark.parametrize("training", [False, True])
def test_call_in_run_uses_local_replica(strategy, training):
    model = make_model()
    reference = copy.deepcopy(model)
    dm = strategy.distribute_module(model)
    dm.train(training)
    reference.train(training)
    assert dm.training is training
    assert all(r.training is training for r in dm.replicas)
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def step(x):
        assert dm.local_module() is dm.replicas[rid()]
        return dm(x)

    out = strategy.run(step, args=(split(strategy, batch),))
    outputs = local(strategy, out)
    assert len(outputs) == strategy.num_replicas_in_sync
    for got, part in zip(outputs, slices(strategy, batch)):
        expected = copy.deepcopy(reference)(part)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_call_outside_run_uses_replica_zero(strategy):
    model = make_model().eval()
    dm = strategy.distribute_module(model)
    x = torch.randn(3, 4)
    assert dm.local_module() is model
    torch.testing.assert_close(dm(x), model(x), rtol=0, atol=0)


# --- state -----------------------------------------------------------------------------------
def run_bn_step(strategy, dm, batch):
    dm.train()
    strategy.run(lambda x: dm(x), args=(split(strategy, batch),))


def test_batch_norm_state_is_aggregated(strategy):
    model = make_model()
    reference = copy.deepcopy(model)
    dm = strategy.distribute_module(model)
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(2)) * 3 + 1
    run_bn_step(strategy, dm, batch)

    replica_means = [r.get_buffer("1.running_mean") for r in dm.replicas]
    replica_vars = [r.get_buffer("1.running_var") for r in dm.replicas]
    if strategy.num_replicas_in_sync > 1:
        assert not torch.allclose(replica_means[0], replica_means[1])  # the replicas saw different data
    # oracle: one single-device module per slice
    oracle_means, oracle_vars = [], []
    for part in slices(strategy, batch):
        m = copy.deepcopy(reference).train()
        m(part)
        oracle_means.append(m.get_buffer("1.running_mean"))
        oracle_vars.append(m.get_buffer("1.running_var"))
    for got, expected in zip(replica_means, oracle_means):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    state = dm.state_dict()
    assert list(state) == list(model.state_dict())
    torch.testing.assert_close(state["1.running_mean"], torch.stack(replica_means).mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(state["1.running_var"], torch.stack(replica_vars).mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(state["1.running_mean"], torch.stack(oracle_means).mean(0), rtol=0, atol=1e-6)
    assert state["1.num_batches_tracked"].item() == 1
    assert state["1.num_batches_tracked"].dtype == torch.int64
    for name in PARAM_NAMES:
        torch.testing.assert_close(state[name], reference.state_dict()[name], rtol=0, atol=0)
    # the cross-replica read of the variable agrees with the state dict
    torch.testing.assert_close(dm.named_variables()["1.running_mean"].read_value(), state["1.running_mean"])
    # state_dict holds detached tensors, not the live buffers
    for name, tensor in state.items():
        assert not tensor.requires_grad, name
    state["0.weight"].add_(100.0)
    assert not torch.equal(model.get_parameter("0.weight"), state["0.weight"])


def test_state_dict_keys_match_module(strategy):
    model = make_model()
    dm = strategy.distribute_module(model)
    run_bn_step(strategy, dm, torch.randn(8, 4, generator=torch.Generator().manual_seed(5)))
    outside = dm.state_dict()
    with strategy.scope():
        inside = dm.state_dict()
    for key in outside:
        torch.testing.assert_close(inside[key], outside[key], rtol=0, atol=0)
    assert list(dm.state_dict().keys()) == list(model.state_dict().keys())
    for key, value in dm.state_dict().items():
        assert value.shape == model.state_dict()[key].shape
        assert value.dtype == model.state_dict()[key].dtype


def test_load_state_dict_writes_every_replica(strategy):
    dm = strategy.distribute_module(make_model(seed=0))
    source = make_model(seed=5)
    with torch.no_grad():
        source.get_buffer("1.running_mean").copy_(torch.arange(8.0))
        source.get_buffer("1.running_var").copy_(torch.arange(8.0) + 2)
        source.get_buffer("1.num_batches_tracked").fill_(7)
    state = source.state_dict()
    result = dm.load_state_dict(state)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    for r, replica in enumerate(dm.replicas):
        for key, value in replica.state_dict().items():
            torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=f"replica {r} {key}")
    loaded = dm.state_dict()
    for key in state:
        torch.testing.assert_close(loaded[key], state[key], rtol=0, atol=0)
    # what replicas read inside run
    out = strategy.run(lambda: dm.named_variables()["1.running_mean"].read_value().clone())
    for value in local(strategy, out):
        assert value.tolist() == list(range(8))
    out = strategy.run(lambda: dm.named_variables()["1.num_batches_tracked"].read_value().clone())
    assert [int(v) for v in local(strategy, out)] == [7] * strategy.num_replicas_in_sync


def test_state_dict_round_trips_across_strategies():
    saver = make_strategy("mirrored2")
    model = make_model(seed=0)
    dm = saver.distribute_module(model)
    run_bn_step(saver, dm, torch.randn(8, 4, generator=torch.Generator().manual_seed(3)) * 2 - 1)
    run_bn_step(saver, dm, torch.randn(8, 4, generator=torch.Generator().manual_seed(4)) * 2 - 1)
    state = dm.state_dict()
    assert state["1.num_batches_tracked"].item() == 2
    assert not torch.equal(state["1.running_mean"], torch.zeros(8))

    for name in ("central_storage2", "default", "one_device", "mirrored2"):
        target_strategy = make_strategy(name)
        target = target_strategy.distribute_module(make_model(seed=9))
        target.load_state_dict(state)
        again = target.state_dict()
        assert list(again) == list(state)
        for key in state:
            torch.testing.assert_close(again[key], state[key], rtol=0, atol=0, msg=f"{name} {key}")
        for replica in target.replicas:
            for key, value in replica.state_dict().items():
                torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=f"{name} replica {key}")
    # and into the bare module
    bare = make_model(seed=11)
    bare.load_state_dict(state)
    for key, value in bare.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)


def test_load_state_dict_strict_key_errors(strategy):
    dm = strategy.distribute_module(make_model(seed=0))
    original = {k: v.clone() for k, v in dm.state_dict().items()}
    source = make_model(seed=3).state_dict()

    missing = dict(source)
    del missing["2.bias"]
    with pytest.raises(RuntimeError, match=r"missing keys \['2.bias'\]"):
        dm.load_state_dict(missing)
    unexpected = dict(source)
    unexpected["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"unexpected keys \['extra.weight'\]"):
        dm.load_state_dict(unexpected)
    # nothing was written by the failed strict loads
    for key, value in dm.state_dict().items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0)

    result = dm.load_state_dict(missing, strict=False)
    assert list(result.missing_keys) == ["2.bias"]
    assert list(result.unexpected_keys) == []
    result = dm.load_state_dict(unexpected, strict=False)
    assert list(result.missing_keys) == []
    assert list(result.unexpected_keys) == ["extra.weight"]
    for replica in dm.replicas:
        torch.testing.assert_close(replica.get_parameter("0.weight"), source["0.weight"], rtol=0, atol=0)


def test_load_state_dict_shape_mismatch_raises(strategy):
    dm = strategy.distribute_module(make_model())
    state = dm.state_dict()
    state["0.weight"] = torch.zeros(2, 2)
    with pytest.raises((ValueError, RuntimeError), match="shape"):
        dm.load_state_dict(state)


# --- updates ----------------------------------------------------------------------------------
def test_extended_update_reaches_every_replica(strategy):
    model = make_model()
    dm = strategy.distribute_module(model)
    weight = dm.named_variables()["0.weight"]
    expected = model.get_parameter("0.weight").detach().clone() - 0.5
    result = strategy.extended.update(weight, lambda c, d: c.assign_sub(d), args=(torch.full((8, 4), 0.5),))
    del result
    for r, replica in enumerate(dm.replicas):
        torch.testing.assert_close(replica.get_parameter("0.weight").detach(), expected, rtol=0, atol=0, msg=str(r))
    # what the replicas compute with afterwards
    x = torch.ones(1, 4)
    dm.eval()
    out = strategy.run(lambda: dm(x))
    outs = local(strategy, out)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)


def test_central_storage_update_refreshes_replica_copies():
    strategy = make_strategy("central_storage2")
    model = make_model()
    dm = strategy.distribute_module(model)
    bias = dm.named_variables()["2.bias"]
    assert type(bias) is ds.CentralStorageVariable
    assert [c.device for c in bias.values] == ["cpu:0"]
    replica1 = dm.replicas[1].get_parameter("2.bias")
    assert replica1 is not model.get_parameter("2.bias")
    strategy.extended.update(bias, lambda c: c.assign(torch.tensor([1.0, 2.0, 3.0])))
    assert model.get_parameter("2.bias").tolist() == [1.0, 2.0, 3.0]
    assert dm.replicas[1].get_parameter("2.bias") is replica1  # refreshed in place
    assert replica1.tolist() == [1.0, 2.0, 3.0]
    # a cross-replica assign refreshes the copies too
    bias.assign_add(torch.ones(3))
    assert dm.replicas[1].get_parameter("2.bias").tolist() == [2.0, 3.0, 4.0]
    out = strategy.run(lambda: bias.read_value().clone())
    assert [t.tolist() for t in local(strategy, out)] == [[2.0, 3.0, 4.0]] * 2


def test_mirrored_parameter_replica_assignment_keeps_replicas_equal():
    strategy = make_strategy("mirrored2")
    dm = strategy.distribute_module(make_model())
    bias = dm.named_variables()["2.bias"]
    assert bias.aggregation is Agg.NONE
    with pytest.raises(ValueError, match="aggregation"):
        strategy.run(lambda: bias.assign_add(torch.full((3,), float(rid()))))
    torch.testing.assert_close(dm.replicas[0].get_parameter("2.bias"), dm.replicas[1].get_parameter("2.bias"))


# --- training parity --------------------------------------------------------------------------
def sgd_step(strategy, dm, batch, target, learning_rate, global_batch):
    variables = dm.trainable_variables

    def merge_fn(strategy, grads):
        reduced = strategy.extended.batch_reduce_to("SUM", list(zip(grads, variables)))
        for variable, grad in zip(variables, reduced):
            strategy.extended.update(variable, lambda c, g: c.assign_sub(learning_rate * g), args=(grad,))

    def replica_step(x, y):
        per_example = ((dm(x) - y) ** 2).sum(dim=1)
        loss = per_example.sum() / global_batch
        grads = torch.autograd.grad(loss, variables)
        ds.get_replica_context().merge_call(merge_fn, args=(list(grads),))
        return loss.detach()

    return strategy.run(replica_step, args=(split(strategy, batch), split(strategy, target)))


def test_manual_sgd_matches_one_device_training(strategy):
    model = make_model(seed=0)
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model.state_dict())
    dm = strategy.distribute_module(model).eval()  # BN on running statistics: no per-replica batch stats
    reference.eval()
    generator = torch.Generator().manual_seed(7)
    learning_rate = 0.1
    for _ in range(3):
        batch = torch.randn(8, 4, generator=generator)
        target = torch.randn(8, 3, generator=generator)
        losses = sgd_step(strategy, dm, batch, target, learning_rate, global_batch=8)

        loss = ((reference(batch) - target) ** 2).sum(dim=1).sum() / 8
        grads = torch.autograd.grad(loss, list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p.sub_(learning_rate * g)
        total = sum(float(v) for v in local(strategy, losses))
        assert total == pytest.approx(loss.item(), abs=1e-6)

    for name, expected in reference.named_parameters():
        assert (expected.detach() - initial[name]).abs().max() > 1e-3, name  # training moved every parameter
        for r, replica in enumerate(dm.replicas):
            torch.testing.assert_close(
                replica.get_parameter(name).detach(), expected.detach(), rtol=0, atol=1e-6, msg=f"replica {r} {name}"
            )
        torch.testing.assert_close(dm.state_dict()[name], expected.detach(), rtol=0, atol=1e-6)
    # the user's module holds the trained weights
    torch.testing.assert_close(model.get_parameter("0.weight"), reference.get_parameter("0.weight"), atol=1e-6, rtol=0)
    # no gradient was accumulated in .grad by the functional autograd.grad pattern
    assert all(p.grad is None for p in model.parameters())


def test_manual_sgd_with_batch_norm_training_updates_statistics(strategy):
    model = make_model(seed=0)
    dm = strategy.distribute_module(model)
    dm.train()
    generator = torch.Generator().manual_seed(8)
    for _ in range(2):
        sgd_step(strategy, dm, torch.randn(8, 4, generator=generator), torch.randn(8, 3, generator=generator), 0.1, 8)
    state = dm.state_dict()
    assert state["1.num_batches_tracked"].item() == 2
    replica_means = torch.stack([r.get_buffer("1.running_mean") for r in dm.replicas]).mean(0)
    torch.testing.assert_close(state["1.running_mean"], replica_means, rtol=0, atol=1e-6)
    # parameters stay identical across replicas
    for name in PARAM_NAMES:
        for replica in dm.replicas[1:]:
            torch.testing.assert_close(replica.get_parameter(name), model.get_parameter(name), rtol=0, atol=0)


def test_repr_names_module_and_strategy(strategy):
    dm = strategy.distribute_module(make_model())
    text = repr(dm)
    assert text.startswith("DistributedModule(Sequential")
    assert repr(strategy) in text


def test_a_distributed_module_still_saves_whole_with_torch_save(tmp_path):
    """``torch.save(model)`` of a module once distributed (regression: its tensors' links to their
    distributed variables were weak references, which cannot be pickled)."""
    model = make_model()
    ds.MirroredStrategy(["cpu:0", "cpu:1"]).distribute_module(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for (key, value), (_, restored) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(value, restored), key
    x = torch.randn(2, 4)
    assert torch.equal(loaded.eval()(x), model.eval()(x))
