"""The states of a torchmetrics metric, read and combined as torchmetrics' own synchronisation would: what
``TorchMetric`` (``torch_metrics.py``) moves between its per-replica copies, the workers and backups.

A metric's states are those it declared with ``add_state`` and those of the metrics inside it (a
``CompositionalMetric`` such as ``MeanSquaredError() + MeanAbsoluteError()``, a wrapper such as
``BinaryTargetTransformer``), each named by its key: ``"tp"``, or ``"metric_a.total"`` for a state of a
metric inside. Each has its default (a tensor, or a list: a list state) and its reduction
(``dist_reduce_fx``).

Combining (``combine``) follows torchmetrics' ``_sync_dist``: tensor states stacked over the replicas and
reduced (a reduction of None keeps the stack); list states gathered element by element in the input's order
(step by step, replica by replica in global replica order) and reduced (``"cat"``: concatenated). A part
restored from a backup (``restored_part``) counts as one replica before the others: its tensor states hold
the reduced value (a reduction of None: its stack), its list states one element per step that was saved.

Example::

    keys = state_keys(metric)                       # {"tp": ("", "tp"), ...}
    parts = [local_part(copy, marks, keys, crossing=False) for copy, marks in zip(copies, all_marks)]
    states = combine(reader, keys, parts, device)   # {"tp": tensor, ...}
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "state_keys",
    "get",
    "put",
    "default",
    "reduction",
    "reduction_name",
    "metrics_in",
    "list_lengths",
    "local_part",
    "restored_part",
    "combine",
]

RESTORED = "__restored__"  # the key marking a part restored from a backup


def metrics_in(metric) -> list:
    """The torchmetrics metrics of ``metric``, itself first, then those inside it (by ``named_modules``)."""
    base = sys.modules["torchmetrics"].Metric
    return [module for _, module in metric.named_modules() if isinstance(module, base)]


def state_keys(metric) -> dict:
    """``{key: (path of the metric that holds it, state name)}`` of every state of ``metric`` and of the
    metrics inside it."""
    base = sys.modules["torchmetrics"].Metric
    keys = {}
    for path, module in metric.named_modules():
        if isinstance(module, base):
            for name in _declared(module):
                keys[f"{path}.{name}" if path else name] = (path, name)
    return keys


def _declared(module) -> dict:
    return module._defaults  # private: torchmetrics' declared states and their defaults (no public accessor)


def _owner(metric, path: str):
    return metric.get_submodule(path) if path else metric


def get(metric, keys: dict, key: str):
    """The state ``key`` of ``metric``."""
    path, name = keys[key]
    return getattr(_owner(metric, path), name)


def put(metric, keys: dict, key: str, value) -> None:
    """Sets the state ``key`` of ``metric``."""
    path, name = keys[key]
    setattr(_owner(metric, path), name, value)


def default(metric, keys: dict, key: str):
    """The state's default (a list: a list state)."""
    path, name = keys[key]
    return _declared(_owner(metric, path))[name]


def reduction(metric, keys: dict, key: str):
    """The state's ``dist_reduce_fx`` as torchmetrics keeps it (a function, or None)."""
    path, name = keys[key]
    return _owner(metric, path)._reductions[name]  # private: torchmetrics' reduction per state (no accessor)


def reduction_name(metric, keys: dict, key: str) -> str:
    """``"dim_zero_sum"``, ``"dim_zero_cat"``, ... (``""`` for None or a function of one's own)."""
    function = reduction(metric, keys, key)
    return getattr(function, "__name__", "") if function is not None else ""


def list_lengths(metric, keys: dict) -> dict:
    """``{key: length}`` of the list states: a mark recorded after each update (``local_part`` reads which
    elements each update appended from consecutive marks)."""
    lengths = {}
    for key in keys:
        value = get(metric, keys, key)
        if isinstance(value, list):
            lengths[key] = len(value)
    return lengths


def local_part(metric, marks: list, keys: list, all_keys: dict, crossing: bool) -> dict:
    """One copy's ``keys`` states, for ``combine``: tensor states as they are; a list state as its elements
    flattened into one tensor, with each element's shape and how many elements each update appended (on the
    CPU when the part crosses workers)."""
    part = {}
    for key in keys:
        value = get(metric, all_keys, key)
        if isinstance(value, torch.Tensor):
            part[key] = value.detach().cpu() if crossing else value.detach()
            continue
        counts, start = [], 0
        for mark in marks:
            end = mark.get(key, start)
            counts.append(end - start)
            start = end
        if start < len(value):  # appended outside an update_state (a load): one step of its own
            counts.append(len(value) - start)
        rows = torch.cat([element.detach().reshape(-1) for element in value]) if value else None
        if crossing and rows is not None:
            rows = rows.cpu()
        part[key] = (rows, [tuple(element.shape) for element in value], counts)
    return part


def restored_part(states: dict, reader, keys: dict) -> dict:
    """A part holding ``states`` restored from a backup (``combine`` counts it before the replicas): its list
    states one element (the saved rows) at the first step."""
    part = {RESTORED: True}
    for key, value in states.items():
        if isinstance(default(reader, keys, key), list):
            part[key] = (value.reshape(-1), [tuple(value.shape)], [1]) if value.numel() else (None, [], [])
        else:
            part[key] = value
    return part


def combine(reader, keys: dict, names: list, parts: list, device, reduce: bool = True) -> dict:
    """The ``names`` states of ``parts`` (``local_part`` of every replica in global replica order, after any
    ``restored_part``) combined by their reductions (module docstring); ``reduce=False`` leaves list states
    concatenated, as a backup keeps them."""
    states = {}
    for key in names:
        function = reduction(reader, keys, key)
        values = [(part[key], RESTORED in part) for part in parts if key in part]
        if isinstance(default(reader, keys, key), torch.Tensor):
            pieces = [
                value.to(device) if restored and function is None else value.to(device).unsqueeze(0)
                for value, restored in values
            ]
            stacked = torch.cat(pieces)
            states[key] = function(stacked) if function is not None else stacked
            continue
        ordered = _in_input_order([value for value, _ in values], device)
        if not reduce or getattr(function, "__name__", "") == "dim_zero_cat":
            states[key] = torch.cat([_at_least_1d(element) for element in ordered]) if ordered else []
        else:
            states[key] = function(ordered) if function is not None else ordered
    return states


def _in_input_order(values: list, device) -> list:
    """The elements of every part's list state, step by step, part by part."""
    per_part = []
    for rows, shapes, counts in values:
        sizes = [_numel(shape) for shape in shapes]
        flat = list(torch.split(rows.to(device), sizes)) if rows is not None else []
        elements = [piece.reshape(shape) for piece, shape in zip(flat, shapes)]
        steps, start = [], 0
        for count in counts:
            steps.append(elements[start : start + count])
            start += count
        per_part.append(steps)
    longest = max((len(steps) for steps in per_part), default=0)
    return [element for step in range(longest) for steps in per_part if step < len(steps) for element in steps[step]]


def _numel(shape: tuple) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _at_least_1d(value: torch.Tensor) -> torch.Tensor:
    return value.unsqueeze(0) if value.dim() == 0 else value
