"""Step values: small per-step counts and flags that ride with the step's gradient reduction.

Some facts of a training step are a sum over every replica of every worker that every worker
needs: how many real elements the step's loss had (to divide by the global count), whether any
worker was told to stop, a value that must reach every worker when the gradients themselves are
only reduce-scattered. A collective of their own would add a round trip to every step; instead
each replica adds its value (``strategy.cluster.add_to_step(name, value)``, in replica or
cross-replica context) and the next SUM ``batch_reduce_to`` (in a training step, the optimizer's
gradient reduction) carries the pending values in the same buffer as the gradients:

* the packed path (``cross_device_ops.py``): one more pair, packed with the gradients of its dtype
  (float32 where the gradients have it, so no pack of its own);
* across workers with gradient buckets (``buckets.py``): spare elements of the last bucket, which
  always starts after backward.

``strategy.cluster.step_total(name)`` is then the total of everything added to ``name`` since the
previous ``step_total(name)`` (an int64 scalar tensor on the reduction's device: reading it back to
Python is the reader's choice, and on an accelerator a synchronisation). Totals add up over every
reduction that carried a part of them, so a value added at each step of an accumulation window and
read when the window is applied is the window's total, whichever reductions (a read of the metrics,
say) carried the earlier steps' parts. What is still pending when it is read is reduced then, on
its own (a collective across workers: every worker reads).

Exactness: integer values (a count, a flag as 0/1, an integer tensor) must be non-negative; each is
split into three base-4096 limbs so that float32 sums them exactly: up to 2**36 per replica and
4096 replicas. A floating value (a Python float, a floating tensor of one element: a sum of class
weights) rides as one element of the carrier and sums as that dtype sums (in replica order, so
alike on every run), its total a float64 tensor. One name keeps one kind. At most ``MAX_VALUES``
names per step. Every worker must add the same names at the same steps, each name of the same kind
on every worker (``0`` or ``0.0`` where it has nothing): the names decide the layout of what the
reduction carries, and the kind how its limbs are read. Where the carrier
is not float32/float64 (a model whose gradients are all bfloat16), the values take a float32
reduction of their own.

Example::

    >>> import torch, replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> def step():
    ...     ctx = ds.get_replica_context()
    ...     strategy.cluster.add_to_step("rows", 3 + ctx.replica_id_in_sync_group)
    ...     return torch.ones(2)
    >>> with strategy.scope():
    ...     grads = strategy.run(step)
    ...     _ = strategy.extended.batch_reduce_to("SUM", [(grads, "cpu:0")])
    >>> int(strategy.cluster.step_total("rows"))
    7
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import context
from .values import DistributedValues

__all__ = ["MAX_VALUES", "StepValues", "carrier", "wide_float"]

BASE = 4096  # one limb: 4096 replicas' limbs sum below 2**24, exact in float32
LIMBS = 3  # values below 2**36
MAX_VALUES = 4
SLOTS = MAX_VALUES * LIMBS  # spare elements a gradient bucket keeps for them
CARRIERS = (torch.float32, torch.float64)


def carrier(pairs, default_destinations) -> tuple:
    """``(dtype, destinations)`` for the step values to ride with ``pairs``: those of the first pair of
    floating values where that dtype sums them exactly (float32, float64), so that they join its pack;
    else float32 to ``default_destinations`` (a pack of their own)."""
    for value, destinations in pairs:
        for component in value.values if isinstance(value, DistributedValues) else (value,):
            dtype = getattr(component, "dtype", None)
            if dtype is not None and dtype.is_floating_point:
                if dtype in CARRIERS:
                    return dtype, destinations
                break
    return torch.float32, default_destinations


class StepPayload:
    """The pending values of one step, encoded per local replica: ``names`` (with ``floating``: which
    of them are floating values) and, for each replica, a float vector of ``len(names) * LIMBS``
    limbs on that replica's device."""

    def __init__(self, names: list, per_replica: list, floating: frozenset = frozenset()):
        self.names = names
        self.per_replica = per_replica
        self.floating = floating

    def as_dtype(self, dtype) -> list:
        return [limbs.to(dtype) for limbs in self.per_replica]


class StepValues:
    """A strategy's pending and reduced step values (one per ``StrategyExtended``).

    Args:
      devices: this worker's replica devices (``torch.device``s), in replica order.
      first_replica_id: the global id of this worker's first replica.
      reduce_alone: ``reduce_alone(payload) -> reduced limbs``: the values' own reduction, for a
        total asked for before a gradient reduction carried it; None where there is one replica in all
        (the default strategy): a total is then the value itself, taken with no reduction.
    """

    def __init__(self, devices, first_replica_id: int, reduce_alone):
        self._devices = list(devices)
        self._first = first_replica_id
        self._reduce_alone = reduce_alone
        self._lock = threading.Lock()
        self._pending: dict = {}  # name -> [per local replica: int or integer tensor or None]
        self._totals: dict = {}  # name -> what the reductions carried since the last read
        self._floating: set = set()  # the names whose values are floating
        self._unread: set = set()  # the names whose totals hold what no read has taken yet

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def waiting(self, name: str) -> bool:
        """Whether a part of ``name`` waits for a reduction to carry it (``total`` would reduce it alone)."""
        with self._lock:
            return name in self._pending

    def add(self, name: str, value) -> None:
        if not isinstance(name, str):
            raise TypeError(f"A step value's name must be a str, got {type(name).__name__}.")
        value, floating = _checked(name, value)
        replica = self._local_replica()
        with self._lock:
            if floating != (name in self._floating) and (name in self._pending or name in self._unread):
                kinds = ("an integer", "a floating") if floating else ("a floating", "an integer")
                raise TypeError(
                    f"Step value {name!r} holds {kinds[0]} value and was given {kinds[1]} one: one name keeps one "
                    "kind (convert the value, or use another name)."
                )
            (self._floating.add if floating else self._floating.discard)(name)
            if name not in self._pending and len(self._pending) == MAX_VALUES:
                raise ValueError(
                    f"At most {MAX_VALUES} step values ride with one step's reduction; {sorted(self._pending)} are "
                    f"pending and {name!r} would be one more. Combine them, or reduce with cluster.sum()."
                )
            slots = self._pending.setdefault(name, [None] * len(self._devices))
            slots[replica] = value if slots[replica] is None else slots[replica] + value

    def _local_replica(self) -> int:
        ctx = context.get_replica_context()
        if ctx is None or context.in_cross_replica_context():
            return 0  # the worker's own value: counted once
        local = ctx.replica_id_in_sync_group - self._first
        return local if 0 <= local < len(self._devices) else 0

    def take(self) -> StepPayload | None:
        """The pending values, encoded (and no longer pending); None when there are none."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return None
        names = sorted(pending)
        per_replica = []
        for replica, device in enumerate(self._devices):
            floating = self._floating
            limbs = [_limbs(pending[name][replica], device, name in floating) for name in names]
            per_replica.append(limbs[0] if len(limbs) == 1 else torch.cat(limbs))
        return StepPayload(names, per_replica, frozenset(n for n in names if n in self._floating))

    def finish(self, payload: StepPayload, reduced: torch.Tensor) -> None:
        """Adds the totals of ``payload``, from its reduced limbs, to what earlier reductions carried."""
        reduced = reduced.detach().reshape(len(payload.names), LIMBS)
        totals = None
        if len(payload.floating) < len(payload.names):  # integer values: their limbs put together
            limbs = reduced.round().to(torch.int64)
            totals = (limbs * _scale(limbs.device)).sum(dim=1)
        floats = reduced[:, 0].to(wide_float(reduced.device)) if payload.floating else None
        with self._lock:
            for index, name in enumerate(payload.names):
                total = floats[index] if name in payload.floating else totals[index]
                known = self._totals.get(name) if name in self._unread else None
                self._totals[name] = total if known is None else known + total.to(known.device)
                self._unread.add(name)

    def total(self, name: str) -> torch.Tensor:
        with self._lock:
            waiting = name in self._pending
        if waiting and self._reduce_alone is None:  # one replica in all: the pending values are the totals
            self._finish_alone()
        elif waiting:  # asked before a reduction carried all of it: the rest is reduced now, on its own
            payload = self.take()
            self.finish(payload, self._reduce_alone(payload))
        with self._lock:
            if name not in self._totals:
                known = sorted(self._totals)
                raise KeyError(
                    f"No step value {name!r} has been added (cluster.add_to_step) this run; the totals known "
                    f"are {known}."
                )
            if name not in self._unread:  # read already: nothing added since
                return torch.zeros_like(self._totals[name])
            self._unread.discard(name)  # the next read counts from here
            return self._totals[name]

    def _finish_alone(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            for name, (value,) in pending.items():
                dtype = wide_float(self._devices[0]) if name in self._floating else torch.int64
                total = torch.as_tensor(0 if value is None else value, dtype=dtype, device=self._devices[0])
                known = self._totals.get(name) if name in self._unread else None
                self._totals[name] = total if known is None else known + total.to(known.device)
                self._unread.add(name)

    def discard(self, name: str) -> None:
        """Forgets what was added to ``name`` and not read (a step that never finished), on this worker."""
        with self._lock:
            self._pending.pop(name, None)
            self._unread.discard(name)


_SCALES: dict = {}
_DIGITS: dict = {}


def _digits_of(device) -> tuple:
    """``(place values, moduli)`` that cut an int64 into its limbs on ``device`` (made once per device)."""
    made = _DIGITS.get(device)
    if made is None:
        modulus = torch.tensor([BASE, BASE, 2**62], dtype=torch.int64, device=device)
        made = _DIGITS[device] = (_scale(device), modulus)
    return made


def _scale(device) -> torch.Tensor:
    """The limbs' place values on ``device`` (made once per device)."""
    scale = _SCALES.get(device)
    if scale is None:
        scale = _SCALES[device] = torch.tensor([1, BASE, BASE * BASE], dtype=torch.int64, device=device)
    return scale


def _checked(name: str, value) -> tuple:
    """``(value, floating)``: an int, an int64 or float64 scalar tensor, or a float; refused otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(
                f"Step value {name!r} must be a non-negative integer or a float (a Python number or a tensor of one "
                f"element), got a {value.dtype} tensor of shape {list(value.shape)}."
            )
        floating = value.is_floating_point()
        return value.detach().reshape(()).to(wide_float(value.device) if floating else torch.int64), floating
    if isinstance(value, bool):
        return int(value), False
    if isinstance(value, float):
        return value, True
    if not isinstance(value, int) or not 0 <= value < BASE**LIMBS:
        raise ValueError(
            f"Step value {name!r} must be a non-negative integer below 2**36 (a count or a 0/1 flag) or a float, "
            f"got {value!r}."
        )
    return value, False


def wide_float(device) -> torch.dtype:
    """float64 where ``device`` has it, else float32 (Apple's MPS has no float64)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def _limbs(value, device: torch.device, floating: bool = False) -> torch.Tensor:
    """``value`` (an int, an int64 tensor or None: 0) as ``LIMBS`` base-``BASE`` digits (float32: exact); a
    floating value as itself and two zeros (``wide_float``: the carrier's dtype is chosen later)."""
    dtype = wide_float(device) if floating else torch.float32
    if value is None:
        return torch.zeros(LIMBS, dtype=dtype, device=device)
    if floating:
        return F.pad(torch.as_tensor(value, dtype=dtype, device=device).reshape(1), (0, LIMBS - 1))
    if isinstance(value, int):
        digits = [value % BASE, value // BASE % BASE, value // (BASE * BASE)]
        return torch.tensor(digits, dtype=dtype, device=device)
    scale, modulus = _digits_of(device)
    return (value.to(device).reshape(1) // scale % modulus).to(dtype)  # two kernels for the three digits
