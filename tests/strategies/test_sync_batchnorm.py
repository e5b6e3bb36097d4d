"""``nn.SyncBatchNorm`` under the strategies: a replica's forward and backward pass are those of one
BatchNorm over the global batch (oracle: plain ``nn.BatchNorm*`` on one device, the same rows)."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from conftest import make_strategy
from torch import nn

import replicafit.strategies as ds
from replicafit.strategies import VariableAggregation as Agg
from replicafit.strategies.sync_batchnorm import SyncBatchNorm

pytestmark = pytest.mark.timeout(60)


def cnn(seed=0, **bn):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4, **bn),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6, **bn),
        nn.Linear(6, 2),
    )


def images(rows=7, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 5, 5, generator=generator) * 2 + 3  # a mean far from 0: variance precision


def slices(strategy, x, sizes):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: x[starts[ctx.replica_id_in_sync_group] :][: sizes[ctx.replica_id_in_sync_group]]
    )


def one_device_step(model, x):
    """Output, summed-loss gradients and buffers of plain BatchNorm on the whole batch (the oracle)."""
    out = model(x)
    grads = torch.autograd.grad((out**2).sum() / len(x), list(model.parameters()))
    return out, grads


def synchronized_step(strategy, model, x, sizes):
    """The same step, each replica on its slice: outputs concatenated, gradients summed over replicas."""
    dmodel = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(model))

    def step(rows):
        out = dmodel(rows)
        params = list(dmodel.local_module().parameters())
        return out, torch.autograd.grad((out**2).sum() / len(x), params)

    out, grads = strategy.run(step, args=(slices(strategy, x, sizes),))
    outs = strategy.experimental_local_results(out)
    per_replica = strategy.experimental_local_results(grads)
    summed = [sum(g[i].to("cpu") for g in per_replica) for i in range(len(per_replica[0]))]
    return dmodel, torch.cat([o.to("cpu") for o in outs]), summed


CASES = [
    ("mirrored2", [4, 3]),  # uneven
    ("mirrored3", [3, 3, 1]),  # a partial batch's split
    ("mirrored3", [2, 0, 5]),  # an empty replica
    ("central_storage2", [5, 2]),
]


@pytest.mark.parametrize("name,sizes", CASES)
def test_forward_backward_and_running_statistics_equal_one_batchnorm_on_the_global_batch(name, sizes):
    reference = cnn()
    expected_out, expected_grads = one_device_step(reference, images())
    strategy = make_strategy(name)
    dmodel, out, grads = synchronized_step(strategy, cnn(), images(), sizes)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=2e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=5e-6)
    expected_buffers = dict(reference.named_buffers())
    for replica in dmodel.replicas:  # every replica holds the statistics of the global batch
        for key, value in replica.named_buffers():
            torch.testing.assert_close(value.to("cpu"), expected_buffers[key], rtol=0, atol=1e-6)
            assert torch.equal(value, dict(dmodel.module.named_buffers())[key].to(value.device)), key
    state = dmodel.state_dict()
    for key, value in expected_buffers.items():
        torch.testing.assert_close(state[key].to("cpu"), value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bn", [{"momentum": None}, {"affine": False}, {"track_running_stats": False}])
def test_layer_options_behave_as_torchs(bn):
    """A cumulative average (``momentum=None``), no affine parameters, no running statistics."""
    reference = cnn(**bn)
    batches = [images(seed=s) for s in (1, 2)]
    strategy = make_strategy("mirrored2")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(cnn(**bn))
    dmodel = strategy.distribute_module(model)
    for x in batches:
        expected_out, expected_grads = one_device_step(reference, x)

        def step(rows, total):
            out = dmodel(rows)
            return out, torch.autograd.grad((out**2).sum() / total, list(dmodel.local_module().parameters()))

        out, grads = strategy.run(step, args=(slices(strategy, x, [4, 3]), len(x)))
        torch.testing.assert_close(torch.cat(strategy.experimental_local_results(out)), expected_out, rtol=0, atol=2e-6)
        local = strategy.experimental_local_results(grads)
        for i, want in enumerate(expected_grads):
            torch.testing.assert_close(local[0][i] + local[1][i], want, rtol=0, atol=5e-6)
    for key, value in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[key], value, rtol=0, atol=1e-6)


def test_eval_mode_uses_the_running_statistics_and_synchronizes_nothing(monkeypatch):
    from replicafit.strategies import sync_batchnorm

    collectives = []
    reduce = sync_batchnorm._all_reduce
    monkeypatch.setattr(sync_batchnorm, "_all_reduce", lambda *a: (collectives.append(1), reduce(*a))[1])
    strategy = make_strategy("mirrored2")
    reference = cnn().eval()
    dmodel = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(cnn())).eval()
    x = images()
    with torch.no_grad():
        expected = reference(x)
        out = strategy.run(dmodel, args=(slices(strategy, x, [4, 3]),))
    torch.testing.assert_close(torch.cat(strategy.experimental_local_results(out)), expected, rtol=0, atol=1e-6)
    assert collectives == []
    dmodel.train()
    with torch.no_grad():
        strategy.run(dmodel, args=(slices(strategy, x, [4, 3]),))
    assert len(collectives) == 4  # two layers, two replicas: one all-reduce each in training


def test_outside_a_replica_it_is_torchs_layer_and_it_pickles_as_torchs_class():
    model = nn.SyncBatchNorm.convert_sync_batchnorm(cnn())
    ds.MirroredStrategy(["cpu:0", "cpu:1"]).distribute_module(model)
    layer = model[5]
    assert type(layer) is SyncBatchNorm and isinstance(layer, nn.SyncBatchNorm) and "SyncBatchNorm(6" in repr(model)
    x = torch.randn(5, 6)
    torch.testing.assert_close(layer(x), nn.functional.batch_norm(x, None, None, training=True))
    assert int(layer.num_batches_tracked) == 1
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored[1]) is nn.SyncBatchNorm  # a saved model needs no replicafit
    assert type(copy.deepcopy(model)[1]) is nn.SyncBatchNorm
    assert torch.equal(restored[5].running_mean, layer.running_mean)


def test_running_statistics_are_read_as_the_first_replicas_and_plain_batchnorm_keeps_the_mean():
    strategy = make_strategy("mirrored2")
    synced = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(cnn()))
    plain = strategy.distribute_module(cnn())
    assert synced.named_variables()["1.running_mean"].aggregation is Agg.ONLY_FIRST_REPLICA
    assert plain.named_variables()["1.running_mean"].aggregation is Agg.MEAN
    assert synced.synchronizes_batchnorm and not plain.synchronizes_batchnorm


def test_plain_batchnorm_under_mirrored_keeps_per_replica_statistics():
    """TensorFlow's default, unchanged: each replica normalizes with its own slice's statistics."""
    strategy = make_strategy("mirrored2")
    dmodel = strategy.distribute_module(cnn())
    x = images(8)
    with torch.no_grad():
        out = strategy.run(dmodel, args=(slices(strategy, x, [4, 4]),))
        per_replica = torch.cat([cnn()(x[:4]), cnn()(x[4:])])
        global_batch = cnn()(x)
    got = torch.cat(strategy.experimental_local_results(out))
    torch.testing.assert_close(got, per_replica, rtol=0, atol=1e-6)
    assert (got - global_batch).abs().max() > 1e-2


def test_a_global_batch_of_one_row_is_refused_as_torch_refuses_it():
    strategy = make_strategy("mirrored2")
    dmodel = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(cnn()))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel.*global batch"):
        strategy.run(dmodel, args=(slices(strategy, images(1), [1, 0]),))


def test_the_first_step_settles_threads_before_any_layer_so_nothing_runs_twice():
    """Replicas that share a device take turns on one thread until a collective meets a backward pass;
    the call then starts again on threads. It starts again before the model's first layer: a plain
    BatchNorm ahead of the synchronized one is updated once (regression: it was updated twice)."""
    strategy = make_strategy("mirrored2")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[3] = nn.SyncBatchNorm.convert_sync_batchnorm(model[3])
    dmodel = strategy.distribute_module(model)
    threads = []

    def step(rows):
        threads.append(threading.get_ident())
        out = dmodel(rows)
        return torch.autograd.grad(out.square().sum(), list(dmodel.local_module().parameters()))

    strategy.run(step, args=(slices(strategy, torch.randn(6, 3), [3, 3]),))
    assert len(set(threads[-2:])) == 2  # on threads
    assert [int(r[1].num_batches_tracked) for r in dmodel.replicas] == [1, 1]
    assert [int(r[3].num_batches_tracked) for r in dmodel.replicas] == [1, 1]


@pytest.mark.parametrize(
    "dtype,mean,std",
    [(torch.float32, 1e4, 0.1), (torch.float64, 1e8, 1.0), (torch.float64, 1e6, 1e-3)],
)
def test_the_variance_keeps_its_precision_when_the_mean_is_large(dtype, mean, std):
    """Each replica's mean and squared deviations about it, merged in float64 (Chan et al.): as precise as
    one device's variance (regression: a sum of squares cancelled, 2.7e-3 and 1.0 relative error here)."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, generator=generator, dtype=torch.float64) * std + mean).to(dtype)
    exact = x.double().var(0, unbiased=True)
    one_device = nn.BatchNorm1d(3, momentum=1.0).to(dtype)
    one_device(x)
    strategy = make_strategy("mirrored2")
    dmodel = strategy.distribute_module(
        nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3, momentum=1.0).to(dtype))
    )
    strategy.run(dmodel, args=(slices(strategy, x, [37, 27]),))
    ours = (dmodel.module.running_var.double() - exact).abs().max() / exact.max()
    torchs = (one_device.running_var.double() - exact).abs().max() / exact.max()
    assert ours <= max(2 * torchs, 1e-12), (float(ours), float(torchs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_in_a_half_type_trains(dtype):
    """``model.bfloat16()``: the parameters in the half type too (regression: the statistics' float32 met
    bfloat16 parameters in torch's kernel, a RuntimeError)."""
    reference = cnn().to(dtype)
    x = images().to(dtype)
    out = reference(x)
    expected = torch.autograd.grad(out.float().square().sum() / len(x), list(reference.parameters()))
    strategy = make_strategy("mirrored2")
    dmodel = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(cnn().to(dtype)))

    def step(rows):
        out = dmodel(rows)
        return torch.autograd.grad(out.float().square().sum() / len(x), list(dmodel.local_module().parameters()))

    grads = strategy.experimental_local_results(strategy.run(step, args=(slices(strategy, x, [4, 3]),)))
    for got0, got1, want in zip(*grads, expected):
        assert got0.dtype is dtype
        torch.testing.assert_close((got0.float() + got1.float()), want.float(), rtol=0.1, atol=0.1)


def test_a_step_of_ones_own_may_make_a_collective_before_the_model():
    """While a module with synchronized layers trains, the replicas run on threads from the start: a step
    that reduces something before calling the model works (taking turns, it could not start again)."""
    strategy = make_strategy("mirrored2")
    dmodel = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(cnn()))

    def step(rows):
        total = ds.get_replica_context().all_reduce("SUM", torch.tensor(float(len(rows))))
        out = dmodel(rows)
        return torch.autograd.grad(out.square().sum() / total, list(dmodel.local_module().parameters()))

    for _ in range(2):
        strategy.run(step, args=(slices(strategy, images(), [4, 3]),))


def test_a_replica_on_an_accelerator_runs_its_backward_on_its_own_thread():
    """torch runs a backward pass on an accelerator on the device's one autograd thread, shared by every
    replica there, where a collective in backward could never meet the others: on threads, a replica on
    an accelerator turns that off for its call (torch's per-thread setting); on the CPU nothing changes."""
    from replicafit.strategies.rendezvous import _RunState
    from replicafit.strategies.runner import _ReplicaTask
    from replicafit.strategies.thread_state import capture_torch_state

    strategy = make_strategy("mirrored2")
    seen = {}
    for device in (torch.device("meta"), torch.device("cpu")):
        state = _RunState(strategy, 1, None)

        def fn(device=device):
            seen[device.type] = torch._C._is_multithreading_enabled()

        _ReplicaTask(state, 0, fn, (), {}, capture_torch_state(), device, True)()
        state.outcome()
    assert seen == {"meta": False, "cpu": True}
    assert torch._C._is_multithreading_enabled()


def test_a_saved_model_loads_without_replicafit(tmp_path):
    """``torch.save(model)`` after distribution: torch's classes only (the layers pickle as torch's
    SyncBatchNorm, a tensor's link to its distributed variable as nothing)."""
    import subprocess
    import sys

    model = nn.SyncBatchNorm.convert_sync_batchnorm(cnn())
    make_strategy("mirrored2").distribute_module(model)
    torch.save(model, tmp_path / "model.pt")
    script = (
        "import sys, torch; sys.modules['replicafit'] = None; "
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); "
        "print(type(model[1]).__module__, type(model[1]).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["torch.nn.modules.batchnorm", "SyncBatchNorm"]


def test_bfloat16_inputs_normalize_in_their_dtype():
    strategy = make_strategy("mirrored2")
    dmodel = strategy.distribute_module(nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3)))
    x = torch.randn(6, 3).bfloat16()
    out = strategy.run(dmodel, args=(slices(strategy, x, [3, 3]),))
    got = torch.cat(strategy.experimental_local_results(out))
    assert got.dtype is torch.bfloat16
    expected = nn.functional.batch_norm(x.float(), None, None, training=True)
    torch.testing.assert_close(got.float(), expected, rtol=0.02, atol=0.02)
