"""The data layer as the strategies' input layer: what a strategy's dataset methods hand their dataset to.

``strategy.experimental_distribute_dataset(dataset)`` and the other dataset methods of ``tf.distribute``'s
API live on the strategy, below this layer; the strategies reach these functions through the role
``"input layer"`` that the root package wires (``replicafit.layer_provider``), never by importing the data
layer. ``strategies/input_layer.py`` states the contract.

Example::

    from replicafit.data import input_layer
    batches = input_layer.distribute_dataset(strategy, loader, None)   # what the strategy's method returns
"""

from __future__ import annotations

from .input_lib import DistributedDataset, DistributedDatasetsFromFunction, NumpyDataset, make_v1_iterator
from .options import InputReplicationMode

__all__ = [
    "check_replication_mode",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "numpy_dataset",
    "v1_iterator",
]


def distribute_dataset(strategy, dataset, options) -> DistributedDataset:
    """``strategy.experimental_distribute_dataset(dataset, options)``: global batches split across its replicas."""
    return DistributedDataset(dataset, strategy, options)


def distribute_datasets_from_function(strategy, dataset_fn, options) -> DistributedDatasetsFromFunction:
    """``strategy.distribute_datasets_from_function(dataset_fn, options)``: per-replica batches."""
    return DistributedDatasetsFromFunction(dataset_fn, strategy, options)


def numpy_dataset(numpy_input) -> NumpyDataset:
    """``strategy.experimental_make_numpy_dataset(numpy_input)``."""
    return NumpyDataset(numpy_input)


def v1_iterator(distributed):
    """The TensorFlow 1 iterator (``get_next()``, ``initialize()``) over a distributed dataset."""
    return make_v1_iterator(distributed)


def check_replication_mode(mode) -> None:
    """Accepts ``make_input_fn_iterator``'s replication mode: ``PER_WORKER`` (or ``None``) only, as TensorFlow."""
    mode = InputReplicationMode.PER_WORKER if mode is None else mode
    if not isinstance(mode, InputReplicationMode) and mode in ("PER_WORKER", "PER_REPLICA"):
        mode = InputReplicationMode(mode)
    if mode is not InputReplicationMode.PER_WORKER:
        raise ValueError(f"Input replication mode not supported: {mode!r}")
