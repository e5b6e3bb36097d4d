"""What each worker reads (``data/sharding.py``): workers simulated in one process with ``InputWorkers``.
Every worker's replicas get exactly the rows one process would give them; a worker reads only those."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import replicafit.data as data
import replicafit.strategies as ds
from replicafit.data import AutoShardPolicy, InputOptions, InputWorkers

pytestmark = pytest.mark.timeout(60)

LOCAL = ("cpu:0", "cpu:1")


class Counting(torch.utils.data.Dataset):
    """A map-style dataset of (features, label) that counts the examples read."""

    def __init__(self, rows: int = 23):
        self.x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
        self.y = torch.arange(rows)
        self.read: list = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.x[index], self.y[index]


def parts(step) -> list:
    """A step's label rows, replica by replica."""
    _, y = step
    values = y.values if isinstance(y, ds.PerReplica) else (y,)
    return [v.tolist() for v in values]


def one_process(source, num_replicas: int, epoch=None) -> list:
    """Every step of ``source`` under one process of ``num_replicas`` replicas: each replica's labels."""
    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])
    distributed = data.DistributedDataset(source, strategy)
    return [parts(step) for step in distributed.start(epoch, 0)]


def workers_of(make_source, num_workers: int, local: int = 2, policy=AutoShardPolicy.AUTO, epoch=None):
    """Each simulated worker's steps (its replicas' labels), its source and what its source read."""
    strategy = ds.MirroredStrategy(list(LOCAL[:local]))
    out = []
    for worker in range(num_workers):
        source, dataset = make_source()
        workers = InputWorkers(LOCAL[:local], num_workers, worker)
        distributed = data.DistributedDataset(source, strategy, InputOptions(auto_shard_policy=policy), workers=workers)
        steps = [parts(step) for step in distributed.start(epoch, 0)]
        out.append((steps, distributed, sorted(dataset.read) if dataset is not None else None))
    return out


def batched_dataset(rows=23, batch=8, shuffle=False):
    dataset = Counting(rows)
    return data.DatasetBatches(dataset, batch, shuffle=shuffle, seed=3), dataset


def loader(rows=23, batch=8, shuffle=True, **kwargs):
    dataset = Counting(rows)
    generator = torch.Generator().manual_seed(11)
    batches = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=shuffle, generator=generator, **kwargs)
    return batches, dataset


@pytest.mark.parametrize("num_workers,local", [(2, 2), (3, 1), (2, 1)])
@pytest.mark.parametrize("make", ["dataset", "shuffled_dataset", "loader", "arrays"])
def test_each_worker_reads_only_its_replicas_rows_and_they_are_one_process_rows(make, num_workers, local):
    """23 rows in batches of 8: the last batch of 7 splits unevenly, and over 6 replicas (3 workers of 2) a
    batch of 7 gives k = 2, so replica 5 gets 0 rows; over 3 replicas of 1 the split is 3/3/2 and 3/3/1."""

    def source():
        if make == "dataset":
            return batched_dataset()
        if make == "shuffled_dataset":
            return batched_dataset(shuffle=True)
        if make == "loader":
            return loader()
        x = np.arange(46, dtype=np.float32).reshape(23, 2)
        return data.ArrayBatches((x, np.arange(23)), 8, shuffle=True, seed=5), None

    reference = one_process(source()[0], num_workers * local, epoch=1 if make != "loader" else None)
    got = workers_of(source, num_workers, local, epoch=1 if make != "loader" else None)
    for worker, (steps, distributed, read) in enumerate(got):
        assert distributed.sharding == "rows"
        mine = [step[worker * local : (worker + 1) * local] for step in reference]
        assert steps == mine, worker
        if read is not None:  # the examples this worker's replicas train on, each once (an empty part: one more)
            wanted = sorted(label for step in mine for replica in step for label in replica)
            empties = sum(1 for step in mine if not any(step))
            assert len(read) == len(wanted) + empties and set(wanted) <= set(read), worker


def test_an_empty_part_keeps_the_trailing_shapes_and_reads_one_example():
    """A global batch of 2 rows over 3 workers of one replica each: the third worker's part is empty."""
    got = workers_of(lambda: batched_dataset(rows=10, batch=4), 3, local=1)
    steps, distributed, read = got[2]
    assert steps[-1] == [[]]  # the last batch (rows 8, 9): 1/1/0
    last = list(distributed.start(None, 0))[-1]
    assert last[0].shape == (0, 2) and last[0].dtype == torch.float32 and last[1].dtype == torch.int64
    assert read.count(8) == 1  # the template's example, read for its shape only


def test_a_dataloaders_own_settings_are_kept():
    """collate_fn, generator, drop_last (in its batch sampler) and num_workers survive the rebuild."""
    calls = []

    def collate(items):
        calls.append(len(items))
        return torch.utils.data.default_collate(items)

    def source():
        return loader(rows=21, collate_fn=collate, drop_last=True)

    reference = one_process(source()[0], 4)
    assert len(reference) == 2  # drop_last
    got = workers_of(source, 2)
    for worker, (steps, _, _) in enumerate(got):
        assert steps == [step[worker * 2 : worker * 2 + 2] for step in reference]
    assert calls[-2:] == [4, 4]  # each worker's parts of the two batches of 8: 4 rows each


@pytest.mark.timeout(120)
def test_a_dataloader_with_worker_processes_is_sharded_too():
    def source():
        return loader(rows=19, num_workers=2, persistent_workers=True)

    reference = one_process(source()[0], 4)
    for worker, (steps, _, _) in enumerate(workers_of(source, 2)):
        assert steps == [step[worker * 2 : worker * 2 + 2] for step in reference]


def test_a_resumed_pass_starts_at_its_batch_without_reading_the_ones_before():
    for make in (batched_dataset, loader):
        source, dataset = make(rows=40, batch=8)
        strategy = ds.MirroredStrategy(["cpu:0"])
        distributed = data.DistributedDataset(source, strategy, workers=InputWorkers(["cpu:0"], 2, 1))
        steps = [parts(step) for step in distributed.start(0, 3)]
        assert len(steps) == 2
        assert len(dataset.read) == 8  # 2 batches, 4 rows each: nothing of the 3 skipped batches


class Shards(torch.utils.data.IterableDataset):
    """Batches of labels 0..n-1 in batches of 4, shardable by batch (as a list of files would be)."""

    def __init__(self, batches, index=0, count=1):
        self.batches, self.index, self.count = batches, index, count
        self.read = []

    def shard(self, num_shards, index):
        return Shards(self.batches, index, num_shards)

    def __iter__(self):
        for number in range(self.index, self.batches, self.count):
            self.read.append(number)
            labels = torch.arange(4) + 4 * number
            yield labels.float().unsqueeze(1), labels


def test_a_source_with_shards_is_read_once_in_total_and_uneven_shards_step_together():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    seen = []
    for worker in range(2):
        source = Shards(5)  # worker 0: batches 0, 2, 4; worker 1: 1, 3 (then empty)
        distributed = data.DistributedDataset(source, strategy, workers=InputWorkers(LOCAL, 2, worker))
        assert distributed.sharding == "shards"
        steps = [parts(step) for step in distributed]
        seen.append(steps)
    labels = sorted(v for steps in seen for step in steps for replica in step for v in replica)
    assert labels == list(range(20))  # every batch once, over both workers
    # without a per-step agreement (no cluster here) a worker stops at its own end
    assert seen[0][0] == [[0, 1], [2, 3]] and seen[1][0] == [[4, 5], [6, 7]]


def test_file_needs_shards_and_off_takes_the_source_as_each_workers_own():
    strategy = ds.MirroredStrategy(["cpu:0"])
    workers = InputWorkers(["cpu:0"], 2, 1)
    with pytest.raises(ValueError, match="FILE needs a source that has shard"):
        data.DistributedDataset([torch.arange(4)], strategy, InputOptions(auto_shard_policy="FILE"), workers=workers)
    off = data.DistributedDataset([torch.arange(4)], strategy, InputOptions(auto_shard_policy="off"), workers=workers)
    assert off.sharding == "off" and [s.tolist() for s in off] == [[0, 1, 2, 3]]
    plain = data.DistributedDataset(
        [torch.arange(4)], strategy, InputOptions(auto_shard_policy=AutoShardPolicy.DATA), workers=workers
    )
    assert plain.sharding == "data" and [s.tolist() for s in plain] == [[2, 3]]
    with pytest.raises(ValueError, match="auto_shard_policy must be"):
        InputOptions(auto_shard_policy="ROWS")


class Unsharded(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(4))


def test_what_cannot_be_sharded_falls_back_to_data_with_a_warning_that_says_why():
    strategy = ds.MirroredStrategy(["cpu:0"])
    workers = InputWorkers(["cpu:0"], 2, 0)

    class MyLoader(torch.utils.data.DataLoader):
        pass

    dataset = Counting(8)
    cases = [
        ([torch.arange(4)], "an iterable of batches"),
        (MyLoader(dataset, batch_size=4), "a subclass of DataLoader"),
        (torch.utils.data.DataLoader(dataset, batch_size=None), "batch_size=None"),
        (torch.utils.data.DataLoader(Unsharded(), batch_size=2), "IterableDataset"),
    ]
    for source, why in cases:
        with pytest.warns(UserWarning, match=f"AutoShardPolicy.DATA.*{why}"):
            distributed = data.DistributedDataset(source, strategy, workers=workers)
        assert distributed.sharding == "data"
    sharded_loader = torch.utils.data.DataLoader(Shards(2), batch_size=None)
    assert data.DistributedDataset(sharded_loader, strategy, workers=workers).sharding == "shards"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DATA asked for: no warning
        data.DistributedDataset([torch.arange(4)], strategy, InputOptions(auto_shard_policy="DATA"), workers=workers)


def test_a_loader_with_a_distributed_sampler_is_each_workers_own_input():
    dataset = Counting(8)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    source = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)
    strategy = ds.MirroredStrategy(["cpu:0"])
    with pytest.warns(UserWarning, match="DistributedSampler.*not sharded again"):
        distributed = data.DistributedDataset(source, strategy, workers=InputWorkers(["cpu:0"], 2, 1))
    assert distributed.sharding == "off"
    assert [parts(step) for step in distributed] == [[[1, 3]], [[5, 7]]]


def test_one_process_reads_everything_once():
    source, dataset = batched_dataset(rows=16, batch=8)
    assert len(one_process(source, 2)) == 2 and sorted(dataset.read) == list(range(16))


@pytest.mark.timeout(120)
def test_two_passes_over_one_loader_at_once_keep_their_own_batch_sizes():
    """The sampler's record of each pass's batch sizes is the pass's own (regression: a second pass wiped
    the first's record of the batches its loader workers had asked for: IndexError)."""
    source, _ = loader(rows=40, batch=8, shuffle=False, num_workers=2)
    strategy = ds.MirroredStrategy(["cpu:0"])
    workers = InputWorkers(["cpu:0"], 2, 1)
    one = data.DistributedDataset(source, strategy, workers=workers).start(0, 0)
    first = parts(next(one))
    two = [parts(step) for step in data.DistributedDataset(source, strategy, workers=workers).start(0, 0)]
    rest = [parts(step) for step in one]
    assert (
        [first] + rest
        == two
        == [[[4, 5, 6, 7]], [[12, 13, 14, 15]], [[20, 21, 22, 23]], [[28, 29, 30, 31]], [[36, 37, 38, 39]]]
    )


def test_each_workers_own_input_walks_the_pass_it_is_given():
    """OFF (and FILE): a shuffled batched source shuffles per pass and starts where asked."""
    source, _ = batched_dataset(rows=16, batch=4, shuffle=True)
    strategy = ds.MirroredStrategy(["cpu:0"])
    distributed = data.DistributedDataset(
        source, strategy, InputOptions(auto_shard_policy="OFF"), workers=InputWorkers(["cpu:0"], 2, 0)
    )
    epochs = [[parts(step) for step in distributed.start(epoch, 0)] for epoch in (0, 1)]
    assert epochs[0] != epochs[1]
    assert [parts(step) for step in distributed.start(1, 2)] == epochs[1][2:]


def test_a_batch_sampler_without_a_length_falls_back_to_data():
    class Batches(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

    source = torch.utils.data.DataLoader(Counting(4), batch_sampler=Batches())
    with pytest.warns(UserWarning, match="no len"):
        distributed = data.DistributedDataset(
            source, ds.MirroredStrategy(["cpu:0"]), workers=InputWorkers(["cpu:0"], 2, 1)
        )
    assert [parts(step) for step in distributed] == [[[1]], [[3]]]
