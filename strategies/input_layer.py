"""The input layer a strategy hands its datasets to, reached as a role, never imported.

``tf.distribute``'s API puts the dataset methods on the strategy (``experimental_distribute_dataset``,
``distribute_datasets_from_function``, ``experimental_make_numpy_dataset`` and the TensorFlow 1 iterators),
but the code that splits global batches across replicas and workers is the data layer, built on the
strategies and so above them. A strategy asks for the role ``"input layer"``, which the root package wires
to ``replicafit.data.input_layer``; the module that plays it provides:

==============================================================  ============================================
function                                                        what it returns
==============================================================  ============================================
``distribute_dataset(strategy, dataset, options)``              the ``DistributedDataset`` of global batches
``distribute_datasets_from_function(strategy, fn, options)``    per-replica batches from ``fn(InputContext)``
``numpy_dataset(numpy_input)``                                  an unbatched dataset of tensor nests
``v1_iterator(distributed)``                                    the TensorFlow 1 iterator over one of these
``check_replication_mode(mode)``                                raises unless ``PER_WORKER``
==============================================================  ============================================

Example::

    >>> from replicafit.strategies.input_layer import input_layer
    >>> input_layer().__name__
    'replicafit.data.input_layer'
"""

from __future__ import annotations

import replicafit

__all__ = ["input_layer"]


def input_layer():
    """The module that plays the input layer (imported on first use)."""
    return replicafit.layer_provider("input layer")
