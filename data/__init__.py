"""The distributed dataset layer: split global batches across replicas, place them.

Example::

    import strategies as ds
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    for x, y in strategy.experimental_distribute_dataset(loader):   # leaves are PerReplica
        strategy.run(step, args=(x, y))
"""

from .input_lib import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    NumpyDataset,
    make_v1_iterator,
    split_sizes,
)
from .options import InputContext, InputOptions, InputReplicationMode

__all__ = [
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "NumpyDataset",
    "make_v1_iterator",
    "split_sizes",
]
