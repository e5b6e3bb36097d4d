"""The local launcher behind ``replicafit fit RECIPE --workers N``: N worker processes on this machine.

``launch_local(command, N)`` runs ``command`` N times, each child told who it is through the
environment that ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), so a
``MultiWorkerMirroredStrategy`` or ``FullyShardedStrategy`` in the children finds its cluster with
``TorchrunClusterResolver``, exactly as under ``torchrun --standalone --nproc-per-node N``.

- **Re-exec, not fork or spawn**: each child runs the whole command again (recipes are re-read,
  nothing is pickled, process-global settings are rebuilt by the child).
- **Output**: worker 0 (the chief) writes to this process's stdout and stderr; the others' stdout
  is dropped (``log_all_workers``: shown, each line prefixed ``"[worker i] "``) and the last 64
  lines of their stderr are kept, to show when that worker fails.
- **Faults**: when a worker exits non-zero or is killed by a signal, the launcher names the worker
  that failed first and stops the others (SIGTERM, then SIGKILL: a worker stuck in a collective
  ignores a polite request; the waits are below). A worker that exits with
  ``PEER_FAILED_EXIT_STATUS`` (69: its collective failed because of another) is not the cause:
  the launcher waits up to ``grace_seconds`` for another to fail, and names a worker still running
  then as the one that stopped arriving (stuck, or stopped by SIGSTOP). The others get ``grace_seconds`` to
  notice and exit on their own before SIGTERM, and one whose fit says it writes a backup after a peer's
  failure (``replicafit.lifeline.tell_launcher``) up to ``rescue_seconds``. With ``max_restarts`` it
  starts all workers again on a fresh port, and they resume from the newest backup: the one a surviving
  worker wrote of the last step every worker finished (``BackupAndRestore(save_on_peer_failure=True)``,
  ``replicafit.trainer.peer_failure``), else the last periodic one. A worker that gave up on a peer says in
  its last line what it wrote; the launcher shows it. With ``min_workers``, after the same worker failed in
  two attempts in a row the next has one worker fewer (not below ``min_workers``; ranks are numbered from 0
  again, so the last rank is the one left out); else it returns a non-zero status.
- **Preemption**: a worker that exits with ``PREEMPTED_EXIT_STATUS`` (75: its ``fit`` stopped on a
  preemption signal after the backup was written, ``BackupAndRestore(save_before_preemption=True)``)
  has not failed: once every worker has exited 0 or 75, the launcher returns 75 and does not restart
  (the scheduler requeues the job; rerunning the same command resumes). SIGTERM or SIGHUP to the
  launcher is passed on to each worker process (not its children: a DataLoader's worker processes
  are left to their worker), which gets ``preemption_seconds`` to stop before SIGKILL; a second
  signal meanwhile changes nothing.
- **Cleanup**: every child runs in a process group of its own, and every group the launcher
  started is signalled and every child reaped before it returns, also on Ctrl-C (SIGINT is
  forwarded to the workers, then ``KeyboardInterrupt`` re-raised) and on SIGTERM/SIGHUP to the
  launcher (forwarded likewise, then ``SystemExit(128 + signal)``). A launcher that cannot
  clean up (``SIGKILL``, the OOM killer) leaves no worker behind either: each worker holds a
  pipe whose other end only the launcher holds, and ends itself and its group when that end
  closes (``replicafit.lifeline.watch_launcher``; torchrun's workers do not). Every wait is
  bounded; the launcher uses no threads (one ``selectors`` loop reads the pipes). POSIX only.

**Environment variables.** They are read by the recipe loader and the cluster resolvers
(``replicafit.strategies.cluster_resolver``) only: ``launched_worker()`` asks
``TorchrunClusterResolver.detected()``, and ``launch_local`` passes the parent's environment on to
the children without reading it.

Differences from ``torchrun``: one machine only, a fresh port per attempt (no ``c10d``
rendezvous), ``OMP_NUM_THREADS`` is ``cores // N`` rather than 1, and only the chief's stdout
is shown by default.

Example::

    import sys
    from replicafit.cli.launch import launch_local

    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'])"
    status = launch_local([sys.executable, "-c", code], num_workers=2)   # prints "0 2"; status 0
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from replicafit.lifeline import LIFELINE_ENV, NOTES_ENV
from replicafit.trainer import PREEMPTED_EXIT_STATUS

__all__ = ["PEER_FAILED_EXIT_STATUS", "TAIL_LINES", "free_port", "launch_local", "launched_worker"]

#: The exit status of a worker that gave up because another died or stopped arriving (``replicafit fit`` on
#: ``WorkerFailedError``; sysexits' EX_UNAVAILABLE): the cause is another worker, which the launcher looks for.
PEER_FAILED_EXIT_STATUS = 69

#: How many lines of a non-chief worker's stderr the launcher keeps, to show when that worker fails.
TAIL_LINES = 64
_LOOPBACK = "127.0.0.1"
_LONGEST_LINE = 1 << 16  # bytes kept of a line that has no end yet
_REAP_SECONDS = 5.0  # after SIGKILL: how long to wait for the kernel to end a child (bounded, never forever)
_FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # signals to the launcher that are passed on before it exits


def launched_worker(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process already runs as one worker of a launched cluster.

    True in the environment ``torchrun`` (and ``launch_local``) give their workers: ``RANK`` and
    ``WORLD_SIZE``, or torchelastic's run id (``TorchrunClusterResolver.detected``). ``environ``
    defaults to ``os.environ``.

    Example::

        launched_worker({"RANK": "0", "WORLD_SIZE": "2"})   # True
        launched_worker({})                                 # False
    """
    from replicafit.strategies.cluster_resolver import TorchrunClusterResolver

    return TorchrunClusterResolver.detected(environ)


def free_port(host: str = _LOOPBACK) -> int:
    """A TCP port that is free on ``host`` now (bind port 0, read the port the kernel chose, close).

    Another process could take it before the workers do; the launcher asks again for every
    attempt, and a clash fails that attempt (which ``max_restarts`` retries on a new port).

    Example::

        port = free_port()   # e.g. 45123
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch_local(
    command: Sequence[str],
    num_workers: int,
    max_restarts: int = 0,
    *,
    min_workers: int | None = None,
    log_all_workers: bool = False,
    grace_seconds: float = 3.0,
    poll_seconds: float = 0.1,
    env: Mapping[str, str] | None = None,
    cpu_count: int | None = None,
    exit_seconds: float = 60.0,
    preemption_seconds: float = 120.0,
    rescue_seconds: float = 30.0,
    chief_completes: bool = False,
) -> int:
    """Runs ``command`` in ``num_workers`` processes on this machine; returns 0 when all exit 0.

    Args:
      command: the program and its arguments (``[sys.executable, "-m", "replicafit", "fit", ...]``),
        the same for every worker.
      num_workers: how many workers (>= 1).
      max_restarts: how many times all workers are started again after one fails (>= 0).
      min_workers: go on with fewer workers, down to this many, when one keeps failing: a restart after the same
        worker failed in two attempts in a row starts one worker fewer (the global batch stays; the workers
        resume from the newest backup on their new count). ``None``: always ``num_workers``.
      log_all_workers: also show the other workers' stdout and stderr, each line prefixed
        ``"[worker i] "``.
      grace_seconds: between SIGTERM (or the forwarded SIGINT) and SIGKILL.
      poll_seconds: how often the workers are checked.
      env: the environment the workers' variables are added to (default: this process's).
      cpu_count: the cores to share out (default: those this process may run on);
        ``OMP_NUM_THREADS`` is ``max(1, cpu_count // num_workers)`` unless ``env`` sets it.
      exit_seconds: how long the other workers may still run once one has exited 0 (they end with the
        same collectives, the chief then writing its reports); past it the one still running is named
        as stuck and the attempt fails.
      preemption_seconds: after SIGTERM or SIGHUP to the launcher, how long the workers may take to stop
        (a preempted ``fit`` ends its step and writes its backup) before SIGKILL.
      chief_completes: the chief's exit status 0 means the run is complete (``replicafit fit``: its last
        collectives are every worker's, and it writes the run's files last): a worker that fails or is signalled
        after it does not make the run fail, nor restart it (a restart would train the run again).
      rescue_seconds: after a worker failed, the others get ``grace_seconds`` to notice it and exit on their own
        before SIGTERM; one whose fit writes the backup of the last step every worker finished after a peer's
        failure (``BackupAndRestore(save_on_peer_failure=True)``: it says so through
        ``replicafit.lifeline.tell_launcher``) gets this long from the failure.

    Returns the exit status: 0, ``PREEMPTED_EXIT_STATUS`` (75) when the workers were preempted, or
    after the last attempt the failed worker's exit code when it is positive, else 1 (a worker killed
    by a signal). Raises ``KeyboardInterrupt`` after
    stopping the workers when interrupted, ``ValueError`` for bad arguments, ``OSError`` when a
    worker cannot be started.

    Example::

        status = launch_local([sys.executable, "train.py"], num_workers=2, max_restarts=1)
    """
    command = _check_command(command)
    _check_int("num_workers", num_workers, 1)
    _check_int("max_restarts", max_restarts, 0)
    min_workers = num_workers if min_workers is None else min_workers
    _check_int("min_workers", min_workers, 1)
    if min_workers > num_workers:
        raise ValueError(f"min_workers must be at most num_workers ({num_workers}), got {min_workers}.")
    if not grace_seconds >= 0 or not preemption_seconds >= 0 or not rescue_seconds >= 0:
        raise ValueError(
            "grace_seconds, preemption_seconds and rescue_seconds must be >= 0, got "
            f"{grace_seconds!r}, {preemption_seconds!r}, {rescue_seconds!r}."
        )
    if not poll_seconds > 0 or not exit_seconds > 0:
        raise ValueError(f"poll_seconds and exit_seconds must be > 0, got {poll_seconds!r}, {exit_seconds!r}.")
    base = dict(os.environ if env is None else env)
    cores = cpu_count if cpu_count is not None else _usable_cores()
    # The lifeline: the workers watch the read end; its write end closes when this process exits,
    # however it exits, and a worker seeing that ends itself (replicafit.lifeline.watch_launcher).
    lifeline, held = os.pipe()
    base[LIFELINE_ENV] = str(lifeline)
    # The notes: a worker that writes a backup after a peer's failure says so (replicafit.lifeline.tell_launcher).
    notes, told = os.pipe()
    os.set_blocking(notes, False)
    base[NOTES_ENV] = str(told)
    try:
        waits = _Waits(grace_seconds, poll_seconds, exit_seconds, preemption_seconds, rescue_seconds, chief_completes)
        counts = (num_workers, min_workers)
        return _attempts(command, counts, max_restarts, base, cores, log_all_workers, waits, notes)
    finally:
        os.close(lifeline)
        os.close(held)
        os.close(notes)
        os.close(told)


class _Waits(collections.namedtuple("_Waits", "grace poll exit preemption rescue chief_completes")):
    """The launcher's bounds, in seconds (``launch_local``'s ``*_seconds`` arguments), and ``chief_completes``."""


def _attempts(command, counts, max_restarts, base, cores, log_all_workers, waits, notes: int) -> int:
    num_workers, min_workers = counts
    previous = None  # the worker that failed first in the attempt before, if one did
    with _forwarding_signals():
        for attempt in range(max_restarts + 1):
            if attempt:
                _say(f"restarting all {num_workers} workers (restart {attempt} of {max_restarts})")
            run = _Attempt(command, num_workers, attempt, base, cores, log_all_workers)
            run.notes = notes
            status = run.run(waits)
            if status in (0, PREEMPTED_EXIT_STATUS):  # preempted: the scheduler's to requeue, not a failure
                return status
            if run.failed is not None and run.failed == previous and num_workers > min_workers:
                num_workers -= 1
                _say(
                    f"worker {run.failed} failed in two attempts in a row: going on with {num_workers} worker(s) "
                    f"(--min-workers {min_workers}); they resume from the newest backup"
                )
                previous = None
            else:
                previous = run.failed
    return status


def _check_command(command) -> list:
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command:
        raise ValueError(f"command must be a non-empty list of strings (program and arguments), got {command!r}.")
    return [os.fspath(part) for part in command]


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _ParentSignaled(BaseException):
    """SIGTERM or SIGHUP reached the launcher: stop the workers, then exit."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _forwarding_signals:
    """While launching, SIGTERM/SIGHUP to the launcher become ``_ParentSignaled`` (main thread only),
    so the workers, in process groups of their own, are stopped rather than orphaned. Only the first:
    while the workers stop, another changes nothing."""

    def __enter__(self):
        self._previous = {}
        self._signaled = False
        if sys.platform != "win32" and _in_main_thread():
            for signum in _FORWARDED:
                self._previous[signum] = signal.signal(signum, self._raise)
        return self

    def _raise(self, signum, frame):
        if not self._signaled:
            self._signaled = True
            raise _ParentSignaled(signum)

    def __exit__(self, kind, error, traceback):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if isinstance(error, _ParentSignaled):
            # One line, as Ctrl-C's "interrupted": the status alone (143) says nothing to whoever reads the log.
            name = signal.Signals(error.signum).name
            _say(f"{name} received; the workers were stopped")
            raise SystemExit(128 + error.signum) from None
        return False


def _process_state(pid: int) -> str:
    """What Linux says the process is doing (``/proc/PID/stat``), in words; "process state unknown" elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "process state unknown"
    words = {"T": "stopped by a signal", "t": "stopped by a debugger", "D": "waiting on the disk or a device"}
    return words.get(state, "running or waiting")


def _say(text: str, end: str = "\n") -> None:
    """A message of the launcher's on stderr, at once (the chief's output shares the stream)."""
    print(f"replicafit: {text}", end=end, file=sys.stderr, flush=True)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _describe(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"exit code {code}, killed by {name}"


class _Attempt:
    """One start of all workers: start, watch, stop; every child reaped before ``run`` returns."""

    def __init__(self, command, num_workers, attempt, base_env, cores, log_all_workers):
        self.command, self.num_workers, self.attempt = command, num_workers, attempt
        self.base_env, self.cores, self.log_all_workers = base_env, cores, log_all_workers
        self.procs: list = []
        self.output = _Output(log_all_workers)
        self.failed = None  # after run(): the worker that failed first (or stopped arriving), else None
        self.notes = None  # the read end of the workers' notes pipe (replicafit.lifeline.tell_launcher)
        self._saving: set = set()  # the pids of workers that said they write a backup after a peer's failure
        self._watching: set = set()  # ... and of those whose fit would write one (between "watching" and "done")

    def _env(self, rank: int, port: int) -> dict:
        env = dict(self.base_env)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.num_workers),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.num_workers),
            MASTER_ADDR=_LOOPBACK,
            MASTER_PORT=str(port),
            REPLICAFIT_RESTART_COUNT=str(self.attempt),
        )
        if "OMP_NUM_THREADS" not in self.base_env:
            env["OMP_NUM_THREADS"] = str(max(1, self.cores // self.num_workers))
        return env

    def run(self, waits: _Waits) -> int:
        try:
            port = free_port()
            sys.stdout.flush()  # what this process printed comes before the chief's output, which shares the stream
            sys.stderr.flush()
            for rank in range(self.num_workers):
                chief = rank == 0
                proc = subprocess.Popen(
                    self.command,
                    env=self._env(rank, port),
                    start_new_session=True,  # a group of its own: killed with its children, spared the terminal's ^C
                    pass_fds=(int(self.base_env[LIFELINE_ENV]), int(self.base_env[NOTES_ENV])),
                    stdin=subprocess.DEVNULL,
                    stdout=None if chief else subprocess.PIPE if self.log_all_workers else subprocess.DEVNULL,
                    stderr=None if chief else subprocess.PIPE,
                )
                self.procs.append(proc)
                self.output.watch(rank, proc)
            failed = self._watch(waits.poll, waits.exit, waits.grace)
            if failed is None:
                return 0
            if waits.chief_completes and failed != "preempted" and self.procs[0].poll() == 0:
                rank, code = failed
                what = _describe(code) if code is not None else "still running"
                _say(f"worker {rank} ended ({what}) after the chief had finished the run: the run is complete")
                return 0
            if failed == "preempted":
                _say(
                    f"the workers were preempted and wrote their backup (exit status "
                    f"{PREEMPTED_EXIT_STATUS}); rerun the same command to resume"
                )
                return PREEMPTED_EXIT_STATUS
            rank, code = failed
            self.failed = rank
            if code is not None:  # (a stuck worker was named by _watch)
                _say(f"worker {rank} failed first ({_describe(code)}); stopping the other workers")
            self._let_survivors_notice(rank, waits.grace, waits.poll, waits.rescue)
            self._stop(signal.SIGTERM, waits.grace)
            self._show_tail(rank)
            self._show_survivors(rank)
            return code if code is not None and code > 0 else 1
        except KeyboardInterrupt:
            self._stop(signal.SIGINT, waits.grace)
            raise
        except _ParentSignaled as error:
            # To each worker, not its group: a DataLoader's worker processes are their worker's to stop.
            self._stop(error.signum, waits.preemption, leaders_only=True)
            codes = [proc.returncode for proc in self.procs]
            if all(code == 0 for code in codes) or (waits.chief_completes and codes[0] == 0):
                return 0  # they had finished (the chief had: the run is complete)
            if PREEMPTED_EXIT_STATUS in codes and all(code in (0, PREEMPTED_EXIT_STATUS) for code in codes):
                name = signal.Signals(error.signum).name
                _say(
                    f"{name} received; the workers stopped at an agreed step and wrote their backup "
                    f"(exit status {PREEMPTED_EXIT_STATUS}: preempted); rerun the same command to resume"
                )
                return PREEMPTED_EXIT_STATUS
            raise
        finally:
            self._stop(signal.SIGKILL, 0.0)  # a no-op after a clean stop; else (any error) nobody is left behind

    def _watch(self, poll_seconds: float, exit_seconds: float, settle_seconds: float = 3.0):
        """Until all exit 0 (None), all exit 0 or preempted with one preempted (``"preempted"``) or one
        fails: ``(rank, exit code)`` of the first failure seen. A worker still running ``exit_seconds``
        after another exited 0 or preempted is stuck (every worker ends with the same collectives): it
        is named here, and ``(rank, None)`` returned; so is one still running ``settle_seconds`` after
        the others gave up waiting for a peer (``PEER_FAILED_EXIT_STATUS``)."""
        first_done = gave_up = None
        ended = (0, PREEMPTED_EXIT_STATUS)
        while True:
            codes = [proc.poll() for proc in self.procs]
            failures = [(rank, code) for rank, code in enumerate(codes) if code not in (None, *ended)]
            causes = [(rank, code) for rank, code in failures if code != PEER_FAILED_EXIT_STATUS]
            if causes or (failures and None not in codes):
                # Several seen in one poll: a death by signal is more likely the cause (the others'
                # collectives fail because of it), then a worker that did not give up on a peer, then
                # the lowest rank.
                return min(causes or failures, key=lambda f: (f[1] >= 0, f[0]))
            if failures:  # gave up on a peer: the peer is one still running, unless it fails in a moment
                gave_up = gave_up if gave_up is not None else time.monotonic()
                if time.monotonic() - gave_up > settle_seconds:
                    return self._stopped_arriving(codes, failures)
            if all(code in ended for code in codes):
                return "preempted" if PREEMPTED_EXIT_STATUS in codes else None
            if first_done is None and any(code in ended for code in codes):
                first_done = time.monotonic()
            if first_done is not None and time.monotonic() - first_done > exit_seconds:
                running = [rank for rank, code in enumerate(codes) if code is None]
                done = [rank for rank, code in enumerate(codes) if code in ended]
                _say(
                    f"worker {running[0]} is still running {exit_seconds:g} s after worker(s) "
                    f"{', '.join(map(str, done))} exited: it is stuck; stopping it"
                )
                return running[0], None
            self.output.pump(poll_seconds)

    def _stopped_arriving(self, codes: list, failures: list) -> tuple:
        """Names the worker(s) the others gave up waiting for (still running; those stopped by a signal or
        waiting on a device first, as a healthy worker still waiting in its collective runs too);
        ``(the first's rank, None)``."""
        running = {rank: _process_state(self.procs[rank].pid) for rank, code in enumerate(codes) if code is None}
        stuck = [rank for rank, state in running.items() if state != "running or waiting"] or list(running)
        waited = ", ".join(str(r) for r, _ in failures)
        named = ", ".join(f"{rank} ({running[rank]})" for rank in stuck)
        _say(
            f"worker {named} stopped arriving: worker(s) {waited} gave up waiting in a collective (exit "
            f"code {PEER_FAILED_EXIT_STATUS}) while it still runs; stopping it"
        )
        return stuck[0], None

    def _stop(self, signum: int, grace_seconds: float, leaders_only: bool = False) -> None:
        """``signum`` to every worker's process group (``leaders_only``: to each worker process),
        ``grace_seconds`` to exit, then SIGKILL to the groups; reaps all."""
        try:
            if leaders_only:
                for proc in self.procs:
                    if proc.poll() is None:
                        os.kill(proc.pid, signum)
            else:
                self._signal_groups(signum)
            deadline = time.monotonic() + grace_seconds
            while self._still_running() and time.monotonic() < deadline:
                self.output.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        finally:
            # The second ^C during the grace lands here too: SIGKILL the groups (children and
            # anything they started) and reap every child, each wait bounded.
            self._signal_groups(signal.SIGKILL)
            for proc in self.procs:
                try:
                    proc.wait(timeout=_REAP_SECONDS)
                except subprocess.TimeoutExpired:  # uninterruptible (D state): reported, never waited on forever
                    _say(f"process {proc.pid} did not end after SIGKILL")
            self.output.close()

    def _still_running(self) -> bool:
        """Whether a worker may still exit by itself (one stopped by a signal cannot: SIGKILL ends it)."""
        return any(proc.poll() is None and _process_state(proc.pid) != "stopped by a signal" for proc in self.procs)

    def _signal_groups(self, signum: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signum)  # the group's id is the child's pid (start_new_session)
            except (ProcessLookupError, PermissionError):  # the whole group has exited already
                pass

    def _let_survivors_notice(self, failed: int, seconds: float, poll_seconds: float, rescue_seconds: float) -> None:
        """Waits, at most ``seconds``, for the workers other than ``failed`` to exit on their own: their collectives
        fail at once (or within the collective timeout). One that told the launcher its fit writes the backup of
        the last step every worker finished after a peer's failure (``"watching"``, until ``"done"``), or that
        it writes it now (``"saving"``), is waited for up to ``rescue_seconds`` from the failure: it notices at
        its next collective. A worker stopped by a signal is not waited for."""
        start = time.monotonic()
        while True:
            self._read_notes()
            running = [
                proc
                for rank, proc in enumerate(self.procs)
                if rank != failed and proc.poll() is None and _process_state(proc.pid) != "stopped by a signal"
            ]
            # (a worker whose fit saves on a peer's failure notices it at its next collective, then writes)
            noticing = [proc for proc in running if proc.pid in self._saving or proc.pid in self._watching]
            elapsed = time.monotonic() - start
            if not running or (elapsed > seconds and not noticing) or elapsed > rescue_seconds:
                return
            self.output.pump(poll_seconds)

    def _read_notes(self) -> None:
        """What the workers told (``pid note`` lines): who writes a backup after a peer's failure."""
        while self.notes is not None:
            try:
                data = os.read(self.notes, 4096)
            except BlockingIOError:
                return
            if not data:
                return
            for line in data.decode(errors="replace").splitlines():
                pid, _, note = line.partition(" ")
                if not pid.isdigit():
                    continue
                if note == "saving":
                    self._saving.add(int(pid))
                elif note == "watching":
                    self._watching.add(int(pid))
                elif note == "done":
                    self._watching.discard(int(pid))

    def _show_survivors(self, failed: int) -> None:
        """The last line of each other worker that gave up on a peer (exit status 69): what it did about the failure
        (which survivor wrote the backup of the last step every worker finished, or why none was written). The
        chief's, and every worker's with ``log_all_workers``, were shown as they came."""
        if self.log_all_workers:
            return
        for rank, proc in enumerate(self.procs):
            lines = self.output.tail(rank)
            if rank not in (0, failed) and proc.returncode == PEER_FAILED_EXIT_STATUS and lines:
                _say(f"worker {rank}: {lines[-1]}")

    def _show_tail(self, rank: int) -> None:
        lines = self.output.tail(rank)
        if rank == 0 or self.log_all_workers or not lines:
            return  # the chief's stderr, or every worker's with log_all_workers, was shown as it came
        shown = "".join(f"  {line}\n" for line in lines)
        _say(f"the last lines of worker {rank}'s stderr:\n{shown}", end="")


class _Output:
    """The non-chief workers' pipes, read with ``selectors`` from the launcher's thread (no reader threads):
    stdout lines are shown prefixed (``log_all_workers``); stderr lines go to a bounded tail
    (and are shown prefixed with ``log_all_workers``)."""

    def __init__(self, log_all_workers: bool):
        self.log_all_workers = log_all_workers
        self._streams: dict = {}  # fd -> [rank, is_stderr, file, pending bytes]
        self._tails: dict = {}
        self._selector = selectors.DefaultSelector()

    def watch(self, rank: int, proc) -> None:
        self._tails[rank] = collections.deque(maxlen=TAIL_LINES)
        for stream, is_stderr in ((proc.stdout, False), (proc.stderr, True)):
            if stream is not None:
                os.set_blocking(stream.fileno(), False)
                self._streams[stream.fileno()] = [rank, is_stderr, stream, b""]
                self._selector.register(stream.fileno(), selectors.EVENT_READ)

    def tail(self, rank: int) -> list:
        return list(self._tails.get(rank, ()))

    def pump(self, timeout: float) -> None:
        """Reads what the pipes hold, waiting at most ``timeout`` seconds for something to arrive."""
        if not self._streams:  # no pipes (or closed): only the wait
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            self._read(key.fd)

    def _read(self, fd: int) -> None:
        entry = self._streams[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:  # end of file: the worker (and all it started) closed the pipe
            self._finish(fd)
            return
        *lines, entry[3] = (entry[3] + data).split(b"\n")
        if len(entry[3]) > _LONGEST_LINE:  # no newline for a long while: shown as a line of its own
            lines.append(entry[3])
            entry[3] = b""
        for line in lines:
            self._line(entry[0], entry[1], line)

    def _line(self, rank: int, is_stderr: bool, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        if is_stderr:
            self._tails[rank].append(line)
        if self.log_all_workers:
            stream = sys.stderr if is_stderr else sys.stdout
            print(f"[worker {rank}] {line}", file=stream, flush=True)

    def _finish(self, fd: int) -> None:
        rank, is_stderr, stream, pending = self._streams.pop(fd)
        self._selector.unregister(fd)
        if pending:
            self._line(rank, is_stderr, pending)
        stream.close()

    def close(self) -> None:
        """Reads what is left (the workers have exited) and closes every pipe; bounded: a pipe that a
        process outside the workers' groups still holds open is closed unread."""
        deadline = time.monotonic() + 1.0
        while self._streams and time.monotonic() < deadline:
            ready = self._selector.select(max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for key, _ in ready:
                self._read(key.fd)
        for fd in list(self._streams):
            self._finish(fd)
        if self._selector is not None:
            self._selector.close()
            self._selector = None
