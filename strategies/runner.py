"""The replica runner: persistent replica threads, replica contexts and ``merge_call``.

``call_for_each_replica`` runs ``fn`` once per replica. Replica 0 runs on the
caller's thread; replicas 1..n-1 run on persistent worker threads (one *crew* per
concurrent call, reused from call to call). With one replica nothing changes thread.

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
import contextlib
import logging
import math
import queue
import threading
import time
import weakref

import torch

from . import context, nest
from .nest import StructureMismatchError
from .reduce_util import ReduceOp, as_reduce_op
from .values import Mirrored, PerReplica, check_component_counts, regroup, select_replica

__all__ = ["ReplicaContext", "MERGE_CALL_MISMATCH", "set_stall_warning_seconds", "get_stall_warning_seconds"]

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


def _per_replica(strategy, value):
    if isinstance(value, PerReplica):
        return value
    return PerReplica([value] * strategy.extended._num_local_replicas)


def _owned(result):
    """A Mirrored whose replicas get tensors of their own (reductions share one host tensor).

    Runs inside the merge_fn, before the replicas resume, so no replica can be writing
    to the tensor being copied.
    """
    if not isinstance(result, Mirrored):
        return result
    seen: set = set()
    values = []
    for value in result.values:
        values.append(value.clone() if id(value) in seen else value)
        seen.add(id(value))
    return Mirrored(values, result.devices)


def _batch_all_reduce(strategy, op, flat_values, options):
    values = [_per_replica(strategy, v) for v in flat_values]
    return [_owned(r) for r in strategy.extended.batch_reduce_to(op, [(v, v) for v in values], options)]


def _batch_all_gather(strategy, axis, flat_values, with_sizes=False):
    """The gathered values; with ``with_sizes`` (for the gradient) also every replica's size along
    ``axis``, of every worker (across workers that is one more collective, so only when asked)."""
    out = []
    for value in flat_values:
        value = _per_replica(strategy, value)
        sizes = None
        if with_sizes:
            sizes = tuple(t.shape[axis] if t.dim() > axis else 0 for t in value.values)
            sizes = strategy.extended._all_workers_sizes(sizes)
        out.append((_owned(strategy.extended._gather_to(value, axis, value)), PerReplicaConstant(sizes)))
    return out


class PerReplicaConstant:
    """A merge result passed unchanged to every replica."""

    def __init__(self, value):
        self.value = value


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

    def merge_call(self, replica_id, merge_fn, args, kwargs):
        with self.cond:
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
            self.requests[replica_id] = (merge_fn, args, kwargs)
            self.arrived += 1
            if self.arrived == 1:
                self.first_arrival = time.monotonic()
                self.cond.notify_all()  # a watcher recomputes its deadline from this arrival
            if self.arrived < self.count:
                return self._wait_for_merge(replica_id)
            requests, self.requests = self.requests, [None] * self.count
            self.merging, self.merging_replica = True, replica_id
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
            self.cond.notify_all()
        return results[replica_id]

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


def _describe(merge_fn, args) -> str:
    """What a collective is, for messages: ``all_reduce(SUM, 2 tensors)``, ``merge_call(apply)``."""
    if merge_fn is _batch_all_reduce:
        return f"all_reduce({args[0].value}, {_count(len(args[1]))})"
    if merge_fn is _batch_all_gather:
        return f"all_gather(axis={args[0]}, {_count(len(args[1]))})"
    return f"merge_call({getattr(merge_fn, '__qualname__', type(merge_fn).__name__)})"


def _count(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def _same_call(request) -> tuple:
    """What must agree across replicas at one collective: its kind, and the reduce op or axis.

    Different merge_fns are not compared: as in TensorFlow, replica 0's runs.
    """
    merge_fn, args, _ = request
    if merge_fn is _batch_all_reduce:
        return ("all_reduce", args[0])
    if merge_fn is _batch_all_gather:
        return ("all_gather", args[0])
    return ("merge_call",)


def _select(replica_id, result):
    if isinstance(result, PerReplicaConstant):
        return result
    if nest.is_nested(result):
        return nest.map_structure(lambda v: _select(replica_id, v), result)
    return select_replica(replica_id, result)


# --- torch thread-local state ---------------------------------------------------------


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _autocast_dtype(device_type: str):
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def _default_device() -> torch.device:
    getter = getattr(torch, "get_default_device", None)
    return getter() if getter is not None else torch.device("cpu")


def capture_torch_state() -> tuple:
    """Grad mode, inference mode, autocast state and default device of the calling thread."""
    autocast = tuple((d, _autocast_dtype(d)) for d in ("cpu", "cuda") if _autocast_enabled(d))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, _default_device())


@contextlib.contextmanager
def torch_state(state: tuple, device: torch.device, current: tuple):
    """Puts ``state`` and the replica's CUDA device in force on this thread for the block.

    ``state`` is what ``capture_torch_state`` returned on the caller's thread.

    Every part that differs from ``current`` (the thread's actual state) is set, so
    state a previous task left behind on a persistent thread never leaks into this one.
    """
    with contextlib.ExitStack() as stack:
        if state != current:
            grad, inference, autocast, default_device = state
            if default_device != current[3]:
                # A GPU default means the replica's own GPU, as TensorFlow places ops on the replica device.
                stack.enter_context(torch.device(device if default_device.type == device.type else default_device))
            if inference != current[1]:
                stack.enter_context(torch.inference_mode(inference))
            stack.enter_context(torch.set_grad_enabled(grad))
            wanted, present = dict(autocast), dict(current[2])
            for device_type in ("cpu", "cuda"):
                if wanted.get(device_type) != present.get(device_type):
                    if device_type in wanted:
                        stack.enter_context(torch.autocast(device_type, dtype=wanted[device_type]))
                    else:
                        stack.enter_context(torch.autocast(device_type, enabled=False))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


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
        count = len(self._devices)
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

    def _task(self, state, replica_id, fn, args, kwargs, torch_state_now, on_caller_thread):
        replica_args = select_replica(replica_id, args) if args else args
        replica_kwargs = select_replica(replica_id, kwargs) if kwargs else kwargs
        device = self._torch_devices[replica_id]
        return _ReplicaTask(
            state, replica_id, fn, replica_args, replica_kwargs, torch_state_now, device, on_caller_thread
        )


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
            if self.torch_state == current and self.device.type != "cuda":
                output = self.fn(*self.args, **self.kwargs)
            else:
                with torch_state(self.torch_state, self.device, current):
                    output = self.fn(*self.args, **self.kwargs)
        except KeyboardInterrupt as error:
            context.truncate(depth)
            if self.on_caller_thread:
                raise  # Ctrl-C: run() aborts every replica and raises at once
            state.fail(self.replica_id, error)
        except BaseException as error:  # noqa: BLE001 - recorded and re-raised by run()
            context.truncate(depth)
            state.fail(self.replica_id, error)
        else:
            context.truncate(depth)
            state.finish(self.replica_id, output)


def inline_call(strategy, fn, args, kwargs, device: torch.device):
    """Runs the single replica of ``strategy`` on the calling thread."""
    mode = context.Mode(strategy, ReplicaContext(strategy, 0, None))
    with context.entered(mode):
        if device.type == "cuda":
            with torch.cuda.device(device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
