"""Distributed datasets: TensorFlow's split rule for global batches, per-replica inputs, prefetch.

Split rule (every batch, including the partial last one): with batch size ``b`` and
``n`` replicas, ``k = ceil(b / n)``; replica ``i`` gets rows ``[i*k, min((i+1)*k, b))``,
empty when ``i*k >= b``. Empty replica batches keep the trailing shape and dtype.

Several workers: ``n`` counts the replicas of *all* workers; each worker keeps only its
own replicas' rows of each global batch, so every replica sees what it would see with
one process of ``n`` replicas. ``distribute_datasets_from_function`` tells each worker
its shard through the ``InputContext``.

Where the replicas' devices are accelerators, iteration prepares the next
``experimental_per_replica_buffer_size`` steps (default 1) on a background thread (split,
pinned and copied to the devices); on CPU-only devices, where there is no copy to overlap, and
across workers (each step's input is agreed by a collective) it prepares each step when asked
(default 0). The thread stops when the iterator is exhausted, closed or dropped, and an exception
raised by the source is raised again by ``next()``.

Example::

    >>> split_sizes(4, 3)
    [2, 2, 0]
    >>> split_sizes(1, 4)
    [1, 0, 0, 0]
"""

from __future__ import annotations

import queue
import threading
import weakref

import numpy as np
import torch

from replicafit.strategies import context, nest
from replicafit.strategies.devices import torch_device
from replicafit.strategies.values import PerReplica

from . import loader_signals, sharding
from .options import InputContext, InputOptions, InputReplicationMode

__all__ = [
    "split_sizes",
    "InputWorkers",
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


class InputWorkers:
    """The replicas one process feeds: its devices, and its place among the workers.

    Args:
      devices: this worker's replica devices, in replica order.
      num_workers: how many workers (processes) feed replicas.
      worker_index: this worker's index; its replicas are
        ``worker_index * len(devices) ... + len(devices) - 1`` of all replicas.

    ``InputWorkers.of(strategy)`` reads them from the strategy's cluster contract
    (``strategy.cluster``); tests build one to simulate a worker of a larger job in one process.
    """

    def __init__(self, devices, num_workers: int = 1, worker_index: int = 0):
        self.devices = tuple(devices)
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index must be in [0, num_workers), got {worker_index} of {num_workers}.")
        self.num_workers = num_workers
        self.worker_index = worker_index
        self.num_local_replicas = len(self.devices)
        self.num_replicas_in_sync = self.num_local_replicas * num_workers
        self.first_replica = worker_index * self.num_local_replicas

    # The strategy's cluster contract when the workers are processes (per-step input agreement), else None.
    cluster = None

    @classmethod
    def of(cls, strategy) -> InputWorkers:
        """This process's ``InputWorkers`` under ``strategy``.

        Its devices are ``strategy.extended.worker_devices``; ``num_workers`` and ``worker_index`` come
        from ``strategy.cluster``, which is kept as ``cluster`` when there are several workers.
        """
        cluster = strategy.cluster
        workers = cls(strategy.extended.worker_devices, cluster.num_workers, cluster.worker_index)
        if cluster.num_workers > 1:
            workers.cluster = cluster
        return workers


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
    """Moves a replica's slice to its device (pinned and asynchronous onto GPUs), or keeps it on the host."""

    def __init__(self, workers: InputWorkers, options: InputOptions):
        self.devices = workers.devices
        self.torch_devices = [torch_device(d) for d in self.devices]
        self.fetch = options.experimental_fetch_to_device
        size = options.experimental_per_replica_buffer_size
        if size is None:  # prefetch where there is something to overlap: copies onto accelerators
            size = int(self.fetch and any(d.type != "cpu" for d in self.torch_devices))
        if workers.cluster is not None:
            # Across workers each step's input is agreed by a collective on the input channel; two
            # iterators' prefetch threads (training and validation) could interleave theirs.
            size = 0
        self.buffer_size = size

    def place(self, tensor: torch.Tensor, replica_id: int) -> torch.Tensor:
        if not self.fetch:
            return tensor
        device = self.torch_devices[replica_id]
        if device.type == "cuda" and tensor.device.type == "cpu":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)

    def group(self, per_replica_nests):
        """One nest per replica → one nest with ``PerReplica`` leaves (plain with one replica)."""
        if len(per_replica_nests) == 1:
            return per_replica_nests[0]
        return nest.map_structure(lambda *leaves: PerReplica(leaves, self.devices), *per_replica_nests)


class _Step:
    """A step's distributed batch with the number of rows of the global batch (all workers) and this
    worker's part of it on the host, before the split (``host``: kept by the iterator for its first step)."""

    __slots__ = ("value", "rows", "host")

    def __init__(self, value, rows: int, host=None):
        self.value, self.rows, self.host = value, rows, host


class _Agreement:
    """Checks that every worker has a step of a global-batch source, one step behind.

    Each step starts a small all-reduce of "I have this step" on the input group and checks
    the previous one's result, so a divergence (one worker's source ends earlier) is an error
    on every worker without a blocking collective per step; the end itself is agreed at once.
    """

    def __init__(self, cluster):
        self.channel = cluster.input_channel()
        self.pending = None
        self.step = 0

    def check_pending(self) -> None:
        if self.pending is not None:
            finish, step = self.pending
            self.pending = None
            self._verify(finish(), 1, step)

    def have(self) -> None:
        self.check_pending()
        self.pending = (self.channel.start_sum(1, "the input agreement"), self.step)
        self.step += 1

    def end(self) -> None:
        self.check_pending()
        total = self.channel.sum(0, "the input agreement (end of data)")
        self._verify(total, 0, self.step)

    def _verify(self, total: int, mine: int, step: int) -> None:
        workers = self.channel.num_workers
        if total not in (0, workers):
            raise RuntimeError(
                f"The workers' input diverged at step {step}: {total} of {workers} workers had a batch "
                f"(this worker {'did' if mine else 'did not'}). A global-batch source must yield the same number "
                "of batches on every worker (same data, same seed); for per-worker shards use "
                "distribute_datasets_from_function, which handles uneven shards."
            )


def split_global_batch(element, workers: InputWorkers, placer: _Placer):
    """This worker's replicas' slices of one global batch, placed and grouped."""
    return _split_step(element, workers, placer).value


def _split_step(element, workers: InputWorkers, placer: _Placer) -> _Step:
    """``split_global_batch`` with the global batch's row count (across workers) and the batch itself."""
    flat = [_as_tensor(leaf) for leaf in nest.flatten(element)]
    size = _batch_size(flat)
    return _Step(_split(element, flat, size, workers, placer), size, element)


def _split_part(item, workers: InputWorkers, placer: _Placer) -> _Step:
    """A step of a source sharded by rows: ``item`` is ``(this worker's rows of a global batch, the global
    batch's row count)``."""
    part, rows = item
    flat = [_as_tensor(leaf) for leaf in nest.flatten(part)]
    sizes = split_sizes(rows, workers.num_replicas_in_sync)
    wanted = sum(sizes[workers.first_replica : workers.first_replica + workers.num_local_replicas])
    if _batch_size(flat) != wanted:
        raise RuntimeError(
            f"This worker's part of a global batch of {rows} rows has {_batch_size(flat)} rows instead of its "
            f"replicas' {wanted}: the source's collate_fn must keep one row per example. Or read the source whole "
            "on every worker: InputOptions(auto_shard_policy=AutoShardPolicy.DATA) (Trainer(input_options=...))."
        )
    return _Step(_split(part, flat, rows, workers, placer, part=True), rows, part)


def _split_own(element, workers: InputWorkers, placer: _Placer):
    """A worker's own batch (a shard, an undivided source) split over its replicas by the split rule."""
    flat = [_as_tensor(leaf) for leaf in nest.flatten(element)]
    local = InputWorkers(workers.devices)
    return _split(element, flat, _batch_size(flat), local, placer), _batch_size(flat)


def _split(element, flat, size: int, workers: InputWorkers, placer: _Placer, part: bool = False):
    """This worker's replicas' slices of a global batch of ``size`` rows: ``element`` is the whole batch,
    or (``part``) only this worker's rows of it."""
    if workers.num_replicas_in_sync == 1:  # one replica: the whole batch, placed
        return nest.pack_sequence_as(element, [placer.place(leaf, 0) for leaf in flat])
    sizes = split_sizes(size, workers.num_replicas_in_sync)
    start = 0 if part else sum(sizes[: workers.first_replica])
    per_replica = []
    for local_id in range(workers.num_local_replicas):
        rows = sizes[workers.first_replica + local_id]
        # An empty replica gets the slice [b:b]: right trailing shape and dtype.
        pieces = [placer.place(leaf[start : start + rows], local_id) for leaf in flat]
        per_replica.append(nest.pack_sequence_as(element, pieces))
        start += rows
    return placer.group(per_replica)


# --- iteration with prefetch ----------------------------------------------------------------

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class _Buffer:
    """A bounded hand-off between the prefetch thread and the consumer.

    ``SimpleQueue`` (C-level, cheap to hand over) plus a semaphore of free slots.
    """

    def __init__(self, size: int):
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.slots = threading.Semaphore(size)
        self.stop = threading.Event()


def _prefetch_loop(produce, buffer: _Buffer) -> None:
    """Fills ``buffer`` with steps until the source ends, fails, or ``buffer.stop`` is set."""
    while True:
        while not buffer.slots.acquire(timeout=0.05):
            if buffer.stop.is_set():
                return
        if buffer.stop.is_set():
            return
        try:
            item = produce()
        except StopIteration:
            item = _END
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            item = _Failure(error)
        buffer.items.put(item)
        if item is _END or isinstance(item, _Failure):
            return


def _shutdown(buffer: _Buffer, thread: threading.Thread) -> None:
    buffer.stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=5)


class DistributedIterator:
    """Iterates a distributed dataset: each step is one global batch split across replicas.

    ``next(it)`` and ``get_next()`` raise ``StopIteration`` at the end (TensorFlow's
    ``get_next`` raises ``OutOfRangeError``). ``close()`` stops the prefetch thread; so
    does exhausting or dropping the iterator.
    """

    #: How many rows the last step's global batch had, over every worker (where the steps carry it,
    #: else ``None``): the denominator of a per-example loss in a loop of one's own.
    global_batch_size = None
    #: This worker's part of the first global batch, before the split (where the steps carry it,
    #: else ``None``); what fit's and evaluate's entry checks read.
    first_host_batch = None

    def __init__(self, produce, buffer_size: int = 1):
        self._produce = produce
        self._done = False
        self._prefetch = None
        if buffer_size > 0:
            buffer = _Buffer(buffer_size)
            thread = threading.Thread(
                target=_prefetch_loop, args=(produce, buffer), name="replicafit-prefetch", daemon=True
            )
            thread.start()
            self._prefetch = (buffer, thread, weakref.finalize(self, _shutdown, buffer, thread))

    def __iter__(self):
        return self

    def __next__(self):
        _check_not_in_replica()
        if self._done:
            raise StopIteration
        if self._prefetch is None:
            try:
                item = self._produce()
            except StopIteration:
                self._done = True
                raise
            return self._unwrap(item)
        buffer, thread, finalizer = self._prefetch
        while True:
            try:
                item = buffer.items.get(timeout=0.5)
                break
            except queue.Empty:
                if not thread.is_alive() and buffer.items.empty():
                    self._done = True
                    raise RuntimeError("The input prefetch thread stopped without a result.") from None
        buffer.slots.release()
        if item is _END or isinstance(item, _Failure):
            self._done = True
            finalizer()
            if item is _END:
                raise StopIteration
            raise item.error
        return self._unwrap(item)

    def _unwrap(self, item):
        if type(item) is _Step:
            self.global_batch_size = item.rows
            if item.host is not None:
                if self.first_host_batch is None:
                    self.first_host_batch = item.host
                item.host = None
            return item.value
        return item

    def get_next(self):
        """The next step's distributed batch."""
        return self.__next__()

    def close(self) -> None:
        """Stops prefetching and lets go of the source; the iterator is exhausted afterwards.

        The source's iterator is released at once (not when this object is collected): a
        ``DataLoader`` iterator with worker processes ends them now. Left to the garbage
        collector, torch's shutdown of such an iterator can find its queues already finalized
        and wait 5 s for each worker before killing it.
        """
        self._done = True
        if self._prefetch is not None:
            self._prefetch[2]()
        self._produce = None


def _check_not_in_replica():
    if context.in_replica_function():
        raise ValueError(
            "next(iterator) should be called from outside of replica_fn. e.g. "
            "strategy.run(replica_fn, args=(next(iterator),))"
        )


class DistributedDataset:
    """A source of global batches, split across a strategy's replicas.

    Iterating yields the source's element nest with every leaf a ``PerReplica`` of the
    replicas' slices (a plain tensor with one replica), placed on the replicas'
    devices. Re-iterating restarts the source (one epoch per ``iter()``); ``len()`` is
    the source's, where it has one. Across workers each worker reads what
    ``options.auto_shard_policy`` says (``sharding.py``): by default only its replicas' rows.
    """

    def __init__(self, dataset, strategy, options: InputOptions | None = None, *, workers: InputWorkers | None = None):
        options = options or InputOptions()
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function`."
            )
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"experimental_distribute_dataset() needs an iterable of global batches, got "
                f"{type(dataset).__name__}; data.as_global_batches() makes one from arrays."
            )
        self._dataset = dataset
        self._options = options
        self._workers = workers or InputWorkers.of(strategy)
        self._placer = _Placer(self._workers, options)
        self._plan = sharding.plan(dataset, self._workers, options.auto_shard_policy)

    @property
    def sharding(self) -> str:
        """How this worker reads the source.

        ``"rows"`` (only its replicas' rows), ``"shards"`` (its shard), ``"off"`` (the source as its own
        input) or ``"data"`` (every global batch, keeping its rows; one process always).
        """
        return self._plan.kind

    def __iter__(self) -> DistributedIterator:
        return self.start(None, 0)

    @property
    def steps(self) -> int | None:
        """The number of steps of a pass, where every worker knows it without asking.

        The source's length for the ``"rows"`` and ``"data"`` sharding (``None`` when it has no
        ``len()``); ``None`` for per-worker inputs (``"shards"``, ``"off"``), whose lengths may differ.
        """
        return _length_of(self._dataset) if self._plan.kind in ("rows", "data") else None

    def __len__(self) -> int:
        length = _length_of(self._dataset)
        if length is None:
            raise TypeError(
                f"len() of a distributed dataset is its source's number of global batches, and the source "
                f"({type(self._dataset).__name__}) has no len(): count its batches yourself or give a sized source "
                "(a list, a DataLoader of a map-style dataset)."
            )
        return length

    def start(self, pass_index: int | None = None, position: int = 0) -> DistributedIterator:
        """The distributed batches of pass ``pass_index`` over the source (``None``: the pass a batched
        source is set to, ``set_epoch``) from batch number ``position`` on, without reading the batches
        before it where the source can start there (batched arrays and datasets, a sharded loader).

        Example::

            iterator = dist.start(3, 10)   # epoch 3's batches from the eleventh on
        """
        plan = self._plan
        if plan.kind == "rows":
            cluster = self._workers.cluster
            if cluster is not None and getattr(plan.reader, "global_rng", False):
                # The loader's sampler may shuffle with torch's generator, which reading only one's rows (a
                # dataset that draws as it reads) moves on unevenly: every pass starts from the chief's.
                torch.set_rng_state(cluster.broadcast(torch.get_rng_state(), "agreeing on the loader's order"))
            parts = plan.reader.iterate_rows(pass_index, position)
            return self._counted(parts, max(0, len(plan.reader) - position), _split_part)
        if plan.kind in ("shards", "off"):
            return self._own(_pass_of(plan.reader, pass_index, position), position)
        source = self._dataset
        batches = _pass_of(source, pass_index, position)
        total = _length_of(source)
        return self.iterate(batches, None if total is None else max(0, total - position))

    def iterate(self, batches, length: int | None = None) -> DistributedIterator:
        """Distributes the global batches of the iterator ``batches`` (e.g. a resumed epoch).

        ``length``: how many batches ``batches`` holds, where known. Across workers a known
        length is agreed once, up front, instead of one small collective per step.
        """
        workers = self._workers
        if workers.cluster is None or length is not None:
            return self._counted(batches, length, _split_step)
        placer = self._placer
        agreement = _Agreement(workers.cluster)

        def produce_agreed():
            element = next(batches, _END)
            if element is _END:
                agreement.end()
                raise StopIteration
            agreement.have()
            return _split_step(element, workers, placer)

        return DistributedIterator(produce_agreed, self._placer.buffer_size)

    def _counted(self, elements, length: int | None, make) -> DistributedIterator:
        """``make(element, workers, placer)`` for each element. Across workers the source's known
        ``length`` is compared once; each worker then checks that its source yields exactly that many
        (an error ends it, and its peers see a ``WorkerFailedError`` at their next collective)."""
        workers, placer = self._workers, self._placer
        if workers.cluster is None:

            def produce():
                return make(next(elements), workers, placer)

            return DistributedIterator(produce, placer.buffer_size)
        lengths = workers.cluster.all_gather(length, "the input agreement (lengths)")
        if len(set(lengths)) > 1:
            shown = ", ".join(f"worker {w}: {n}" for w, n in enumerate(lengths))
            raise RuntimeError(
                f"The workers' input diverged: their sources hold different numbers of batches ({shown}). A "
                "global-batch source must yield the same batches on every worker (same data, same seed); for "
                "per-worker shards use distribute_datasets_from_function, which handles uneven shards."
            )
        count = [0]

        def produce_counted():
            element = next(elements, _END)
            if element is not _END and count[0] == length:
                raise RuntimeError(
                    f"The input source yielded more than its length of {length} batches: the workers agreed on "
                    "the length, so they would no longer step together. Make len() match what the source yields."
                )
            if element is _END:
                if count[0] < length:
                    raise RuntimeError(
                        f"The input source ended after {count[0]} batches although its length is {length}: the "
                        "workers agreed on the length, so they would no longer step together. Make len() match "
                        "what the source yields."
                    )
                raise StopIteration
            count[0] += 1
            return make(element, workers, placer)

        return DistributedIterator(produce_counted, placer.buffer_size)

    def _own(self, batches, position: int) -> DistributedIterator:
        """A worker's own input (its shard, or an undivided source) from the iterator ``batches``: each of
        its batches is split over its replicas; the workers agree at every step whether any still has a
        batch (one that has run out gives its replicas empty batches) and on the global batch's rows."""
        workers, placer = self._workers, self._placer
        channel = workers.cluster.input_channel() if workers.cluster is not None else None
        seen = [None]  # this worker's last batch: the template of its empty ones

        def produce():
            element = next(batches, _END)
            mine = 0 if element is _END else _batch_size([_as_tensor(v) for v in nest.flatten(element)])
            rows = mine
            if channel is not None:
                having, rows = channel.sum([int(element is not _END), mine], "the input agreement")
                if having == 0:
                    raise StopIteration
                if element is _END and seen[0] is None:
                    raise ValueError(
                        "This worker's input yielded no batch while other workers still have data, so its "
                        "replicas cannot be given empty batches of the right shape: give every worker's shard "
                        "at least one batch."
                    )
            elif element is _END:
                raise StopIteration
            if element is _END:
                element = _empty_like(seen[0])
            seen[0] = element
            value, _ = _split_own(element, workers, placer)
            return _Step(value, rows, element)

        return DistributedIterator(produce, placer.buffer_size)


def _pass_of(source, pass_index: int | None, position: int):
    """An iterator over pass ``pass_index`` of ``source`` from batch number ``position`` on: a batched
    source starts there (``iterate``; with a pass named, any source that has ``iterate(pass, start)``),
    a loader's sampler is told the pass (``set_epoch``: a ``DistributedSampler``), others skip."""
    from .sources import _Batched

    if hasattr(source, "iterate") and (pass_index is not None or isinstance(source, _Batched)):
        return source.iterate(pass_index, position)
    if pass_index is not None:
        batch_sampler = getattr(source, "batch_sampler", None)
        for sampler in (getattr(source, "sampler", None), getattr(batch_sampler, "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(pass_index)
                break
    batches = loader_signals.iterate(source)
    for _ in range(position):
        if next(batches, _END) is _END:
            break
    return batches


def _length_of(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # no __len__ (a generator, an iterable dataset)
        return None


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

    ``PER_WORKER``: one dataset per worker (its shard: ``InputContext(num_workers,
    worker_index, num_replicas_in_sync)``), the worker's replicas take consecutive
    elements; ``PER_REPLICA``: one dataset per replica (``InputContext(num_replicas,
    replica_id, num_replicas)``). Replicas that run out first get empty batches (same
    trailing shape and dtype); iteration ends when every replica is out.
    """

    def __init__(
        self, dataset_fn, strategy, options: InputOptions | None = None, *, workers: InputWorkers | None = None
    ):
        self._options = options or InputOptions()
        self._workers = workers = workers or InputWorkers.of(strategy)
        self._placer = _Placer(workers, self._options)
        total = workers.num_replicas_in_sync
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            first = workers.first_replica
            self._datasets = [
                dataset_fn(InputContext(total, first + i, total)) for i in range(workers.num_local_replicas)
            ]
        else:
            self._datasets = [dataset_fn(InputContext(workers.num_workers, workers.worker_index, total))]

    def __iter__(self) -> DistributedIterator:
        count = self._workers.num_local_replicas
        iterators = [iter(d) for d in self._datasets]
        placer = self._placer
        per_replica_sources = len(iterators) > 1

        cluster = self._workers.cluster
        channel = cluster.input_channel() if cluster is not None else None
        seen = [None]  # this worker's last element: the template of its empty batches

        def produce():
            elements = [next(iterators[r] if per_replica_sources else iterators[0], _END) for r in range(count)]
            rows = 0
            if channel is not None:  # TensorFlow's per-step agreement: stop when every worker is out
                mine = sum(1 for e in elements if e is not _END)
                rows = sum(_batch_size([_as_tensor(v) for v in nest.flatten(e)]) for e in elements if e is not _END)
                having, rows = channel.sum([int(mine > 0), rows], "the input agreement")
                if having == 0:
                    raise StopIteration
                if mine == 0 and seen[0] is None:
                    raise ValueError(
                        "This worker's dataset yielded no element while other workers still have data, so its "
                        "replicas cannot be given empty batches of the right shape: give every worker's shard at "
                        "least one batch."
                    )
            elif all(e is _END for e in elements):
                raise StopIteration
            template = next((e for e in elements if e is not _END), seen[0])
            seen[0] = template
            nests = []
            for replica_id, element in enumerate(elements):
                element = _empty_like(template) if element is _END else element
                nests.append(nest.map_structure(lambda v, r=replica_id: placer.place(_as_tensor(v), r), element))
            if channel is not None:
                return _Step(placer.group(nests), rows)
            return placer.group(nests)

        return DistributedIterator(produce, self._placer.buffer_size)


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
        self._iterator.close()
        self._iterator = iter(self._distributed)
        return []

    def get_next(self):
        return next(self._iterator)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._iterator)


def make_v1_iterator(distributed) -> _V1Iterator:
    """The TensorFlow 1 style iterator over a distributed dataset.

    What ``make_dataset_iterator`` and ``make_input_fn_iterator`` return: ``get_next()`` (or
    ``next(iterator)``) gives the next distributed batch, and ``initialize()`` restarts the iteration
    from the beginning and returns an empty list (there are no initialization ops to run). It starts
    iterating ``distributed`` (and its prefetching, if any) as soon as it is made.

    Args:
      distributed: a ``DistributedDataset`` or ``DistributedDatasetsFromFunction``.
    """
    return _V1Iterator(distributed)
