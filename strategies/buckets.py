"""Gradient buckets: all-reduces across workers started during backward, consumed by the optimizer.

``MultiWorkerMirroredStrategy`` keeps the contract that ``apply_gradients`` does
``merge_call`` -> ``batch_reduce_to`` -> ``update``; this module only makes the
``batch_reduce_to`` of a training step find most of its work already done. For a fixed list of
trainable variables it lays their gradients out in flat *buckets*, in reverse variable order (the
order backward produces them): the first bucket up to 1 MiB, the others up to the strategy's
``bytes_per_pack`` (25 MiB when 0), one dtype per bucket, as DDP does. A hook on every local
component of every variable records the gradient as backward produces it; when every local
replica has given every gradient of a bucket, the bucket is filled (local replicas summed in
replica order) and its all-reduce starts, on a process group of its own, **strictly in bucket
order** (bucket *i* only after *i - 1*). ``reduce`` (called by ``batch_reduce_to``) then:

1. starts, from the gradients it is given, every bucket that backward did not start (an unused
   parameter, an empty replica that ran no backward), in bucket order; the last bucket always
   starts here. With several buckets every worker also says whether it was given, for a bucket
   started during backward, anything other than the gradients that backward produced (a gradient
   the user transformed, in place or not): on CPU buckets that flag is one more element of the last
   bucket (read back for free); on an accelerator reading it back would make the host wait for the
   device every step, so the flags are summed on the host (the control group, started before the
   buckets are waited for: one small gloo all-reduce per step, no device synchronisation);
2. waits for every bucket, in order;
3. if any worker set that flag, every worker reduces every bucket again from the given values
   (so the collective sequence is the same on every worker whatever ran locally);
4. returns views of the reduced buffers, which go straight into the update.

With sharded optimizer states (``parts`` = the number of workers) each bucket's buffer is padded with
zeros to equal parts and worker ``w`` keeps the sum of part ``w`` of every bucket, exactly the gradients of
the elements whose optimizer state it keeps (``state_sharding.StateShards`` cuts the same layout; a bucket it
keeps whole, under ``StateShards.min_bytes``, is reduced in one part, as unsharded). On NCCL
the all-reduce becomes a **reduce-scatter**, in place (the last bucket's spare and flag elements travel whole
to every worker: a copy after each part, ``Collective.start_reduce_scatter``); on gloo it stays an all-reduce
(``Collective.lean_scatter``: gloo's reduce-scatter takes longer than its all-reduce and allocates the whole
buffer again). ``reduce`` then returns this worker's part of each bucket, in bucket order.

Every worker therefore makes the same collectives in the same order every step, and the sums are
those of the packed path: the same values summed in the same order (bit-identical to
``overlap_gradients=False``, which reduces through the same buckets after backward).

The hooks act only while a step is *armed* (the trainer arms its built-in ``train_step``); a
backward pass outside an armed step is untouched.
"""

from __future__ import annotations

import threading

import torch

from . import foreach
from .step_values import CARRIERS, SLOTS
from .values import local_results

__all__ = ["GradientBuckets", "bucket_layout"]

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket: small, so communication starts early
DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb


def reading_back_waits(device: torch.device) -> bool:
    """Whether reading a value on ``device`` from the host makes the host wait for the device's queued
    work (every device but the CPU): such values are not read back in a step."""
    return device.type != "cpu"


def bucket_layout(tensors: list, bucket_bytes: int = 0) -> list:
    """``[(variable indices, dtype, device)]``: the buckets of gradients shaped like ``tensors`` (one list
    of local copies per variable; the first copy decides), in reverse variable order: the first bucket up to
    1 MiB, the others up to ``bucket_bytes`` (``DEFAULT_BUCKET_BYTES`` when 0), one dtype and device each.
    Sharded optimizer states cut the same layout (``state_sharding.StateShards``), so that each bucket's
    reduce-scatter hands every worker the gradients it updates.

    Example::

        >>> import torch
        >>> [m for m, _, _ in bucket_layout([[torch.zeros(3)], [torch.zeros(2, dtype=torch.float64)]])]
        [[1], [0]]
    """
    cap = bucket_bytes or DEFAULT_BUCKET_BYTES
    layout: list = []
    size, key = 0, None
    for index in reversed(range(len(tensors))):
        first = tensors[index][0]
        nbytes = first.numel() * first.element_size()
        limit = min(FIRST_BUCKET_BYTES, cap) if len(layout) == 1 else cap  # the first is small
        if not layout or (first.dtype, first.device) != key or (layout[-1][0] and size + nbytes > limit):
            size, key = 0, (first.dtype, first.device)
            layout.append(([], first.dtype, first.device))
        layout[-1][0].append(index)
        size += nbytes
    return layout


class _Bucket:
    __slots__ = (
        "members", "buffer", "data", "parts", "scattered", "views", "spare", "work", "out", "ready", "remaining",
        "dtype", "device",
    )  # fmt: skip

    def __init__(self, members, dtype, device):
        self.members = members  # variable indices, in bucket order
        self.dtype = dtype
        self.device = device
        self.buffer = None
        self.views = []
        self.spare = None  # the step values' elements (the last bucket)
        self.data = 0  # the gradients' elements in the buffer, padding included (the rest: spare and flag)
        self.parts = 1  # the parts it is reduced into (one per worker where sharded optimizer states cut it)
        self.scattered = False  # whether its collective in flight is a reduce-scatter (else an all-reduce)
        self.work = None  # the all-reduce (or reduce-scatter) in flight
        self.out = None  # the reduce-scatter's result: this worker's part, then the spare and flag totals
        self.ready = False  # every local gradient recorded during backward
        self.remaining = 0


class GradientBuckets:
    """Bucketed, hook-started gradient all-reduces of ``variables`` (see the module docstring).

    Example (what ``MultiWorkerMirroredStrategy`` does for the trainer)::

        buckets = GradientBuckets(collective, variables, local_count=1, bucket_bytes=0)
        with buckets.armed():
            grads = torch.autograd.grad(loss, [v.value() for v in variables])  # buckets start
            reduced = buckets.reduce([PerReplica([g]) for g in grads])           # waits, views
        buckets.remove()
    """

    #: Where the "transformed" flags are summed: ``None`` picks by device (in the last bucket on CPU,
    #: on the host elsewhere); ``True`` forces the host (the tests exercise that path on CPU).
    flag_on_host: bool | None = None

    def __init__(
        self, collective, variables, local_count: int, bucket_bytes: int = 0, parts: int = 1, whole=frozenset()
    ):
        self._collective = collective
        self.variables = list(variables)
        self._count = local_count
        self._lock = threading.Lock()
        self._armed = False
        components = [local_results(v) for v in self.variables]
        self._tensors = [[c._read() for c in comps] for comps in components]
        self._parts = parts
        self._buckets = [_Bucket(m, dtype, device) for m, dtype, device in bucket_layout(self._tensors, bucket_bytes)]
        self._bucket_of = {index: number for number, b in enumerate(self._buckets) for index in b.members}
        last = len(self._buckets) - 1
        host = self.flag_on_host if self.flag_on_host is not None else reading_back_waits(self._buckets[-1].device)
        # With one bucket nothing starts during backward: there is nothing to agree on.
        self._flag = None if last == 0 else "host" if host else "bucket"
        # The step values (step_values.py) ride in spare elements of the last bucket, which always
        # starts after backward, where its dtype sums their limbs exactly.
        self.carrier_dtype = self._buckets[-1].dtype if self._buckets[-1].dtype in CARRIERS else None
        self.carried = None  # the step values' summed limbs of the last step that carried any
        self._spare_used = False  # whether the spare elements hold a carried step's sums (not zeros)
        for number, bucket in enumerate(self._buckets):
            numels = [self._tensors[i][0].numel() for i in bucket.members]
            spare = SLOTS if number == last and self.carrier_dtype is not None else 0
            flag = 1 if number == last and self._flag == "bucket" else 0  # the "transformed" flag
            bucket.parts = 1 if number in whole else parts  # ``whole``: buckets every worker keeps all of
            bucket.data = -(-sum(numels) // bucket.parts) * bucket.parts  # padded with zeros to equal parts
            pad = bucket.data - sum(numels)
            bucket.buffer = torch.zeros(bucket.data + spare + flag, dtype=bucket.dtype, device=bucket.device)
            pieces = bucket.buffer.split(numels + [pad, spare, flag])
            bucket.views = [p.view(self._tensors[i][0].shape) for p, i in zip(pieces, bucket.members)]
            bucket.spare = pieces[len(numels) + 1]
        self._grads = [[None] * len(self.variables) for _ in range(local_count)]
        self._versions = [[0] * len(self.variables) for _ in range(local_count)]
        self._next = 0
        self.redone = False  # whether the last step reduced every bucket again (tests count it)
        self._handles = []
        for index, tensors in enumerate(self._tensors):
            for replica, tensor in enumerate(tensors):
                if tensor.requires_grad:
                    self._handles.append(tensor.register_hook(self._hook(replica, index)))

    @property
    def cut(self) -> bool:
        """Whether ``reduce`` returns this worker's parts of the buckets (sharded optimizer states) rather than
        whole gradients."""
        return self._parts > 1

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def matches(self, variables) -> bool:
        return len(variables) == len(self.variables) and all(a is b for a, b in zip(variables, self.variables))

    # --- one step ------------------------------------------------------------------------
    def arm(self, hooks: bool = True) -> None:
        """Starts a step: hooks record gradients until ``reduce`` or ``disarm`` (with ``hooks=False``
        they do not, and ``reduce`` starts every bucket)."""
        with self._lock:
            self._reset()
            self._armed = hooks

    def disarm(self, quiet: bool = False) -> None:
        """Ends a step. A bucket started during backward but not consumed (the step raised) is
        waited for, so no collective stays in flight (``quiet``: a failure to wait is not raised,
        the step's own error is on its way)."""
        with self._lock:
            self._armed = False
            pending = [(b, b.work) for b in self._buckets if b.work is not None]
            self._reset()
        for bucket, work in pending:
            try:
                self._wait(bucket, work, "gradient buckets (an unfinished step)")
            except Exception:
                if not quiet:
                    raise

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.work = None
            bucket.ready = False
            bucket.remaining = self._count * len(bucket.members)
        for grads in self._grads:
            grads[:] = [None] * len(grads)
        self._next = 0

    def _hook(self, replica: int, index: int):
        number = self._bucket_of[index]

        def hook(grad):
            if not self._armed:
                return None
            with self._lock:
                if not self._armed or self._grads[replica][index] is not None:
                    return None  # a second backward pass in one step: reduce() sees other values
                self._grads[replica][index] = grad
                self._versions[replica][index] = grad._version  # private: the in-place write counter
                bucket = self._buckets[number]
                bucket.remaining -= 1
                if bucket.remaining == 0:
                    bucket.ready = True
                    self._launch_ready()
            return None

        return hook

    def _launch_ready(self) -> None:
        """Starts the ready buckets in order, all but the last (``reduce`` starts that one)."""
        last = len(self._buckets) - 1
        while self._next < last and self._buckets[self._next].ready:
            bucket = self._buckets[self._next]
            self._fill(bucket, [[self._grads[r][i] for i in bucket.members] for r in range(self._count)])
            self._start(bucket, f"gradient bucket {self._next}")
            self._next += 1

    def _start(self, bucket: _Bucket, what: str) -> None:
        """Starts the bucket's all-reduce, or with ``parts`` > 1 its reduce-scatter (the spare and flag elements
        carried whole to every worker)."""
        bucket.scattered = bucket.parts > 1 and self._collective.lean_scatter
        if not bucket.scattered:  # one part, or gloo: an all-reduce, of which this worker keeps its part
            bucket.work = self._collective.start_all_reduce(bucket.buffer, what)
        elif bucket.buffer.numel() == bucket.data:  # in place: this worker's part of the buffer gets the sums
            bucket.work = self._collective.start_reduce_scatter_in_place(bucket.buffer, what, bucket=True)
        else:
            data, extras = bucket.buffer[: bucket.data], bucket.buffer[bucket.data :]
            bucket.work = self._collective.start_reduce_scatter(data, extras, what, bucket=True)

    def _wait(self, bucket: _Bucket, work, what: str):
        if not bucket.scattered:  # an all-reduce's work
            return self._collective.wait_work(work, what)
        return work.result()

    def _finish(self, bucket: _Bucket, what: str) -> None:
        work, bucket.work = bucket.work, None
        result = self._wait(bucket, work, what)
        if self._parts > 1 and not bucket.scattered:  # all-reduced: this worker's part of the sums
            chunk = bucket.data // bucket.parts
            rank = self._collective.rank if bucket.parts > 1 else 0
            result = (bucket.buffer[rank * chunk : (rank + 1) * chunk], bucket.buffer[bucket.data :])
        if self._parts > 1:  # this worker's part (all of a whole bucket), then the spare and flag totals
            bucket.out = result

    def _fill(self, bucket: _Bucket, per_replica: list) -> None:
        """The local replicas' gradients summed in replica order into the bucket (as the packed
        path sums them: ``(g0 + g1) + g2 ...``)."""
        views = bucket.views
        with torch.no_grad():
            first = [g.to(bucket.device) if g.device != bucket.device else g for g in per_replica[0]]
            foreach.copy_(views, first)
            for grads in per_replica[1:]:
                foreach.add_(views, [g.to(bucket.device) for g in grads])

    def reduce(self, values: list, carried: list | None = None) -> list:
        """The summed gradients of every worker and replica, one tensor per variable (a view of
        its bucket, valid until the next step; with ``parts`` > 1 this worker's part of each bucket
        instead, in bucket order): ``values`` are the ``PerReplica`` gradients
        ``batch_reduce_to`` was given. ``carried``: the step values' limbs per local replica
        (``carrier_dtype``), summed in the last bucket's spare elements into ``self.carried``."""
        given = [v.values for v in values]
        with self._lock:
            self._armed = False
            transformed = 0
            for bucket in self._buckets:
                if bucket.work is None:
                    continue
                for index in bucket.members:
                    for replica in range(self._count):
                        g = given[index][replica]
                        changed = g._version != self._versions[replica][index]  # private: written in place since?
                        if g is not self._grads[replica][index] or changed:
                            transformed = 1
            agreed = None
            if self._flag == "host":
                agreed = self._collective.start_sum_ints(
                    [transformed], "gradient buckets (agreeing on transformed gradients)", group="control"
                )
            last = len(self._buckets) - 1
            for number in range(self._next, len(self._buckets)):
                bucket = self._buckets[number]
                self._fill(bucket, [[given[i][r] for i in bucket.members] for r in range(self._count)])
                if number == last:
                    self._fill_spare(bucket, carried)
                if number == last and self._flag == "bucket":
                    bucket.buffer[-1] = transformed
                self._start(bucket, f"gradient bucket {number}")
            self._next = len(self._buckets)
        for number, bucket in enumerate(self._buckets):
            self._finish(bucket, f"gradient bucket {number}")
        if self._flag == "bucket":
            self.redone = float(self._extras()[-1]) > 0  # a CPU buffer: no synchronisation
        else:
            self.redone = agreed is not None and agreed()[0] > 0
        if self.redone:
            # Some worker was given other gradients than backward produced: every worker reduces
            # every bucket again from the given values (the same sequence everywhere).
            for number, bucket in enumerate(self._buckets[:-1]):
                self._fill(bucket, [[given[i][r] for i in bucket.members] for r in range(self._count)])
                self._start(bucket, f"gradient bucket {number} (again)")
            for number, bucket in enumerate(self._buckets[:-1]):
                self._finish(bucket, f"gradient bucket {number} (again)")
        if carried:
            self.carried = self._extras()[: carried[0].numel()].clone()
        with self._lock:
            self._reset()
        if self._parts > 1:
            return [bucket.out[0] for bucket in self._buckets]
        results: list = [None] * len(self.variables)
        for bucket in self._buckets:
            for view, index in zip(bucket.views, bucket.members):
                results[index] = view
        return results

    def regions(self) -> list:
        """Each bucket's gradient elements, padding included (free once ``reduce`` returned: sharded optimizer
        states all-gather the updated values into them)."""
        return [bucket.buffer[: bucket.data] for bucket in self._buckets]

    def _extras(self) -> torch.Tensor:
        """The last bucket's reduced spare and flag elements."""
        last = self._buckets[-1]
        return last.out[1] if self._parts > 1 else last.buffer[last.data :]

    def _fill_spare(self, bucket: _Bucket, carried: list | None) -> None:
        """The step values' limbs summed over the local replicas into the spare elements; zeros when
        this step carries none (every worker's bucket has the same length). The elements hold zeros
        until a step carries values: only after one are they cleared, so a fit without step values
        pays nothing per step."""
        if bucket.spare is None or bucket.spare.numel() == 0 or not (carried or self._spare_used):
            return
        with torch.no_grad():
            bucket.spare.zero_()
            for limbs in carried or ():
                bucket.spare[: limbs.numel()] += limbs.to(bucket.device)
        self._spare_used = bool(carried)

    def remove(self) -> None:
        """Removes the hooks (the model no longer carries them)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._armed = False
