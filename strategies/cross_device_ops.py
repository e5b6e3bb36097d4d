"""Cross-device ops: the one place where values of several replicas are combined.

A ``CrossDeviceOps`` turns ``(per-replica value, destinations)`` pairs into reduced
values on the destination devices. ``batch_reduce`` packs many tensors into few
batched operations (``CommunicationOptions.bytes_per_pack``), so a model with
hundreds of parameters costs a handful of reductions, not hundreds.

* ``ReductionToOneDevice``: sums on one device, in replica order (so results never
  depend on thread timing), then copies the result to every destination. Tensors
  that must cross physical devices travel as one flat buffer per pack; tensors that
  already share memory (logical CPUs) are summed pack by pack with multi-tensor
  (``torch._foreach_*``) kernels, without the copy into a flat buffer.
* ``NcclAllReduce``: NCCL all-reduce of flat packs across several GPUs of one process.

Example::

    >>> import torch, replicafit.strategies as ds
    >>> ops = ds.ReductionToOneDevice()
    >>> value = ds.PerReplica((torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])), ("cpu:0", "cpu:1"))
    >>> ops.reduce("SUM", value, destinations=["cpu:0", "cpu:1"]).values
    (tensor([4., 6.]), tensor([4., 6.]))
"""

from __future__ import annotations

import functools

import torch

from . import foreach
from .devices import canonicalize, canonicalize_list, torch_device
from .reduce_util import CommunicationOptions, ReduceOp, as_reduce_op
from .values import DistributedValues, Mirrored, PerReplica, local_results
from .variables import Variable

__all__ = ["CrossDeviceOps", "ReductionToOneDevice", "NcclAllReduce", "group_by_size", "destination_devices"]


def destination_devices(destinations) -> tuple[str, ...]:
    """The canonical devices named by ``destinations``.

    A variable or distributed value means its devices; a device string (or
    ``torch.device``) one device; a list of device strings those devices.
    """
    if isinstance(destinations, DistributedValues):
        return destinations.devices
    if isinstance(destinations, Variable):
        return tuple(component.device for component in local_results(destinations))
    if isinstance(destinations, (str, torch.device)):
        return (canonicalize(destinations),)
    if isinstance(destinations, (list, tuple)):
        if not destinations:
            raise ValueError("destinations can not be empty")
        if all(isinstance(d, (str, torch.device)) for d in destinations):
            return canonicalize_list(destinations, "destinations")
    raise ValueError(
        "destinations must be one of a `DistributedValues` object, a replicafit.strategies.Variable object, a device "
        f"string or a list of device strings; got {type(destinations).__name__}: {destinations!r}."
    )


def component_tensors(value) -> list:
    """The tensors of a distributed value (variables give their components' tensors)."""
    if type(value) is PerReplica:
        values = value._values
        for v in values:
            if type(v) is not torch.Tensor:
                break
        else:
            return values
    out = []
    for item in local_results(value):
        if isinstance(item, Variable):
            item = item._read()
        elif not isinstance(item, torch.Tensor):
            item = torch.as_tensor(item)
        out.append(item)
    return out


def group_by_size(nbytes: list[int], bytes_per_pack: int) -> list[list[int]]:
    """Splits indices into consecutive packs of at most ``bytes_per_pack`` bytes.

    ``0`` puts everything in one pack; a tensor larger than the budget gets a pack of
    its own.

    Example::

        >>> group_by_size([4, 8, 12, 16, 20], 24)
        [[0, 1, 2], [3], [4]]
    """
    if bytes_per_pack == 0:
        return [list(range(len(nbytes)))] if nbytes else []
    packs: list[list[int]] = []
    used = 0
    for index, size in enumerate(nbytes):
        if not packs or used + size > bytes_per_pack:
            packs.append([])
            used = 0
        packs[-1].append(index)
        used += size
    return packs


def _shape_error(tensors) -> None:
    shapes = ", ".join(f"replica {i}: {tuple(t.shape)}" for i, t in enumerate(tensors))
    raise ValueError(
        f"Cannot reduce a value whose shape differs across replicas ({shapes}). Values reduced "
        "across replicas must have the same shape; for per-example values whose batch sizes "
        "differ, use strategy.reduce(op, value, axis=0) or strategy.gather(value, axis=0)."
    )


def _packs(pairs, indices: list, bytes_per_pack: int) -> list:
    """The pairs ``indices`` (one dtype and device set) split into packs of at most ``bytes_per_pack``."""
    if bytes_per_pack == 0:
        return [indices]
    nbytes = [pairs[i][0][0].numel() * pairs[i][0][0].element_size() for i in indices]
    return [[indices[p] for p in pack] for pack in group_by_size(nbytes, bytes_per_pack)]


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copies to ``device``: asynchronously onto a GPU (stream-ordered), synchronously to the host,
    where the CPU reads the result right away."""
    return tensor.to(device, non_blocking=device.type == "cuda")


def _mean(total: torch.Tensor, count: int) -> torch.Tensor:
    return total / count


@functools.lru_cache(maxsize=1024)
def _memory_of(devices: tuple) -> tuple:
    """The torch device holding each canonical device's memory (logical CPUs share one)."""
    return tuple(torch_device(d) for d in devices)


def _broadcast(tensor: torch.Tensor, devices: tuple, memories: tuple | None = None):
    """``tensor`` on every destination: a tensor for one device, else a ``Mirrored``.

    Destinations sharing the tensor's memory (logical CPUs) share the tensor itself: no
    copy. Treat reduction results as read-only.
    """
    memories = memories or _memory_of(devices)
    if len(devices) == 1:
        return tensor if tensor.device == memories[0] else _move(tensor, memories[0])
    source = tensor.device
    if all(memory == source for memory in memories):
        return Mirrored((tensor,) * len(devices), devices)
    copies = {source: tensor}
    out = []
    for memory in memories:
        copy = copies.get(memory)
        if copy is None:
            copy = copies[memory] = _move(tensor, memory)
        out.append(copy)
    return Mirrored(out, devices)


class CrossDeviceOps:
    """Base class of cross-device reductions (``tf.distribute.CrossDeviceOps``).

    Subclasses implement ``batch_reduce_implementation(op, pairs, options)`` over
    ``(component tensors, destination devices)`` pairs; the public methods validate and
    normalize their arguments.
    """

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        """Reduces ``per_replica_value`` onto ``destinations``: a ``Mirrored``, or a tensor for one device."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None) -> list:
        """Reduces many ``(value, destinations)`` pairs in one batched operation; one result per pair."""
        op = as_reduce_op(reduce_op)
        options = CommunicationOptions() if options is None else options
        pairs = []
        for value, destinations in value_destination_pairs:
            tensors = component_tensors(value)
            if tensors[0].dtype == torch.bool:
                tensors = [t.to(torch.int64) for t in tensors]  # a SUM of flags counts them, as axis=k does
            shape = tensors[0].shape
            for tensor in tensors:
                if tensor.shape != shape:
                    _shape_error(tensors)
            pairs.append((tensors, destination_devices(destinations)))
        return self.batch_reduce_implementation(op, pairs, options)

    def broadcast(self, tensor, destinations):
        """Copies ``tensor`` to every destination device: a ``Mirrored`` (a tensor for one device)."""
        return _broadcast(tensor, destination_devices(destinations))

    def gather(self, per_replica_value, axis: int, destinations):
        """Concatenates the components along ``axis`` onto each destination device."""
        devices = destination_devices(destinations)
        tensors = component_tensors(per_replica_value)
        target = torch_device(devices[0])
        moved = [_move(t, target) for t in tensors]
        try:
            gathered = torch.cat(moved, dim=axis)
        except (RuntimeError, IndexError) as error:
            shapes = ", ".join(f"replica {i}: {tuple(t.shape)}" for i, t in enumerate(tensors))
            raise ValueError(
                f"Cannot gather along axis {axis}: the components ({shapes}) must have at least {axis + 1} "
                f"dimension(s) and may differ only along axis {axis}. ({error})"
            ) from None
        return _broadcast(gathered, devices)

    def batch_reduce_implementation(self, reduce_op: ReduceOp, pairs, options: CommunicationOptions) -> list:
        """The reduction a subclass implements, called by ``reduce`` and ``batch_reduce``.

        Unlike TensorFlow's, it gets normalized arguments: ``reduce_op`` a ``ReduceOp``, ``pairs`` a list
        of ``(component tensors in replica order, canonical destination devices)`` whose tensors have one
        shape (booleans made ``int64``), ``options`` a ``CommunicationOptions``.

        Returns:
          One result per pair, in order: a ``Mirrored`` on the destinations, or a tensor for one device.
        """
        raise NotImplementedError


class ReductionToOneDevice(CrossDeviceOps):
    """Sums on one device in replica order, then copies the result to every destination.

    Args:
      reduce_to_device: where the sum is computed; by default the first destination.

    Sums are taken in replica order (``((v0 + v1) + v2) + ...``), so the same inputs
    give bit-identical results whatever thread finishes first. Batched reductions
    follow ``bytes_per_pack``: one multi-tensor kernel per pack where the tensors share
    memory, one flat buffer per pack where they must be moved.

    Example::

        strategy = ds.MirroredStrategy(
            ["cpu:0", "cpu:1"], cross_device_ops=ds.ReductionToOneDevice())
    """

    _force_flat = False  # tests set this to check the flat-buffer path against the multi-tensor one

    def __init__(self, reduce_to_device=None):
        self.reduce_to_device = None if reduce_to_device is None else canonicalize(reduce_to_device)

    def batch_reduce_implementation(self, reduce_op, pairs, options) -> list:
        results: list = [None] * len(pairs)
        groups: dict = {}
        targets: dict = {}
        for index, (tensors, destinations) in enumerate(pairs):
            target = targets.get(destinations)
            if target is None:
                target = targets[destinations] = torch_device(self.reduce_to_device or destinations[0])
            if len(tensors) == 1 and tensors[0].device == target:
                # One replica and no copy needed: nothing to add (bit-identical, no work).
                results[index] = _broadcast(tensors[0], destinations)
                continue
            key = (tensors[0].dtype, tuple([t.device for t in tensors]), target, destinations)
            group = groups.get(key)
            if group is None:
                groups[key] = [index]
            else:
                group.append(index)
        for (_, sources, target, destinations), indices in groups.items():
            count = len(sources)
            memories = _memory_of(destinations)
            local = all(source == target for source in sources) and not self._force_flat
            shared = all(memory == target for memory in memories)
            for members in _packs(pairs, indices, options.bytes_per_pack):
                per_replica = [[pairs[i][0][r] for i in members] for r in range(count)]
                if local:
                    reduced = _sum_packed_foreach(per_replica, reduce_op, count)
                else:
                    reduced = _sum_packed_flat(per_replica, reduce_op, count, target)
                if shared and len(destinations) > 1:
                    copies = len(destinations)
                    make = Mirrored._make
                    for i, tensor in zip(members, reduced):
                        results[i] = make((tensor,) * copies, destinations)
                else:
                    for i, tensor in zip(members, reduced):
                        results[i] = _broadcast(tensor, destinations, memories)
        return results


def _sum_packed_foreach(per_replica: list, reduce_op: ReduceOp, count: int) -> list:
    if count == 1:
        return list(per_replica[0])  # one replica: its values are the sum and the mean
    total = foreach.add(per_replica[0], per_replica[1])
    for tensors in per_replica[2:]:
        foreach.add_(total, tensors)
    if reduce_op is ReduceOp.MEAN:
        if total[0].is_floating_point() or total[0].is_complex():
            foreach.div_(total, count)
        else:
            total = [_mean(t, count) for t in total]
    return total


def _sum_packed_flat(per_replica: list, reduce_op: ReduceOp, count: int, device: torch.device) -> list:
    shapes = [t.shape for t in per_replica[0]]
    sizes = [t.numel() for t in per_replica[0]]
    flats = [_move(torch.cat([t.reshape(-1) for t in tensors]), device) for tensors in per_replica]
    total = flats[0] + flats[1] if count > 1 else flats[0]
    for flat in flats[2:]:
        total += flat
    if reduce_op is ReduceOp.MEAN:
        total = _mean(total, count)
    return [piece.view(shape) for piece, shape in zip(total.split(sizes), shapes)]


class NcclAllReduce(CrossDeviceOps):
    """NCCL all-reduce across the GPUs of one process, in flat packs.

    Args:
      num_packs: how many flat buffers each group of tensors is split into (``0``: one
        all-reduce per tensor).

    Values whose destinations are not exactly their own GPUs (a CPU destination, a
    different device set) fall back to ``ReductionToOneDevice``. Unlike that op, the
    order in which NCCL adds the replicas' values is NCCL's (deterministic for a fixed
    set of GPUs, but not strictly replica order).

    Example::

        strategy = ds.MirroredStrategy(["cuda:0", "cuda:1"],
                                               cross_device_ops=ds.NcclAllReduce())
    """

    def __init__(self, num_packs: int = 1):
        if num_packs < 0:
            raise ValueError(f"NCCL all-reduce requires num_packs >= 0, but {num_packs} is specified")
        self.num_packs = num_packs
        self._fallback = ReductionToOneDevice()

    def batch_reduce_implementation(self, reduce_op, pairs, options) -> list:
        results: list = [None] * len(pairs)
        nccl_groups: dict = {}
        fallback = []
        for index, (tensors, destinations) in enumerate(pairs):
            devices = tuple(t.device for t in tensors)
            usable = (
                len(tensors) > 1
                and all(d.type == "cuda" for d in devices)
                and len(set(devices)) == len(devices)
                and _memory_of(destinations) == devices
            )
            if usable:
                nccl_groups.setdefault((tensors[0].dtype, devices), []).append(index)
            else:
                fallback.append(index)
        if fallback:
            reduced = self._fallback.batch_reduce_implementation(reduce_op, [pairs[i] for i in fallback], options)
            for i, value in zip(fallback, reduced):
                results[i] = value
        for (_, devices), indices in nccl_groups.items():
            count = len(devices)
            if self.num_packs == 0:
                packs = [[i] for i in indices]
            else:
                packs = _packs(pairs, indices, options.bytes_per_pack)
            for members in packs:
                per_replica = [[pairs[i][0][r] for i in members] for r in range(count)]
                reduced = _nccl_all_reduce(per_replica, reduce_op, count, self.num_packs or 1)
                for position, i in enumerate(members):
                    destinations = pairs[i][1]
                    results[i] = Mirrored([reduced[r][position] for r in range(count)], destinations)
        return results


def _nccl_all_reduce(per_replica, reduce_op, count, num_packs):
    from torch.cuda import nccl

    shapes = [t.shape for t in per_replica[0]]
    sizes = [t.numel() for t in per_replica[0]]
    flats = [torch.cat([t.reshape(-1) for t in tensors]) for tensors in per_replica]
    total = flats[0].numel()
    chunk = max(1, total // max(1, num_packs))
    bounds = list(range(0, total, chunk))[:num_packs] + [total]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        nccl.all_reduce([flat[start:stop] for flat in flats])
    out = []
    for flat in flats:
        if reduce_op is ReduceOp.MEAN:
            flat = _mean(flat, count)
        out.append([piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)])
    return out


class CollectiveAllReduce(CrossDeviceOps):
    """Reductions across worker processes (``MultiWorkerMirroredStrategy``'s cross-device ops).

    Three stages: this worker's replicas are summed in replica order onto its first
    destination device (``ReductionToOneDevice``); each pack of ``bytes_per_pack`` bytes
    (per dtype) travels as **one flat buffer** in one ``torch.distributed`` all-reduce (all
    packs started, then waited in pack order, the same order on every worker); the result
    is divided by the global replica count for ``MEAN`` and copied to the local
    destinations. ``gather`` concatenates local components, then the workers' parts (uneven
    sizes along the axis allowed: sizes are exchanged first, parts padded to the largest).

    With two workers the sums equal ``MirroredStrategy``'s replica-order sums bit for bit;
    with three or more the collective's summation order may differ in the last bits (the
    result is still identical on every worker).

    Example::

        strategy = ds.MultiWorkerMirroredStrategy()        # builds one for its cluster
        strategy.extended._cross_device_ops                # CollectiveAllReduce(workers=2)
    """

    def __init__(self, collective, num_replicas_in_sync: int):
        self._collective = collective
        self._count = num_replicas_in_sync
        self._local = ReductionToOneDevice()

    def __repr__(self) -> str:
        return f"CollectiveAllReduce(workers={self._collective.world_size})"

    def batch_reduce_implementation(self, reduce_op, pairs, options) -> list:
        # 1. Local replicas, in replica order, onto the first destination device.
        firsts = [(tensors, destinations[:1]) for tensors, destinations in pairs]
        local = self._local.batch_reduce_implementation(ReduceOp.SUM, firsts, options)
        # 2. One flat buffer per pack (per dtype and device), in first-appearance order.
        groups: dict = {}
        for index, tensor in enumerate(local):
            groups.setdefault((tensor.dtype, tensor.device), []).append(index)
        packs, buffers = [], []
        for indices in groups.values():
            nbytes = [local[i].numel() * local[i].element_size() for i in indices]
            for pack in group_by_size(nbytes, options.bytes_per_pack):
                members = [indices[p] for p in pack]
                packs.append(members)
                buffers.append(torch.cat([local[i].reshape(-1) for i in members]))
        what = f"batch_reduce_to ({len(pairs)} value(s) in {len(buffers)} pack(s))"
        self._collective.all_reduce_flat(buffers, what)
        # 3. MEAN over every replica of every worker; views back into shapes; local copies.
        results: list = [None] * len(pairs)
        for members, buffer in zip(packs, buffers):
            if reduce_op is ReduceOp.MEAN:
                # (within the collective's alone(): over this worker's replicas only)
                buffer = _mean(buffer, self._count * self._collective.answering // self._collective.world_size)
            pieces = buffer.split([local[i].numel() for i in members])
            for i, piece in zip(members, pieces):
                results[i] = _broadcast(piece.view(local[i].shape), pairs[i][1])
        return results

    def local_sums(self, values: list, device: str, options) -> list:
        """Each of ``values`` (``PerReplica``) summed over this worker's replicas, in replica order, onto
        ``device``: the first stage of ``batch_reduce_implementation``, for a reduction that goes on otherwise
        (sharded optimizer states reduce the sums into parts)."""
        pairs = [(v.values if isinstance(v, DistributedValues) else (v,), (device,)) for v in values]
        return self._local.batch_reduce_implementation(ReduceOp.SUM, pairs, options)

    def gather(self, per_replica_value, axis: int, destinations):
        devices = destination_devices(destinations)
        part = super().gather(per_replica_value, axis, devices[0])  # this worker's replicas, in order
        collective = self._collective
        shapes = [tuple(s) for s in collective.all_gather_ints(list(part.shape), "gather (sizes)")]
        axis_ = axis % part.dim()
        others = {s[:axis_] + s[axis_ + 1 :] for s in shapes}
        if len(others) > 1:
            raise ValueError(
                f"Cannot gather along axis {axis}: the workers' values differ outside that axis "
                f"({', '.join(f'worker {w}: {s}' for w, s in enumerate(shapes))})."
            )
        longest = max(s[axis_] for s in shapes)
        padded = part
        if part.shape[axis_] < longest:
            pad_shape = list(part.shape)
            pad_shape[axis_] = longest - part.shape[axis_]
            padded = torch.cat([part, part.new_zeros(pad_shape)], dim=axis_)
        parts = collective.all_gather(padded, "gather")
        gathered = torch.cat([p.narrow(axis_, 0, s[axis_]) for p, s in zip(parts, shapes)], dim=axis_)
        return _broadcast(gathered, devices)
