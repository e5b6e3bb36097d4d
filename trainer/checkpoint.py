"""Checkpoint files: written atomically, loadable with ``torch.load(path, weights_only=True)``.

A checkpoint is a plain dict of tensors and Python scalars/containers. It is written to
a temporary file in the same folder, flushed to disk and renamed over the target, so a
crash never leaves a half-written file where the last good checkpoint was.

Example::

    save({"model": model.state_dict(), "epoch": 3}, "ckpt.pt")
    state = load("ckpt.pt")
"""

from __future__ import annotations

import os
import tempfile

import torch

__all__ = ["save", "load", "CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, damaged, or not one of ours."""


def save(state: dict, path) -> str:
    """Writes ``state`` to ``path`` atomically; returns the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path


def load(path, kind: str = "checkpoint") -> dict:
    """Reads a checkpoint with ``weights_only=True``; a clear ``CheckpointError`` if it is bad."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"No {kind} at {path!r}.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - damage surfaces as many error types; all mean the same
        raise CheckpointError(
            f"The {kind} {path!r} cannot be read: it is truncated, damaged or not a replicafit {kind} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})."
        ) from error
    if not isinstance(state, dict):
        raise CheckpointError(f"The {kind} {path!r} does not hold a dict of state (found {type(state).__name__}).")
    return state
