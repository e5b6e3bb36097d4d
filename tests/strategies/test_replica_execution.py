"""Replicas that share one device take turns on one thread: parity with a thread per replica.

The cooperative runner (``set_replica_execution("auto")``, the default for logical CPUs) must give
bit-identical results to the threaded runner it replaces, and keep every replica's own state
(torch's thread-local modes, the replica context) across the switches at rendezvous.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from conftest import make_strategy
from torch import nn

import replicafit.strategies as ds
from replicafit.data import datasets
from replicafit.trainer import Trainer


@contextlib.contextmanager
def execution(mode: str):
    previous = ds.get_replica_execution()
    ds.set_replica_execution(mode)
    try:
        yield
    finally:
        ds.set_replica_execution(previous)


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def fit_once(name: str, mode: str, batch: int):
    x, y = datasets.make_classification(78, 8, n_classes=4, seed=3)  # partial last batches, uneven splits
    with execution(mode):
        net = model()
        trainer = Trainer(
            strategy=make_strategy(name),
            optimizer={"class_name": "adam", "config": {"learning_rate": 0.01}},
            loss="cross_entropy",
            metrics=["accuracy"],
            seed=4,
        )
        history = trainer.fit(net, (x, y), batch_size=batch, epochs=3, verbose=0, validation_data=(x[:20], y[:20]))
        evaluated = trainer.evaluate(net, (x, y), batch_size=batch, verbose=0)
        predicted = trainer.predict(net, x, batch_size=batch, verbose=0)
    return history.history, {k: v.clone() for k, v in net.state_dict().items()}, evaluated, predicted


@pytest.mark.parametrize("name", ["mirrored2", "mirrored3", "central_storage2", "multi_worker1x2"])
@pytest.mark.parametrize("batch", [8, 10])
def test_fit_evaluate_predict_taking_turns_equal_threads_bit_for_bit(name, batch):
    history, weights, evaluated, predicted = fit_once(name, "auto", batch)
    history_t, weights_t, evaluated_t, predicted_t = fit_once(name, "threads", batch)
    assert history == history_t
    assert evaluated == evaluated_t
    assert weights.keys() == weights_t.keys()
    for key in weights:
        assert torch.equal(weights[key], weights_t[key]), key
    assert np.array_equal(np.asarray(predicted), np.asarray(predicted_t))


def _collectives_step(w):
    """Differentiable collectives forward and backward, a merge_call, per-replica branches."""
    ctx = ds.get_replica_context()
    r = ctx.replica_id_in_sync_group
    x = w * (r + 1)
    total = ctx.all_reduce("SUM", x)
    gathered = ctx.all_gather(x.unsqueeze(0) * (r + 2), axis=0)
    loss = (total * gathered.sum(0)).sum() + (x**2).sum()
    (grad,) = torch.autograd.grad(loss, [w])
    merged = ctx.merge_call(lambda st, g: st.reduce("SUM", g, axis=None), args=(grad,))
    return grad, merged, ctx.all_reduce("MEAN", grad * r)


@pytest.mark.parametrize("name", ["mirrored2", "mirrored3", "central_storage2"])
def test_collectives_in_forward_and_backward_taking_turns_equal_threads(name):
    results = {}
    for mode in ("auto", "threads"):
        with execution(mode):
            strategy = make_strategy(name)
            w = torch.linspace(-1.0, 1.0, 5, requires_grad=True)
            out = strategy.run(_collectives_step, args=(w,))
            results[mode] = [strategy.experimental_local_results(v) for v in out]
    for auto, threads in zip(results["auto"], results["threads"]):
        assert len(auto) == len(threads)
        for a, t in zip(auto, threads):
            assert torch.equal(a, t)


def test_each_replica_keeps_its_own_torch_modes_across_switches():
    """Grad mode, inference mode, autocast and a default-device mode entered by one replica before
    a rendezvous stay that replica's, and never leak into the other or the caller."""
    strategy = make_strategy("mirrored2")
    seen = {}

    def fn():
        ctx = ds.get_replica_context()
        r = ctx.replica_id_in_sync_group
        with contextlib.ExitStack() as stack:
            if r == 0:
                stack.enter_context(torch.no_grad())
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
                stack.enter_context(torch.device("meta"))
            else:
                stack.enter_context(torch.inference_mode())
            for k in range(3):
                ctx.all_reduce("SUM", torch.ones((), device="cpu"))
                made = torch.empty(1)
                seen[(r, k)] = (
                    torch.is_grad_enabled(),
                    torch.is_inference_mode_enabled(),
                    torch.is_autocast_enabled("cpu"),
                    made.device.type,
                    ds.get_replica_context() is ctx,
                )
        ctx.merge_call(lambda st: None)
        seen[(r, "after")] = (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
        )

    strategy.run(fn)
    for k in range(3):
        assert seen[(0, k)] == (False, False, True, "meta", True)
        assert seen[(1, k)] == (False, True, False, "cpu", True)
    assert seen[(0, "after")] == seen[(1, "after")] == (True, False, False)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert not torch.is_autocast_enabled("cpu") and torch.empty(1).device.type == "cpu"
    assert ds.get_replica_context() is not None and not ds.in_cross_replica_context()


def test_the_callers_modes_are_in_force_in_every_replica():
    strategy = make_strategy("mirrored2")
    seen = {}

    def fn():
        ctx = ds.get_replica_context()
        ctx.merge_call(lambda st: None)
        state = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), ds.get_strategy() is strategy)
        seen[ctx.replica_id_in_sync_group] = state

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        strategy.run(fn)
    assert seen == {0: (False, True, True), 1: (False, True, True)}


def test_a_differentiable_collective_first_gives_the_function_threads():
    """Its backward is a rendezvous inside autograd's engine, which replicas taking turns cannot
    reach: the call starts again on threads before anything is merged, and the function keeps them."""
    strategy = make_strategy("mirrored2")
    calls = []

    def fn(w):
        calls.append(threading.get_ident())
        total = ds.get_replica_context().all_reduce("SUM", w * 2)
        (grad,) = torch.autograd.grad(total.sum(), [w])
        return grad

    w = torch.ones(3, requires_grad=True)
    out = strategy.run(fn, args=(w,))
    assert [g.tolist() for g in strategy.experimental_local_results(out)] == [[4.0] * 3] * 2
    assert len(calls) == 3 and len(set(calls[1:])) == 2  # one replica started taking turns, then two threads
    calls.clear()
    strategy.run(fn, args=(w,))
    assert len(calls) == 2 and len(set(calls)) == 2  # threads at once


def test_a_merge_call_inside_backward_while_taking_turns_says_how_to_fix_it():
    strategy = make_strategy("mirrored2")

    class MergeInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return ds.get_replica_context().merge_call(lambda st, g: g, args=(grad,))

    def fn(w):
        (grad,) = torch.autograd.grad(MergeInBackward.apply(w).sum(), [w])
        return grad

    w = torch.ones(2, requires_grad=True)
    with pytest.raises(
        RuntimeError, match=r"inside a backward pass while the replicas take turns.*set_replica_execution\('threads'\)"
    ):
        strategy.run(fn, args=(w,))
    with execution("threads"):
        out = strategy.run(fn, args=(w,))
    assert [g.tolist() for g in strategy.experimental_local_results(out)] == [[1.0, 1.0]] * 2


def test_a_nested_run_inside_a_merge_fn_takes_turns_too():
    strategy = make_strategy("mirrored2")

    def fn():
        inner = ds.get_replica_context().merge_call(
            lambda st: st.run(lambda: ds.get_replica_context().all_reduce("SUM", torch.tensor(1.0)))
        )
        return inner

    out = strategy.run(fn)
    assert [float(v) for v in strategy.experimental_local_results(out)] == [2.0, 2.0]
    out = strategy.run(fn)  # the crews are back and reused
    assert [float(v) for v in strategy.experimental_local_results(out)] == [2.0, 2.0]


def test_a_strategy_whose_replicas_took_turns_is_collected_with_its_greenlets():
    """Nothing of a call stays referenced from a replica greenlet (its C stack included)."""
    import gc
    import weakref

    def make():
        strategy = make_strategy("mirrored3")
        for _ in range(3):
            strategy.run(lambda: ds.get_replica_context().merge_call(lambda st: None))

        def failing():
            if ds.get_replica_context().replica_id_in_sync_group == 1:
                raise ValueError("boom")
            ds.get_replica_context().merge_call(lambda st: None)

        with pytest.raises(ValueError):
            strategy.run(failing)
        crew = strategy.extended._runner._greenlets.idle[0]
        return weakref.ref(strategy), [weakref.ref(g) for g in crew]

    strategy_ref, greenlet_refs = make()
    gc.collect()
    assert strategy_ref() is None
    assert all(ref() is None for ref in greenlet_refs)
