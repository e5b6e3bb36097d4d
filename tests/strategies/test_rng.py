"""Per-replica random streams (strategies/rng.py): each replica draws from its own stream, seeded from
``(seed, global replica id)``, whatever order or thread the replicas run in."""

from __future__ import annotations

import pytest
import torch

import replicafit.strategies as ds
from replicafit.strategies.rng import replica_seed

STRATEGIES = {
    "one_device": lambda: ds.OneDeviceStrategy("cpu:0"),
    "mirrored2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored3": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
    "central_storage2": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def _expected(seed, replica, *shapes):
    """What replica ``replica`` draws (``torch.rand`` of each shape in turn): the oracle is a plain
    generator seeded with the replica's seed."""
    generator = torch.Generator().manual_seed(replica_seed(seed, replica))
    return [torch.rand(shape, generator=generator) for shape in shapes]


def _draws(strategy):
    def step():
        first = torch.rand(3)
        second = torch.nn.functional.dropout(torch.ones(4), 0.5)  # dropout draws from the stream too
        return first, second

    return [strategy.experimental_local_results(part) for part in strategy.run(step)]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_replica_draws_from_its_own_seeded_stream(name):
    strategy = STRATEGIES[name]()
    ds.seed_replicas(strategy, 7)
    firsts, seconds = _draws(strategy)
    for replica, first in enumerate(firsts):
        assert torch.equal(first, _expected(7, replica, 3)[0])
    assert len({tuple(f.tolist()) for f in firsts}) == len(firsts)  # distinct streams
    # the same seed again: the same draws; the streams go on from where they were otherwise
    ds.seed_replicas(strategy, 7)
    again = _draws(strategy)
    assert all(torch.equal(a, b) for a, b in zip(firsts + seconds, again[0] + again[1]))
    later = _draws(strategy)
    assert not torch.equal(later[0][0], firsts[0])


@pytest.mark.parametrize("name", ["mirrored2", "mirrored3"])
def test_replicas_on_threads_draw_what_replicas_taking_turns_draw(name, replica_threads):
    strategy = STRATEGIES[name]()
    ds.seed_replicas(strategy, 3)
    on_threads = [_draws(strategy) for _ in range(3)]
    ds.set_replica_execution("auto")
    ds.seed_replicas(strategy, 3)
    taking_turns = [_draws(strategy) for _ in range(3)]
    for a, b in zip(on_threads, taking_turns):
        for x, y in zip(a[0] + a[1], b[0] + b[1]):
            assert torch.equal(x, y)


def test_a_timeout_puts_replicas_on_threads_with_the_same_draws():
    strategy = STRATEGIES["mirrored2"]()
    ds.seed_replicas(strategy, 3)
    plain = strategy.experimental_local_results(strategy.run(lambda: torch.randn(5)))
    ds.seed_replicas(strategy, 3)
    options = ds.CommunicationOptions(timeout_seconds=30)
    timed = strategy.experimental_local_results(strategy.run(lambda: torch.randn(5), options=options))
    assert all(torch.equal(a, b) for a, b in zip(plain, timed))


def test_replica_draws_leave_the_callers_generator_alone():
    strategy = STRATEGIES["mirrored2"]()
    torch.manual_seed(5)
    strategy.run(lambda: torch.rand(2))  # seeds the streams from one draw, then draws from them
    after_run = torch.rand(2)
    torch.manual_seed(5)
    torch.randint(0, 2**62, ())  # the one draw the first run took from torch's generator (the streams' seed)
    assert torch.equal(torch.rand(2), after_run)
    ds.seed_replicas(strategy, 1)  # seeded explicitly: nothing is drawn from torch's generator
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    strategy.run(lambda: torch.rand(100))
    assert torch.equal(torch.rand(2), expected)


def test_unseeded_streams_follow_torch_manual_seed():
    results = []
    for _ in range(2):
        torch.manual_seed(11)
        strategy = STRATEGIES["mirrored2"]()
        results.append(strategy.experimental_local_results(strategy.run(lambda: torch.rand(3))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], results[0][1])


def test_the_default_strategy_draws_from_torchs_generator():
    torch.manual_seed(4)
    expected = torch.rand(3)
    torch.manual_seed(4)
    assert torch.equal(ds.get_strategy().run(lambda: torch.rand(3)), expected)


def test_a_call_restarted_on_threads_draws_what_it_would_have_drawn_there():
    """A differentiable collective makes a call that began with replicas taking turns start again on
    threads: the draws made before it are drawn again from the same states, not from advanced ones."""

    def step():
        noise = torch.rand(2)
        total = ds.get_replica_context().all_reduce("SUM", noise.clone().requires_grad_())
        total.sum().backward()
        return noise

    strategy = STRATEGIES["mirrored2"]()
    ds.seed_replicas(strategy, 9)
    got = strategy.experimental_local_results(strategy.run(step))
    for replica, noise in enumerate(got):
        assert torch.equal(noise, _expected(9, replica, 2)[0])


def test_merge_fn_draws_from_the_stream_of_the_replica_that_runs_it():
    def merge_fn(strategy, value):
        return torch.rand(1)

    strategy = STRATEGIES["mirrored2"]()
    ds.seed_replicas(strategy, 2)
    first = strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn, args=(torch.zeros(1),)))
    ds.seed_replicas(strategy, 2)
    second = strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn, args=(torch.zeros(1),)))
    assert torch.equal(first, second)


def test_state_dict_round_trip_continues_the_streams():
    strategy = STRATEGIES["mirrored2"]()
    ds.seed_replicas(strategy, 5)
    strategy.run(lambda: torch.rand(4))
    streams = strategy.extended._replica_streams
    saved = streams.state_dict()
    want = strategy.experimental_local_results(strategy.run(lambda: torch.rand(4)))
    other = STRATEGIES["mirrored2"]()
    other.extended._replica_streams.load_state_dict(saved)
    got = other.experimental_local_results(other.run(lambda: torch.rand(4)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with pytest.raises(ValueError, match="streams are of 2 replicas; this worker has 3"):
        STRATEGIES["mirrored3"]().extended._replica_streams.load_state_dict(saved)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "1", True])
def test_seed_replicas_checks_the_seed(seed):
    with pytest.raises(ValueError, match=r"integer seed in \[0, 2\*\*64 - 1\]"):
        ds.seed_replicas(STRATEGIES["mirrored2"](), seed)


def test_global_replica_ids_make_worker_streams_distinct():
    # worker 1 of two (one replica each) is global replica 1: its stream is Mirrored(2)'s replica 1's
    from replicafit.strategies.rng import ReplicaStreams

    worker1 = ReplicaStreams((torch.device("cpu"),), first_global_id=1)
    worker1.seed(7)
    worker1.put(0)
    try:
        drawn = torch.rand(3)
    finally:
        torch.manual_seed(0)
    assert torch.equal(drawn, _expected(7, 1, 3)[0])


def test_replicas_sharing_an_accelerator_generator_on_threads_each_draw_their_own_stream():
    """Logical GPUs on one GPU share its generator: on threads each draw is routed to the replica's
    own state. Checked on the CPU by letting the host generator stand for the shared GPU one (the
    branch a GPU takes, forced)."""
    import threading

    from replicafit.strategies.rng import ReplicaStreams

    streams = ReplicaStreams((torch.device("cpu"), torch.device("cpu")), 0)
    streams._accelerators = [torch.default_generator, torch.default_generator]
    streams._route_cpu, streams._shared = False, [True, True]
    streams.seed(7)
    host = torch.default_generator.get_state()
    barrier, out = threading.Barrier(2), {}

    def replica(r):
        with streams.on_thread(r):
            draws = []
            for _ in range(20):
                barrier.wait(timeout=10)  # interleave the two replicas' draws
                draws.append(torch.rand(3))
            out[r] = torch.stack(draws)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for r in range(2):
        expected = torch.rand(20, 3, generator=torch.Generator().manual_seed(replica_seed(7, r)))
        assert torch.equal(out[r], expected), r
    assert torch.equal(torch.default_generator.get_state(), host)  # the shared generator is given back


def test_keyed_streams_depend_only_on_the_seed_the_replica_epoch_kind_and_step():
    """``ReplicaStreams.key`` (fit's, before each step): what a replica draws next depends on (base seed, global
    replica id, epoch, kind, step) alone, not on what the stream drew before; the state made when first put (the
    generator seeded in place) equals the one made for a snapshot."""
    from replicafit.strategies.rng import TRAINING, VALIDATION

    a, b = STRATEGIES["mirrored2"](), STRATEGIES["mirrored2"]()
    ds.seed_replicas(a, 5)
    ds.seed_replicas(b, 5)
    _draws(b)  # b's streams moved on
    a.extended.replica_streams.key(2, 7)
    b.extended.replica_streams.key(2, 7)
    b.extended.replica_streams.state_dict()  # (b's states made from the seeds; a's generator seeded in place)
    assert all(torch.equal(x, y) for x, y in zip(*(_draws(s)[0] for s in (a, b))))
    seen = set()
    for epoch, step, kind in [(2, 7, TRAINING), (2, 8, TRAINING), (3, 7, TRAINING), (2, 7, VALIDATION)]:
        a.extended.replica_streams.key(epoch, step, kind)
        seen.update(tuple(f.tolist()) for f in _draws(a)[0])
    assert len(seen) == 8  # every (replica, epoch, step, kind) draws its own
