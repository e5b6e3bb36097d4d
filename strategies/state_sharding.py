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

__all__ = ["Piece", "ShardPlan", "dtype_segments", "owned_bytes"]


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

    Attributes:
      chunk_lengths: the elements of each worker's chunk, per segment (the padded buffer holds
        ``num_workers`` of them).
      lengths: each segment's elements (unpadded).
    """

    def __init__(self, segments, num_workers: int):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}.")
        self.num_workers = num_workers
        self.segments = [[tuple(int(x) for x in r) for r in segment] for segment in segments]
        for index, segment in enumerate(self.segments):
            for variable, start, stop in segment:
                if not 0 <= start < stop:
                    raise ValueError(f"Segment {index} has an empty or reversed range {(variable, start, stop)}.")
        self.lengths = [sum(stop - start for _, start, stop in segment) for segment in self.segments]
        self.chunk_lengths = [math.ceil(length / num_workers) for length in self.lengths]
        self._owned: list = [[] for _ in range(num_workers)]
        for index, segment in enumerate(self.segments):
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
        """The elements of segment ``segment``'s buffer padded for an equal reduce-scatter."""
        return self.chunk_lengths[segment] * self.num_workers

    def __repr__(self) -> str:
        return f"ShardPlan({len(self.segments)} segment(s), {sum(self.lengths)} elements, {self.num_workers} workers)"


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
