"""Checkpoint files: written atomically, loadable with ``torch.load(path, weights_only=True)``.

A checkpoint is a plain dict of tensors and Python scalars/containers, its tensors in host
memory (a run on a GPU writes a file that a machine without one loads as it is). It is written to
a temporary file in the same folder, flushed to disk and renamed over the target, so a
crash never leaves a half-written file where the last good checkpoint was. The file gets
the permissions of any other file the user creates (``0o666`` less the umask).

A save killed mid-write leaves its temporary file behind; the next save in the same
folder removes such leftovers. Temporary files are named
``.replicafit-tmp-<pid>-<host>-<random>.pt`` (``<host>``: a short hash of the host name).
One written on this host is *stale* when its pid runs no process any more (a live
writer's file is never removed; a reused pid only delays the clean-up). One whose
writer cannot be asked (another host sharing the folder, Windows, or the
``.tmp-XXXXXXXX.pt`` files of earlier versions, which carry no pid) is stale once it has
not changed for ``STALE_AFTER_SECONDS``: a live writer keeps changing its file.

``load(path, kind)`` checks the structure of what it reads, per kind: a trainer
``"checkpoint"``, a ``"backup"`` of ``BackupAndRestore`` or a ``"weights"`` file
(a model's state dict alone). Whatever is missing, damaged or of the wrong type is a
``CheckpointError`` saying which entry, before anything is restored.

Example::

    save({"model": model.state_dict(), "epoch": 3}, "ckpt.pt")
    state = load("ckpt.pt", kind="weights")      # the saved model state, checked
"""

from __future__ import annotations

import hashlib
import numbers
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping

import torch

from replicafit.strategies import nest
from replicafit.strategies.describe import brief

__all__ = [
    "save",
    "load",
    "read",
    "check",
    "remove_stale_temporary_files",
    "CheckpointError",
    "FORMAT",
    "STALE_AFTER_SECONDS",
]

#: The format tag of trainer checkpoints and backups.
FORMAT = "replicafit-checkpoint-v1"

#: A temporary file unchanged for this long belongs to no live save.
STALE_AFTER_SECONDS = 3600.0

_PREFIX = ".replicafit-tmp-"
_OURS = re.compile(r"^\.replicafit-tmp-(\d+)-([0-9a-f]{8})-[0-9a-f]+\.pt$")
_EARLIER = re.compile(r"^\.tmp-[a-z0-9_]{8}\.pt$")  # tempfile.mkstemp names of earlier versions


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, damaged, or not one of ours."""


# --- writing ------------------------------------------------------------------------------------
def save(state: dict, path) -> str:
    """Writes ``state`` to ``path`` atomically; returns the path.

    Tensors on an accelerator are written as host tensors. Stale temporary files of
    interrupted saves in the folder are removed first.
    """
    state = _on_host(state)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporary_files(folder)
    handle, temporary = _create_temporary(folder)
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


def _on_host(state):
    """``state`` with every tensor in host memory."""
    return nest.map_structure(lambda leaf: leaf.detach().cpu() if _on_accelerator(leaf) else leaf, state)


def _on_accelerator(leaf) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode(), usedforsecurity=False).hexdigest()[:8]


def _create_temporary(folder: str):
    """A new, exclusively created temporary file: ``(fd, path)``.

    Created with mode ``0o666`` so that the kernel applies the umask (and any default
    ACL), as for any file the user creates; ``tempfile.mkstemp`` would make it ``0o600``.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOFOLLOW", 0)
    prefix = f"{_PREFIX}{os.getpid()}-{_host_tag()}-"
    while True:
        temporary = os.path.join(folder, f"{prefix}{secrets.token_hex(4)}.pt")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:  # a 32-bit clash with a file of our own pid: draw again
            continue


def remove_stale_temporary_files(folder) -> list:
    """Deletes the stale temporary files of interrupted saves in ``folder``; returns their paths.

    Only files named as this module names them are considered, and only stale ones
    (see the module docstring); files that vanish or cannot be removed are skipped, so
    this never makes a save fail.
    """
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    host, now = _host_tag(), time.time()
    for name in names:
        ours, earlier = _OURS.match(name), _EARLIER.match(name)
        if not ours and not earlier:
            continue
        path = os.path.join(folder, name)
        try:
            live = _running(int(ours.group(1))) if ours and ours.group(2) == host else None
            if live is None:  # no way to ask the writer: judge by the file's age
                live = now - os.stat(path, follow_symlinks=False).st_mtime <= STALE_AFTER_SECONDS
            if not live:
                os.unlink(path)
                removed.append(path)
        except OSError:  # removed meanwhile (another save cleaning up), or not ours to remove
            continue
    return removed


def _running(pid: int) -> bool | None:
    """Whether process ``pid`` runs on this host; ``None`` where that cannot be asked."""
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


# --- reading ------------------------------------------------------------------------------------
def load(path, kind: str = "checkpoint") -> dict:
    """Reads a file with ``weights_only=True`` and checks its structure for ``kind``.

    ``kind``: ``"checkpoint"`` (``Trainer.save_checkpoint``), ``"backup"``
    (``BackupAndRestore``), ``"weights"`` (a model state dict, e.g. ``ModelCheckpoint``
    with ``save_weights_only``); any other kind is only required to hold a dict. A
    missing, unreadable or malformed file raises ``CheckpointError``.
    """
    state = read(path, kind)
    check(state, kind, path)
    return state


def read(path, kind: str = "checkpoint") -> dict:
    """The dict in the file ``path`` (``weights_only=True``), its structure not checked yet (``check``): a
    missing or unreadable file, or one without a dict, raises ``CheckpointError``."""
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


def check(state: dict, kind: str, path) -> None:
    """``CheckpointError`` unless ``state`` (read from ``path``) has the structure of a ``kind``."""
    problem = _problem(state, kind)
    if problem is not None:
        raise CheckpointError(f"The {kind} {os.fspath(path)!r} is damaged or not a replicafit {kind}: {problem}.")


def _problem(state: dict, kind: str) -> str | None:
    """What is wrong with the structure of ``state`` for ``kind`` (``None``: nothing)."""
    if kind == "weights":
        return _model_problem(state, "the file")
    if kind not in ("checkpoint", "backup"):
        return None
    if state.get("format") != FORMAT:
        return f"it has no format tag {FORMAT!r} (found {brief(state.get('format'))})"
    checks = dict(_COMMON)
    if kind == "backup":
        checks.update(_BACKUP)
    missing = [key for key in checks if key not in state]
    if missing:
        return f"it has no {', '.join(repr(key) for key in missing)}"
    for key, check in checks.items():
        problem = check(state[key], key)
        if problem is not None:
            return problem
    if "replica_rng" in state:  # optional: files of the default strategy, or written before replicas had streams
        problem = _replica_rng_problem(state["replica_rng"], "replica_rng")
        if problem is not None:
            return problem
    if kind == "backup":  # optional: backups written before these entries existed have none
        for key, check in _BACKUP_OPTIONAL.items():
            problem = check(state[key], key) if key in state else None
            if problem is not None:
                return problem
    return _callbacks_problem(state.get("callbacks", {}), "callbacks")


def _replica_rng_problem(value, what: str) -> str | None:
    # {"seed": int, "cpu": [torch CPU state per replica], "gpu": [GPU generator state or None per replica]}
    if not isinstance(value, Mapping) or not isinstance(value.get("cpu"), list) or not value["cpu"]:
        return f"{what} must be {{'seed': int, 'cpu': [states], 'gpu': [states]}}, found {brief(value)}"
    problem = _seed_problem(value.get("seed"), f"{what}['seed']")
    if problem is not None:
        return problem
    if all(cpu is None for cpu in value["cpu"]):
        return f"{what}['cpu'] holds no state, found {brief(value['cpu'])}"
    for r, cpu in enumerate(value["cpu"]):
        if cpu is None:  # a replica of a worker that died: a backup written after its failure lacks its stream
            continue
        problem = _rng_problem(cpu, f"{what}['cpu'][{r}]")
        if problem is not None:
            return problem
    gpu = value.get("gpu")
    if not isinstance(gpu, list) or len(gpu) != len(value["cpu"]):
        return f"{what}['gpu'] must be a list of {len(value['cpu'])} states (or None), found {brief(gpu)}"
    if not all(g is None or (isinstance(g, torch.Tensor) and g.dtype == torch.uint8) for g in gpu):
        return f"{what}['gpu'] must hold uint8 tensors or None, found {brief(gpu)}"
    return None


def _global_batch_size_problem(value, what: str) -> str | None:
    # The rows of the saver's first global batch (None where it had read none).
    if value is None or (_is_int(value) and value >= 1):
        return None
    return f"{what} must be an int >= 1 (or None), found {brief(value)}"


def _generator_states_problem(value, what: str) -> str | None:
    if not isinstance(value, list) or not all(isinstance(g, torch.Tensor) and g.dtype == torch.uint8 for g in value):
        return f"{what} must be a list of generator states (uint8 tensors), found {brief(value)}"
    return None


def _data_rng_problem(value, what: str) -> str | None:
    # {"pass": {"torch": CPU state, "generators": [states]} or None, "generators": [states]}: the random
    # state the data's current pass began with, and the source's own generators now.
    if not isinstance(value, Mapping) or "pass" not in value or "generators" not in value:
        return f"{what} must be {{'pass': {{'torch': state, 'generators': [states]}} or None, 'generators': [states]}}"
    problem = _generator_states_problem(value["generators"], f"{what}['generators']")
    if problem is not None or value["pass"] is None:
        return problem
    begun = value["pass"]
    if not isinstance(begun, Mapping) or "torch" not in begun:
        return f"{what}['pass'] must be {{'torch': state, 'generators': [states]}} or None, found {brief(begun)}"
    return _rng_problem(begun["torch"], f"{what}['pass']['torch']") or _generator_states_problem(
        begun.get("generators"), f"{what}['pass']['generators']"
    )


def _callbacks_problem(value, what: str) -> str | None:
    # Optional (files written before callbacks kept state have none): {callback key: its state dict}.
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        return f"{what} must be a dict of callback states (dicts), found {brief(value)}"
    return None


def _model_problem(value, what: str) -> str | None:
    if not isinstance(value, Mapping):
        return f"{what} must be a model state dict (a dict of tensors), found {type(value).__name__}"
    for key, tensor in value.items():
        if not isinstance(key, str):
            return f"{what} must be keyed by parameter names, found the key {brief(key)}"
        # torch.nn.Module.get_extra_state() may return any (weights-only loadable) value.
        if not isinstance(tensor, torch.Tensor) and not key.endswith("_extra_state"):
            return f"{what}[{key!r}] must be a tensor, found {type(tensor).__name__}"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value, what: str) -> str | None:
    if not _is_int(value) or value < 0:
        return f"{what} must be an int >= 0, found {brief(value)}"
    return None


def _optimizer_problem(value, what: str) -> str | None:
    # The layout inside is the optimizer's own (Optimizer.load_state_dict checks it).
    if not isinstance(value, Mapping):
        return f"{what} must be an optimizer state dict, found {type(value).__name__}"
    if "iterations" not in value:
        return f"{what} has no 'iterations'"
    return _count(value["iterations"], f"{what}['iterations']")


def _rng_problem(value, what: str) -> str | None:
    size = torch.get_rng_state().numel()
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or tuple(value.shape) != (size,):
        found = (
            f"a {value.dtype} tensor of shape {list(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        return f"{what} must be torch's CPU random state (a uint8 tensor of {size} bytes), found {found}"
    return None


def _cursor_problem(value, what: str) -> str | None:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) and v >= 0 for v in value):
        return f"{what} must be [pass, batch] (two ints >= 0), found {brief(value)}"
    return None


def _seed_problem(value, what: str) -> str | None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return None
    return f"{what} must be an int, found {brief(value)}"


def _metrics_problem(value, what: str) -> str | None:
    if not isinstance(value, Mapping):
        return f"{what} must be a dict of metric states, found {type(value).__name__}"
    for name, states in value.items():
        if not isinstance(states, Mapping) or not all(isinstance(t, torch.Tensor) for t in states.values()):
            return f"{what}[{name!r}] must be a dict of tensors, found {brief(states)}"
    return None


def _history_problem(value, what: str) -> str | None:
    if not isinstance(value, Mapping) or not isinstance(value.get("history"), Mapping):
        return f"{what} must be {{'history': {{key: [values]}}, 'epoch': [ints]}}, found {brief(value)}"
    for key, values in value["history"].items():
        if not isinstance(values, list):
            return f"{what}['history'][{key!r}] must be a list, found {type(values).__name__}"
    epochs = value.get("epoch")
    if not isinstance(epochs, list) or not all(_is_int(e) for e in epochs):
        return f"{what}['epoch'] must be a list of ints, found {brief(epochs)}"
    return None


_COMMON = {
    "model": _model_problem,
    "optimizer": _optimizer_problem,
    "epoch": _count,
    "step": _count,
    "rng": _rng_problem,
}
_BACKUP = {
    "cursor": _cursor_problem,
    "data_seed": _seed_problem,
    "metrics": _metrics_problem,
    "history": _history_problem,
}
_BACKUP_OPTIONAL = {"global_batch_size": _global_batch_size_problem, "data_rng": _data_rng_problem}
