"""Distributed datasets: TensorFlow's split rule for global batches, and per-replica inputs.

Split rule (every batch, including the partial last one): with batch size ``b`` and
``n`` replicas, ``k = ceil(b / n)``; replica ``i`` gets rows ``[i*k, min((i+1)*k, b))``,
empty when ``i*k >= b``. Empty replica batches keep the trailing shape and dtype.

Example::

    >>> split_sizes(4, 3)
    [2, 2, 0]
    >>> split_sizes(1, 4)
    [1, 0, 0, 0]
"""

from __future__ import annotations

import numpy as np
import torch

from strategies import nest
from strategies.devices import torch_device
from strategies.values import PerReplica

from .options import InputContext, InputOptions, InputReplicationMode

__all__ = [
    "split_sizes",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedDatasetsFromFunction",
    "NumpyDataset",
    "make_v1_iterator",
]


def split_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """How many rows each replica gets of a batch of ``batch_size`` rows."""
    chunk = -(-batch_size // num_replicas)
    return [max(0, min(chunk, batch_size - i * chunk)) for i in range(num_replicas)]


def _as_tensor(leaf):
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf)
    raise ValueError(
        f"A dataset element leaf must be a torch.Tensor or a NumPy array, got {type(leaf).__name__}: the dataset "
        "must be batched by the global batch size (every leaf a tensor whose first dimension is the batch)."
    )


def _batch_size(leaves) -> int:
    sizes = set()
    for leaf in leaves:
        if leaf.dim() == 0:
            raise ValueError(
                "The dataset must be batched by the global batch size: found a scalar leaf (shape ()), which "
                "cannot be split across replicas. Batch the source, e.g. DataLoader(dataset, batch_size=64)."
            )
        sizes.add(leaf.shape[0])
    if len(sizes) > 1:
        raise ValueError(
            f"The dataset must be batched by the global batch size: the leaves of one element have different "
            f"leading (batch) sizes {sorted(sizes)}; every leaf must have the same first dimension."
        )
    return sizes.pop()


class _Placer:
    """Moves a replica's slice to its device (or keeps it on the host)."""

    def __init__(self, strategy, options: InputOptions):
        self.devices = strategy.extended.worker_devices
        self.torch_devices = [torch_device(d) for d in self.devices]
        self.fetch = options.experimental_fetch_to_device

    def place(self, tensor: torch.Tensor, replica_id: int) -> torch.Tensor:
        if not self.fetch:
            return tensor
        device = self.torch_devices[replica_id]
        return tensor.to(device, non_blocking=device.type == "cuda")

    def group(self, per_replica_nests):
        """One nest per replica → one nest with ``PerReplica`` leaves (plain with one replica)."""
        if len(per_replica_nests) == 1:
            return per_replica_nests[0]
        return nest.map_structure(lambda *leaves: PerReplica(leaves, self.devices), *per_replica_nests)


def _split_element(element, placer: _Placer):
    count = len(placer.devices)
    flat = [_as_tensor(leaf) for leaf in nest.flatten(element)]
    size = _batch_size(flat)
    bounds, start = [], 0
    for rows in split_sizes(size, count):
        bounds.append((start, start + rows))
        start += rows
    per_replica = []
    for replica_id, (begin, end) in enumerate(bounds):
        # An empty replica gets the slice [b:b]: right trailing shape and dtype.
        pieces = [placer.place(leaf[begin:end], replica_id) for leaf in flat]
        per_replica.append(nest.pack_sequence_as(element, pieces))
    return placer.group(per_replica)


class DistributedIterator:
    """Iterates a ``DistributedDataset``: each step is one global batch split across replicas.

    ``next(it)`` raises ``StopIteration`` at the end; ``get_next()`` raises
    ``StopIteration`` too (TensorFlow raises ``OutOfRangeError``).
    """

    def __init__(self, source_iterator, step_fn):
        self._source = source_iterator
        self._step = step_fn

    def __iter__(self):
        return self

    def __next__(self):
        _check_not_in_replica()
        return self._step(self._source)

    def get_next(self):
        """The next step's distributed batch."""
        return self.__next__()


def _check_not_in_replica():
    from strategies import context

    ctx = context.current_mode().replica_context
    if ctx is not None and not ctx._is_default:
        raise ValueError(
            "next(iterator) should be called from outside of replica_fn. e.g. "
            "strategy.run(replica_fn, args=(next(iterator),))"
        )


class DistributedDataset:
    """A source of global batches, split across a strategy's replicas.

    Iterating yields the source's element nest with every leaf a ``PerReplica`` of the
    replicas' slices (a plain tensor with one replica), placed on the replicas'
    devices. Re-iterating restarts the source (one epoch per ``iter()``).
    """

    def __init__(self, dataset, strategy, options: InputOptions | None = None):
        options = options or InputOptions()
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function`."
            )
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"experimental_distribute_dataset() needs an iterable of global batches, got {type(dataset).__name__}."
            )
        self._dataset = dataset
        self._strategy = strategy
        self._placer = _Placer(strategy, options)

    def __iter__(self) -> DistributedIterator:
        placer = self._placer
        return DistributedIterator(iter(self._dataset), lambda source: _split_element(next(source), placer))

    def __len__(self) -> int:
        return len(self._dataset)


def _empty_like(element):
    def leaf(value):
        tensor = _as_tensor(value)
        if tensor.dim() == 0:
            raise ValueError(
                "A replica ran out of data, and an empty batch cannot be made for an unbatched "
                "(scalar) element: return batched elements from dataset_fn."
            )
        return tensor[:0]

    return nest.map_structure(leaf, element)


class DistributedDatasetsFromFunction:
    """Per-replica batches from ``dataset_fn(InputContext)`` (``distribute_datasets_from_function``).

    ``PER_WORKER``: one dataset, replicas take consecutive elements; ``PER_REPLICA``:
    one dataset per replica. When some replicas run out first they get empty batches
    (same trailing shape and dtype); iteration ends when every replica is out.
    """

    def __init__(self, dataset_fn, strategy, options: InputOptions | None = None):
        self._options = options or InputOptions()
        self._strategy = strategy
        self._placer = _Placer(strategy, self._options)
        count = strategy.num_replicas_in_sync
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self._datasets = [dataset_fn(InputContext(count, i, count)) for i in range(count)]
        else:
            self._datasets = [dataset_fn(InputContext(1, 0, count))]

    def __iter__(self) -> DistributedIterator:
        count = len(self._placer.devices)
        iterators = [iter(d) for d in self._datasets]
        placer = self._placer
        per_replica_sources = len(iterators) > 1

        def step(_):
            elements = []
            for replica_id in range(count):
                source = iterators[replica_id] if per_replica_sources else iterators[0]
                elements.append(next(source, _END))
            if all(e is _END for e in elements):
                raise StopIteration
            template = next(e for e in elements if e is not _END)
            nests = []
            for replica_id, element in enumerate(elements):
                element = _empty_like(template) if element is _END else element
                nests.append(nest.map_structure(lambda v, r=replica_id: placer.place(_as_tensor(v), r), element))
            return placer.group(nests)

        return DistributedIterator(None, step)


_END = object()


class NumpyDataset(torch.utils.data.Dataset):
    """A nest of arrays as an unbatched map-style dataset of tensor nests on the host.

    Example::

        ds = NumpyDataset({"x": np.zeros((10, 3)), "y": np.arange(10)})
        ds[2]     # {'x': tensor([0., 0., 0.], dtype=torch.float64), 'y': tensor(2)}
    """

    def __init__(self, numpy_input):
        self._structure = numpy_input
        self._leaves = [
            _as_tensor(np.asarray(leaf) if not isinstance(leaf, torch.Tensor) else leaf)
            for leaf in nest.flatten(numpy_input)
        ]
        self._length = _batch_size(self._leaves)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        return nest.pack_sequence_as(self._structure, [leaf[index] for leaf in self._leaves])


class _V1Iterator:
    """The v1 iterator of ``make_dataset_iterator``/``make_input_fn_iterator``."""

    def __init__(self, distributed):
        self._distributed = distributed
        self._iterator = iter(distributed)

    def initialize(self) -> list:
        """Restarts the iteration; returns the (empty) list of initialization ops."""
        self._iterator = iter(self._distributed)
        return []

    def get_next(self):
        return next(self._iterator)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._iterator)


def make_v1_iterator(distributed) -> _V1Iterator:
    return _V1Iterator(distributed)
