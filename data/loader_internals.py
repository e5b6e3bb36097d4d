"""What replicafit reads and changes inside a ``torch.utils.data.DataLoader`` beyond its public API: here only.

A loader made with ``persistent_workers=True`` keeps its iterator, and with it its worker processes, from one
pass to the next, in the private attribute ``_iterator``; torch has no public way to ask whether one is alive
or to end it. Resuming a fit mid-pass needs both: the workers draw their base seed only when the iterator is
made, so a backup records whether its pass began with a live iterator, and a replayed pass that must draw
what the saved pass drew ends the one a look ahead made (``inputs.Cursor``, ``sharding``). Each private read
is on one line here, with its reason; a torch release that renames them breaks this file alone.

Example::

    if has_live_iterator(loader):
        end_persistent_iterator(loader)   # the next pass makes new workers, with a new base seed
"""

from __future__ import annotations

__all__ = ["end_persistent_iterator", "has_live_iterator"]


def has_live_iterator(loader) -> bool:
    """Whether ``loader`` holds a live persistent iterator (worker processes kept from a pass before)."""
    return getattr(loader, "_iterator", None) is not None  # private: torch keeps it here, with no public reader


def end_persistent_iterator(loader) -> None:
    """Ends ``loader``'s live persistent iterator (its worker processes), so that the next pass makes a new one,
    drawing its workers' base seed again as the first pass did."""
    iterator = getattr(loader, "_iterator", None)  # private: torch keeps it here, with no public reader
    if iterator is None:
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)  # private: torch's own way to end the workers
    if callable(shutdown):
        shutdown()
    loader._iterator = None  # private: what torch itself sets when the iterator is done with
