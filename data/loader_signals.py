"""A ``DataLoader``'s worker processes and the signals a fit saves before preemption on.

A scheduler that preempts a job signals every process of it (SLURM does), a ``DataLoader``'s worker
processes included, and torch ends those on SIGTERM: the main process then fails at once ("DataLoader
worker ... is killed by signal"), where it should have saved and exited. While a fit watches such
signals (``BackupAndRestore(save_before_preemption=...)``), the loaders it iterates start their worker
processes with the signals ignored (a ``worker_init_fn`` around the user's own, set for the moment
the iterator is made): they go on serving batches until their main process stops them, as it does
when it exits. Persistent workers started before the fit keep what they had.

Example::

    with ignored_in_loader_workers([signal.SIGTERM]):
        batches = iterate(loader)   # its worker processes ignore SIGTERM
"""

from __future__ import annotations

import contextlib
import signal

import torch

__all__ = ["ignored_in_loader_workers", "iterate"]

_IGNORED: tuple = ()  # the signals a running fit watches (set by its PreemptionWatch)


@contextlib.contextmanager
def ignored_in_loader_workers(signals):
    """Within the block, loaders iterated through ``iterate`` start worker processes that ignore ``signals``."""
    global _IGNORED
    before, _IGNORED = _IGNORED, tuple(signals)
    try:
        yield
    finally:
        _IGNORED = before


def iterate(loader):
    """``iter(loader)``; a ``DataLoader`` with worker processes starts them ignoring the watched signals."""
    if not _IGNORED or not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers:
        return iter(loader)
    own = loader.worker_init_fn
    loader.worker_init_fn = _Ignoring(_IGNORED, own)  # read once, by the iterator made now
    try:
        return iter(loader)
    finally:
        loader.worker_init_fn = own


class _Ignoring:
    """A ``worker_init_fn``: ignores ``signals``, then calls the loader's own (picklable: spawned workers too)."""

    def __init__(self, signals, then):
        self.signals, self.then = tuple(int(s) for s in signals), then

    def __call__(self, worker_id: int) -> None:
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)
