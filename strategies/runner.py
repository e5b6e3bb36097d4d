"""The replica runner: persistent replica threads, replica contexts and ``merge_call``.

``call_for_each_replica`` runs ``fn`` once per replica. With one replica nothing changes
thread. Replicas that share one physical device (logical CPUs, several replicas on one GPU)
*take turns* on the caller's thread: each is a persistent greenlet that runs until it reaches a
rendezvous, so a step costs no thread hand-off and torch's intra-op pool is used as by one
replica (``set_replica_execution``). Replicas on distinct devices run side by side: replica 0
on the caller's thread, replicas 1..n-1 on persistent worker threads (one *crew* per concurrent
call, reused from call to call). Either way every replica carries its own torch thread-local
state and replica context, and results are bit-identical.

``merge_call`` is a rendezvous: every replica hands in its arguments and waits; the
last one to arrive runs ``merge_fn`` once, in cross-replica context, with the
arguments regrouped, then releases the others, each with its part of the result.
Nothing here can hang: a replica that raises, or returns while others wait in
``merge_call``, wakes them, and ``run`` raises the replica's exception, or
``RuntimeError("Some replicas made a different number of replica_context().merge_call() calls.")``;
replicas that make different collectives at the same point are named in the error.
A ``CommunicationOptions.timeout_seconds`` bounds every wait, the end of the function
included (with a timeout, replica 0 runs on a crew thread too, so the caller can return
whichever replica is stuck); without one, a rendezvous that stays incomplete for
``set_stall_warning_seconds`` (60 s) is logged once. On Ctrl-C ``run`` raises at once and
interpreter exit waits (bounded) for the released replicas to leave torch.

Replicas may run concurrently (TensorFlow runs them one at a time); every reduction
combines values in replica order, so results do not depend on thread timing.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import logging
import math
import queue
import threading
import time
import weakref

import torch

try:
    import greenlet as _greenlet
except ImportError:  # pragma: no cover - greenlet is a dependency; without it replicas run on threads
    _greenlet = None

from . import context, nest
from .merge_fns import PerReplicaConstant, _batch_all_gather, _batch_all_reduce, _describe, _same_call
from .nest import StructureMismatchError
from .reduce_util import ReduceOp, as_reduce_op
from .thread_state import (
    _autocast_nesting,
    _close_autocast_regions,
    _put_in_force,
    _snapshot,
    capture_torch_state,
    torch_state,
)
from .values import check_component_counts, regroup, select_replica

__all__ = [
    "ReplicaContext",
    "MERGE_CALL_MISMATCH",
    "set_stall_warning_seconds",
    "get_stall_warning_seconds",
    "set_replica_execution",
    "get_replica_execution",
]

MERGE_CALL_MISMATCH = "Some replicas made a different number of replica_context().merge_call() calls."

_logger = logging.getLogger(__name__)
_EXIT_GRACE = 10.0  # at interpreter exit, seconds for busy replica threads to leave torch
_stall_warning_seconds = 60.0


def set_stall_warning_seconds(seconds: float) -> None:
    """How long replicas may wait at a rendezvous before a warning is logged (0: never).

    Applies to calls without ``CommunicationOptions(timeout_seconds=...)`` (with a timeout the
    call fails instead). The warning (logger ``replicafit.strategies.runner``) is logged once per
    stalled rendezvous and says which replicas have arrived, which have not, and at which
    ``merge_call``/``all_reduce``; nothing is aborted. Horovod's stall inspector is the model.

    Example::

        ds.set_stall_warning_seconds(600)   # long steps: warn after 10 minutes
        ds.set_stall_warning_seconds(0)     # never warn
    """
    global _stall_warning_seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (seconds >= 0) or math.isinf(seconds):
        raise ValueError(f"The stall warning threshold must be a number of seconds >= 0 (0: off), got {seconds!r}.")
    _stall_warning_seconds = float(seconds)


_REPLICA_EXECUTIONS = ("auto", "threads")
_replica_execution = "auto"


def set_replica_execution(mode: str) -> None:
    """How the replicas of a multi-replica ``run`` are executed, for calls started afterwards.

    ``"auto"`` (the default): replicas that share one physical device (logical CPUs such as
    ``"cpu:0"``/``"cpu:1"``, or several replicas on one GPU) take turns on the caller's thread,
    switching only where they meet (``merge_call``, ``all_reduce``, ``all_gather``, the end of the
    function); they could not run faster side by side, and a thread hand-off costs more than
    a step's arithmetic at small batches. Replicas on distinct devices run on threads of their
    own, side by side. A call with ``CommunicationOptions(timeout_seconds=...)`` always uses
    threads, so that it can return while a replica is stuck in user code.

    ``"threads"``: every replica on a thread of its own, always (what replica code that waits
    for other replicas by other means than the strategy's collectives, a ``threading.Barrier``
    for instance, needs). Results are bit-identical either way.

    Example::

        ds.set_replica_execution("threads")
        out = strategy.run(fn_that_uses_its_own_barrier)
        ds.set_replica_execution("auto")
    """
    global _replica_execution
    if mode not in _REPLICA_EXECUTIONS:
        raise ValueError(f"The replica execution must be one of {list(_REPLICA_EXECUTIONS)}, got {mode!r}.")
    _replica_execution = mode


def get_replica_execution() -> str:
    """The replica execution mode (``"auto"`` or ``"threads"``); see ``set_replica_execution``."""
    return _replica_execution


def get_stall_warning_seconds() -> float:
    """The stall warning threshold in seconds (0: off); see ``set_stall_warning_seconds``."""
    return _stall_warning_seconds


class _Aborted(BaseException):
    """Stops a replica because another replica failed (never escapes ``run``)."""


def require_replica_context(replica_ctx) -> None:
    current = context.current_mode().replica_context
    if current is replica_ctx:
        return
    if current is None:
        raise RuntimeError(
            "Need to be inside `call_for_each_replica()`: this ReplicaContext's merge_call/all_reduce/"
            "all_gather can only be called from its own replica function (inside strategy.run())."
        )
    if current.strategy is replica_ctx.strategy:
        raise RuntimeError("Mismatching ReplicaContext: this replica context belongs to another replica or run.")
    raise RuntimeError(f"Mismatching tf.distribute.Strategy objects: {current.strategy} is not {replica_ctx.strategy}.")


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Example::

        def step(x):
            ctx = ds.get_replica_context()
            total = ctx.all_reduce("SUM", x.sum())          # same value on every replica
            return total, ctx.replica_id_in_sync_group

        strategy.run(step, args=(per_replica_batch,))
    """

    _is_default = False

    def __init__(self, strategy, replica_id: int, state=None):
        self._strategy = strategy
        self._replica_id = replica_id
        self._state = state

    @property
    def strategy(self):
        """The strategy running this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, ``0 <= id < num_replicas_in_sync`` (a Python int).

        Global across workers (``worker_index * local replicas + local index``) under
        ``MultiWorkerMirroredStrategy``, as in TensorFlow.
        """
        return self._replica_id + self._strategy.extended._replica_id_offset

    @property
    def devices(self) -> tuple:
        """The device(s) of this replica."""
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every replica must call it. Arguments are regrouped across replicas (values
        that differ become ``PerReplica``; the same object on every replica stays
        itself); each replica gets its own part of the result.

        Example::

            def merge_fn(strategy, value):
                return strategy.reduce("SUM", value, axis=None)

            def step():
                ctx = ds.get_replica_context()
                return ctx.merge_call(merge_fn, args=(torch.tensor(1.0),))
        """
        require_replica_context(self)
        return self._merge_call(merge_fn, tuple(args), dict(kwargs or {}))

    def _merge_call(self, merge_fn, args, kwargs):
        if self._state is None:
            strategy = self._strategy
            with context.entered(context.Mode(strategy, None, strategy)):
                return merge_fn(strategy, *args, **kwargs)
        return self._state.merge_call(self._replica_id, merge_fn, args, kwargs)

    def all_reduce(self, reduce_op, value, options=None):
        """Reduces ``value`` (any nest of tensors) across replicas in one batched reduction.

        Every replica gets the result. Gradients flow: the gradient of an all-reduce is
        the same all-reduce of the incoming gradients.
        """
        require_replica_context(self)
        op = as_reduce_op(reduce_op)
        flat = [_as_tensor(v) for v in nest.flatten(value)]
        if self._state is None and self._strategy.num_replicas_in_sync == 1:
            return nest.pack_sequence_as(value, flat)
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            _backward_needs_threads(self._state)
            reduced = _AllReduce.apply(self, op, options, *flat)
        else:
            reduced = self._merge_call(_batch_all_reduce, (op, flat, options), {})
        return nest.pack_sequence_as(value, list(reduced))

    def all_gather(self, value, axis: int, options=None):
        """Concatenates ``value`` (any nest of tensors) of every replica along ``axis``.

        Shapes may differ only along ``axis``. Gradients flow back to each replica's slice.
        """
        require_replica_context(self)
        flat = [_as_tensor(v) for v in nest.flatten(value)]
        if self._state is None and self._strategy.num_replicas_in_sync == 1:
            return nest.pack_sequence_as(value, flat)
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            _backward_needs_threads(self._state)
            gathered = _AllGather.apply(self, axis, options, *flat)
        else:
            gathered = [g for g, _ in self._merge_call(_batch_all_gather, (axis, flat), {})]
        return nest.pack_sequence_as(value, list(gathered))

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r}, replica_id_in_sync_group={self.replica_id_in_sync_group})"


class DefaultReplicaContext(ReplicaContext):
    """The replica context of the default strategy (outside any scope): one replica, inline."""

    _is_default = True


def _as_tensor(value):
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


_TURNS_IN_BACKWARD = (
    "{what} inside a backward pass while the replicas take turns on one thread (they share one device): "
    "torch's autograd engine cannot run one replica's backward pass while another's is suspended. "
    "Call replicafit.strategies.set_replica_execution('threads') before this run to give every replica a "
    "thread of its own."
)


def _backward_needs_threads(state) -> None:
    """A differentiable collective: its backward is a rendezvous inside autograd's engine, which
    replicas taking turns on one thread cannot reach (the engine's per-thread state would be shared
    by two suspended backward passes). Before anything has been merged, the call starts again with
    a thread per replica (and the function keeps threads from then on); later it is an error."""
    if not isinstance(state, _CoopState):
        return
    with state.cond:
        if state.generation == 0 and not state.aborted:
            state.rerun_on_threads = True
            state._abort()
            raise _Aborted()
    raise RuntimeError(_TURNS_IN_BACKWARD.format(what="A differentiable all_reduce/all_gather after a merge_call"))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, replica_ctx, op, options, *tensors):
        ctx.replica_ctx, ctx.op, ctx.options = replica_ctx, op, options
        return tuple(replica_ctx._merge_call(_batch_all_reduce, (op, list(tensors), options), {}))

    @staticmethod
    def backward(ctx, *grads):
        reduced = ctx.replica_ctx._merge_call(_batch_all_reduce, (ctx.op, list(grads), ctx.options), {})
        return (None, None, None, *reduced)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, replica_ctx, axis, options, *tensors):
        ctx.replica_ctx, ctx.axis, ctx.options = replica_ctx, axis, options
        results = replica_ctx._merge_call(_batch_all_gather, (axis, list(tensors), True), {})
        ctx.sizes = [sizes.value for _, sizes in results]
        return tuple(g for g, _ in results)

    @staticmethod
    def backward(ctx, *grads):
        reduced = ctx.replica_ctx._merge_call(_batch_all_reduce, (ReduceOp.SUM, list(grads), ctx.options), {})
        replica_id = ctx.replica_ctx.replica_id_in_sync_group  # sizes are of every replica, all workers
        out = []
        for grad, sizes in zip(reduced, ctx.sizes):
            start = sum(sizes[:replica_id])
            out.append(grad.narrow(ctx.axis, start, sizes[replica_id]))
        return (None, None, None, *out)


# --- one call_for_each_replica -----------------------------------------------------------


class _RunState:
    """Shared state of one multi-replica call: the merge_call rendezvous and the outcome.

    Every wait of the call goes through ``_wait_step``, which knows when the current
    rendezvous began (the first replica to reach a ``merge_call``, or to finish): with a
    timeout, a rendezvous that stays incomplete for ``timeout`` seconds aborts the call with
    a ``TimeoutError`` naming the replicas that did not arrive and the last collective each
    reached; without one, a rendezvous incomplete for ``stall_after`` seconds is logged once.
    A ``merge_fn`` that is running counts as progress (its own collectives have their own
    timeouts).
    """

    def __init__(self, strategy, count: int, timeout: float | None, stall_after: float = 0.0):
        self.strategy = strategy
        self.streams = strategy.extended._replica_streams  # the replicas' random streams (rng.py)
        self.count = count
        self.timeout = timeout
        self.stall_after = stall_after
        self.cond = threading.Condition(threading.Lock())
        self.arrived = 0
        self.merging = False
        self.merging_replica = None
        self.generation = 0
        self.requests: list = [None] * count
        self.results: list = []
        self.finished = 0
        self.done = 0
        self.aborted = False
        self.abort_time = 0.0
        self.abort_error: BaseException | None = None
        self.errors: dict = {}
        self.outputs: list = [None] * count
        self.first_arrival = 0.0  # when the first replica reached the pending merge_call
        self.first_finish = 0.0  # when the first replica returned from the function
        self.reached: list = [None] * count  # per replica: (collective number, description) last reached
        self.stall_reported = None  # the rendezvous already reported as stalled
        self._finished_ids: set = set()

    def _abort(self, error=None) -> None:
        if not self.aborted:
            self.aborted = True
            self.abort_error = error
            self.abort_time = time.monotonic()
        self.cond.notify_all()

    def _check_arrival(self, replica_id, merge_fn, args) -> None:
        """What every arrival at a rendezvous checks first (``cond`` held): raises ``_Aborted``
        (after recording why) when the call cannot go on."""
        if self.done == self.count:
            raise RuntimeError(
                "merge_call (or all_reduce/all_gather, also in a backward pass) was called after "
                "strategy.run() returned: differentiate through a collective inside the replica function, "
                "on every replica."
            )
        if self.aborted:
            raise _Aborted()
        self.reached[replica_id] = (self.generation + 1, _describe(merge_fn, args))
        if self.finished:
            self._abort(RuntimeError(MERGE_CALL_MISMATCH))
            raise _Aborted()

    def merge_call(self, replica_id, merge_fn, args, kwargs):
        with self.cond:
            self._check_arrival(replica_id, merge_fn, args)
            self.requests[replica_id] = (merge_fn, args, kwargs)
            self.arrived += 1
            if self.arrived == 1:
                self.first_arrival = time.monotonic()
                self.cond.notify_all()  # a watcher recomputes its deadline from this arrival
            if self.arrived < self.count:
                return self._wait_for_merge(replica_id)
            requests, self.requests = self.requests, [None] * self.count
            self.merging, self.merging_replica = True, replica_id
        return self._merge(requests, replica_id)

    def _merge(self, requests, replica_id):
        """Runs the merge (this replica arrived last), publishes the results; this replica's part."""
        try:
            results = self._run_merge(requests)
        except BaseException as error:  # noqa: BLE001 - every failure must release the others
            with self.cond:
                self.merging = False
                self._abort(error)
            raise _Aborted() from None
        with self.cond:
            self.results = results
            self.arrived = 0
            self.merging = False
            self.generation += 1
            self._merged(replica_id)
            self.cond.notify_all()
        return results[replica_id]

    def _merged(self, replica_id) -> None:
        """After a merge's results are published (``cond`` held): the runner's own bookkeeping."""

    def _wait_for_merge(self, replica_id):
        """Waits (holding ``cond``) until the merge of this generation is done or the run aborts."""
        generation = self.generation
        while self.generation == generation and not self.aborted:
            self._wait_step()
        if self.generation == generation:
            raise _Aborted()
        return self.results[replica_id]

    def _run_merge(self, requests):
        strategy = self.strategy
        calls = [_same_call(r) for r in requests]
        if any(call != calls[0] for call in calls):
            number = self.generation + 1
            made = ", ".join(f"replica {i} called {_describe(r[0], r[1])}" for i, r in enumerate(requests))
            raise StructureMismatchError(
                f"The replicas made different collective calls at collective #{number} of this run: {made}. "
                "Every replica must make the same sequence of merge_call/all_reduce/all_gather calls (with "
                "the same reduce op or axis)."
            )
        merge_fn = requests[0][0]  # replica 0's merge_fn, as TensorFlow does
        devices = strategy.extended.worker_devices
        args = regroup([r[1] for r in requests], devices=devices) if requests[0][1] else ()
        kwargs = regroup([r[2] for r in requests], devices=devices) if requests[0][2] else {}
        with context.entered(context.Mode(strategy, None, strategy)):
            result = merge_fn(strategy, *args, **kwargs)
        if not isinstance(result, PerReplicaConstant):
            check_component_counts(result, self.count, "The result of merge_fn")
        return [_select(replica_id, result) for replica_id in range(self.count)]

    # --- bounded waits ---------------------------------------------------------------------
    def _pending(self):
        """``(rendezvous key, since)`` of the rendezvous some replica waits at, or None.

        A running merge_fn is progress: nobody waits for a missing replica then.
        """
        if self.merging:
            return None
        if self.arrived:
            return ("merge_call", self.generation), self.first_arrival
        if 0 < self.finished < self.count:
            return ("end", None), self.first_finish
        return None

    def _wait_step(self) -> None:
        """One bounded ``cond.wait`` (the caller holds ``cond``): times out or reports a stall when due."""
        pending = self._pending()
        wake = None
        if pending is not None:
            key, since = pending
            now = time.monotonic()
            if self.timeout is not None:
                if now - since >= self.timeout:
                    self._abort(TimeoutError(self._describe_wait(key, now - since, timed_out=True)))
                    return
                wake = since + self.timeout
            if self.stall_after and self.stall_reported != key:
                if now - since >= self.stall_after:
                    self.stall_reported = key
                    _logger.warning("%s", self._describe_wait(key, now - since, timed_out=False))
                else:
                    wake = min(wake, since + self.stall_after) if wake is not None else since + self.stall_after
            if wake is not None:
                self.cond.wait(max(wake - now, 0.001))
                return
        self.cond.wait()  # woken by every arrival, merge, finish and abort

    def check_stall(self) -> None:
        """Logs the pending rendezvous once if it is stalled (``cond`` held); never waits."""
        pending = self._pending()
        if pending is None or not self.stall_after or self.aborted:
            return
        key, since = pending
        now = time.monotonic()
        if self.stall_reported != key and now - since >= self.stall_after:
            self.stall_reported = key
            _logger.warning("%s", self._describe_wait(key, now - since, timed_out=False))

    def _describe_wait(self, key, waited: float, timed_out: bool) -> str:
        kind, generation = key
        if kind == "merge_call":
            waiting = [i for i, r in enumerate(self.requests) if r is not None]
            missing = [i for i, r in enumerate(self.requests) if r is None]
            number, what = self.reached[waiting[0]]
            at = f"collective #{number} of this run ({what})"
            verb = "did not arrive"
        else:
            waiting = sorted(self._finished_ids)
            missing = [i for i in range(self.count) if i not in self._finished_ids]
            at = "the end of the replica function"
            verb = "did not finish"
        last = "; ".join(
            f"replica {i} last reached collective #{self.reached[i][0]} ({self.reached[i][1]})"
            if self.reached[i]
            else f"replica {i} reached no collective in this run"
            for i in missing
        )
        name = type(self.strategy).__name__
        if timed_out:
            return (
                f"{name}.run() timed out after {self.timeout} s (CommunicationOptions.timeout_seconds): "
                f"replica(s) {waiting} waited at {at} for replica(s) {missing}, which {verb}; {last}."
            )
        return (
            f"{name}.run() may be stalled: replica(s) {waiting} have waited {waited:.3g} s at {at} for "
            f"replica(s) {missing}, which {verb} ({last}). Nothing is aborted; pass "
            f"CommunicationOptions(timeout_seconds=...) to fail instead, or set_stall_warning_seconds(0) to "
            f"silence this warning."
        )

    # --- the end of the call ---------------------------------------------------------------
    def finish(self, replica_id, output) -> None:
        with self.cond:
            self.outputs[replica_id] = output
            self._finished_ids.add(replica_id)
            self.finished += 1
            if self.finished == 1:
                self.first_finish = time.monotonic()
            self.done += 1
            if self.arrived:
                self._abort(RuntimeError(MERGE_CALL_MISMATCH))
            self.cond.notify_all()

    def fail(self, replica_id, error) -> None:
        with self.cond:
            if not isinstance(error, _Aborted):
                self.errors[replica_id] = error
            self.done += 1
            self._abort()
            self.cond.notify_all()

    def wait_all(self) -> bool:
        """Waits for every replica. After an abort, released replicas unwind at their next
        rendezvous or return; with a timeout set they get ``timeout`` more seconds, except after
        a timeout, whose missing replicas are stuck by diagnosis (``run`` raises at once).

        Returns False when some replica may still be running user code.
        """
        with self.cond:
            while self.done < self.count:
                if not self.aborted:
                    self._wait_step()
                elif self.timeout is None:
                    self.cond.wait()
                else:
                    remaining = self.abort_time + self.timeout - time.monotonic()
                    if remaining <= 0 or isinstance(self.abort_error, TimeoutError):
                        return False
                    self.cond.wait(remaining)
        return True

    def outcome(self):
        if self.errors:
            raise self.errors[min(self.errors)]
        if self.abort_error is not None:
            raise self.abort_error
        return self.outputs


class _CoopState(_RunState):
    """The state of a cooperative call: every replica is a greenlet on one thread.

    A replica runs until it reaches a rendezvous (or its end), then hands control back to the
    scheduler (the caller's greenlet), which runs the next ready replica; the last replica to
    arrive runs ``merge_fn`` and carries on, the others are resumed in replica order. Nothing
    can wait forever: a replica that returns while others wait, or raises, aborts the call as
    on threads, and the suspended replicas are resumed to unwind.

    Waiting is measured in each replica's own running time (what the replicas would have
    waited had they run side by side): a rendezvous is pending for the time the running replica
    has run since it was resumed, less the shortest time an already-arrived replica ran.
    """

    def __init__(self, strategy, count: int, stall_after: float):
        super().__init__(strategy, count, None, stall_after)
        self.hub = None  # the scheduler's greenlet
        self.ready: collections.deque = collections.deque(range(count))
        self.blocked: list = []  # replicas suspended in merge_call, in arrival order
        self.resumed_at = 0.0  # when the running replica was (re)started
        self.running = None  # the replica running now (None: the scheduler runs)
        self.shortest = math.inf  # the shortest segment of the replicas at the pending rendezvous
        self.rerun_on_threads = False  # a differentiable collective came first: start again on threads

    def _arrive(self, now: float) -> None:
        """Bookkeeping of an arrival at a rendezvous or the end (``cond`` held)."""
        segment = now - self.resumed_at
        if segment < self.shortest:
            self.shortest = segment
        self.running = None

    def resume_clock(self, replica_id: int) -> None:
        """Called by the scheduler as it (re)starts a replica."""
        with self.cond:
            self.resumed_at = time.monotonic()
            self.running = replica_id

    def _pending(self):
        """The rendezvous others wait at, and since when in their own running time: the running
        replica's time since it was resumed, less the shortest time an arrived replica ran. With
        no arrival yet, the replicas still to run wait for their turn from the moment it began."""
        if self.merging or self.running is None or self.aborted:
            return None
        if self.arrived:
            return ("merge_call", self.generation), self.resumed_at + self.shortest
        if self.finished:
            return ("end", None), self.resumed_at + self.shortest
        if self.count - self.done > 1:
            return ("turn", self.generation, self.running), self.resumed_at
        return None

    def _describe_wait(self, key, waited: float, timed_out: bool) -> str:
        if key[0] != "turn":
            return super()._describe_wait(key, waited, timed_out)
        running = key[2]
        waiting = [i for i in range(self.count) if i != running and i not in self._finished_ids]
        reached = self.reached[running]
        last = f"it last reached collective #{reached[0]} ({reached[1]})" if reached else "it reached no collective"
        return (
            f"{type(self.strategy).__name__}.run() may be stalled: replica {running} has run {waited:.3g} s "
            f"without reaching a rendezvous ({last} in this run); replica(s) {waiting} wait for their turn "
            "(replicas that share one device take turns on one thread). Nothing is aborted; pass "
            "CommunicationOptions(timeout_seconds=...) to fail instead, or set_stall_warning_seconds(0) to "
            "silence this warning."
        )

    def merge_call(self, replica_id, merge_fn, args, kwargs):
        with self.cond:
            self._check_arrival(replica_id, merge_fn, args)
            if _graph_task_id() != -1:  # inside autograd's engine: this replica cannot be suspended
                self._abort(RuntimeError(_TURNS_IN_BACKWARD.format(what=_describe(merge_fn, args))))
                raise _Aborted()
            self.requests[replica_id] = (merge_fn, args, kwargs)
            self.arrived += 1
            self._arrive(time.monotonic())
            if self.arrived < self.count:
                self.blocked.append(replica_id)
                generation = self.generation
                last = False
            else:
                requests, self.requests = self.requests, [None] * self.count
                self.merging, self.merging_replica = True, replica_id
                last = True
        if not last:
            self.hub.switch()  # the scheduler resumes this replica after the merge, or to unwind
            if self.generation == generation:
                raise _Aborted()
            return self.results[replica_id]
        return self._merge(requests, replica_id)

    def _merged(self, replica_id) -> None:
        self.shortest = math.inf
        self.ready.extend(sorted(self.blocked))
        self.blocked.clear()
        self.resumed_at = time.monotonic()
        self.running = replica_id

    def finish(self, replica_id, output) -> None:
        with self.cond:
            self._arrive(time.monotonic())
        super().finish(replica_id, output)


def _select(replica_id, result):
    if isinstance(result, PerReplicaConstant):
        return result
    if nest.is_nested(result):
        return nest.map_structure(lambda v: _select(replica_id, v), result)
    return select_replica(replica_id, result)


# --- switching replicas on one thread ---------------------------------------------------


_DONE = object()  # what a replica greenlet hands back when its task has ended
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _switch_to(replica, state, task=None) -> None:
    """Runs one replica greenlet until it yields (starting ``task``, or resuming it where it
    waits); its torch state and context stack travel with it. Re-raises a Ctrl-C from it."""
    current = _snapshot()
    wanted = replica.torch_state
    guard = _put_in_force(wanted, current) if wanted != current else None
    hub_stack = context.swap_stack(replica.stack)
    state.resume_clock(replica.replica_id)
    streams = state.streams
    if streams is not None:
        streams.put(replica.replica_id)
    try:
        out = replica.switch(task) if task is not None else replica.switch()
    finally:
        if streams is not None:
            streams.take(replica.replica_id)
        context.swap_stack(hub_stack)
        replica.torch_state = _snapshot()
        if guard is not None:
            guard.__exit__(None, None, None)
        if replica.torch_state != current:
            _put_in_force(current, _snapshot())
    if out is _DONE:
        replica.task = None
    elif isinstance(out, BaseException):  # Ctrl-C in this replica; it is back at the top of its loop
        replica.task = None
        raise out


class _Replica(_greenlet.greenlet if _greenlet is not None else object):
    """A persistent replica greenlet: runs one task per call, then hands control back.

    Between calls it waits at the top of its loop; during a call it carries the replica's own
    torch state and context stack (``_switch_to`` swaps them in and out).
    """

    def __init__(self, replica_id: int, hub):
        super().__init__(_replica_loop, hub)
        self.replica_id = replica_id
        self.task = None
        self.torch_state = None
        self.stack = None


def _replica_loop():
    """A replica greenlet's life. It keeps no reference to itself (``run`` is this plain function,
    no local names the greenlet), so a crew no longer referenced is freed at once; and the first
    task arrives by a switch too: passed to the first switch it would stay referenced from this
    greenlet's C stack for its whole life (and its call with it)."""
    task = _greenlet.getcurrent().parent.switch()
    while True:
        try:
            task()
            out = _DONE
        except _greenlet.GreenletExit:
            raise  # the crew is being freed: this greenlet ends
        except BaseException as error:  # noqa: BLE001 - only Ctrl-C escapes a task; the hub re-raises it
            out = error
        task = None
        task = _greenlet.getcurrent().parent.switch(out)
        out = None


def _new_crew(count: int) -> list:
    """``count`` replica greenlets, started and waiting at the top of their loop."""
    crew = [_Replica(r, _greenlet.getcurrent()) for r in range(count)]
    for replica in crew:
        replica.switch()
    return crew


def _run_cooperatively(state, tasks, crew) -> bool:
    """The scheduler: runs the replica greenlets of ``crew`` on this thread until all are done.

    On Ctrl-C (raised in whichever replica runs) the call is aborted, every suspended replica is
    resumed to unwind at its rendezvous, replicas not yet started never start, and the interrupt
    propagates. Returns whether every replica is back at the top of its loop (the crew reusable).
    """
    hub = _greenlet.getcurrent()
    state.hub = hub
    initial = _snapshot()
    host_random = state.streams.host_state() if state.streams is not None else None
    stack = context.current_stack()
    for replica, task in zip(crew, tasks):
        replica.parent = hub
        replica.gr_context = contextvars.copy_context()
        replica.torch_state, replica.stack, replica.task = initial, list(stack), task
    _monitor.watch(state)
    try:
        while state.ready:
            replica = crew[state.ready.popleft()]
            task, replica.task = replica.task, True  # True: started
            _switch_to(replica, state, task if task is not True else None)
            if state.aborted and state.blocked:
                with state.cond:
                    state.ready.extend(sorted(state.blocked))
                    state.blocked.clear()
    except BaseException:
        with state.cond:
            state._abort()
            pending = sorted(set(state.blocked) | {r for r in state.ready if crew[r].task is True})
            state.blocked.clear()
            state.ready.clear()
        for replica_id in pending:  # started and suspended: unwind now, on this thread
            with contextlib.suppress(BaseException):
                _switch_to(crew[replica_id], state)
        raise
    finally:
        _monitor.unwatch(state)
        if host_random is not None:
            state.streams.restore(host_random)
        for replica in crew:
            replica.stack = replica.torch_state = None
    return all(replica.task is None and not replica.dead for replica in crew)


class _StallMonitor:
    """One daemon thread that logs stalled cooperative calls (they have no thread of their own
    waiting). Sleeps between checks; touches no torch state."""

    def __init__(self):
        self._states: set = set()
        self._thread = None
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a new call: check at its threshold's pace from now, not after a sleep

    def watch(self, state) -> None:
        if not state.stall_after:
            return
        with self._lock:  # (the thread leaves under this lock once nothing is watched)
            self._states.add(state)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="replicafit-stall-monitor", daemon=True)
                self._thread.start()
        self._wake.set()

    def unwatch(self, state) -> None:
        self._states.discard(state)

    def _loop(self) -> None:
        idle_since = None
        while True:
            # A sleep started under another (longer) threshold would let a short stall pass unseen.
            self._wake.wait(min(1.0, max(0.01, _stall_warning_seconds / 4 or 1.0)))
            self._wake.clear()
            states = list(self._states)
            for state in states:
                with state.cond:
                    state.check_stall()
            watched, states, state = bool(states), None, None  # keep no call (nor its strategy) alive
            if watched:
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 2.0:  # nothing to watch for a while: leave
                with self._lock:
                    if not self._states:
                        self._thread = None
                        return


_monitor = _StallMonitor()


# --- persistent replica threads --------------------------------------------------------


class _Worker(threading.Thread):
    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.running = None  # the _RunState of the task being run, for the wait at exit
        _WORKERS.add(self)

    def run(self) -> None:
        get = self.tasks.get
        while True:
            task = get()
            if task is None:
                return
            self.running = task.state
            try:
                task()
            except BaseException:  # noqa: BLE001 - a task reports its own outcome; the thread must live on
                pass
            self.running = None
            task = None  # an idle thread keeps no reference to the strategy or the user's fn


_WORKERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _wait_for_released_replicas() -> None:
    """At interpreter exit, replica threads still inside a call get a bounded time to leave torch.

    ``run`` raises at once on Ctrl-C (or a failure) while the other replicas are released: each
    stops at its next rendezvous or at the end of its function. A daemon thread still inside a
    torch op when the interpreter finalizes can abort the whole process ("terminate called
    without an active exception"), so exit waits for them, at most ``_EXIT_GRACE`` seconds in
    all; a second Ctrl-C exits at once. Threads given up by a timeout are stuck by diagnosis
    and are not waited for.
    """
    deadline = time.monotonic() + _EXIT_GRACE
    try:
        for worker in list(_WORKERS):
            state = worker.running
            if state is None or isinstance(state.abort_error, TimeoutError):
                continue
            with state.cond:
                state._abort()
            worker.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass


class ReplicaRunner:
    """Runs a function once per replica on persistent threads (see the module docstring)."""

    def __init__(self, strategy_name: str, devices: tuple, torch_devices: tuple):
        self._name = strategy_name
        self._devices = devices
        self._torch_devices = torch_devices
        # Replicas that share one physical device (logical CPUs, or several replicas on one GPU)
        # cannot run faster side by side: they take turns on one thread instead.
        self.shares_device = _greenlet is not None and len(set(torch_devices)) == 1
        self._greenlets = threading.local()  # per thread: idle crews of replica greenlets
        self._needs_threads: set = set()  # replica functions with differentiable collectives
        self._lock = threading.Lock()
        self._idle: list = []
        self._crews: list = []
        self._closed = False

    def _acquire(self) -> list:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"The replica threads of {self._name} were shut down.")
            if self._idle:
                return self._idle.pop()
            index = len(self._crews)
            # One thread per replica; replica 0's runs only calls with a timeout (see run()).
            crew = [_Worker(f"{self._name}-crew{index}-replica{r}") for r in range(len(self._devices))]
            for worker in crew:
                worker.start()
            self._crews.append(crew)
            return crew

    def _release(self, crew) -> None:
        with self._lock:
            if self._closed:
                for worker in crew:
                    worker.tasks.put(None)
            else:
                self._idle.append(crew)

    def _discard(self, crew) -> None:
        with self._lock:
            if crew in self._crews:
                self._crews.remove(crew)
        for worker in crew:
            worker.tasks.put(None)

    def shutdown(self) -> None:
        """Stops every idle thread; threads still running stop when their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for crew in idle:
            for worker in crew:
                worker.tasks.put(None)

    def run(self, strategy, fn, args, kwargs, timeout):
        """Calls ``fn`` once per replica; returns the list of the replicas' outputs.

        Without a timeout the caller's thread is replica 0 (one hand-off less). With one, every
        replica runs on a crew thread and the caller only watches, so ``run`` returns within about
        ``timeout`` whichever replica is stuck, at a collective or not.
        """
        nesting = _autocast_nesting()
        try:
            return self._run(strategy, fn, args, kwargs, timeout)
        finally:
            _close_autocast_regions(nesting)  # regions a replica entered on this thread and never left

    def _run(self, strategy, fn, args, kwargs, timeout):
        count = len(self._devices)
        if timeout is None and self.shares_device and _replica_execution == "auto":
            key = _function_key(fn)
            if key not in self._needs_threads:
                outputs = self._run_cooperatively(strategy, fn, args, kwargs)
                if outputs is not None:
                    return outputs
                self._needs_threads.add(key)
        state = _RunState(strategy, count, timeout, _stall_warning_seconds if timeout is None else 0.0)
        torch_state_now = capture_torch_state()
        on_caller = 0 if timeout is None else None
        crew = self._acquire()
        try:
            for replica_id in range(count):
                if replica_id != on_caller:
                    crew[replica_id].tasks.put(self._task(state, replica_id, fn, args, kwargs, torch_state_now, False))
            if on_caller is not None:
                self._task(state, on_caller, fn, args, kwargs, torch_state_now, True)()
            finished = state.wait_all()
        except BaseException:
            # Interrupted (KeyboardInterrupt): release every replica and retire this crew; its
            # threads end when their current call does (and interpreter exit waits for them).
            with state.cond:
                state._abort()
            self._discard(crew)
            raise
        if finished:
            self._release(crew)
        else:
            # A replica is stuck in user code past the timeout: retire its crew (its threads
            # end when that code returns) and report the failure now.
            self._discard(crew)
        return state.outcome()

    def _run_cooperatively(self, strategy, fn, args, kwargs):
        """Every replica on the caller's thread, one at a time, switching only at rendezvous."""
        if self._closed:
            raise RuntimeError(f"The replica threads of {self._name} were shut down.")
        count = len(self._devices)
        state = _CoopState(strategy, count, _stall_warning_seconds)
        tasks = [self._task(state, r, fn, args, kwargs, None, True) for r in range(count)]
        idle = self._greenlets.__dict__.setdefault("idle", [])  # this thread's crews of greenlets
        crew = idle.pop() if idle else _new_crew(count)
        reusable = False
        streams_before = state.streams.snapshot() if state.streams is not None else None
        try:
            reusable = _run_cooperatively(state, tasks, crew)
        finally:
            if reusable:
                idle.append(crew)
        if state.rerun_on_threads and not state.errors:
            if streams_before is not None:
                state.streams.rewind(streams_before)  # the rerun draws what this attempt drew
            return None  # nothing merged yet: run() starts the call again with a thread per replica
        return state.outcome()

    def _task(self, state, replica_id, fn, args, kwargs, torch_state_now, on_caller_thread):
        replica_args = select_replica(replica_id, args) if args else args
        replica_kwargs = select_replica(replica_id, kwargs) if kwargs else kwargs
        device = self._torch_devices[replica_id]
        return _ReplicaTask(
            state, replica_id, fn, replica_args, replica_kwargs, torch_state_now, device, on_caller_thread
        )


def _function_key(fn):
    """What identifies a replica function from call to call (a bound method or a closure is a new
    object every time; its code is not)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code if code is not None else type(fn)


class _ReplicaTask:
    __slots__ = ("state", "replica_id", "fn", "args", "kwargs", "torch_state", "device", "on_caller_thread")

    def __init__(self, state, replica_id, fn, args, kwargs, torch_state_, device, on_caller_thread):
        self.state = state
        self.replica_id = replica_id
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.torch_state = torch_state_
        self.device = device
        self.on_caller_thread = on_caller_thread

    def __call__(self) -> None:
        state = self.state
        depth = context.stack_depth()
        context.push(context.Mode(state.strategy, ReplicaContext(state.strategy, self.replica_id, state)))
        try:
            if state.aborted:
                raise _Aborted()
            # The caller's thread is already in the wanted state; a worker checks its own.
            current = self.torch_state if self.on_caller_thread else capture_torch_state()
            nesting = None if self.on_caller_thread else _autocast_nesting()  # (the caller's: run() restores it)
            streams = None if isinstance(state, _CoopState) else state.streams
            try:
                if streams is not None:  # a replica on a thread of its own (taking turns: _switch_to swaps)
                    with streams.on_thread(self.replica_id), torch_state(self.torch_state, self.device, current):
                        output = self.fn(*self.args, **self.kwargs)
                elif self.torch_state == current and self.device.type != "cuda":
                    output = self.fn(*self.args, **self.kwargs)
                else:
                    with torch_state(self.torch_state, self.device, current):
                        output = self.fn(*self.args, **self.kwargs)
            finally:
                if nesting is not None:
                    _close_autocast_regions(nesting)
        except KeyboardInterrupt as error:
            context.truncate(depth)
            if self.on_caller_thread:
                raise  # Ctrl-C: run() aborts every replica and raises at once
            state.fail(self.replica_id, error)
        except BaseException as error:  # noqa: BLE001 - recorded and re-raised by run()
            context.truncate(depth)
            state.fail(self.replica_id, error)
            if _greenlet is not None and isinstance(error, _greenlet.GreenletExit):
                raise  # a replica greenlet being freed mid-call ends (the call is aborted above)
        else:
            context.truncate(depth)
            state.finish(self.replica_id, output)


def inline_call(strategy, fn, args, kwargs, device: torch.device):
    """Runs the single replica of ``strategy`` on the calling thread."""
    mode = context.Mode(strategy, ReplicaContext(strategy, 0, None))
    streams = strategy.extended._replica_streams
    if streams is None:
        return _inline(mode, fn, args, kwargs, device)
    host = streams.host_state()
    streams.put(0)
    try:
        return _inline(mode, fn, args, kwargs, device)
    finally:
        streams.take(0)
        streams.restore(host)


def _inline(mode, fn, args, kwargs, device: torch.device):
    with context.entered(mode):
        if device.type == "cuda":
            with torch.cuda.device(device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
