"""The user's data as the trainer reads it: global batches from arrays, datasets or iterables, the
validation split, a batch's parts and float type, and the ``Cursor`` that says where a ``fit`` stands in it.

Example::

    source = batch_source((x, y), batch_size=64, shuffle=True, seed=0)  # a shuffled source of global batches
    train, validation = split_off_validation((x, y), 0.2)  # the last 20% of the examples for validation
    x, y, sample_weight = unpack(batch)  # x, (x, y) or (x, y, sample_weight)
"""

from __future__ import annotations

import torch

import replicafit.data as data_layer
from replicafit.strategies import nest

__all__ = [
    "Cursor",
    "as_dtype",
    "batch_source",
    "batchable",
    "length_of",
    "rows",
    "split_off_validation",
    "unpack",
]


def unpack(element):
    """``(x, y, sample_weight)`` of a batch: ``(x, y)``, ``(x, y, w)``, or ``x`` alone."""
    if isinstance(element, (tuple, list)) and not hasattr(element, "_fields"):
        if len(element) == 2:
            return element[0], element[1], None
        if len(element) == 3:
            return element[0], element[1], element[2]
        if len(element) == 1:
            return element[0], None, None
        raise ValueError(f"A batch must be x, (x, y) or (x, y, sample_weight); got a sequence of {len(element)}.")
    return element, None, None


def rows(x) -> int:
    leaves = nest.flatten(x)
    return leaves[0].shape[0] if leaves else 0


def as_dtype(structure, dtype):
    """``structure`` with its floating tensors of another float type cast to ``dtype``."""
    if structure is None:
        return None
    if type(structure) is torch.Tensor:  # the common case, without a walk of the structure
        floating = structure.is_floating_point() and structure.dtype != dtype
        return structure.to(dtype) if floating else structure

    def cast(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return nest.map_structure(cast, structure)


def batch_source(dataset, batch_size, shuffle, seed):
    return data_layer.as_global_batches(
        dataset, batch_size if batchable(dataset) else None, shuffle=shuffle and batchable(dataset), seed=seed
    )


def split_off_validation(dataset, validation_split: float):
    if validation_split == 0:
        return dataset, None
    if isinstance(dataset, torch.utils.data.Dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
        n = len(dataset)
        cut = _split_point(n, validation_split)
        return (torch.utils.data.Subset(dataset, range(cut)), torch.utils.data.Subset(dataset, range(cut, n)))
    if not batchable(dataset):
        raise ValueError(
            "validation_split needs arrays, tensors or a torch Dataset (it keeps the last examples "
            "for validation, as Keras does); pass validation_data for other sources."
        )
    leaves = [data_layer.as_tensor(leaf) for leaf in nest.flatten(dataset)]
    n = leaves[0].shape[0]
    cut = _split_point(n, validation_split)
    train = nest.pack_sequence_as(dataset, [leaf[:cut] for leaf in leaves])
    valid = nest.pack_sequence_as(dataset, [leaf[cut:] for leaf in leaves])
    return train, valid


def batchable(dataset) -> bool:
    """Arrays, tensors, tuples/dicts of them, or a map-style Dataset: batched by the trainer."""
    if isinstance(dataset, torch.utils.data.Dataset) and not isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return data_layer.is_array_nest(dataset)


def _split_point(n: int, validation_split: float) -> int:
    """Where ``validation_split`` cuts ``n`` examples; both parts must hold one at least (as in Keras)."""
    cut = n - int(n * validation_split)
    if cut == 0 or cut == n:
        raise ValueError(
            f"validation_split={validation_split} of {n} examples leaves {cut} for training and {n - cut} for "
            "validation, and each needs at least one: pass more data or another validation_split (or "
            "validation_data)."
        )
    return cut


def length_of(source):
    try:
        return len(source)
    except TypeError:
        return None


class Cursor:
    """Where the data stands: the pass over the source and the batches taken from it.

    Batched arrays/datasets and loaders sharded by rows resume exactly without reading what they skip;
    other sources skip the consumed batches of a fresh pass. ``peek`` reads the first step of a pass
    ahead (fit's entry checks look at it), and ``next`` then returns that same step: nothing is read
    twice.
    """

    def __init__(self, source, distributed, repeat: bool):
        self.source, self.distributed, self.repeat = source, distributed, repeat
        self.pass_index, self.position = 0, 0
        self._iterator = None
        self._held = None  # the step peek read ahead, and where it stands: (pass, position, batch)

    def start(self, pass_index: int, position: int = 0) -> None:
        held = self._held
        if held is not None and held[:2] == (pass_index, position) and self._iterator is not None:
            self.pass_index, self.position = pass_index, position  # the peeked pass: go on from its step
            return
        self._held = None
        if self._iterator is not None:
            self._iterator.close()
        self.pass_index, self.position = pass_index, position
        self._iterator = self.distributed.start(pass_index, position)

    def forget(self) -> None:
        """Drops the pass read ahead (``peek``): the next ``start`` begins a fresh one, read anew."""
        if self._held is not None:
            self._held = None
            self._iterator.close()
            self._iterator = None

    def peek(self, pass_index: int, position: int = 0):
        """The host batch of the step at ``(pass_index, position)`` (this worker's part of that global batch,
        before the split), read ahead: the next ``next()`` returns its distributed step. ``None`` when the
        pass has no step there."""
        self.start(pass_index, position)
        try:
            batch = next(self._iterator)
        except StopIteration:
            return None
        self._held = (pass_index, position, batch)
        return self._iterator.first_host_batch

    def next(self):
        if self._held is not None:
            batch, self._held = self._held[2], None
            self.position += 1
            return batch
        try:
            batch = next(self._iterator)
        except StopIteration:
            if not self.repeat:
                raise
            self.start(self.pass_index + 1, 0)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ValueError(
                    f"The training data yielded no batch on pass {self.pass_index + 1} over it, so steps_per_epoch "
                    "cannot repeat it: a one-shot iterator (such as a generator) is used up after one pass. Pass a "
                    "re-iterable source (arrays, a Dataset, a DataLoader or a list of batches) or fewer steps."
                ) from None
        self.position += 1
        return batch

    @property
    def started(self) -> bool:
        """Whether a pass has been started (``start``)."""
        return self._iterator is not None

    @property
    def global_batch_size(self):
        """Rows of the last batch over every worker (known once a step is read, else None)."""
        return getattr(self._iterator, "global_batch_size", None)

    def close(self) -> None:
        self._held = None
        if self._iterator is not None:
            self._iterator.close()
