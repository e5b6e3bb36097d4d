"""Which worker owns which elements of the optimizer's state, for sharded optimizer states.

Sharding optimizer states (ZeRO stage 1, torch's ``ZeroRedundancyOptimizer``) splits the slots of an
optimizer across the workers: each worker keeps and updates only its part of the variables. Here the
part is cut from the reductions themselves, so that a reduce-scatter hands each worker exactly the
gradients it updates:

* a **segment** is the flat buffer of one gradient reduction: a pack of one dtype, or one gradient
  bucket started during backward. It lists, in buffer order, ``(variable index, start, stop)``
  ranges of the variables' flattened elements (a bucket may hold part of a variable);
* each segment is cut into ``num_workers`` **chunks** of ``ceil(length / num_workers)`` elements
  (the buffer padded with zeros to that multiple: a reduce-scatter of equal parts, which every
  backend has); worker ``w`` owns chunk ``w`` of every segment;
* so the partition is **balanced by bytes**: every worker owns ``1/num_workers`` of every
  segment, of whatever dtype, give or take a chunk's padding, and a large matrix is cut into
  slices (one weight often holds most of a model) rather than given whole to one worker.

A **piece** is the part of one variable inside one worker's chunk: ``(variable, start, stop)`` in
the variable's flattened elements, and where it sits in the chunk. The update of an element-wise
rule on a piece is the update of those elements of the whole variable.

Example::

    >>> plan = ShardPlan([[(0, 0, 10), (1, 0, 3)]], num_workers=2)   # 10 + 3 elements in one segment
    >>> plan.chunk_lengths, [(p.variable, p.start, p.stop) for p in plan.owned(1)]
    ([7], [(0, 7, 10), (1, 0, 3)])
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import foreach
from .buckets import bucket_layout
from .distributed_checkpoint import PiecedValue
from .parameter_shards import keeps_shards, workers_mesh
from .state_layout import ReducedGradients, StateLayout
from .step_values import CARRIERS
from .values import local_results
from .variables import LocalVariable

__all__ = ["Piece", "ShardPlan", "StateShards", "dtype_segments", "owned_bytes"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of variable ``variable`` (flattened), owned by one worker: they sit at
    ``offset:offset + stop - start`` of that worker's chunk of segment ``segment``."""

    segment: int
    variable: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class ShardPlan:
    """The owners of every element of ``segments`` across ``num_workers`` workers.

    Args:
      segments: one list per reduction, of ``(variable index, start, stop)`` ranges in buffer order.
      num_workers: how many workers share the state (>= 1).
      whole: indices of segments that are not cut: every worker owns all of them (small buckets, whose
        gather would cost more than their state weighs).

    Attributes:
      chunk_lengths: the elements of each worker's chunk, per segment (the padded buffer holds
        ``num_workers`` of them).
      lengths: each segment's elements (unpadded).
    """

    def __init__(self, segments, num_workers: int, whole=()):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}.")
        self.num_workers = num_workers
        self.segments = [[tuple(int(x) for x in r) for r in segment] for segment in segments]
        for index, segment in enumerate(self.segments):
            for variable, start, stop in segment:
                if not 0 <= start < stop:
                    raise ValueError(f"Segment {index} has an empty or reversed range {(variable, start, stop)}.")
        self.whole = frozenset(whole)
        self.lengths = [sum(stop - start for _, start, stop in segment) for segment in self.segments]
        self.chunk_lengths = [
            length if index in self.whole else math.ceil(length / num_workers)
            for index, length in enumerate(self.lengths)
        ]
        self._owned: list = [[] for _ in range(num_workers)]
        for index, segment in enumerate(self.segments):
            if index in self.whole:  # every worker owns it all, at its place in the buffer
                for worker in range(num_workers):
                    position = 0
                    for variable, start, stop in segment:
                        self._owned[worker].append(Piece(index, variable, start, stop, position))
                        position += stop - start
            else:
                self._cut(index, segment)

    def _cut(self, index: int, segment: list) -> None:
        chunk = self.chunk_lengths[index]
        position = 0  # in the segment's buffer
        for variable, start, stop in segment:
            at = start
            while at < stop:
                worker = position // chunk
                room = (worker + 1) * chunk - position  # what is left of this worker's chunk
                take = min(room, stop - at)
                self._owned[worker].append(Piece(index, variable, at, at + take, position - worker * chunk))
                at += take
                position += take

    def owned(self, worker: int) -> list:
        """The pieces of ``worker``, segment by segment, each in chunk order."""
        return list(self._owned[worker])

    def owned_elements(self, worker: int) -> int:
        return sum(piece.size for piece in self._owned[worker])

    def padded_length(self, segment: int) -> int:
        """The elements of segment ``segment``'s buffer padded for an equal reduce-scatter (unpadded when whole)."""
        return self.chunk_lengths[segment] * (1 if segment in self.whole else self.num_workers)

    def chunk_start(self, segment: int, worker: int) -> int:
        """Where ``worker``'s chunk of segment ``segment`` starts in its buffer (0 for a whole segment)."""
        return 0 if segment in self.whole else worker * self.chunk_lengths[segment]

    def __repr__(self) -> str:
        return f"ShardPlan({len(self.segments)} segment(s), {sum(self.lengths)} elements, {self.num_workers} workers)"


def _where(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device


def dtype_segments(tensors) -> tuple:
    """``(segments, dtypes)``: one segment per dtype (in order of first appearance) holding whole
    tensors in order, as the reduction packs them when it is not bucketed."""
    by_dtype: dict = {}
    for index, tensor in enumerate(tensors):
        numel = tensor.numel()
        if numel:
            by_dtype.setdefault(tensor.dtype, []).append((index, 0, numel))
    return list(by_dtype.values()), list(by_dtype)


def owned_bytes(plan: ShardPlan, dtypes, worker: int) -> int:
    """The bytes of ``worker``'s pieces, segment ``i`` being of ``dtypes[i]``."""
    return sum(piece.size * dtypes[piece.segment].itemsize for piece in plan.owned(worker))


class StateShards(StateLayout):
    """This worker's part of the optimizer state of one list of variables, and the collectives that serve it
    (``MultiWorkerMirroredStrategy(shard_optimizer_states=True)``; ``extended.state_layout`` returns it): the
    ``StateLayout`` whose targets are the piece variables (``slices_variables``).

    The segments are the gradient buckets of these variables (``buckets.bucket_layout``: the same
    layout the buckets started during backward use), so a bucket's reduce-scatter hands this worker exactly
    the gradients of its pieces. For every piece it owns the worker keeps a **piece variable**: a 1-D
    ``LocalVariable`` viewing those elements of the variable's first local copy, which the optimizer updates
    in place as if it were a variable (its slots are made shaped like it). A step:

    1. the gradients arrive as this worker's chunk of each segment, reduce-scattered in place in the
       segment's buffer (the bucket's, or one made by ``reduce``), viewed per piece;
    2. the optimizer updates the piece variables (so the first copy's owned elements);
    3. ``publish(buffers)``: this worker's updated elements packed into its chunk of each buffer, every
       worker's chunks all-gathered in place (all started, then each waited for) and copied into every local
       copy of the variables.

    No memory beyond the buffers the unsharded reduction uses: what sharding saves is the optimizer state.

    Example (what the optimizer does with the layout the strategy gives it)::

        shards = strategy.extended.state_layout(variables)   # StateShards where the strategy cuts them
        reduced = shards.reduce(per_replica_grads, variables)  # this worker's pieces' gradients
        for piece, grad in zip(shards.targets, reduced.values):
            ...                                                # the update rule on the piece
        shards.finish(reduced, variables, direct=True)       # the updated pieces gathered everywhere
    """

    #: A bucket of fewer bytes than this is not cut: every worker keeps all of its optimizer state and none of its
    #: values is gathered. On gloo over loopback one collective costs about a millisecond whatever its size
    #: (0.8 ms for 48 bytes, 1.3 ms for 340 KB on 2 workers), more than sharding a small bucket's state saves; the
    #: buckets this leaves whole are the first (up to 1 MiB), remainders and dtype boundaries, so the state kept
    #: whole is a few MiB at most. 0 cuts every bucket.
    min_bytes: int = 1 << 20

    slices_variables = True

    def __init__(self, collective, variables, bucket_bytes: int = 0, extended=None):
        super().__init__(extended._strategy if extended is not None else None)
        self._extended = extended  # the strategy's: the reductions of a step (its gradient buckets) are its
        self._collective = collective
        self.variables = list(variables)
        copies = [[component.value() for component in local_results(v)] for v in self.variables]
        layout = bucket_layout(copies, bucket_bytes)
        # One segment per bucket (a bucket of empty variables only is an empty segment: indices stay aligned).
        segments = [[(i, 0, copies[i][0].numel()) for i in members if copies[i][0].numel()] for members, _, _ in layout]
        sizes = [sum(b - a for _, a, b in segment) * dtype.itemsize for segment, (_, dtype, _) in zip(segments, layout)]
        whole = [k for k, size in enumerate(sizes) if size < self.min_bytes]
        self.plan = ShardPlan(segments, collective.world_size, whole)
        self.dtypes = [dtype for _, dtype, _ in layout]
        self.devices = [device for _, _, device in layout]
        self.worker = collective.rank
        idle = [w for w in range(collective.world_size) if not self.plan.owned(w)]
        if idle:  # the same plan on every worker: every worker raises
            raise ValueError(
                f"Sharded optimizer states: worker(s) {idle} of {collective.world_size} would own no element of these "
                f"variables ({sum(self.plan.lengths)} elements in {len(segments)} bucket(s), each cut into one equal "
                "part per worker). A model this small has nothing to save by sharding: use "
                "MultiWorkerMirroredStrategy(shard_optimizer_states=False)."
            )
        self.pieces = self.plan.owned(self.worker)
        self.piece_variables = []
        self._storage: list = [None] * len(self.variables)  # (data pointer, shape, dtype) the pieces view
        for piece in self.pieces:
            source = self.variables[piece.variable]
            view = self._view(piece)
            device = local_results(source)[0].device
            name = f"{source.name}[{piece.start}:{piece.stop}]"
            self.piece_variables.append(LocalVariable(view, name=name, device=device, trainable=False))
        self._ids = [id(v) for v in self.variables]
        self._position_of = {id(v): piece.variable for piece, v in zip(self.pieces, self.piece_variables)}
        self._pending = None  # the gathers a deferred publish started
        self._mesh = None  # the workers' DeviceMesh, made for the first sharded checkpoint
        #: Whether ``publish`` only starts the gathers (``settle`` finishes them): set by the strategy.
        self.defer = False
        fits = [k for k, dtype in enumerate(self.dtypes) if dtype in CARRIERS]
        #: The segment whose reduce-scatter carries the step values (the last of a dtype that sums their limbs
        #: exactly, as the buckets carry them in the last bucket), or ``None``: they are reduced on their own.
        self.carrier = fits[-1] if fits else None

    def _view(self, piece: Piece) -> torch.Tensor:
        tensor = local_results(self.variables[piece.variable])[0].value()
        if not tensor.is_contiguous():
            raise ValueError(
                f"Sharded optimizer states update the variables in place, and {self.variables[piece.variable].name!r} "
                "is not contiguous: make its tensor contiguous (module parameters are) before training."
            )
        self._storage[piece.variable] = _where(tensor)
        return tensor.detach().view(-1)[piece.start : piece.stop]

    def refresh(self) -> bool:
        """Points the piece variables at the variables' memory again where it moved (``param.data = ...`` keeps the
        parameter and gives it other memory); whether any did (the optimizer then makes its plans again). A
        variable whose shape or dtype changed since is a ``ValueError``: the partition was cut for the old one."""
        changed = False
        for piece, variable in zip(self.pieces, self.piece_variables):
            tensor = local_results(self.variables[piece.variable])[0].value()
            now, then = _where(tensor), self._storage[piece.variable]
            if now == then:
                continue
            if now[1:] != then[1:]:
                raise ValueError(
                    f"The variable {self.variables[piece.variable].name!r} changed from shape {list(then[1])} "
                    f"{then[2]} on {then[3]} to {list(now[1])} {now[2]} on {now[3]} after its optimizer state was "
                    "sharded: change a model's parameters before its first update (or make a new optimizer)."
                )
            variable._tensor = self._view(piece)
            changed = True
        return changed

    def matches(self, variables) -> bool:
        return len(variables) == len(self._ids) and all(id(v) == i for v, i in zip(variables, self._ids))

    def pieces_of(self, index: int) -> list:
        """``[(piece, piece variable)]`` of variable ``index`` that this worker owns."""
        return [(p, v) for p, v in zip(self.pieces, self.piece_variables) if p.variable == index]

    def piece_views(self, chunks: list) -> list:
        """Each piece's elements of ``chunks`` (this worker's chunk of each segment)."""
        return [chunks[p.segment][p.offset : p.offset + p.size] for p in self.pieces]

    def slices(self, tensors: list) -> list:
        """Each piece's elements of whole tensors (one per variable, of its shape)."""
        return [tensors[p.variable].reshape(-1)[p.start : p.stop] for p in self.pieces]

    # --- a step ----------------------------------------------------------------------------------
    def buffers(self) -> list:
        """A zeroed buffer per segment, padded to equal parts."""
        return [
            torch.zeros(self.plan.padded_length(k), dtype=dtype, device=device)
            for k, (dtype, device) in enumerate(zip(self.dtypes, self.devices))
        ]

    def reduce_scatter(self, local_sums: list, carried=None) -> tuple:
        """``(this worker's chunk of each segment summed over every worker, the segments' buffers, the total of
        carried)``: ``local_sums`` holds one tensor per variable (this worker's replicas summed); ``carried``: the
        step values' limbs (of segment ``carrier``'s dtype, not ``None`` only where there is one), which ride
        whole in that segment's reduction. One reduction per segment, all started and then waited for in order:
        an all-reduce for a whole segment and on gloo (this worker keeping its part), else a reduce-scatter, in
        place in its buffer but the carrier's."""
        carrier = self.carrier if carried is not None else None
        buffers, started = self.buffers(), []
        for k, (segment, buffer) in enumerate(zip(self.plan.segments, buffers)):
            if not segment and k != carrier:  # a bucket of empty variables: nothing to reduce
                started.append(None)
                continue
            position = 0
            for i, a, b in segment:
                buffer[position : position + b - a] = local_sums[i].reshape(-1)[a:b]
                position += b - a
            what = f"reduce_scatter (segment {k})"
            if not self._collective.lean_scatter or k in self.plan.whole:  # an all-reduce: this worker keeps its part
                extra = carried.to(self.dtypes[k]) if k == carrier else buffer.new_empty(0)
                whole = torch.cat([buffer, extra]) if extra.numel() else buffer
                started.append((self._collective.start_all_reduce(whole, what), whole))
            elif k == carrier:
                started.append(self._collective.start_reduce_scatter(buffer, carried.to(self.dtypes[k]), what))
            else:
                started.append(self._collective.start_reduce_scatter_in_place(buffer, what))
        chunks, total = [], None
        for k, work in enumerate(started):
            if work is None:
                chunks.append(buffers[k])
                continue
            if isinstance(work, tuple):
                self._collective.wait_work(work[0], f"reduce_scatter (segment {k})")
                chunk, length = self.plan.chunk_lengths[k], self.plan.padded_length(k)
                at = self.plan.chunk_start(k, self.worker)
                part, extra = work[1][at : at + chunk], work[1][length:]
                if work[1] is not buffers[k]:
                    buffers[k] = work[1][:length]
            else:
                part, extra = work.result()
            chunks.append(part)
            if k == carrier:
                total = extra
        return chunks, buffers, total

    def publish(self, buffers: list | None = None) -> None:
        """Every worker's updated pieces into every local copy of every variable: this worker's owned elements
        packed into its chunk of each segment's buffer (``buffers``: the step's, free once the gradients are
        used; ``None``: new ones), one in-place all-gather per segment, then copied out.

        With ``defer`` set (the strategy sets it for the trainer's built-in step) the gathers are only started:
        ``settle()`` waits for them and copies the values out, which the strategy and trainer do before anything
        reads the variables again (the next step's forward, any ``strategy.run``, the batch hooks of callbacks
        that may read them, the end of the epoch's steps), so the gather overlaps what the trainer does between
        two steps. Whole segments (``ShardPlan.whole``) are not gathered: every worker updated all of them."""
        self.settle()
        whole = self.plan.whole  # every worker updated all of these: nothing to gather
        buffers = self.buffers() if buffers is None else buffers
        rank = self.worker
        with torch.no_grad():
            destinations, sources = [], []
            for piece, variable in zip(self.pieces, self.piece_variables):
                if piece.segment not in whole:
                    at = rank * self.plan.chunk_lengths[piece.segment] + piece.offset
                    destinations.append(buffers[piece.segment][at : at + piece.size])
                    sources.append(variable.value())
            lean = self._collective.lean_scatter
            for k, buffer in enumerate(buffers):  # the padding of this worker's chunk: zeros (all but it, on gloo)
                if k in whole:
                    continue
                chunk = self.plan.chunk_lengths[k]
                end = min(max(self.plan.lengths[k] - rank * chunk, 0), chunk)
                buffer[rank * chunk + end : (rank + 1) * chunk].zero_()
                if not lean:
                    buffer[: rank * chunk].zero_()
                    buffer[(rank + 1) * chunk :].zero_()
            if destinations:
                foreach.copy_(destinations, sources)
        self._pending = [
            self._collective.start_all_gather_in_place(buffer, f"all_gather (updated values, segment {k})")
            if buffer.numel() and k not in whole
            else None
            for k, buffer in enumerate(buffers)
        ]
        if not self.defer:
            self.settle()

    @property
    def pending(self) -> bool:
        """Whether a deferred ``publish`` has not been settled yet (the variables do not hold the update yet)."""
        return self._pending is not None

    def settle(self, quiet: bool = False) -> None:
        """Finishes a deferred ``publish``: waits for its gathers and copies every worker's updated values into
        every local copy (nothing when none is pending). ``quiet``: on the way out of a failed step or fit, a
        failure to wait is not raised (the error on its way is the one to report); what did arrive is copied."""
        started, self._pending = self._pending, None
        if not started:
            return
        with torch.no_grad():
            for k, work in enumerate(started):
                if work is None:  # a whole segment (updated in the first copy: the others follow) or an empty one
                    if k in self.plan.whole:
                        self._copy_from_first(k)
                    continue
                try:
                    full = work.result()
                except Exception:
                    if quiet:
                        continue
                    raise
                self._scatter(k, full)

    def _copy_from_first(self, k: int) -> None:
        """A whole segment's values from the first local copy (which the pieces updated) into the others."""
        destinations, sources = [], []
        for index, start, stop in self.plan.segments[k]:
            components = local_results(self.variables[index])
            first = components[0].value().detach().view(-1)[start:stop]
            for component in components[1:]:
                tensor = component.value()
                destinations.append(tensor.detach().view(-1)[start:stop])
                sources.append(first if first.device == tensor.device else first.to(tensor.device))
        if destinations:
            foreach.copy_(destinations, sources)

    def _scatter(self, k: int, full: torch.Tensor) -> None:
        destinations, sources, position = [], [], 0
        for index, start, stop in self.plan.segments[k]:
            part = full[position : position + stop - start]
            position += stop - start
            for component in local_results(self.variables[index]):
                tensor = component.value()
                destinations.append(tensor.detach().view(-1)[start:stop])
                sources.append(part if part.device == tensor.device else part.to(tensor.device))
        foreach.copy_(destinations, sources)

    def _pieced(self, per_piece: list) -> list:
        """One ``PiecedValue`` per variable: its elements are parts of the segments' buffers, each segment's buffer a
        ``DTensor`` of every worker's chunk (this worker's pieces at their places, zeros in the padding), or a plain
        tensor where the segment is whole (every worker holds all of it: written once)."""
        from torch.distributed.tensor import DTensor, Shard

        if self._mesh is None:
            self._mesh = workers_mesh(self._collective)
        chunks = []
        for k, (dtype, device) in enumerate(zip(self.dtypes, self.devices)):
            chunks.append(torch.zeros(self.plan.chunk_lengths[k], dtype=dtype, device=device))
        for piece, tensor in zip(self.pieces, per_piece):
            if tensor is not None:
                chunks[piece.segment][piece.offset : piece.offset + piece.size] = tensor.reshape(-1)
        buffers = []
        for k, chunk in enumerate(chunks):
            if k in self.plan.whole:
                buffers.append(chunk)
            else:
                length = self.plan.padded_length(k)
                buffers.append(DTensor.from_local(chunk, self._mesh, [Shard(0)], shape=(length,), stride=(1,)))
        parts: list = [[] for _ in self.variables]
        for k, segment in enumerate(self.plan.segments):
            position = 0
            for index, start, stop in segment:
                parts[index].append((buffers[k], position, start, stop))
                position += stop - start
        return [
            PiecedValue(local_results(v)[0].value().shape, local_results(v)[0].value().dtype, p)
            for v, p in zip(self.variables, parts)
        ]

    def gather(self, per_piece: list, what: str) -> list:
        """Whole tensors from pieces: ``per_piece`` holds a 1-D tensor (or ``None``: zeros) per piece of this
        worker, of its variable's dtype; returns one flat tensor per variable, every worker's pieces in place
        (a collective: every worker calls it). One in-place gather per cut segment (an all-gather, on gloo an
        all-reduce of the parts with zeros elsewhere), one segment at a time; whole segments are here already."""
        whole: list = [None] * len(self.variables)
        by_segment: dict = {}
        for piece, tensor in zip(self.pieces, per_piece):
            by_segment.setdefault(piece.segment, []).append((piece, tensor))
        for k, segment in enumerate(self.plan.segments):
            if not segment:
                continue
            buffer = torch.zeros(self.plan.padded_length(k), dtype=self.dtypes[k], device=self.devices[k])
            at = self.plan.chunk_start(k, self.worker)
            for piece, tensor in by_segment.get(k, ()):
                if tensor is not None:
                    buffer[at + piece.offset : at + piece.offset + piece.size] = tensor.reshape(-1)
            full = buffer  # a whole segment: every worker holds all of it
            if k not in self.plan.whole:  # this worker's chunk, zeros elsewhere: gathered in place
                full = self._collective.start_all_gather_in_place(buffer, f"gathering {what} (segment {k})").result()
            position = 0
            for index, start, stop in segment:
                if whole[index] is None:
                    first = local_results(self.variables[index])[0].value()
                    whole[index] = first.new_zeros(first.numel())
                whole[index][start:stop] = full[position : position + stop - start]
                position += stop - start
        for index, variable in enumerate(self.variables):
            if whole[index] is None:  # no elements (an empty variable)
                whole[index] = local_results(variable)[0].value().new_zeros(0)
        return whole

    def sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` summed over the workers (a small all-reduce: the partial sums of a norm)."""
        buffer = tensor.detach().to(self._collective.device).clone().reshape(-1)
        self._collective.all_reduce_flat([buffer], what)
        return buffer.view(tensor.shape).to(tensor.device)

    def all_workers_agree(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on every worker."""
        return self._collective.sum_ints([0 if flag else 1], what)[0] == 0

    @property
    def num_workers(self) -> int:
        return self._collective.world_size

    # --- the StateLayout an optimizer talks to ----------------------------------------------------
    def extend(self, variables) -> list:
        """The piece variables, when an optimizer registers this layout's variables (every one of them: the pieces
        were cut for exactly these). The strategy gives the same layout to every optimizer of these variables,
        and each builds its own slots for the same pieces."""
        variables = list(variables)
        if not variables:
            return []
        self._check(variables)
        return list(self.piece_variables)

    def targets_of(self, variables) -> list:
        self._check(variables)
        return self.piece_variables

    @property
    def targets(self) -> list:
        return self.piece_variables

    def _check(self, variables) -> None:
        if not self.matches(variables):
            raise ValueError(
                f"These sharded optimizer states were cut for {len(self.variables)} variables, and this update gave "
                f"{len(variables)} other ones: with shard_optimizer_states an optimizer updates one list of variables "
                "(use one optimizer per list)."
            )

    def position_of(self, target) -> int:
        return self._position_of[id(target)]

    def reduce(self, grads: list, variables: list) -> ReducedGradients:
        self._check(variables)
        chunks, buffers = self._extended.reduce_scatter_gradients(self, grads)
        views = self.piece_views(chunks)
        return ReducedGradients(views, views, buffers)

    def take(self, grads: list, variables: list) -> ReducedGradients:
        self._check(variables)
        whole = [g if type(g) is torch.Tensor else local_results(g)[0] for g in grads]
        parts = self.slices(whole)
        return ReducedGradients(parts, parts)

    def sum_over_workers(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return self.sum(tensor, what)

    def all_agree(self, flag: bool, what: str) -> bool:
        return self.all_workers_agree(flag, what)

    def counts(self, index: int) -> bool:
        # Every worker holds the pieces of a whole segment: worker 0 counts them, once.
        return self.pieces[index].segment not in self.plan.whole or self.worker == 0

    @property
    def device(self) -> torch.device:
        return self.devices[0] if self.devices else torch.device("cpu")

    def make_slot(self, target, name: str, value: torch.Tensor) -> LocalVariable:
        """A slot of a piece variable: on this worker only (no collective, unlike a variable's slot)."""
        tensor = value.to(target.value().device)
        return LocalVariable(tensor, name=f"{target.name}/{name}", device=target.device, trainable=False)

    def update(self, target, fn, args: tuple) -> None:
        fn(target, *args)

    def finish(self, reduced: ReducedGradients, variables: list, direct: bool) -> None:
        self.publish(reduced.buffers)
        self._extended.after_direct_update(self.variables)

    def whole(self, per_target: list, what: str) -> list:
        if keeps_shards():  # a sharded checkpoint: every worker's chunks, nothing gathered
            return self._pieced([None if t is None else t.detach() for t in per_target])
        gathered = self.gather([None if t is None else t.detach() for t in per_target], what)
        return [flat.view(local_results(v)[0].value().shape).clone() for flat, v in zip(gathered, self.variables)]

    def cut(self, position: int, value: torch.Tensor) -> list:
        flat = value.detach().reshape(-1)
        return [(variable, flat[piece.start : piece.stop]) for piece, variable in self.pieces_of(position)]

    def copy_from_slots(self, variables: list, slot_of) -> None:
        self.settle()  # the last update's values first (a gather the trainer's step may defer)
        wholes = self.whole([slot_of(t).value() for t in self.piece_variables], "the moving averages")
        positions = {id(v): i for i, v in enumerate(self.variables)}
        with torch.no_grad():
            for variable in variables:
                value = wholes[positions[id(variable)]]
                for component in local_results(variable):
                    tensor = component.value()
                    tensor.detach().view(-1).copy_(value.reshape(-1).to(tensor.device))

    def gather_objects(self, obj, what: str) -> list:
        return self._collective.all_gather_object(obj, what)

    def __repr__(self) -> str:
        return f"StateShards(worker {self.worker} of {self.num_workers}, {len(self.pieces)} pieces, {self.plan!r})"
