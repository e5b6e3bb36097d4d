"""Sharded checkpoints: a directory that every worker writes its part of, loadable on any number of workers.

Under a strategy that shards parameters (``FullyShardedStrategy``) a checkpoint's model weights and optimizer
slots are ``DTensor`` s (``strategies.sharded_state_dict()``): gathering them on one worker to write one file would
hold the whole state there. A sharded checkpoint instead is a directory:

* the tensors that are sharded, in torch's distributed checkpoint format (``.metadata`` and one ``.distcp`` file
  per worker: every worker writes its own shards, nothing is gathered);
* ``state.pt``: everything else (epoch, step, random streams, history, metric states, callbacks' states...),
  written by the chief as ``checkpoint.save`` writes files, each sharded tensor replaced by a placeholder
  ``{"__sharded__": key, "shape": [...], "dtype": "float32"}``.

It is written into a temporary directory beside its path (``<path>.tmp-<token>``) and renamed into place once
complete (``state.pt`` is written last): a crash never leaves a half-written checkpoint at the path. Replacing an
older one renames it aside first (``<path>.old-<token>``), then deletes it; a crash between the two renames leaves
two complete checkpoints beside the path, and ``exists``/``load`` put the newer one back.

Loading reads ``state.pt``, makes a target for each placeholder — laid out as the loading strategy shards that
parameter (``strategies.parameter_shards.load_target``: each worker reads its own chunk, whatever the number of
workers that wrote it), or a whole tensor (one process, or a strategy that does not shard) — and reads them
with torch's distributed checkpoint; then the same checks as for a file (``checkpoint.check``). torch's own
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, "out.pt")`` also converts the directory to one
file (its placeholders unfilled in ``state.pt``).

Example (every worker)::

    with ds.sharded_state_dict():
        state = {"format": checkpoint.FORMAT, "model": dm.state_dict(), ...}
    save(state, "runs/ckpt", strategy.cluster)               # a directory
    state = load("runs/ckpt", "checkpoint", target_for, strategy.cluster)
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil

import torch

from replicafit.strategies.distributed_checkpoint import PiecedValue, read_shards, write_shards
from replicafit.strategies.parameter_shards import is_sharded

from . import checkpoint

__all__ = ["STATE_FILE", "exists", "is_sharded_checkpoint", "load", "remove", "save", "set_aside", "variable_name"]

#: The file of a sharded checkpoint that holds everything but the sharded tensors (written last).
STATE_FILE = "state.pt"

_TEMPORARY = ".tmp-"
_REPLACED = ".old-"
_MARK = "__sharded__"
_PIECED = "__pieced__"


def is_sharded_checkpoint(path) -> bool:
    """Whether ``path`` is a sharded checkpoint (a directory holding ``state.pt``), not a file."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE_FILE))


def exists(path) -> bool:
    """Whether a checkpoint (a file or a sharded directory) is at ``path``, after putting back a sharded one that a
    crash left aside mid-replacement."""
    path = os.fspath(path)
    _recover(path)
    return os.path.exists(path)


# --- writing -------------------------------------------------------------------------------------------------
def _split(state) -> tuple:
    """``(skeleton, tensors)``: ``state`` with each sharded tensor replaced by a placeholder, and those tensors by
    key (the path of keys to it, ``/``-joined; a tensor met twice, such as tied weights, is written once)."""
    tensors: dict = {}
    keys: dict = {}

    def walk(value, where):
        if is_sharded(value):
            key = keys.get(id(value))
            if key is None:
                key = keys[id(value)] = "/".join(str(part) for part in where)
                tensors[key] = value
            return {_MARK: key, "shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
        if isinstance(value, PiecedValue):  # parts of sharded buffers (sharded optimizer states), each written once
            parts = []
            for index, (tensor, offset, start, stop) in enumerate(value.parts):
                key = keys.get(id(tensor))
                if key is None:
                    key = keys[id(tensor)] = "/".join(str(part) for part in (*where, f"part{index}"))
                    tensors[key] = tensor
                parts.append([key, int(offset), int(start), int(stop), list(tensor.shape)])
            return {_PIECED: parts, "shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
        if isinstance(value, dict):
            return {k: walk(v, (*where, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, (*where, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v, (*where, i)) for i, v in enumerate(value))
        return value

    return walk(state, ()), tensors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _placeholder_kind(value) -> str | None:
    if isinstance(value, dict) and set(value) in ({_MARK, "shape", "dtype"}, {_PIECED, "shape", "dtype"}):
        return _MARK if _MARK in value else _PIECED
    return None


def save(state: dict, path, cluster) -> str:
    """*Collective* (every worker, in the same order). Writes ``state`` as a sharded checkpoint at ``path`` (a
    directory; an older checkpoint there, file or directory, is replaced once the new one is complete); returns
    the path. Every worker must see ``path``'s folder (a shared file system across machines)."""
    path = os.path.abspath(os.fspath(path))
    token = cluster.broadcast(secrets.token_hex(4) if cluster.is_chief else None, "naming the sharded checkpoint")
    temporary = f"{path}{_TEMPORARY}{token}"
    skeleton, tensors = _split(state)
    if cluster.is_chief:
        os.makedirs(temporary, exist_ok=True)
    cluster.barrier("making the sharded checkpoint's folder")
    write_shards(tensors, temporary, cluster)
    if cluster.is_chief:
        checkpoint.save(skeleton, os.path.join(temporary, STATE_FILE))  # last: the mark of a complete checkpoint
        _put_in_place(temporary, path, token)
    cluster.barrier("writing the sharded checkpoint")
    return path


def _put_in_place(temporary: str, path: str, token: str) -> None:
    aside = None
    if os.path.lexists(path):
        aside = f"{path}{_REPLACED}{token}"
        os.rename(path, aside)
    os.rename(temporary, path)
    if aside is not None:
        _remove(aside)
    for stale in glob.glob(glob.escape(path) + _TEMPORARY + "*") + glob.glob(glob.escape(path) + _REPLACED + "*"):
        _remove(stale)  # left by saves that crashed (the chief writes one save at a time)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _recover(path: str) -> None:
    """Puts back the newest complete sharded checkpoint left beside ``path`` by a save that crashed between
    renaming the old one aside and renaming the new one in."""
    if os.path.lexists(path):
        return
    candidates = [
        c
        for c in glob.glob(glob.escape(path) + _REPLACED + "*") + glob.glob(glob.escape(path) + _TEMPORARY + "*")
        if is_sharded_checkpoint(c)
    ]
    if candidates:
        newest = max(candidates, key=lambda c: os.path.getmtime(os.path.join(c, STATE_FILE)))
        os.rename(newest, path)


def set_aside(path) -> str:
    """Renames the checkpoint at ``path`` aside (``<path>.old-<token>``, which ``exists`` puts back if nothing
    replaces it); returns the new name."""
    path = os.fspath(path)
    aside = f"{path}{_REPLACED}{secrets.token_hex(4)}"
    os.rename(path, aside)
    return aside


def remove(path) -> None:
    """Deletes the checkpoint at ``path`` (a file or a sharded directory), if any."""
    _remove(os.fspath(path))


# --- reading -------------------------------------------------------------------------------------------------
def _placeholders(skeleton) -> list:
    """``[(where, placeholder)]`` of every placeholder in ``skeleton`` (``where``: the path of keys to it)."""
    found = []

    def walk(value, where):
        if isinstance(value, dict):
            if _placeholder_kind(value) is not None:
                found.append((where, value))
                return
            for k, v in value.items():
                walk(v, (*where, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, (*where, i))

    walk(skeleton, ())
    return found


def _fill(skeleton, tensors: dict):
    def walk(value):
        if isinstance(value, dict):
            kind = _placeholder_kind(value)
            if kind == _MARK:
                return tensors[value[_MARK]]
            if kind == _PIECED:
                whole = torch.zeros(int(torch.Size(value["shape"]).numel()), dtype=getattr(torch, value["dtype"]))
                for key, offset, start, stop, _ in value[_PIECED]:
                    whole[start:stop] = tensors[key].reshape(-1)[offset : offset + stop - start]
                return whole.view(value["shape"])
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(skeleton)


def load(path, kind: str, target_for, cluster) -> dict:
    """*Collective.* The state of the sharded checkpoint at ``path``, checked as ``checkpoint.load`` checks a
    ``kind`` (a checkpoint a crashed replacement left aside is put back first by ``exists``, which the trainer's
    ``read_checkpoint`` calls on the chief). ``target_for(where, shape, dtype, skeleton)`` gives the tensor each
    sharded entry is read into (``where``: the path of keys to it in the state); ``CheckpointError`` for a missing
    or damaged checkpoint."""
    path = os.fspath(path)
    skeleton = checkpoint.read(os.path.join(path, STATE_FILE), kind)
    targets = {}
    for where, placeholder in _placeholders(skeleton):
        dtype = getattr(torch, str(placeholder["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise checkpoint.CheckpointError(f"The {kind} {path!r} names an unknown dtype {placeholder['dtype']!r}.")
        if _MARK in placeholder:
            targets.setdefault(placeholder[_MARK], target_for(where, placeholder["shape"], dtype, skeleton))
        else:  # the parts' buffers, read whole (each worker then keeps what its layout cuts of the value)
            for key, _, _, _, shape in placeholder[_PIECED]:
                targets.setdefault(key, torch.empty(shape, dtype=dtype))
    try:
        read_shards(targets, path, cluster)
    except Exception as error:  # noqa: BLE001 - torch raises several types for a damaged or foreign checkpoint
        raise checkpoint.CheckpointError(
            f"The sharded {kind} {path!r} cannot be read ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}): its shards are missing or damaged, "
            "or it was written for another model."
        ) from error
    state = _fill(skeleton, targets)
    checkpoint.check(state, kind, path)
    return state


def variable_name(where: tuple, skeleton) -> str | None:
    """The name of the model variable a sharded entry at ``where`` is laid out like: a model weight's key, or the
    variable of an optimizer slot (``{"variables": [...], "slots": {position: ...}}`` at any depth); else None."""
    if len(where) == 1:  # a weights file: the model's state dict itself
        return str(where[0])
    if len(where) >= 2 and where[0] == "model":
        return str(where[1])
    node = skeleton
    for index, part in enumerate(where):
        if isinstance(node, dict) and part == "slots" and "variables" in node and index + 1 < len(where):
            records = node["variables"]
            position = where[index + 1]
            if isinstance(records, list) and isinstance(position, int) and 0 <= position < len(records):
                return records[position].get("name")
            return None
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    return None
