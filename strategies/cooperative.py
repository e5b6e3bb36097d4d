"""Replicas that take turns on one thread: persistent greenlets that switch only at a rendezvous.

Replicas that share one physical device (logical CPUs, several replicas on one GPU) could not
run faster side by side, and a thread hand-off costs more than a step's arithmetic at small
batches. So they take turns on the caller's thread: each is a persistent greenlet that runs
until it reaches a rendezvous (``merge_call``, ``all_reduce``, ``all_gather``, the end of the
function), then hands control back to the scheduler (``_run_cooperatively``), which runs the next
ready replica; torch's intra-op pool is used as by one replica. Every replica carries its own
torch state (``thread_state.py``), context stack and random stream across each switch, and
results are bit-identical to replicas on threads.

``_CoopState`` is the rendezvous (``rendezvous.py``) of such a call. No thread waits while a
replica runs, so one monitor thread logs stalled calls instead. A differentiable collective
cannot be suspended inside autograd's engine: before anything is merged the call starts again
on threads (``_backward_needs_threads``). The runner (``runner.py``) decides when replicas take
turns (``set_replica_execution``) and keeps idle crews of greenlets per thread.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import threading
import time

import torch

try:
    import greenlet as _greenlet
except ImportError:  # pragma: no cover - greenlet is a dependency; without it replicas run on threads
    _greenlet = None

from . import context
from .merge_fns import _describe
from .rendezvous import _Aborted, _RunState, get_stall_warning_seconds
from .thread_state import _put_in_force, _snapshot

_TURNS_IN_BACKWARD = (
    "{what} inside a backward pass while the replicas take turns on one thread (they share one device): "
    "torch's autograd engine cannot run one replica's backward pass while another's is suspended. "
    "Call replicafit.strategies.set_replica_execution('threads') before this run to give every replica a "
    "thread of its own."
)


def _backward_needs_threads(state, what: str = "A differentiable all_reduce/all_gather") -> None:
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
    raise RuntimeError(_TURNS_IN_BACKWARD.format(what=f"{what} after a merge_call"))


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


_DONE = object()  # what a replica greenlet hands back when its task has ended
# torch's private ``_current_graph_task_id`` says whether this thread is inside autograd's engine (a
# backward pass), which no public call tells; where a torch lacks it, never inside.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # private: see the comment above


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


# --- the stall monitor ------------------------------------------------------------------


class _StallMonitor:
    """One daemon thread that logs stalled cooperative calls (they have no thread of their own
    waiting). Sleeps between checks; touches no torch state."""

    def __init__(self):
        self._states: set = set()
        self._thread = None
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a call whose threshold needs a shorter pace than the thread's sleep
        self._pace = None  # the seconds the thread sleeps between checks (None: no thread)

    def watch(self, state) -> None:
        if not state.stall_after:
            return
        with self._lock:  # (the thread leaves under this lock once nothing is watched)
            self._states.add(state)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="replicafit-stall-monitor", daemon=True)
                self._thread.start()
            # Woken only when its sleep is too long for this call's threshold: a wake-up per call (per training
            # step) handed the interpreter to this thread and back every step.
            pace = self._pace
            wake = pace is None or _pace_for(state.stall_after) < pace
        if wake:
            self._wake.set()

    def unwatch(self, state) -> None:
        self._states.discard(state)

    def _loop(self) -> None:
        idle_since = None
        while True:
            # A sleep started under another (longer) threshold would let a short stall pass unseen: watch() wakes it.
            # (The threshold is read and the pace kept under the lock watch() compares under: no wake-up is lost.)
            with self._lock:
                pace = self._pace = _pace_for(get_stall_warning_seconds())
            self._wake.wait(pace)
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
                        self._thread, self._pace = None, None
                        return


def _pace_for(threshold: float) -> float:
    """The seconds between two checks for stalls of ``threshold`` seconds (0: off)."""
    return min(1.0, max(0.01, threshold / 4 or 1.0))


_monitor = _StallMonitor()
