"""TensorFlow 1's members of a strategy, kept for ported code: what ``Strategy``'s v1 methods do.

``experimental_run`` (one input per replica from one ``get_next()``), the v1 iterators
(``make_dataset_iterator``, ``make_input_fn_iterator``), ``group``, ``configure`` and
``update_config_proto``: the strategy's methods call these and keep their docstrings.

Example::

    iterator = strategy.make_dataset_iterator(batches)   # v1: get_next() per step
    strategy.experimental_run(step, iterator)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from . import nest
from .input_layer import input_layer
from .values import local_results
from .variables import Variable

__all__ = ["configure", "group", "make_dataset_iterator", "make_input_fn_iterator", "update_config_proto"]


def make_dataset_iterator(strategy, dataset):
    """An iterator (``get_next()``, ``initialize()``) over ``strategy.experimental_distribute_dataset(dataset)``."""
    return input_layer().v1_iterator(strategy.experimental_distribute_dataset(dataset))


def make_input_fn_iterator(strategy, input_fn, replication_mode=None):
    """An iterator over ``input_fn(InputContext)``'s per-replica batches (``PER_WORKER`` only, as TensorFlow)."""
    layer = input_layer()
    layer.check_replication_mode(replication_mode)
    return layer.v1_iterator(strategy.distribute_datasets_from_function(input_fn))


def group(value, devices) -> None:
    """Waits until the pending work on every device of ``value`` and ``devices`` is done (CUDA devices)."""
    for device in {t.device for t in _all_tensors(value)} | set(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def configure(strategy, session_config=None, cluster_spec=None, task_type=None, task_id=None) -> None:
    """Checks ``configure``'s arguments for a strategy of one process: a cluster of several tasks is refused."""
    if session_config is not None and not isinstance(session_config, Mapping):
        raise TypeError(f"session_config must be a mapping or None, got {type(session_config).__name__}.")
    if cluster_spec:
        if not isinstance(cluster_spec, Mapping):
            raise TypeError(f"cluster_spec must be a mapping of task type to addresses, got {cluster_spec!r}.")
        tasks = sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in cluster_spec.values())
        if tasks > 1:
            raise ValueError(
                f"{type(strategy).__name__} runs in one process; a cluster of {tasks} tasks needs "
                "MultiWorkerMirroredStrategy."
            )
    if task_id is not None and (not isinstance(task_id, int) or task_id < 0):
        raise ValueError(f"task_id must be a non-negative int, got {task_id!r}.")
    if task_type is not None and not isinstance(task_type, str):
        raise ValueError(f"task_type must be a string, got {task_type!r}.")


def update_config_proto(config):
    """An updated copy of a mapping of runtime settings (``config`` itself is never changed)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"update_config_proto() needs a mapping of settings, got {type(config).__name__}.")
    return copy.deepcopy(dict(config))


def _all_tensors(value):
    out = []
    for leaf in nest.flatten(value):
        for item in local_results(leaf):
            if isinstance(item, Variable):
                item = item.value()
            if isinstance(item, torch.Tensor):
                out.append(item)
    return out
