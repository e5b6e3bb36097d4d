"""The user's data as the trainer reads it: global batches from arrays, datasets or iterables, the
validation split, a batch's parts and float type, and the ``Cursor`` that says where a ``fit`` stands in it.

Example::

    source = batch_source((x, y), batch_size=64, shuffle=True, seed=0)  # a shuffled source of global batches
    train, validation = split_off_validation((x, y), 0.2)  # the last 20% of the examples for validation
    x, y, sample_weight = unpack(batch)  # x, (x, y) or (x, y, sample_weight)
"""

from __future__ import annotations

import math

import torch

import replicafit.data as data_layer
from replicafit.data import loader_internals, sharding, sources
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
    """The global batches of ``dataset``: arrays and datasets of examples are batched by ``batch_size`` (and
    shuffled where they are addressed by index; a stream never is), other sources are batched already."""
    addressed = batchable(dataset)
    batched_here = addressed or sources.streamed_examples(dataset)
    return data_layer.as_global_batches(
        dataset, batch_size if batched_here else None, shuffle=shuffle and addressed, seed=seed
    )


def split_off_validation(dataset, validation_split: float):
    if validation_split == 0:
        return dataset, None
    if sources.indexed_examples(dataset):
        n = len(dataset)
        cut = _split_point(n, validation_split)
        return sources.subset(dataset, 0, cut), sources.subset(dataset, cut, n)
    if not batchable(dataset):
        raise ValueError(
            "validation_split needs arrays, tensors or a dataset addressed by index (a torch or Hugging Face "
            "Dataset; it keeps the last examples for validation, as Keras does); pass validation_data for other "
            "sources."
        )
    leaves = [data_layer.as_tensor(leaf) for leaf in nest.flatten(dataset)]
    n = leaves[0].shape[0]
    cut = _split_point(n, validation_split)
    train = nest.pack_sequence_as(dataset, [leaf[:cut] for leaf in leaves])
    valid = nest.pack_sequence_as(dataset, [leaf[cut:] for leaf in leaves])
    return train, valid


def batchable(dataset) -> bool:
    """Arrays, tensors, tuples/dicts of them, or a dataset of examples addressed by index (a map-style torch
    Dataset, a Hugging Face Dataset, a ``CollatedDataset`` of one): batched and shuffled by the trainer."""
    return sources.indexed_examples(dataset) or data_layer.is_array_nest(dataset)


def _split_point(n: int, validation_split: float) -> int:
    """Where ``validation_split`` cuts ``n`` examples: Keras 3's point, ``floor(n * (1 - split))`` rows for
    training and the rest (the last rows) for validation; both parts must hold one at least (as in Keras)."""
    cut = math.floor(n * (1.0 - validation_split))
    if cut == 0 or cut == n:
        raise ValueError(
            f"validation_split={validation_split} of {n} examples leaves {cut} for training and {n - cut} for "
            f"validation (floor({n} * (1 - {validation_split})) = {cut} rows train, in floating point, as in "
            "Keras), and each needs at least one: pass more data or another validation_split (or validation_data)."
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

    A source that draws its order as a pass begins (a ``DataLoader(shuffle=True)``, from torch's generator
    or its own ``generator``) is replayed: ``pass_random_state`` is the random state the current pass began
    with, and a pass begun again from it (``replay``) draws the same order.
    """

    def __init__(self, source, distributed, repeat: bool):
        self.source, self.distributed, self.repeat = source, distributed, repeat
        self.pass_index, self.position = 0, 0
        self.pass_random_state = None  # the random state the current pass began with (``random_state``)
        self.batch_size = None  # rows of the first global batch read (this fit's global batch size)
        self._iterator = None
        self._held = None  # the step read ahead, and where it stands: (pass, position, batch)
        self._replay = None  # (pass, position, random state it began with, generator states after): ``replay``

    def start(self, pass_index: int, position: int = 0) -> None:
        """Puts the cursor at batch ``position`` of pass ``pass_index`` (a pass read ahead there goes on)."""
        held = self._held
        if held is not None and held[:2] == (pass_index, position) and self._iterator is not None:
            self.pass_index, self.position = pass_index, position  # the peeked pass: go on from its step
            return
        replay, self._replay = self._replay, None
        if replay is None or replay[:2] != (pass_index, position):
            self._begin(pass_index, position)
            return
        now = torch.get_rng_state()
        self.set_random_state(replay[2])
        self._match_persistent_iterators(replay[2].get("live"))
        try:
            self._begin(pass_index, position)
            self._read_ahead(pass_index, position)  # the pass's draws happen now, from its own random state
        finally:
            torch.set_rng_state(now)
        self.set_generator_states(replay[3])

    def replay(self, pass_index: int, position: int, pass_random_state: dict, generator_states: list) -> None:
        """The next ``start`` at ``(pass_index, position)`` begins that pass from the random state it began
        with (``pass_random_state``, a ``random_state()``) and reads its step ahead: a source that draws its
        order as a pass begins (a shuffled ``DataLoader``) draws the same order as when it was saved. torch's
        generator is then left as it was, the source's generators set to ``generator_states``.

        Example::

            cursor.replay(2, 5, saved["pass"], saved["generators"])  # a resumed epoch 2, from its sixth batch
        """
        self._replay = (pass_index, position, pass_random_state, generator_states)

    def _begin(self, pass_index: int, position: int) -> None:
        self._held = None
        if self._iterator is not None:
            self._iterator.close()
        self.pass_index, self.position = pass_index, position
        self.pass_random_state = self.random_state()
        self._iterator = self.distributed.start(pass_index, position)

    def _read_ahead(self, pass_index: int, position: int) -> bool:
        """Reads the step at ``position`` ahead (held for ``next``); False where the pass has ended."""
        try:
            batch = next(self._iterator)
        except StopIteration:
            return False
        self._held = (pass_index, position, batch)
        self._note_batch_size()
        return True

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
        if self._held is None and not self._read_ahead(pass_index, position):
            return None
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
        self._note_batch_size()
        return batch

    def _note_batch_size(self) -> None:
        if self.batch_size is None:
            self.batch_size = self.global_batch_size

    @property
    def generators(self) -> list:
        """The source's own ``torch.Generator`` objects its order draws from (a ``DataLoader``'s, its
        sampler's, its batch sampler's sampler's), each once."""
        source = self.source
        batch_sampler = getattr(source, "batch_sampler", None)
        found = []
        for owner in (source, getattr(source, "sampler", None), getattr(batch_sampler, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                found.append(generator)
        return found

    def random_state(self) -> dict:
        """``{"torch": torch's generator state, "generators": [state of each of ``generators``], "live": [whether
        each loader iterated had a live persistent iterator]}``: a loader with persistent worker processes
        draws their base seed only as its first pass begins, and the order of every pass."""
        live = [loader_internals.has_live_iterator(loader) for loader in sharding.loaders_of(self.source)]
        return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in self.generators], "live": live}

    def _match_persistent_iterators(self, saved_live) -> None:
        """Before a replayed pass: a loader whose pass began without a live persistent iterator (its first, where
        the base seed is drawn too) and that has one now (made by ``peek`` before the restore) drops it, so the
        replay draws what the saved pass drew."""
        loaders = sharding.loaders_of(self.source)
        if not isinstance(saved_live, list) or len(saved_live) != len(loaders):
            return
        for loader, was_live in zip(loaders, saved_live):
            if not was_live and loader_internals.has_live_iterator(loader):
                loader_internals.end_persistent_iterator(loader)

    def set_random_state(self, state: dict) -> None:
        """Sets what ``random_state`` returned (the source's generators only where they are as many)."""
        torch.set_rng_state(state["torch"])
        self.set_generator_states(state["generators"])

    def set_generator_states(self, states: list) -> None:
        """Sets the source's generators (``generators``) to ``states``, where they are as many."""
        generators = self.generators
        if len(states) == len(generators):
            for generator, value in zip(generators, states):
                generator.set_state(value)

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
