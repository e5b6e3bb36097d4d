"""Collectives across worker processes (``torch.distributed``): the only module that calls it.

One ``Collective`` per process owns the process groups of a ``MultiWorkerMirroredStrategy``:

* the **data** group (gloo on CPU, NCCL on CUDA; gloo on CUDA too with
  ``CommunicationImplementation.RING``) carries reductions, gathers and broadcasts of tensors:
  one flat buffer per pack, started together and waited in order. On gloo a small sum (at most
  ``gather_sum_bytes`` gathered, 1 MiB) is an all-gather and a local sum in worker order, which
  takes half the message rounds of gloo's all-reduce (``_start_sum``); ``RING`` keeps the all-reduce;
* the **control** group (always gloo) carries small host-side agreements: object
  broadcasts, flags, counts and barriers;
* the **input** group (gloo) carries the per-step input agreement, which may run on the
  input pipeline's prefetch thread: each thread has a group of its own, so two threads
  never interleave collectives on one group (gloo pairs messages by order).

Every call is bounded by the process-group timeout (``CommunicationOptions.timeout_seconds``;
``None``: torch's default, 30 minutes on gloo and 10 on NCCL). A worker whose process is gone is an error at once
on gloo; one that stops arriving, after the timeout. Either way every other worker raises
``WorkerFailedError`` naming the operation, and the collective refuses further work: a
group that lost a member cannot be used again (restart every worker; ``BackupAndRestore``
resumes). NCCL differs: its watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, torch's default 3)
ends a process whose collective timed out instead of raising, so a stuck peer shows up as a
worker that died (the launcher names it) and its peers then raise ``WorkerFailedError``.

Example::

    >>> from replicafit.strategies.collective import WorkerFailedError
    >>> issubclass(WorkerFailedError, RuntimeError)
    True
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import pickle
import re
import socket
import threading
import time

import torch
import torch.distributed as dist

from replicafit.lifeline import watch_launcher

__all__ = ["Collective", "WorkerFailedError"]


class WorkerFailedError(RuntimeError):
    """A worker died or stopped arriving at a collective (``strategies.WorkerFailedError``).

    Raised on every other worker, naming the operation; torch's own error is chained as
    ``__cause__``. The process group is unusable afterwards: end the process, restart
    every worker (``replicafit fit --workers N --max-restarts K`` does) and resume from a
    backup.

    Example::

        try:
            trainer.fit(model, data)
        except ds.WorkerFailedError as error:
            print("a worker failed:", error)      # e.g. during batch_reduce_to (pack 1 of 1)
            raise SystemExit(1)
    """


# What the backends' texts say, in our words (the text itself stays in the error's __cause__).
_BACKEND_FAILURES = (
    (
        re.compile(r"connection (reset|closed) by peer|broken pipe|end of file", re.I),
        "its connection to a peer closed",
    ),
    (re.compile(r"connection refused", re.I), "a peer refused the connection"),
    (re.compile(r"timed out|timeout", re.I), "no peer answered within the communication timeout"),
)


def backend_failure(error: BaseException) -> str:
    """One line of ours for a ``torch.distributed`` backend's error (gloo's name their source file and
    line, and sign off "GLHF!"): what it means where we know it, else its first sentence without the
    source location.

    Example::

        >>> backend_failure(RuntimeError("[gloo/pair.cc:537] Read error [127.0.0.1]:3930: Connection reset by peer. "
        ...                              "Check the logs of the remote worker before reporting an error. GLHF!"))
        'its connection to a peer closed (Read error [127.0.0.1]:3930: Connection reset by peer)'
    """
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)  # gloo's "[.../pair.cc:537] "
    sentence = first.split(". ")[0].rstrip(".")
    sentence = sentence if len(sentence) <= 160 else sentence[:157] + "..."
    for pattern, meaning in _BACKEND_FAILURES:
        if pattern.search(sentence):
            return f"{meaning} ({sentence})"
    return sentence


_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def backend_for(device: torch.device, implementation: str = "AUTO") -> str:
    """The process-group backend for replicas on ``device``: gloo for CPU, NCCL for CUDA.

    ``implementation`` is a ``CommunicationImplementation`` value: ``"RING"`` asks for gloo on
    CUDA devices too (what several processes on one GPU need: NCCL refuses two ranks on one
    device), ``"NCCL"`` for NCCL (CUDA devices only).

    Example::

        >>> backend_for(torch.device("cpu"))
        'gloo'
        >>> backend_for(torch.device("cuda", 0), "RING")
        'gloo'
    """
    if device.type not in _BACKENDS:
        raise ValueError(
            f"MultiWorkerMirroredStrategy has no collective backend for {device.type!r} devices "
            "(gloo serves CPU devices, NCCL CUDA devices)."
        )
    if implementation == "RING":
        return "gloo"
    if implementation == "NCCL" and device.type != "cuda":
        raise ValueError(f"CommunicationImplementation.NCCL needs CUDA devices; this worker's are on {device}.")
    return _BACKENDS[device.type]


# torch 2.13 renamed the single-tensor gather (all_gather_into_tensor -> all_gather_single) and
# deprecates the old name; torch 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# ... and the single-tensor reduce-scatter (reduce_scatter_tensor -> reduce_scatter_single): the new name where
# it exists (2.13), the old one before (2.11), which 2.13 still has but warns about.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collective:
    """The process groups of this worker and the collectives the strategy needs.

    Created once per process (``Collective.get``); a second strategy for the same cluster
    shares it. If ``torch.distributed`` is already initialised (the user's own
    ``init_process_group`` under ``torchrun``), its default group is the data group.
    """

    _instance: Collective | None = None
    _instance_lock = threading.Lock()

    #: ``None``: reduce into parts and gather them with reduce-scatter and all-gather where the backend does
    #: them cheaply (``lean_scatter``); ``True``/``False`` forces that way or the all-reduce way.
    prefer_scatter: bool | None = None

    #: A sum on gloo whose gathered size (``world_size`` times the buffer's bytes) is at most this is one
    #: all-gather and a local sum in worker order (``_GatheredSum``), not gloo's all-reduce; ``0``: always the
    #: all-reduce (``CommunicationImplementation.RING`` sets that).
    gather_sum_bytes: int = 1 << 20

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        port: int,
        device,
        timeout_seconds,
        implementation="AUTO",
        shared_store: bool = False,
    ):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_seconds) if timeout_seconds else None
        self._key = (rank, world_size, address, port)
        self._failed: str | None = None
        self._alone = False  # after a failure, within alone(): every collective answers with this worker's part
        self._owns_default = False
        # Started, not yet waited for. A process must not exit with one of these still pending:
        # torch aborts it ("terminate called without an active exception"), so they are drained
        # after a failure and at exit.
        self._pending: list = []
        watch_launcher()
        self.backend = backend = backend_for(self.device, implementation)
        if implementation == "RING":
            self.gather_sum_bytes = 0
        # gloo reduces and broadcasts CUDA tensors itself (through the host); other collectives of
        # CUDA tensors on gloo go through host memory here.
        self._staged = backend == "gloo" and self.device.type == "cuda"
        # Objects (broadcast_object, all_gather_object) whose tensors may be on an accelerator travel as bytes
        # pickled with those tensors on the host, and arrive on this worker's device (``_HostPickler``).
        self._host_objects = self.device.type != "cpu"
        self._pickler = _HostPickler
        with self._guard("joining the cluster (init_process_group)"):
            if dist.is_initialized():
                if dist.get_rank() != rank or dist.get_world_size() != world_size:
                    raise ValueError(
                        f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                        f"{dist.get_world_size()}, but the cluster resolver says worker {rank} of {world_size}."
                    )
            else:
                kwargs = {"timeout": self.timeout} if self.timeout else {}
                wait = self.timeout or datetime.timedelta(minutes=30)
                if rank != 0:  # torch's own wait for an absent chief logs C++ stack frames, and retries past T
                    _wait_for_rendezvous(address, port, wait)
                if shared_store:  # torchrun's agent holds the store: the workers meet in one of their own
                    store = _own_store(rank, world_size, address, port, wait)
                else:
                    address_url = f"tcp://{_host(address)}:{port}"
                    store, _, _ = next(dist.rendezvous(address_url, rank=rank, world_size=world_size, timeout=wait))
                # (A store of this start alone: worker 0's, on the port of this start. Keys that an earlier start left
                # in a store that outlived it sent a restarted worker to a closed socket: gloo's "connectFullMesh
                # failed ... Connection refused". The restart count cannot name a start: an elastic rendezvous's
                # agents count their restarts each on their own.)
                store = dist.PrefixStore("replicafit", store)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
                self._owns_default = True
            self.data_group = None  # the default group
            kwargs = {"timeout": self.timeout} if self.timeout else {}
            self.control_group = dist.new_group(backend="gloo", **kwargs)
            self.input_group = dist.new_group(backend="gloo", **kwargs)
            # Gradient buckets started during backward: a group of their own, so their order never
            # interleaves with other data collectives (gloo pairs messages by order).
            self.bucket_group = dist.new_group(backend=backend, **kwargs)
        self.operations = 0  # data collectives issued (benchmarks count them)

    @classmethod
    def get(
        cls,
        rank,
        world_size,
        address,
        port,
        device,
        timeout_seconds,
        implementation="AUTO",
        shared_store: bool = False,
    ) -> Collective:
        """The process's collective for this cluster (created on first use)."""
        with cls._instance_lock:
            current = cls._instance
            if current is not None and current._failed is None:
                if current._key != (rank, world_size, address, port):
                    raise ValueError(
                        f"This process already belongs to a cluster (worker {current.rank} of {current.world_size}); "
                        "a process can be a worker of one cluster only."
                    )
                return current
            cls._instance = cls(rank, world_size, address, port, device, timeout_seconds, implementation, shared_store)
            return cls._instance

    # --- failure handling ----------------------------------------------------------------
    @property
    def failed(self) -> bool:
        """Whether a collective of this cluster failed (a worker died or stopped arriving)."""
        return self._failed is not None

    @property
    def answering(self) -> int:
        """How many workers' parts a collective combines now: ``world_size``, or 1 within ``alone()``."""
        return 1 if self._alone else self.world_size

    @contextlib.contextmanager
    def alone(self):
        """After a failure: within the block every collective answers at once with this worker's own part, as
        in a cluster of one (sums and gathers of this worker only, broadcasts keep its value, barriers pass),
        so a survivor can read its own state through the code that reads it across workers. Reductions into
        parts (sharded states) have no such answer: they raise. Outside a failure it raises ``RuntimeError``:
        the other workers would wait for this one's collectives."""
        if self._failed is None:
            raise RuntimeError("Collective.alone() is for a cluster that lost a worker; this one has not failed.")
        self._alone = True
        try:
            yield
        finally:
            self._alone = False

    @contextlib.contextmanager
    def _guard(self, operation: str):
        if self._alone:
            raise WorkerFailedError(
                f"Cannot run {operation} alone: after a worker's failure only sums, gathers, broadcasts and "
                "barriers answer with this worker's own part."
            )
        if self._failed is not None:
            raise WorkerFailedError(
                f"Cannot run {operation}: the cluster failed earlier ({self._failed}). A process group that lost "
                "a worker cannot be used again: end this process and restart every worker."
            )
        try:
            yield
        except WorkerFailedError:
            raise
        except RuntimeError as error:  # torch.distributed's errors (DistError and its kinds) are RuntimeErrors
            self._failed = operation
            self._drain()
            self._abandon()
            raise WorkerFailedError(
                f"Worker {self.rank} of {self.world_size}: another worker died or stopped arriving during "
                f"{operation}: {backend_failure(error)}. Every worker must make the same collectives in the same "
                "order; after a failure restart every worker (replicafit fit --workers N --max-restarts K) and "
                "resume from a backup (BackupAndRestore)."
            ) from error

    def _drain(self) -> None:
        """Waits for every started collective, errors ignored (after a failure they end at once; a
        live but stuck peer's within the timeout)."""
        pending, self._pending = self._pending, []
        for work in pending:
            with contextlib.suppress(Exception):
                work.wait()

    def _abandon(self) -> None:
        """Tears the process groups down now, in a known state: left to interpreter exit, gloo's
        threads of a group that lost a peer can end the process with SIGABRT."""
        if self._owns_default and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._owns_default = False

    def _wait(self, work) -> None:
        work.wait()
        with contextlib.suppress(ValueError):
            self._pending.remove(work)

    def _start_sum(self, buffer: torch.Tensor, group):
        """Starts summing ``buffer`` across workers in place; returns the work (its ``wait()`` ends the sum).

        gloo's ring all-reduce takes twice the message rounds of its all-gather (a reduce-scatter, then an
        all-gather), so a small sum, where the rounds' latency is the cost, is one all-gather and a local sum in
        worker order on gloo: MPI's choice too for short messages (whole vectors exchanged, fewer rounds). The
        gather moves ``world_size / 2`` times the bytes, so it is for buffers of at most ``gather_sum_bytes``
        gathered (1 MiB). Measured with ``benchmarks/bench_collectives.py --workers N`` on 127.0.0.1, the gathered
        sum's time over the all-reduce's (medians of paired rounds): 2 workers 0.45 at 9 KiB each, 0.76-0.87 at
        332-512 KiB, 0.99 at 1 MiB, 1.47 at 2 MiB; 3 workers 0.51 at 9 KiB, 0.70 at 332 KiB, 1.31 at 1 MiB; 4
        workers 0.61 at 9 KiB, 1.28 at 1 MiB. Every worker adds the same rows in the same order, so every
        worker's result is the same, bit for bit; with one replica per worker it is that of
        ``MirroredStrategy`` over as many replicas (``(w0 + w1) + w2 ...``), and on 2 workers also the
        all-reduce's (``a + b == b + a``)."""
        size = buffer.numel() * buffer.element_size() * self.world_size
        if (
            size > self.gather_sum_bytes
            or self.world_size < 2
            or not buffer.numel()
            or buffer.device.type != "cpu"
            or not buffer.is_contiguous()
            or (self.backend != "gloo" and group is not self.control_group and group is not self.input_group)
        ):
            return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        gathered = buffer.new_empty(self.world_size * buffer.numel())
        work = _all_gather_single(gathered, buffer.detach().view(-1), group=group, async_op=True)
        return _GatheredSum(work, gathered, buffer)

    # --- data collectives ------------------------------------------------------------------
    def all_reduce_flat(self, buffers: list, what: str) -> None:
        """Sums each flat buffer across workers in place: all started, then waited in order."""
        if self._alone:
            return
        with self._guard(what):
            works = [self._start_sum(buffer, None) for buffer in buffers]
            self._pending.extend(works)
            self.operations += len(works)
            for work in works:
                self._wait(work)

    def start_all_reduce(self, buffer: torch.Tensor, what: str):
        """Starts summing ``buffer`` across workers in place on the bucket group; returns the work
        (``wait_work`` it)."""
        with self._guard(what):
            work = self._start_sum(buffer, self.bucket_group)
            self._pending.append(work)
            self.operations += 1
            return work

    def wait_work(self, work, what: str) -> None:
        with self._guard(what):
            self._wait(work)

    def all_gather(self, tensor: torch.Tensor, what: str) -> list:
        """Every worker's ``tensor`` (same shape on all), in worker order: one collective into one buffer."""
        if self._alone:
            return [tensor.detach().clone()]
        with self._guard(what):
            source = tensor.detach().contiguous()
            if self._staged:
                source = source.cpu()
            out = source.new_empty((self.world_size, *source.shape))
            _all_gather_single(out.reshape(-1), source.reshape(-1))
            self.operations += 1
            return [part.to(tensor.device) for part in out.unbind(0)]

    def start_reduce_scatter(self, buffer: torch.Tensor, carried, what: str, bucket: bool = False) -> _Started:
        """Starts the SUM over workers of this worker's part of the flat ``buffer``: its elements are cut into
        ``world_size`` equal parts (``buffer`` padded with zeros to a multiple of ``world_size`` first) and worker
        ``w`` gets part ``w`` summed, ``ceil(len / world_size)`` elements, in one collective
        (``reduce_scatter_single``, on every backend of torch 2.11 and later). ``carried`` (``None``, or a few
        elements: the step values, ``step_values.py``) is summed for every worker in the same collective: each
        part of the padded buffer is followed by a copy of it, so every worker's part ends with their total.
        ``bucket`` puts it on the gradient buckets' group. Its ``result()`` waits and returns ``(this worker's
        part, the total of carried)``."""
        with self._guard(what):
            flat = buffer.detach().reshape(-1)
            extra = None if carried is None or not carried.numel() else carried.detach().reshape(-1)
            chunk = -(-flat.numel() // self.world_size)
            padded = flat if flat.numel() == chunk * self.world_size else _padded(flat, chunk * self.world_size)
            if extra is None:
                source = padded.contiguous()
            else:
                layout = flat.new_empty(self.world_size, chunk + extra.numel())
                layout[:, :chunk] = padded.view(self.world_size, chunk)
                layout[:, chunk:] = extra.to(
                    flat.dtype
                )  # (a copy per part: the sum of the copies in part w is the total)
                source = layout.reshape(-1)
            if self._staged:
                source = source.cpu()
            out = source.new_empty(source.numel() // self.world_size)
            group = self.bucket_group if bucket else None
            work = _reduce_scatter_single(out, source, op=dist.ReduceOp.SUM, group=group, async_op=True)
            self._pending.append(work)
            self.operations += 1
            return _Started(self, work, out, buffer.device, chunk, what)

    @property
    def lean_scatter(self) -> bool:
        """Whether reduce-scatter and all-gather are the cheaper way to reduce into parts and gather them back.

        Yes on NCCL (in place, no memory of their own). Not on gloo, measured on 2 workers with 38 MB: its
        reduce-scatter took 60 ms and its all-gather 53 ms against 30-38 ms for an all-reduce, and each allocated
        the whole buffer again (38-47 MB), which is what sharded optimizer states exist to save; there the sharded
        reduction is an in-place all-reduce of which each worker keeps its part, and the gather an in-place
        all-reduce of the parts with zeros elsewhere (exact: every element has one non-zero term; a -0.0
        comes back as 0.0).
        ``prefer_scatter`` overrides it (the tests run the NCCL way on gloo)."""
        return self.prefer_scatter if self.prefer_scatter is not None else self.backend == "nccl"

    def start_reduce_scatter_in_place(self, buffer: torch.Tensor, what: str, bucket: bool = False) -> _Started:
        """Starts summing ``buffer`` (flat, of ``world_size`` equal parts) across workers into this worker's part
        of it, in place (no other memory: what sharded optimizer states save must not be spent on buffers);
        ``result()`` waits and returns ``(that part, an empty tensor)``. On a GPU over gloo the collective runs
        on a host copy, which is copied back."""
        with self._guard(what):
            chunk = buffer.numel() // self.world_size
            source = buffer.cpu() if self._staged else buffer
            part = source[self.rank * chunk : (self.rank + 1) * chunk]
            group = self.bucket_group if bucket else None
            work = _reduce_scatter_single(part, source, op=dist.ReduceOp.SUM, group=group, async_op=True)
            self._pending.append(work)
            self.operations += 1
            target = buffer[self.rank * chunk : (self.rank + 1) * chunk]
            return _Started(self, work, part, buffer.device, chunk, what, target=target)

    def start_all_gather_in_place(self, buffer: torch.Tensor, what: str) -> _Started:
        """Starts filling ``buffer`` (flat, of ``world_size`` equal parts) with every worker's part of it, this
        worker's part being its input (in place); ``result()`` waits and returns ``buffer``. Without
        ``lean_scatter`` an all-reduce: the other parts must hold zeros."""
        with self._guard(what):
            if not self.lean_scatter:
                work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True)
                self._pending.append(work)
                self.operations += 1
                return _Started(self, work, buffer, buffer.device, buffer.numel(), what, gathered=True, target=buffer)
            chunk = buffer.numel() // self.world_size
            source = buffer.cpu() if self._staged else buffer
            work = _all_gather_single(source, source[self.rank * chunk : (self.rank + 1) * chunk], async_op=True)
            self._pending.append(work)
            self.operations += 1
            return _Started(self, work, source, buffer.device, buffer.numel(), what, gathered=True, target=buffer)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Worker 0's ``tensor`` into ``tensor`` on every worker, in place."""
        if self._alone:
            return
        with self._guard(what):
            dist.broadcast(tensor, src=0)
            self.operations += 1

    # --- control collectives (host, gloo) ----------------------------------------------------
    def all_gather_object(self, obj, what: str, group: str = "control") -> list:
        """Every worker's ``obj`` (picklable), in worker order. A worker on an accelerator sends its object's
        tensors there through the host (``host_bytes``), and every receiver puts them on its own first device
        (not on the sender's device index, which is another worker's GPU, or none, on the receiver)."""
        if self._alone:
            return [obj]
        sent = host_bytes(obj, self._pickler) if self._host_objects else obj  # (local work: outside the guard)
        with self._guard(what):
            out = [None] * self.world_size
            dist.all_gather_object(out, sent, group=getattr(self, f"{group}_group"))
        return [self._received(part) for part in out]

    def broadcast_object(self, obj, what: str, group: str = "control"):
        """Worker 0's ``obj`` on every worker (worker 0 keeps its own object); its tensors on an accelerator
        arrive on each receiver's device, as in ``all_gather_object``."""
        if self._alone:
            return obj
        box = [host_bytes(obj, self._pickler) if self._host_objects and self.rank == 0 else obj]
        with self._guard(what):
            dist.broadcast_object_list(box, src=0, group=getattr(self, f"{group}_group"))
        return obj if self.rank == 0 else self._received(box[0])

    def _received(self, part):
        """A part of an object collective as its sender meant it: ``host_bytes`` unpickled onto this worker's
        device (a worker on an accelerator sent it, whatever this worker's device), anything else as it came."""
        return from_host_bytes(part, self.device) if isinstance(part, _HostBytes) else part

    def all_gather_ints(self, values: list, what: str) -> list:
        """Every worker's integer vector (same length on all), in worker order, on the host."""
        if self._alone:
            return [list(values)]
        with self._guard(what):
            tensor = torch.tensor(values, dtype=torch.int64)
            out = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(out, tensor, group=self.control_group)
            return [t.tolist() for t in out]

    def sum_ints(self, values: list, what: str, group: str = "control") -> list:
        """Element-wise sums of small integer vectors across workers."""
        if self._alone:
            return [int(v) for v in values]
        with self._guard(what):
            tensor = torch.tensor(values, dtype=torch.int64)
            self._start_sum(tensor, getattr(self, f"{group}_group")).wait()
            return tensor.tolist()

    def start_sum_ints(self, values: list, what: str, group: str = "input"):
        """``sum_ints`` started now (on the input group unless told); returns ``finish() -> list``."""
        if self._alone:
            values = [int(v) for v in values]
            return lambda: values
        with self._guard(what):
            tensor = torch.tensor(values, dtype=torch.int64)
            work = self._start_sum(tensor, getattr(self, f"{group}_group"))
            self._pending.append(work)

        def finish() -> list:
            with self._guard(what):
                self._wait(work)
                return tensor.tolist()

        return finish

    def barrier(self, what: str, group: str = "control") -> None:
        """Waits for every worker; a missing one is named (gloo's monitored barrier)."""
        if self._alone:
            return
        with self._guard(what):
            timeout = self.timeout or datetime.timedelta(minutes=30)
            dist.monitored_barrier(group=getattr(self, f"{group}_group"), timeout=timeout, wait_all_ranks=True)

    def destroy(self) -> None:
        """Leaves the cluster (at interpreter exit; a failed group is left as it is)."""
        self._drain()
        if self._owns_default and dist.is_initialized() and self._failed is None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._owns_default = False


class _Started:
    """A collective in flight (``Collective.start_reduce_scatter`` and the in-place ones): ``result()`` waits for
    it (bounded by the timeout, a lost worker a ``WorkerFailedError``) and returns its output on the caller's
    device: ``(part, carried total)`` of a reduce-scatter, the buffer of a gather (``gathered``)."""

    __slots__ = ("collective", "work", "out", "device", "length", "what", "gathered", "target")

    def __init__(self, collective, work, out, device, length: int, what: str, gathered=False, target=None):
        self.collective, self.work, self.out, self.device = collective, work, out, device
        self.length, self.what, self.gathered, self.target = length, what, gathered, target

    def result(self):
        self.collective.wait_work(self.work, self.what)
        if self.target is not None:  # in place (a host copy's result copied back where it ran staged)
            if self.target.data_ptr() != self.out.data_ptr():
                self.target.copy_(self.out)
            return self.target if self.gathered else (self.target, self.target.new_empty(0))
        out = self.out.to(self.device)
        return out[: self.length], out[self.length :]


class _GatheredSum:
    """A sum across workers in flight as an all-gather (``Collective._start_sum``): ``wait()`` waits for the
    gather, then writes the rows' sum into the buffer in worker order (``(w0 + w1) + w2 ...``), once (two
    threads may wait, as for a torch work: the prefetch thread's input sum and ``_drain``)."""

    __slots__ = ("work", "gathered", "buffer", "lock")

    def __init__(self, work, gathered: torch.Tensor, buffer: torch.Tensor):
        self.work, self.gathered, self.buffer = work, gathered, buffer
        self.lock = threading.Lock()

    def wait(self) -> bool:
        with self.lock:
            if self.gathered is not None:
                self.work.wait()
                # Written as a collective writes its output: whatever autograd or inference mode the caller is
                # in (a buffer that requires grad, or one made under inference mode and finished outside it).
                with torch.inference_mode():
                    rows = self.gathered.view(-1, self.buffer.numel())
                    flat = self.buffer.view(-1)
                    torch.add(rows[0], rows[1], out=flat)
                    for row in rows[2:]:
                        flat.add_(row)
                self.gathered = None
        return True


_DEVICE_TENSOR = "replicafit: a tensor from an accelerator"


class _HostBytes(bytes):
    """An object pickled by ``host_bytes`` (what a worker on an accelerator sends): every receiver unpickles
    it, a worker on the host too."""


class _HostPickler(pickle.Pickler):
    """Pickles an object with each tensor that is not on the host as a host copy, marked: ``from_host_bytes``
    puts it on the receiver's device. (Plain pickling keeps a tensor's device, which the receiver's unpickling
    allocates on: a GPU of another worker's, or one this worker lacks.)"""

    def __init__(self, file):
        super().__init__(file)
        self._marked: dict = {}  # id(tensor) -> (tensor, its marker): a tensor met twice arrives as one
        self._copy = None  # the host copy being pickled inside its marker (pickled as it is)

    def _off_host(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type not in ("cpu", "meta")  # (a meta tensor has no data: it pickles as it is)

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor) or obj is self._copy:
            return None
        known = self._marked.get(id(obj))
        if known is not None:
            return known[1]
        if not self._off_host(obj):
            return None
        self._copy = obj.detach().cpu()
        marker = (_DEVICE_TENSOR, self._copy, obj.requires_grad, isinstance(obj, torch.nn.Parameter))
        self._marked[id(obj)] = (obj, marker)
        return marker


class _DeviceUnpickler(pickle.Unpickler):
    def __init__(self, file, device: torch.device):
        super().__init__(file)
        self.device = device
        self._placed: dict = {}  # id(host copy) -> (host copy, the tensor on the device)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 4 and pid[0] == _DEVICE_TENSOR):
            raise pickle.UnpicklingError(f"unknown persistent id in an object from another worker: {pid!r}")
        _, tensor, requires_grad, parameter = pid
        placed = self._placed.get(id(tensor))
        if placed is None:
            value = tensor.to(self.device)
            value = torch.nn.Parameter(value, requires_grad) if parameter else value.requires_grad_(requires_grad)
            placed = self._placed[id(tensor)] = (tensor, value)
        return placed[1]


def host_bytes(obj, pickler=_HostPickler) -> _HostBytes:
    """``obj`` pickled with its tensors off the host copied to it (marked, for ``from_host_bytes``; a
    ``Parameter`` stays one; Python attributes set on such a tensor are not kept).

    Example::

        >>> data = host_bytes({"step": 3, "state": torch.ones(2)})
        >>> from_host_bytes(data, torch.device("cpu"))
        {'step': 3, 'state': tensor([1., 1.])}
    """
    file = io.BytesIO()
    pickler(file).dump(obj)
    return _HostBytes(file.getvalue())


def from_host_bytes(data: bytes, device) -> object:
    """The object of ``host_bytes``, its tensors that were off the sender's host now on ``device``."""
    return _DeviceUnpickler(io.BytesIO(data), torch.device(device)).load()


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    out = flat.new_zeros(length)
    out[: flat.numel()] = flat
    return out


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _wait_for_rendezvous(address: str, port: int, timeout: datetime.timedelta) -> None:
    """Waits until the chief's rendezvous (its ``TCPStore``) at ``address:port`` accepts a connection, at most
    ``timeout``; raises ``RuntimeError`` (a ``WorkerFailedError`` from ``_guard``) past it."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address.strip("[]"), port), timeout=max(0.05, min(1.0, left))):
                return
        except OSError as error:
            if left <= 0:
                raise RuntimeError(
                    f"the chief's rendezvous at {_host(address)}:{port} did not answer within "
                    f"{timeout.total_seconds():g} s ({error.strerror or error}): worker 0 has not started, has "
                    "exited, or the address or port is wrong"
                ) from None
        time.sleep(min(0.05, max(0.0, left)))


_OWN_STORE_KEY = "replicafit/workers-store-port"


def _own_store(rank: int, world_size: int, address: str, port: int, timeout: datetime.timedelta):
    """A store of this start's workers alone, where torchrun's agent holds the one at ``address:port``.

    The agent's store outlives the workers and is shared by every start (torchrun's restarts; the rounds of an
    elastic rendezvous, whose agents count their restarts each on their own, so no count names a start on every
    worker): keys there can be an earlier start's. Worker 0 starts a store of its own on a free port and notes
    the port in the agent's store; the others read it and connect to that port of ``address`` (worker 0's host).
    A port an earlier start noted answers no more (the agent ended every worker of a start before the next
    one began): they read again until worker 0 of this start has noted its own, within ``timeout``."""
    agent = dist.TCPStore(_host(address).strip("[]"), port, is_master=False, timeout=timeout)
    if rank == 0:
        own = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(_OWN_STORE_KEY, str(own.port))
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        noted = int(agent.get(_OWN_STORE_KEY))  # (waits for the key, within the store's timeout)
        try:
            with socket.create_connection((address.strip("[]"), noted), timeout=1.0):
                pass
            return dist.TCPStore(_host(address).strip("[]"), noted, is_master=False, timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker 0's store at {_host(address)}:{noted} (the port noted in torchrun's store) did not "
                    f"answer within {timeout.total_seconds():g} s"
                ) from None
            time.sleep(0.05)


@atexit.register
def _leave_cluster() -> None:
    collective = Collective._instance
    if collective is not None:
        collective.destroy()
