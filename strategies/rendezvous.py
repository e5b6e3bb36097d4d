"""The rendezvous of one multi-replica call: ``merge_call``, bounded waits and the outcome.

``merge_call`` is a rendezvous: every replica hands in its arguments and waits; the
last one to arrive runs ``merge_fn`` once, in cross-replica context, with the
arguments regrouped, then releases the others, each with its part of the result.
Nothing here can hang: a replica that raises, or returns while others wait in
``merge_call``, wakes them, and ``run`` raises the replica's exception, or
``RuntimeError("Some replicas made a different number of replica_context().merge_call() calls.")``;
replicas that make different collectives at the same point are named in the error.
A ``CommunicationOptions.timeout_seconds`` bounds every wait, the end of the function
included; without one, a rendezvous that stays incomplete for ``set_stall_warning_seconds``
(60 s) is logged once.

``_RunState`` is the state of one call whose replicas run on threads of their own (they wait on
its condition); ``_CoopState`` (``cooperative.py``) extends it for replicas that take turns on
one thread. The runner (``runner.py``) makes one per call, and each replica's context
(``replica_context.py``) hands it its ``merge_call``s.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from . import context, nest
from .merge_fns import PerReplicaConstant, _describe, _same_call
from .nest import StructureMismatchError
from .values import check_component_counts, regroup, select_replica

__all__ = ["MERGE_CALL_MISMATCH", "set_stall_warning_seconds", "get_stall_warning_seconds"]


MERGE_CALL_MISMATCH = "Some replicas made a different number of replica_context().merge_call() calls."

# The logger of the stall warning keeps the runner's name, the one set_stall_warning_seconds documents.
_logger = logging.getLogger(__package__ + ".runner")
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


def _select(replica_id, result):
    if isinstance(result, PerReplicaConstant):
        return result
    if nest.is_nested(result):
        return nest.map_structure(lambda v: _select(replica_id, v), result)
    return select_replica(replica_id, result)
