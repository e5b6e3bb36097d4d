"""What each worker reads: ``AutoShardPolicy`` applied to a source of global batches.

Under ``MultiWorkerMirroredStrategy`` a worker's replicas train on a few rows of every global batch
(TensorFlow's split rule, ``input_lib``). ``plan(source, workers, policy)`` decides how the worker
reads only those:

* **rows** (``AUTO`` on addressable rows): the source's batched arrays or map-style ``Dataset``
  (``sources._Batched.iterate_rows``), or a ``DataLoader`` over a map-style ``Dataset`` rebuilt around a
  batch sampler that keeps this worker's indices of every global batch (``ShardedLoader``: its sampler
  is driven exactly as the user's, so the global batches and their order are one process's, and its
  ``collate_fn``, workers, pinning, ``generator``... are the user's). Each step yields the worker's part
  and the global batch's row count, known without communication.
* **shards** (``AUTO``/``FILE`` on a source with ``shard(num_shards, index)``): the worker's shard is
  its own input; each of its batches is its replicas' share of a step (``per_worker``).
* **off** (``OFF``, or a ``DataLoader`` with a ``DistributedSampler``): the source itself is the
  worker's own input.
* **data** (``DATA``, or ``AUTO`` on anything else, with one warning): every worker reads every global
  batch and keeps its rows (``input_lib``'s split).

Example::

    >>> from replicafit.data import InputWorkers
    >>> workers = InputWorkers(["cpu:0"], num_workers=2, worker_index=1)
    >>> share_of(workers)(5)   # worker 1's rows of a global batch of 5: offset 3, 2 rows
    (3, 2)
"""

from __future__ import annotations

import collections
import warnings
import weakref

import torch

from replicafit.strategies import nest

from . import hugging_face, loader_signals
from .options import AutoShardPolicy

__all__ = ["ShardPlan", "ShardedLoader", "plan", "share_of"]


def share_of(workers):
    """``share(rows) -> (offset, count)``: this worker's rows of a global batch of ``rows`` rows."""
    from .input_lib import split_sizes

    total, first, local = workers.num_replicas_in_sync, workers.first_replica, workers.num_local_replicas

    def share(rows: int) -> tuple:
        sizes = split_sizes(rows, total)
        return sum(sizes[:first]), sum(sizes[first : first + local])

    return share


class ShardPlan:
    """How a worker reads a source: ``kind`` (``"rows"``, ``"shards"``, ``"off"``, ``"data"``), the
    ``reader`` (rows: ``iterate_rows(epoch, start)``; shards/off: the worker's own source) and, for a
    fallback to ``data``, ``why``."""

    def __init__(self, kind: str, reader=None, why: str | None = None):
        self.kind, self.reader, self.why = kind, reader, why

    def __repr__(self) -> str:
        return f"ShardPlan({self.kind!r})"


class _RowsOfBatches:
    """A batched source's parts (``sources._Batched.iterate_rows``) with a worker's share."""

    def __init__(self, source, share):
        self.source, self.share = source, share

    def __len__(self) -> int:
        return len(self.source)

    def iterate_rows(self, epoch, start: int):
        return self.source.iterate_rows(epoch, start, self.share)


class _ShardedBatchSampler(torch.utils.data.Sampler):
    """The user's batch sampler, keeping this worker's indices of each global batch. Each pass (``iter``)
    iterates the user's sampler whole (so a random sampler draws as it would in one process) and
    records, in order, each global batch's size and whether the worker's part is empty (it then
    yields the batch's first index alone, read for the trailing shapes only): ``latest`` is the pass
    begun last, with its own record (a loader iterated twice at once keeps two)."""

    def __init__(self, batch_sampler, share):
        self.batch_sampler, self.share = batch_sampler, share
        self.skip = 0  # global batches to pass over at the start of the next pass (a resumed epoch)
        self.latest = None

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        self.latest = _Pass(self.batch_sampler, self.share, skip)
        return self.latest


class _Pass:
    """One pass of ``_ShardedBatchSampler``: the worker's index lists, and ``sizes``, a record of each
    global batch's ``(rows, whether the worker's part is empty)`` in the order they were yielded."""

    def __init__(self, batch_sampler, share, skip: int):
        self.batches, self.share, self.skip = iter(batch_sampler), share, skip
        self.sizes: collections.deque = collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        while self.skip:
            next(self.batches)
            self.skip -= 1
        indices = list(next(self.batches))
        offset, count = self.share(len(indices))
        self.sizes.append((len(indices), count == 0))
        return indices[offset : offset + count] if count else indices[:1]


class ShardedLoader:
    """A ``DataLoader`` over a map-style ``Dataset``, rebuilt once around ``_ShardedBatchSampler``: its
    worker's part of each global batch and that batch's row count, ``iterate_rows(epoch, start)``.
    Everything else is the user's loader's: ``collate_fn``, ``num_workers``, ``pin_memory``,
    ``worker_init_fn``, ``generator``, ``persistent_workers``, ``prefetch_factor``, ``timeout``, ...
    ``global_rng``: whether its sampling may draw from torch's global generator (no ``generator``), which
    the workers then agree on at the start of every pass (``input_lib``)."""

    def __init__(self, loader, share):
        self.sampler = _ShardedBatchSampler(loader.batch_sampler, share)
        self.global_rng = loader.generator is None
        extra = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}  # (torch >= 2.6)
        self.loader = torch.utils.data.DataLoader(
            loader.dataset, batch_sampler=self.sampler, **extra, **_settings(loader)
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def iterate_rows(self, epoch, start: int):
        """``(part, rows)`` of each global batch from batch number ``start`` on (``epoch`` is the
        loader's business: its sampler draws a new order per pass, as the user's would)."""
        self.sampler.skip = start
        parts = loader_signals.iterate(self.loader)  # (begins the sampler's pass at once, with its record of sizes)
        sizes = self.sampler.latest.sizes
        for part in parts:
            rows, empty = sizes.popleft()
            yield (nest.map_structure(_no_rows, part) if empty else part), rows


_REBUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # user's loader -> {worker's place: ShardedLoader}


def _rebuilt(loader, workers) -> ShardedLoader:
    """The loader rebuilt for this worker, once per loader (its persistent workers persist, e.g. across the
    epochs' validation passes)."""
    place = (workers.num_replicas_in_sync, workers.first_replica, workers.num_local_replicas)
    mine = _REBUILT.setdefault(loader, {})
    if place not in mine:
        mine[place] = ShardedLoader(loader, share_of(workers))
    return mine[place]


def loaders_of(source) -> list:
    """The ``DataLoader`` objects a pass over ``source`` iterates: the user's own, and the ones rebuilt from it
    for the workers' shares (``[]`` for other sources)."""
    if not isinstance(source, torch.utils.data.DataLoader):
        return []
    rebuilt = _REBUILT.get(source) or {}
    return [source, *(sharded.loader for sharded in rebuilt.values())]


def _no_rows(leaf):
    return leaf[:0] if isinstance(leaf, torch.Tensor) else leaf


def _distributed_sampler(loader) -> bool:
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
    return any(isinstance(sampler, torch.utils.data.DistributedSampler) for sampler in samplers)


def _map_style(dataset) -> bool:
    """Whether a loader's dataset is read by index (a map-style ``Dataset``, or a list: what a
    ``DataLoader`` reads with a sampler)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return False
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _loader_problem(loader) -> str | None:
    """Why a ``DataLoader`` cannot be rebuilt by rows (``None``: it can)."""
    if type(loader) is not torch.utils.data.DataLoader:
        return f"it is a subclass of DataLoader ({type(loader).__name__}), which cannot be rebuilt faithfully"
    if not _map_style(loader.dataset):
        return "its dataset is an IterableDataset, whose rows cannot be addressed"
    if loader.batch_sampler is None:
        return "it has batch_size=None: its dataset's items are the batches, whose rows cannot be addressed"
    if not getattr(loader, "in_order", True):
        return "it has in_order=False: its batches may come in another order than its sampler's"
    try:
        len(loader.batch_sampler)
    except TypeError:
        return "its batch sampler has no len(): the workers could not agree on its number of batches up front"
    return None


def _shardable(source) -> bool:
    return callable(getattr(source, "shard", None))


def _iterable_shards(dataset) -> bool:
    """A loader's dataset that is read by its shards: an ``IterableDataset`` with ``shard``."""
    return isinstance(dataset, torch.utils.data.IterableDataset) and _shardable(dataset)


def _sharded_loader(loader, workers):
    """A ``DataLoader`` over ``loader.dataset.shard(...)`` (an ``IterableDataset``: no sampler to keep; a Hugging
    Face one split by ``hugging_face.shard``, which never leaves a worker without data), otherwise the user's: its
    batches are the worker's."""
    shard = hugging_face.shard(loader.dataset, workers.num_workers, workers.worker_index)
    return torch.utils.data.DataLoader(
        shard, batch_size=loader.batch_size, drop_last=loader.drop_last, **_settings(loader)
    )


def _settings(loader) -> dict:
    """What a rebuilt loader keeps of the user's ``DataLoader``, besides its dataset and batching."""
    workers = loader.num_workers
    return {
        "num_workers": workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context if workers else None,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor if workers else None,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }


def plan(source, workers, policy: AutoShardPolicy) -> ShardPlan:
    """How this worker reads ``source`` under ``policy`` (see the module docstring). One process, or a
    worker alone: every row is its own (``data``)."""
    from .sources import _Batched

    if workers.num_workers == 1 or policy is AutoShardPolicy.DATA:
        return ShardPlan("data")
    if policy is AutoShardPolicy.OFF:
        return ShardPlan("off", source)
    loader = isinstance(source, torch.utils.data.DataLoader)
    plain_loader = type(source) is torch.utils.data.DataLoader
    if policy is AutoShardPolicy.FILE:
        if plain_loader and _iterable_shards(source.dataset):
            return ShardPlan("shards", _sharded_loader(source, workers))
        if _shardable(source):
            return ShardPlan("shards", source.shard(workers.num_workers, workers.worker_index))
        what = f"a DataLoader whose IterableDataset ({type(source.dataset).__name__})" if loader else "a source that"
        raise ValueError(
            f"AutoShardPolicy.FILE needs {what} has shard(num_shards, index), and this {type(source).__name__} has "
            "none: give it one (each worker reads shard(num_workers, worker_index)), or use AUTO."
        )
    if isinstance(source, _Batched):
        return ShardPlan("rows", _RowsOfBatches(source, share_of(workers)))
    if loader:
        if _distributed_sampler(source):
            warnings.warn(
                "The DataLoader's sampler is a DistributedSampler, which gives each worker its own examples "
                "already: it is read as each worker's own input (AutoShardPolicy.OFF), not sharded again.",
                stacklevel=4,
            )
            return ShardPlan("off", source)
        problem = _loader_problem(source)
        if problem is None:
            return ShardPlan("rows", _rebuilt(source, workers))
        if plain_loader and _iterable_shards(source.dataset):
            return ShardPlan("shards", _sharded_loader(source, workers))
        return _fallback(source, problem)
    if _shardable(source):
        return ShardPlan("shards", source.shard(workers.num_workers, workers.worker_index))
    kind = "an IterableDataset" if isinstance(source, torch.utils.data.IterableDataset) else "an iterable of batches"
    return _fallback(source, f"it is {kind}, whose rows cannot be addressed, without shard(num_shards, index)")


def _fallback(source, why: str) -> ShardPlan:
    warnings.warn(
        f"Every worker reads every global batch of this {type(source).__name__} and keeps its replicas' rows "
        f"(AutoShardPolicy.DATA): {why}. To read only each worker's share, pass arrays or a map-style Dataset "
        "with batch_size (or a plain DataLoader over one), give the source shard(num_shards, index), or use "
        "strategy.distribute_datasets_from_function; auto_shard_policy=AutoShardPolicy.DATA keeps this and "
        "silences the warning (InputOptions(auto_shard_policy=...); in Trainer(input_options=...) for fit).",
        stacklevel=4,
    )
    return ShardPlan("data", why=why)
