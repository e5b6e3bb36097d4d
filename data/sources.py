"""Sources of global batches: arrays, tensors and ``torch.utils.data.Dataset``s batched here.

``as_global_batches(source, batch_size=...)`` turns what a user has into a re-iterable
source of global batches, the one form the distributed layer splits:

* a ``DataLoader`` or any other iterable of batches: used as it is;
* NumPy arrays, tensors, and tuples/dicts/namedtuples of them (Keras-style ``(x, y)``
  or ``(x, y, sample_weight)``): ``ArrayBatches``;
* a map-style ``torch.utils.data.Dataset``: ``DatasetBatches`` (items collated with
  torch's ``default_collate``).

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

__all__ = ["as_global_batches", "as_tensor", "ArrayBatches", "DatasetBatches", "epoch_permutation", "is_array_nest"]

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
    """Batches of a map-style ``torch.utils.data.Dataset``, collated like a ``DataLoader``.

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
        indices = range(begin, end) if order is None else order[begin:end].tolist()
        return self.collate_fn([self.dataset[i] for i in indices])


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
    ``seed`` and ``drop_remainder`` apply to arrays and datasets; a source that is
    already batched (a ``DataLoader``, a list of batches, a generator) must not get them.
    A *list* is read as a list of batches; pass a tuple for several arrays.
    """
    if is_array_nest(source):
        return ArrayBatches(
            source,
            DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
        )
    if isinstance(source, torch.utils.data.Dataset) and not isinstance(source, torch.utils.data.IterableDataset):
        if batch_size is None:
            raise ValueError(
                f"A {type(source).__name__} (a torch Dataset of single examples) needs a batch_size "
                "to be cut into global batches."
            )
        return DatasetBatches(source, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder)
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
