"""The replica runner: runs a function once per replica, by turns on one thread or on threads.

``call_for_each_replica`` runs ``fn`` once per replica. With one replica nothing changes
thread (``inline_call``). Replicas that share one physical device (logical CPUs, several
replicas on one GPU) *take turns* on the caller's thread as persistent greenlets that switch
only at a rendezvous (``cooperative.py``), so a step costs no thread hand-off and torch's
intra-op pool is used as by one replica (``set_replica_execution``); a function that reaches
a differentiable collective before anything is merged starts again on threads, and keeps them
(every call does while a module with SyncBatchNorm layers trains; a replica on an accelerator then
runs its backward passes on its own thread, not on the device's autograd thread that all share).
Replicas on distinct devices run side by side: replica 0 on the caller's thread, replicas
1..n-1 on persistent worker threads (one *crew* per concurrent call, reused from call to call).
Either way every replica carries its own torch thread-local state (``thread_state.py``) and
replica context (``replica_context.py``), and results are bit-identical.

The replicas of a call meet at its rendezvous (``rendezvous.py``), at every ``merge_call`` and
at the end of the function; nothing can hang, and ``run`` raises a replica's exception. A
``CommunicationOptions.timeout_seconds`` bounds every wait, the end of the function included
(with a timeout, every replica runs on a crew thread, replica 0 too, so the caller can return
whichever replica is stuck). On Ctrl-C ``run`` raises at once and interpreter exit waits
(bounded) for the released replicas to leave torch.

Replicas may run concurrently (TensorFlow runs them one at a time); every reduction
combines values in replica order, so results do not depend on thread timing.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import torch

from . import context
from .cooperative import _CoopState, _greenlet, _new_crew, _run_cooperatively
from .rendezvous import _Aborted, _RunState, get_stall_warning_seconds
from .replica_context import ReplicaContext
from .thread_state import _autocast_nesting, _close_autocast_regions, capture_torch_state, torch_state
from .values import select_replica

__all__ = ["set_replica_execution", "get_replica_execution"]

_EXIT_GRACE = 10.0  # at interpreter exit, seconds for busy replica threads to leave torch
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
    """Runs a function once per replica (see the module docstring).

    Replicas that share one device take turns on the calling thread, as a crew of persistent
    greenlets kept per thread; otherwise (and with a timeout, ``set_replica_execution("threads")``,
    or for a function that needed threads for a differentiable collective) they run on a crew of
    persistent threads, reused from call to call, replica 0 on the caller's thread unless there
    is a timeout.
    """

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
            if key not in self._needs_threads and not _trains_synchronized(strategy):
                outputs = self._run_cooperatively(strategy, fn, args, kwargs)
                if outputs is not None:
                    return outputs
                self._needs_threads.add(key)
        state = _RunState(strategy, count, timeout, get_stall_warning_seconds() if timeout is None else 0.0)
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
        state = _CoopState(strategy, count, get_stall_warning_seconds())
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


def _trains_synchronized(strategy) -> bool:
    """Whether a module of ``strategy`` with SyncBatchNorm layers is in training mode: its layers' backward
    passes are collectives, which replicas taking turns cannot meet, so every call runs on threads then
    (a step of one's own may make a collective before the model's: it could not start again on threads)."""
    return any(module.training for module in list(strategy.extended._synchronized_modules))


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
            # On threads, a replica on an accelerator runs its backward passes on its own thread: torch would
            # run them on the device's one autograd thread, shared by every replica on that device, where a
            # collective in a backward pass (a differentiable all_reduce, a SyncBatchNorm layer) could never
            # meet the other replicas' (torch's setting is per thread).
            own_backward = not isinstance(state, _CoopState) and self.device.type != "cpu"
            try:
                if own_backward:
                    with torch.autograd.set_multithreading_enabled(False):
                        output = self._call_in(streams, current)
                else:
                    output = self._call_in(streams, current)
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

    def _call_in(self, streams, current):
        """The replica function, with this replica's random stream (on a thread of its own) and torch state."""
        if streams is not None:  # a replica on a thread of its own (taking turns: _switch_to swaps)
            with streams.on_thread(self.replica_id), torch_state(self.torch_state, self.device, current):
                return self.fn(*self.args, **self.kwargs)
        if self.torch_state == current and self.device.type != "cuda":
            return self.fn(*self.args, **self.kwargs)
        with torch_state(self.torch_state, self.device, current):
            return self.fn(*self.args, **self.kwargs)


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
