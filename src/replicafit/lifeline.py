"""A worker whose launcher is gone ends itself (``replicafit fit --workers N``, ``launch_local``).

Torch-free, so the ``replicafit`` command can start the watch before anything heavy is imported; it sits
below every layer (the strategies start it when a worker joins its cluster, the command line when it
starts), which is why it lives at the root of the package rather than in one of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import threading

__all__ = ["LIFELINE_ENV", "NOTES_ENV", "tell_launcher", "watch_launcher"]

LIFELINE_ENV = "REPLICAFIT_LAUNCHER_FD"  # set by replicafit's launcher: the read end of a pipe it holds open
NOTES_ENV = "REPLICAFIT_LAUNCHER_NOTES_FD"  # set by replicafit's launcher: the write end of a pipe it reads
_lifeline_watched = False
_lifeline_lock = threading.Lock()
_notes_fd = None  # this worker's end of the launcher's notes pipe, once read from the environment


def tell_launcher(note: str) -> bool:
    """In a worker started by ``replicafit fit --workers N`` (``launch_local``): tells the launcher ``note``
    (one word: ``"watching"``: this worker's fit writes a backup after a peer's failure, so after a failure it
    exits by itself once it noticed and wrote, until ``"done"``; ``"saving"``: it writes that backup now; do not
    stop it until it exits, within the launcher's ``rescue_seconds``). Returns whether a launcher was told
    (elsewhere a no-op).

    Example::

        from replicafit.lifeline import tell_launcher
        tell_launcher("saving")   # False outside a launched worker
    """
    with _lifeline_lock:
        fd = _take_notes_fd()
        if fd < 0:
            return False
        try:
            os.write(fd, f"{os.getpid()} {note}\n".encode())  # (one write under PIPE_BUF: never interleaved)
        except OSError:
            return False
    return True


def _take_notes_fd() -> int:
    """The notes pipe's descriptor (-1: none), taken from the environment once (under ``_lifeline_lock``)."""
    global _notes_fd
    if _notes_fd is None:
        value = os.environ.pop(NOTES_ENV, None)  # not for this worker's own children
        try:
            _notes_fd = int(value) if value else -1
            if _notes_fd >= 0 and not stat.S_ISFIFO(os.fstat(_notes_fd).st_mode):
                _notes_fd = -1
        except (ValueError, OSError):
            _notes_fd = -1
    return _notes_fd


def watch_launcher() -> bool:
    """In a worker started by ``replicafit fit --workers N`` (``launch_local``): ends this worker, and its
    process group, as soon as the launcher is gone, however it went (even ``SIGKILL``, which it cannot
    catch to stop its workers). Returns whether a watch started (once per process; elsewhere a no-op).

    The launcher keeps the write end of a pipe open and never writes; the worker's daemon thread reads
    the other end, and end-of-file means the launcher has exited. A worker left alone would otherwise
    go on training (or wait in a collective until its timeout) with nobody to report to. ``torchrun``'s
    workers do not do this. Called when a worker joins its cluster and by the ``replicafit`` command.

    Example::

        from replicafit.lifeline import watch_launcher
        watch_launcher()   # False outside a launched worker
    """
    global _lifeline_watched
    with _lifeline_lock:
        _take_notes_fd()  # (its variable too is not for this worker's own children)
        value = os.environ.pop(LIFELINE_ENV, None)  # not for this worker's own children
        if _lifeline_watched or not value:
            return False
        try:
            fd = int(value)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return False
        except (ValueError, OSError):
            return False
        _lifeline_watched = True
    threading.Thread(target=_await_launcher_exit, args=(fd,), name="replicafit-launcher-watch", daemon=True).start()
    return True


def _await_launcher_exit(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        return  # the descriptor was closed here: nothing to watch
    with contextlib.suppress(Exception):  # a non-chief's stderr was a pipe to the launcher: broken now
        print(
            f"replicafit: worker {os.environ.get('RANK', '?')}: the launcher is gone; ending this worker",
            file=sys.stderr,
            flush=True,
        )
    # The launcher started each worker as the leader of a session of its own: that group holds the
    # worker and anything it started (data-loading processes). Elsewhere only this process ends.
    if os.getpgrp() == os.getsid(0):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
