"""Sources of global batches: arrays, tensors and ``torch.utils.data.Dataset``s batched here.

``as_global_batches(source, batch_size=...)`` turns what a user has into a re-iterable
source of global batches, the one form the distributed layer splits:

* a ``DataLoader`` or any other iterable of batches: used as it is;
* NumPy arrays, tensors, and tuples/dicts/namedtuples of them (Keras-style ``(x, y)``
  or ``(x, y, sample_weight)``): ``ArrayBatches``;
* a map-style ``torch.utils.data.Dataset``: ``DatasetBatches`` (items collated with
  torch's ``default_collate``);
* a Hugging Face ``datasets.Dataset`` (dict rows, any format): ``DatasetBatches``, rows collated
  by ``collation.collate_rows``; a ``datasets.IterableDataset`` (a stream): ``IterableBatches``;
* a ``CollatedDataset`` (examples with the ``collate_fn`` that batches them, e.g. a padding
  collator): either of the two, with its ``collate_fn``.

Batched sources shuffle with a seed per epoch (``set_epoch``) and can start at any
batch (``iterate(epoch, start)``), so an interrupted epoch resumes with exactly the
batches it would have seen.

Example::

    >>> import numpy as np
    >>> batches = as_global_batches((np.arange(10.0), np.arange(10)), batch_size=4)
    >>> [len(x) for x, y in batches]
    [4, 4, 2]
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from replicafit.strategies import nest

from . import hugging_face
from .collation import CollatedDataset, collate_rows

__all__ = [
    "as_global_batches",
    "as_tensor",
    "ArrayBatches",
    "DatasetBatches",
    "IterableBatches",
    "epoch_permutation",
    "indexed_examples",
    "is_array_nest",
    "streamed_examples",
    "subset",
]

DEFAULT_BATCH_SIZE = 32  # Keras' default for arrays


def epoch_permutation(size: int, seed: int | None, epoch: int) -> np.ndarray:
    """The order of ``size`` examples in ``epoch``: a permutation fixed by ``(seed, epoch)``."""
    rng = np.random.default_rng(None if seed is None else [int(seed), int(epoch)])
    return rng.permutation(size)


def _check_batch_size(batch_size) -> int:
    """``batch_size`` as an int (a NumPy integer counts), or ``ValueError``."""
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    return int(batch_size)


class _Batched:
    """Shared epoch/shuffle/resume logic of the batched sources."""

    def __init__(self, size: int, batch_size: int, shuffle: bool, seed: int | None, drop_remainder: bool):
        self._size = size
        self.batch_size = _check_batch_size(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_remainder = bool(drop_remainder)
        self.epoch = 0

    def __len__(self) -> int:
        full, rest = divmod(self._size, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    @property
    def num_examples(self) -> int:
        """How many examples (rows) the source holds; an epoch walks each once."""
        return self._size

    def set_epoch(self, epoch: int) -> None:
        """Which epoch the next ``iter()`` walks (its shuffle order depends on it)."""
        self.epoch = int(epoch)

    def order(self, epoch: int | None = None) -> np.ndarray | None:
        """The example order of ``epoch`` (``None``: in order)."""
        if not self.shuffle:
            return None
        return epoch_permutation(self._size, self.seed, self.epoch if epoch is None else epoch)

    def __iter__(self):
        return self.iterate(self.epoch)

    def iterate(self, epoch: int | None = None, start: int = 0):
        """The batches of ``epoch`` from batch number ``start`` on."""
        order = self.order(epoch)
        for index in range(start, len(self)):
            begin = index * self.batch_size
            end = min(begin + self.batch_size, self._size)
            yield self._batch(order, begin, end)

    def iterate_rows(self, epoch: int | None, start: int, share):
        """Part of each global batch of ``epoch`` from batch number ``start`` on: ``(part, rows)``, where
        ``share(rows)`` gives the ``(offset, count)`` of the part within the global batch of ``rows``
        rows. Only the part's examples are read; an empty part keeps the batch's trailing shapes (one
        example is read for them).

        Example (the second half of every batch)::

            for part, rows in batches.iterate_rows(0, 0, lambda rows: (rows // 2, rows - rows // 2)): ...
        """
        order = self.order(epoch)
        for index in range(start, len(self)):
            begin = index * self.batch_size
            rows = min(self.batch_size, self._size - begin)
            offset, count = share(rows)
            if count:
                yield self._batch(order, begin + offset, begin + offset + count), rows
            else:
                yield self._empty_batch(order, begin), rows

    def _empty_batch(self, order, begin: int):
        return nest.map_structure(lambda leaf: leaf[:0], self._batch(order, begin, begin + 1))

    def _batch(self, order, begin: int, end: int):
        raise NotImplementedError


class ArrayBatches(_Batched):
    """Batches of a nest of arrays/tensors sharing their first dimension.

    Args:
      arrays: an array, a tensor, or a tuple/dict/namedtuple of them.
      batch_size: rows per global batch; the last batch may be smaller.
      shuffle: a new order every epoch, fixed by ``(seed, epoch)``.
      seed: shuffling seed (``None``: a fresh random order each time).
      drop_remainder: drop the last, partial batch.

    Example::

        batches = ArrayBatches((x, y), batch_size=64, shuffle=True, seed=0)
        batches.set_epoch(3)
        for xb, yb in batches: ...
    """

    def __init__(
        self,
        arrays,
        batch_size: int = DEFAULT_BATCH_SIZE,
        *,
        shuffle: bool = False,
        seed: int | None = None,
        drop_remainder: bool = False,
    ):
        self._structure = arrays
        self._leaves = [as_tensor(leaf) for leaf in nest.flatten(arrays)]
        sizes = {leaf.shape[0] if leaf.dim() else None for leaf in self._leaves}
        if None in sizes or len(sizes) != 1:
            shapes = [tuple(leaf.shape) for leaf in self._leaves]
            raise ValueError(f"The arrays must share their first (example) dimension; got shapes {shapes}.")
        super().__init__(sizes.pop(), batch_size, shuffle, seed, drop_remainder)
        self._orders = None  # (the epoch's order, {device: that order as an index tensor there})

    def _batch(self, order, begin, end):
        if order is None:
            parts = [leaf[begin:end] for leaf in self._leaves]
        else:
            parts = [leaf.index_select(0, self._order_on(order, leaf.device)[begin:end]) for leaf in self._leaves]
        return nest.pack_sequence_as(self._structure, parts)

    def _empty_batch(self, order, begin: int):
        return self._batch(order, begin, begin)  # a slice of no rows: no example read

    def _order_on(self, order: np.ndarray, device: torch.device) -> torch.Tensor:
        """The epoch's order as an index tensor on ``device`` (arrays already on a GPU are gathered
        there): one copy per epoch and device, asynchronous from pinned memory, not one per batch."""
        cached = self._orders
        if cached is None or cached[0] is not order:
            cached = self._orders = (order, {})
        index = cached[1].get(device)
        if index is None:
            index = torch.from_numpy(order)
            if device.type == "cuda":
                index = index.pin_memory().to(device, non_blocking=True)
            elif device.type != "cpu":
                index = index.to(device)
            cached[1][device] = index
        return index


class DatasetBatches(_Batched):
    """Batches of a map-style ``torch.utils.data.Dataset`` (or a Hugging Face ``Dataset``), read and
    collated as a ``DataLoader`` reads them: a dataset with ``__getitems__`` (Hugging Face's reads a
    batch of rows from Arrow at once) gets each batch's indices in one call, others one index at a time;
    ``collate_fn`` (default torch's ``default_collate``) makes the batch of the examples.

    Example::

        batches = DatasetBatches(my_dataset, batch_size=32, shuffle=True, seed=1)
    """

    def __init__(
        self,
        dataset,
        batch_size: int = DEFAULT_BATCH_SIZE,
        *,
        shuffle: bool = False,
        seed: int | None = None,
        drop_remainder: bool = False,
        collate_fn=None,
    ):
        self.dataset = dataset
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        super().__init__(len(dataset), batch_size, shuffle, seed, drop_remainder)

    def _batch(self, order, begin, end):
        indices = list(range(begin, end)) if order is None else order[begin:end].tolist()
        read_many = getattr(self.dataset, "__getitems__", None)  # (torch's fetcher protocol)
        examples = read_many(indices) if callable(read_many) else [self.dataset[i] for i in indices]
        return self.collate_fn(examples)


class IterableBatches:
    """Batches of a stream of examples (a Hugging Face ``IterableDataset``; a torch ``IterableDataset`` of
    single examples in a ``CollatedDataset``): ``batch_size`` examples at a time, in the order the stream
    yields them, made into a global batch by ``collate_fn`` (default ``collation.collate_rows``); the last
    batch may be smaller (``drop_remainder`` drops it).

    A stream is not shuffled here (shuffle it yourself: ``dataset.shuffle(seed=..., buffer_size=...)``):
    each pass (``iterate(epoch)``) tells the stream its epoch (``set_epoch``, where it has one: a shuffled
    Hugging Face stream then reshuffles per epoch, alike on every worker), and a pass resumed at a later
    batch reads the batches before it again (a stream cannot be addressed). ``len()`` is unknown.

    Across workers ``shard(num_shards, index)`` is worker ``index``'s part: its shard of the stream
    (``hugging_face.shard``; a torch ``IterableDataset``'s own ``shard``), batched by its share of
    ``batch_size``, so that a step's global batch still holds ``batch_size`` examples (Keras' meaning of
    ``batch_size``; a ``DataLoader`` over a sharded stream batches ``batch_size`` per worker instead). A
    stream with no ``shard`` has ``shard = None`` (read whole by every worker, with a warning).

    Example::

        stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True).map(tokenize)
        batches = IterableBatches(stream, batch_size=32, collate_fn=collator)
        for batch in batches.iterate(epoch=0): ...
    """

    def __init__(self, dataset, batch_size: int = DEFAULT_BATCH_SIZE, *, collate_fn=None, drop_remainder: bool = False):
        self.dataset = dataset
        self.batch_size = _check_batch_size(batch_size)
        self.collate_fn = collate_fn or collate_rows
        self.drop_remainder = bool(drop_remainder)
        self.epoch = 0
        if not (hugging_face.is_iterable_dataset(dataset) or callable(getattr(dataset, "shard", None))):
            self.shard = None  # (nothing to shard by: the data layer reads it whole on every worker)

    def set_epoch(self, epoch: int) -> None:
        """Which epoch the next ``iter()`` walks (told to the stream, where it has ``set_epoch``)."""
        self.epoch = int(epoch)

    def __iter__(self):
        return self.iterate(self.epoch)

    def iterate(self, epoch: int | None = None, start: int = 0):
        """The batches of pass ``epoch`` from batch number ``start`` on (the batches before it are read)."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch if epoch is None else int(epoch))
        examples, index = [], 0
        for example in self.dataset:
            examples.append(example)
            if len(examples) == self.batch_size:
                if index >= start:
                    yield self.collate_fn(examples)
                examples, index = [], index + 1
        if examples and not self.drop_remainder and index >= start:
            yield self.collate_fn(examples)

    def shard(self, num_shards: int, index: int) -> IterableBatches:
        """Worker ``index``'s batches among ``num_shards`` workers: its shard of the stream, batched by its
        share of ``batch_size`` (``split_sizes``: 8 over 2 workers is 4 and 4, 7 is 4 and 3).

        Example::

            mine = batches.shard(2, 1)   # worker 1 of 2
        """
        from .input_lib import split_sizes

        share = split_sizes(self.batch_size, num_shards)[index]
        if share == 0:
            raise ValueError(
                f"A batch_size of {self.batch_size} cannot be shared by {num_shards} workers each reading its own "
                f"shard of the stream: pass a batch_size of {num_shards} at least."
            )
        part = hugging_face.shard(self.dataset, num_shards, index)
        return IterableBatches(part, share, collate_fn=self.collate_fn, drop_remainder=self.drop_remainder)


def indexed_examples(source) -> bool:
    """Whether ``source`` is a dataset of single examples addressed by index that ``as_global_batches``
    batches (and may shuffle): a map-style torch ``Dataset``, a Hugging Face ``Dataset``, a
    ``CollatedDataset`` of either.

    Example::

        >>> indexed_examples(CollatedDataset([{"x": 1}], collate_rows)), indexed_examples([1, 2])
        (True, False)
    """
    if isinstance(source, CollatedDataset):
        return source.by_index
    if hugging_face.is_dataset(source):
        return True
    return isinstance(source, torch.utils.data.Dataset) and not isinstance(source, torch.utils.data.IterableDataset)


def streamed_examples(source) -> bool:
    """Whether ``source`` is a stream of single examples that ``as_global_batches`` batches (never
    shuffles): a Hugging Face ``IterableDataset``, or a ``CollatedDataset`` of a stream.

    Example::

        >>> streamed_examples(CollatedDataset(iter([{"x": 1}]), collate_rows))
        True
    """
    if isinstance(source, CollatedDataset):
        return not source.by_index
    return hugging_face.is_iterable_dataset(source)


def subset(dataset, start: int, stop: int):
    """Examples ``start`` to ``stop`` of a dataset that ``indexed_examples`` accepts, as the same kind of
    dataset: a Hugging Face ``Dataset``'s ``select`` (its format and rows' collation kept), a
    ``CollatedDataset`` of the part (its ``collate_fn`` kept), else a ``torch.utils.data.Subset``.

    Example::

        train, held_out = subset(dataset, 0, 800), subset(dataset, 800, 1000)
    """
    if isinstance(dataset, CollatedDataset):
        return CollatedDataset(subset(dataset.dataset, start, stop), dataset.collate_fn)
    if hugging_face.is_dataset(dataset):
        return dataset.select(range(start, stop))
    return torch.utils.data.Subset(dataset, range(start, stop))


def is_array_nest(value) -> bool:
    """Whether ``value`` is in-memory data as ``as_global_batches`` reads it: a NumPy array or
    tensor, alone or in (nested) tuples and mappings, each of them holding one at least. A list is
    not (a list is a list of batches), nor is an empty tuple or dict.

    Example::

        >>> import numpy as np
        >>> x = np.zeros((4, 2))
        >>> is_array_nest((x, {"y": x})), is_array_nest((x, [x])), is_array_nest((x, ())), is_array_nest([x])
        (True, False, False, False)
    """
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, (tuple, Mapping)):
        items = list(value.values() if isinstance(value, Mapping) else value)
        return bool(items) and all(is_array_nest(item) for item in items)
    return False


def as_tensor(leaf) -> torch.Tensor:
    """An array leaf as a tensor: a tensor as it is, a NumPy array (or a number) without a copy where
    its memory allows. An object array (strings, ragged rows) is a ``ValueError``.

    Example::

        >>> as_tensor(np.arange(3)).tolist()
        [0, 1, 2]
    """
    if isinstance(leaf, torch.Tensor):
        return leaf
    array = np.asarray(leaf)
    if array.dtype == object:
        raise ValueError(f"Array leaves must hold numbers, got an object array from {type(leaf).__name__}.")
    return torch.from_numpy(np.ascontiguousarray(array))


def as_global_batches(
    source,
    batch_size: int | None = None,
    *,
    shuffle: bool = False,
    seed: int | None = None,
    drop_remainder: bool = False,
):
    """A re-iterable source of global batches made from ``source`` (see the module docstring).

    ``batch_size`` (default 32 for arrays, required for a ``Dataset``), ``shuffle``,
    ``seed`` and ``drop_remainder`` apply to arrays and datasets (a stream of examples takes
    ``batch_size`` and ``drop_remainder``: shuffle the stream itself); a source that is
    already batched (a ``DataLoader``, a list of batches, a generator) must not get them.
    A *list* is read as a list of batches; pass a tuple for several arrays.

    Example::

        batches = as_global_batches(hf_dataset.with_format("torch"), batch_size=8, shuffle=True, seed=0)
        padded = as_global_batches(CollatedDataset(hf_dataset, collator), batch_size=8)
    """
    if is_array_nest(source):
        return ArrayBatches(
            source,
            DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
        )
    if hugging_face.is_dataset_dict(source):
        raise ValueError(
            f"A {type(source).__name__} holds named splits ({', '.join(map(str, source))}), not examples: pass one "
            "split, e.g. fit(model, dataset_dict['train'], batch_size=..., validation_data=dataset_dict['validation'])."
        )
    if indexed_examples(source) or streamed_examples(source):
        if batch_size is None:
            raise ValueError(
                f"A {type(source).__name__} (a dataset of single examples) needs a batch_size to be cut into "
                "global batches. (A dataset whose items are batches already, such as a Hugging Face "
                "Dataset.batch(...) or IterableDataset.batch(...), goes in a DataLoader(dataset, batch_size=None).)"
            )
        collated = isinstance(source, CollatedDataset)
        dataset = source.dataset if collated else source
        collate_fn = source.collate_fn if collated else collate_rows if hugging_face.is_dataset(source) else None
        if indexed_examples(source):
            return DatasetBatches(
                dataset, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder, collate_fn=collate_fn
            )
        if shuffle:
            raise ValueError(
                f"A stream of examples ({type(dataset).__name__}) is read in its own order and cannot be shuffled "
                "here: shuffle it itself (a Hugging Face IterableDataset: dataset.shuffle(seed=..., buffer_size=...))."
            )
        return IterableBatches(dataset, batch_size, collate_fn=collate_fn, drop_remainder=drop_remainder)
    if isinstance(source, (tuple, Mapping)):
        raise ValueError(
            f"A {type(source).__name__} is read as arrays, such as (x, y) or {{'image': x, 'label': y}}: every leaf "
            "must be a NumPy array or tensor, in tuples and dicts that are not empty. This one holds something else "
            "(a list, an empty tuple or dict, another object); pass a list for a list of batches."
        )
    if not hasattr(source, "__iter__"):
        raise TypeError(
            f"Cannot make global batches from a {type(source).__name__}: pass a DataLoader or another iterable of "
            "batches, NumPy arrays or tensors (alone or as a tuple/dict such as (x, y)), or a torch Dataset with a "
            "batch_size."
        )
    if batch_size is not None or shuffle or drop_remainder:
        raise ValueError(
            f"A {type(source).__name__} already yields batches: batch_size, shuffle and drop_remainder apply only to "
            "arrays and Datasets. Set them on the DataLoader instead."
        )
    return source
