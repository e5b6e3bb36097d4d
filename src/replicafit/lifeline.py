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

__all__ = ["LIFELINE_ENV", "watch_launcher"]

LIFELINE_ENV = "REPLICAFIT_LAUNCHER_FD"  # set by replicafit's launcher: the read end of a pipe it holds open
_lifeline_watched = False
_lifeline_lock = threading.Lock()


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
