"""Hugging Face ``datasets`` as sources: recognising its datasets, and a worker's shard of a stream.

``datasets`` is an optional dependency, never imported here: a user who holds one of its datasets has
imported it already, so its classes are looked up in ``sys.modules`` (an object cannot be one of them
otherwise). ``sources.as_global_batches`` batches a ``datasets.Dataset`` (map-style: its rows are
addressed, so each worker reads only its rows) and a ``datasets.IterableDataset`` (a stream: each worker
reads its shard, ``shard``).

Example::

    if hugging_face.is_iterable_dataset(source):
        mine = hugging_face.shard(source, num_shards=2, index=1)   # worker 1's part of the stream
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["is_dataset", "is_dataset_dict", "is_iterable_dataset", "shard"]


def _class(name: str):
    library = sys.modules.get("datasets")
    return getattr(library, name, None) if library is not None else None


def _is(value, *names: str) -> bool:
    classes = tuple(c for c in map(_class, names) if isinstance(c, type))
    return bool(classes) and isinstance(value, classes)


def is_dataset(value) -> bool:
    """Whether ``value`` is a map-style ``datasets.Dataset`` (rows addressed by index, in any format)."""
    return _is(value, "Dataset")


def is_iterable_dataset(value) -> bool:
    """Whether ``value`` is a ``datasets.IterableDataset`` (a stream of rows, e.g. ``streaming=True``)."""
    return _is(value, "IterableDataset")


def is_dataset_dict(value) -> bool:
    """Whether ``value`` is a ``datasets.DatasetDict`` or ``IterableDatasetDict`` (splits by name)."""
    return _is(value, "DatasetDict", "IterableDatasetDict")


def shard(dataset, num_shards: int, index: int):
    """Worker ``index``'s part of ``dataset`` among ``num_shards`` workers.

    A ``datasets.IterableDataset`` is split by ``datasets.distributed.split_dataset_by_node``, which
    gives each worker whole shards (files) where their number is a multiple of ``num_shards``; otherwise
    every worker reads the whole stream and keeps one example in ``num_shards`` (correct, but each
    reads everything: a warning says so). ``IterableDataset.shard`` itself is not used: with fewer
    shards than workers it leaves some workers with nothing to read. Any other dataset's own
    ``shard(num_shards, index)`` is called.
    """
    if not is_iterable_dataset(dataset):
        return dataset.shard(num_shards, index)
    from datasets.distributed import split_dataset_by_node  # (imported already: the dataset is one of its)

    if index == 0 and dataset.num_shards % num_shards:
        warnings.warn(
            f"The IterableDataset has {dataset.num_shards} shard(s), not a multiple of the {num_shards} workers: "
            "every worker reads every example of it and keeps one in "
            f"{num_shards}. To have each worker read only its own shards, make their number a multiple of the "
            f"workers' (e.g. Dataset.to_iterable_dataset(num_shards={num_shards}), or more data files).",
            stacklevel=5,
        )
    return split_dataset_by_node(dataset, rank=index, world_size=num_shards)
