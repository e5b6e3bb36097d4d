"""Background prefetch of distributed iterators, and simulated multi-worker input."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit import data

PREFETCH = "replicafit-prefetch"


def prefetch_threads():
    return {t for t in threading.enumerate() if t.name == PREFETCH and t.is_alive()}


def all_dead(threads, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(t.is_alive() for t in threads):
            return True
        time.sleep(0.01)
    return not any(t.is_alive() for t in threads)


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


class Counting:
    """A re-iterable source of ``count`` batches ``[2i, 2i+1]`` recording each pull and the thread it ran on."""

    def __init__(self, count=50, fail_at=None):
        self.count = count
        self.fail_at = fail_at
        self.pulls = 0
        self.threads = []
        self.error = None

    def __iter__(self):
        for i in range(self.count):
            self.pulls += 1
            self.threads.append(threading.current_thread())
            if self.fail_at is not None and i == self.fail_at:
                self.error = ValueError(f"source broke at batch {i}")
                raise self.error
            yield torch.tensor([2.0 * i, 2.0 * i + 1.0])


def options(buffer=1, fetch=True):
    return data.InputOptions(experimental_fetch_to_device=fetch, experimental_per_replica_buffer_size=buffer)


def as_lists(strategy, steps):
    return [[t.tolist() for t in strategy.experimental_local_results(step)] for step in steps]


# --- prefetch -----------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_host_only_devices_prepare_steps_inline_by_default():
    strategy = make_strategy("mirrored2")
    source = Counting(5)
    before = prefetch_threads()
    steps = list(strategy.experimental_distribute_dataset(source))
    assert prefetch_threads() - before == set()
    assert set(source.threads) == {threading.current_thread()}
    assert as_lists(strategy, steps) == as_lists(
        strategy, strategy.experimental_distribute_dataset(Counting(5), options(1))
    )


@pytest.mark.timeout(30)
def test_a_buffer_size_prefetches_on_a_named_thread():
    strategy = make_strategy("mirrored2")
    source = Counting(20)
    before = prefetch_threads()
    iterator = iter(strategy.experimental_distribute_dataset(source, options(1)))
    new = prefetch_threads() - before
    assert len(new) == 1
    (thread,) = new
    assert thread.daemon
    first = next(iterator)
    assert [t.tolist() for t in first.values] == [[0.0], [1.0]]
    assert wait_for(lambda: source.pulls >= 2)
    assert set(source.threads) == {thread}
    iterator.close()
    assert all_dead(new)


@pytest.mark.timeout(30)
def test_break_then_drop_stops_the_thread():
    strategy = make_strategy("mirrored2")
    source = Counting(100)
    distributed = strategy.experimental_distribute_dataset(source, options(1))
    first = None
    for batch in distributed:
        first = batch
        break
    assert [t.tolist() for t in first.values] == [[0.0], [1.0]]
    gc.collect()
    (thread,) = set(source.threads)
    assert thread.name == PREFETCH
    assert all_dead({thread})

    before = prefetch_threads()
    iterator = iter(distributed)
    next(iterator)
    new = prefetch_threads() - before
    assert len(new) == 1
    del iterator
    gc.collect()
    assert all_dead(new)


@pytest.mark.timeout(30)
def test_exhaustion_stops_the_thread():
    strategy = make_strategy("mirrored2")
    before = prefetch_threads()
    iterator = iter(strategy.experimental_distribute_dataset(Counting(5), options(1)))
    new = prefetch_threads() - before
    assert len(new) == 1
    steps = list(iterator)
    assert len(steps) == 5
    assert all_dead(new)
    del iterator, steps


@pytest.mark.timeout(30)
def test_close_stops_the_thread_and_ends_iteration():
    strategy = make_strategy("mirrored2")
    before = prefetch_threads()
    iterator = iter(strategy.experimental_distribute_dataset(Counting(100)))
    new = prefetch_threads() - before
    next(iterator)
    iterator.close()
    assert all_dead(new)
    with pytest.raises(StopIteration):
        next(iterator)
    iterator.close()  # twice is fine


@pytest.mark.timeout(30)
def test_buffer_zero_starts_no_thread_and_gives_the_same_batches():
    strategy = make_strategy("mirrored2")
    x = np.arange(22, dtype=np.float32).reshape(11, 2)
    y = np.arange(11)
    source = data.as_global_batches((x, y), batch_size=4, shuffle=True, seed=4)
    before = prefetch_threads()
    counting = Counting(3)
    iterator = iter(strategy.experimental_distribute_dataset(counting, options(0)))
    assert prefetch_threads() - before == set()
    assert counting.pulls == 0
    next(iterator)
    assert counting.pulls == 1
    assert set(counting.threads) == {threading.current_thread()}
    del iterator

    def run(buffer):
        steps = list(strategy.experimental_distribute_dataset(source, options(buffer)))
        return [(as_lists(strategy, [sx])[0], as_lists(strategy, [sy])[0]) for sx, sy in steps]

    reference = run(0)
    assert prefetch_threads() - before == set()
    assert len(reference) == 3
    assert [len(p) for p in reference[2][1]] == [2, 1]
    assert run(1) == reference
    assert run(3) == reference


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buffer", [0, 1, 3])
def test_buffers_give_identical_batches_from_function(buffer):
    strategy = make_strategy("mirrored2")

    def dataset_fn(ctx):
        return [torch.full((2, 3), float(i)) for i in range(5)]

    steps = as_lists(strategy, strategy.distribute_datasets_from_function(dataset_fn, options(buffer)))
    expected = [[[[0.0] * 3] * 2, [[1.0] * 3] * 2], [[[2.0] * 3] * 2, [[3.0] * 3] * 2], [[[4.0] * 3] * 2, []]]
    assert steps == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buffer", [0, 1, 3])
def test_source_error_is_raised_by_next(buffer):
    strategy = make_strategy("mirrored2")
    source = Counting(10, fail_at=2)
    iterator = iter(strategy.experimental_distribute_dataset(source, options(buffer)))
    assert [t.tolist() for t in next(iterator).values] == [[0.0], [1.0]]
    assert [t.tolist() for t in next(iterator).values] == [[2.0], [3.0]]
    with pytest.raises(ValueError) as info:
        next(iterator)
    assert type(info.value) is ValueError
    assert str(info.value) == "source broke at batch 2"
    assert source.pulls == 3
    (thread,) = set(source.threads)
    assert (thread.name == PREFETCH) if buffer else (thread is threading.current_thread())
    if buffer:
        assert all_dead({thread})


@pytest.mark.timeout(30)
def test_source_error_from_function_is_raised_by_next():
    strategy = make_strategy("mirrored2")

    def dataset_fn(ctx):
        def gen():
            ran_on.append(threading.current_thread())
            yield torch.zeros(1)
            yield torch.zeros(1)
            raise KeyError("no such shard")

        return gen()

    ran_on = []
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn, options(1)))
    next(iterator)
    with pytest.raises(KeyError, match="no such shard"):
        next(iterator)
    (thread,) = ran_on
    assert thread.name == PREFETCH
    assert all_dead({thread})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buffer", [0, 1, 2])
def test_next_after_the_end_keeps_raising_stop_iteration(buffer):
    strategy = make_strategy("mirrored2")
    iterator = iter(strategy.experimental_distribute_dataset(Counting(2), options(buffer)))
    assert len(list(iterator)) == 2
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(iterator)
    with pytest.raises(StopIteration):
        iterator.get_next()
    from_function = iter(strategy.distribute_datasets_from_function(lambda ctx: Counting(3), options(buffer)))
    assert len(list(from_function)) == 2
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(from_function)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buffer", [1, 3])
def test_read_ahead_is_bounded(buffer):
    strategy = make_strategy("mirrored2")
    source = Counting(100)
    iterator = iter(strategy.experimental_distribute_dataset(source, options(buffer)))
    next(iterator)
    consumed = 1
    # it does read ahead ...
    assert wait_for(lambda: source.pulls >= consumed + buffer)
    time.sleep(0.3)
    # ... but at most buffer_size + 1 batches beyond what was consumed
    assert consumed + buffer <= source.pulls <= consumed + buffer + 1
    for _ in range(2):
        next(iterator)
    consumed = 3
    assert wait_for(lambda: source.pulls >= consumed + buffer)
    time.sleep(0.3)
    assert source.pulls <= consumed + buffer + 1
    iterator.close()


@pytest.mark.timeout(30)
def test_fetch_to_device_false_keeps_tensors_on_the_host():
    strategy = make_strategy("mirrored2")
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    source = data.as_global_batches((x, np.arange(6)), batch_size=4)
    steps = list(strategy.experimental_distribute_dataset(source, options(fetch=False)))
    assert len(steps) == 2
    for sx, sy in steps:
        for t in list(strategy.experimental_local_results(sx)) + list(strategy.experimental_local_results(sy)):
            assert t.device == torch.device("cpu")
    assert torch.equal(torch.cat(list(strategy.experimental_local_results(steps[0][0]))), torch.from_numpy(x[:4]))
    from_function = list(strategy.distribute_datasets_from_function(lambda ctx: Counting(3), options(fetch=False)))
    assert all(t.device == torch.device("cpu") for step in from_function for t in step.values)


# --- simulated multi-worker -----------------------------------------------------------------------------

LOCAL_DEVICES = {1: ("cpu:0",), 2: ("cpu:0", "cpu:1")}
PAIRS = [(10, 4), (10, 3), (7, 7), (5, 2), (3, 1), (1, 1), (9, 5), (8, 8), (6, 4), (2, 3)]


def source_of(rows, batch):
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    y = np.arange(rows, dtype=np.int64) * 10
    return data.as_global_batches((x, y), batch_size=batch)


def local_parts(strategy, step):
    """Per local replica: (x rows, y rows, x shape, dtypes)."""
    xs = strategy.experimental_local_results(step[0])
    ys = strategy.experimental_local_results(step[1])
    return [(x.tolist(), y.tolist(), tuple(x.shape), x.dtype, y.dtype) for x, y in zip(xs, ys)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("per_worker", [1, 2])
def test_two_workers_equal_one_process(per_worker):
    total = 2 * per_worker
    reference_strategy = make_strategy(f"mirrored{total}")
    local_strategy = ds.MirroredStrategy(list(LOCAL_DEVICES[per_worker]))
    for rows, batch in PAIRS:
        reference = [
            local_parts(reference_strategy, s)
            for s in reference_strategy.experimental_distribute_dataset(source_of(rows, batch))
        ]
        per_worker_steps = []
        for w in range(2):
            workers = data.InputWorkers(LOCAL_DEVICES[per_worker], 2, w)
            distributed = data.DistributedDataset(source_of(rows, batch), local_strategy, None, workers=workers)
            steps = list(distributed)
            if per_worker == 1:
                assert all(isinstance(s[0], torch.Tensor) for s in steps)
            else:
                assert all(isinstance(s[0], ds.PerReplica) for s in steps)
            per_worker_steps.append([local_parts(local_strategy, s) for s in steps])
        assert len(per_worker_steps[0]) == len(per_worker_steps[1]) == len(reference), (rows, batch)
        combined = [a + b for a, b in zip(*per_worker_steps)]
        assert combined == reference, (per_worker, rows, batch)
    # the cases include empty replicas on the second worker (batch 1 over 2 or 4 replicas)
    w1 = data.DistributedDataset(
        source_of(1, 1), local_strategy, None, workers=data.InputWorkers(LOCAL_DEVICES[per_worker], 2, 1)
    )
    (step,) = list(w1)
    assert [p[2] for p in local_parts(local_strategy, step)] == [(0, 3)] * per_worker


@pytest.mark.timeout(30)
def test_worker_keeps_only_its_replicas_rows():
    local_strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    got = []
    for w in range(2):
        workers = data.InputWorkers(("cpu:0", "cpu:1"), 2, w)
        # (a list of batches cannot be read in part: every worker reads it, and is told so)
        with pytest.warns(UserWarning, match="Every worker reads every global batch of this list"):
            distributed = data.DistributedDataset([torch.arange(10)], local_strategy, workers=workers)
            (step,) = list(distributed)
        got.append([t.tolist() for t in step.values])
    # 10 rows over 4 replicas: k = 3 -> [3, 3, 3, 1]
    assert got == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9]]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("per_worker", [1, 2])
def test_from_function_per_worker_contexts_and_shards(per_worker):
    total = 2 * per_worker
    local_strategy = ds.MirroredStrategy(list(LOCAL_DEVICES[per_worker]))
    elements = [torch.tensor([float(i), 100.0 + i]) for i in range(4 * total)]

    def make_fn(contexts):
        def dataset_fn(ctx):
            contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
            local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
            return [
                e for i, e in enumerate(elements) if (i // local) % ctx.num_input_pipelines == ctx.input_pipeline_id
            ]

        return dataset_fn

    reference_strategy = make_strategy(f"mirrored{total}")
    reference_contexts = []
    reference = [
        [t.tolist() for t in reference_strategy.experimental_local_results(s)]
        for s in reference_strategy.distribute_datasets_from_function(make_fn(reference_contexts))
    ]
    assert reference_contexts == [(1, 0, total)]
    per_worker_steps = []
    for w in range(2):
        contexts = []
        workers = data.InputWorkers(LOCAL_DEVICES[per_worker], 2, w)
        distributed = data.DistributedDatasetsFromFunction(make_fn(contexts), local_strategy, None, workers=workers)
        assert contexts == [(2, w, total)]
        per_worker_steps.append(
            [[t.tolist() for t in local_strategy.experimental_local_results(s)] for s in distributed]
        )
        assert len(contexts) == 1  # iterating does not call dataset_fn again
    assert len(per_worker_steps[0]) == len(per_worker_steps[1]) == len(reference) == 4
    assert [a + b for a, b in zip(*per_worker_steps)] == reference


@pytest.mark.timeout(30)
@pytest.mark.parametrize("per_worker", [1, 2])
def test_from_function_per_replica_contexts(per_worker):
    total = 2 * per_worker
    local_strategy = ds.MirroredStrategy(list(LOCAL_DEVICES[per_worker]))
    mode = data.InputOptions(experimental_replication_mode=data.InputReplicationMode.PER_REPLICA)
    for w in range(2):
        contexts = []

        def dataset_fn(ctx, contexts=contexts):
            contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
            return [torch.tensor([10.0 * ctx.input_pipeline_id + i]) for i in range(2)]

        workers = data.InputWorkers(LOCAL_DEVICES[per_worker], 2, w)
        distributed = data.DistributedDatasetsFromFunction(dataset_fn, local_strategy, mode, workers=workers)
        ids = [w * per_worker + r for r in range(per_worker)]
        assert contexts == [(total, i, total) for i in ids]
        steps = [[t.tolist() for t in local_strategy.experimental_local_results(s)] for s in distributed]
        assert steps == [[[10.0 * i + k] for i in ids] for k in range(2)]


def test_input_workers_attributes_and_validation():
    workers = data.InputWorkers(["cpu:0", "cpu:1"], 3, 2)
    assert workers.devices == ("cpu:0", "cpu:1")
    assert workers.num_workers == 3 and workers.worker_index == 2
    assert workers.num_local_replicas == 2
    assert workers.num_replicas_in_sync == 6
    assert workers.first_replica == 4
    for num_workers, index in ((2, 2), (2, -1), (1, 1), (0, 0), (3, 5)):
        with pytest.raises(ValueError):
            data.InputWorkers(("cpu:0",), num_workers, index)
    single = data.InputWorkers.of(make_strategy("mirrored2"))
    assert (single.devices, single.num_workers, single.worker_index) == (
        tuple(make_strategy("mirrored2").extended.worker_devices),
        1,
        0,
    )


@pytest.mark.parametrize("buffer", [None, 1])
def test_a_dataloaders_worker_processes_end_with_their_pass(buffer):
    """Each epoch's pass over a DataLoader with worker processes ends its workers when the pass ends
    (the steps are counted, so the loader is never read to its end), not when the garbage collector
    gets to its iterator: then torch's shutdown can wait 5 s for each worker before killing it."""
    import gc
    import multiprocessing

    from replicafit.trainer import Callback, Trainer

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=16, num_workers=2
    )
    alive = []

    class Children(Callback):
        def on_epoch_begin(self, epoch, logs=None):
            alive.append(len(multiprocessing.active_children()))

    options = data.InputOptions(experimental_per_replica_buffer_size=buffer)
    strategy = ds.OneDeviceStrategy("cpu")
    original = strategy.experimental_distribute_dataset
    strategy.experimental_distribute_dataset = lambda source, _=None: original(source, options)
    trainer = Trainer(strategy=strategy, optimizer="sgd", metrics=[])
    before = len(multiprocessing.active_children())
    gc.disable()  # what the collector would find is not the point: nothing may be left to it
    try:
        trainer.fit(torch.nn.Linear(4, 2), loader, epochs=3, verbose=0, callbacks=[Children()])
        assert alive == [before + 2] * 3  # this pass's two workers only
        assert len(multiprocessing.active_children()) == before  # none outlives fit, the trainer alive
    finally:
        gc.enable()
