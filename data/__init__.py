"""The distributed dataset layer: sources of global batches, the split across replicas, what each
worker reads (``AutoShardPolicy``, ``sharding.py``: by default only its replicas' rows), prefetch.
Hugging Face ``datasets`` are sources too (``hugging_face.py``), their rows collated by ``collate_rows`` or
by the collator a ``CollatedDataset`` carries (``collation.py``).

Example::

    import replicafit.strategies as ds
    from replicafit.data import as_global_batches
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    batches = as_global_batches((x, y), batch_size=64, shuffle=True, seed=0)
    for xb, yb in strategy.experimental_distribute_dataset(batches):   # leaves are PerReplica
        strategy.run(step, args=(xb, yb))
"""

from . import datasets
from .collation import CollatedDataset, collate_rows
from .input_lib import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    InputWorkers,
    NumpyDataset,
    make_v1_iterator,
    split_global_batch,
    split_sizes,
)
from .options import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode
from .sources import (
    ArrayBatches,
    DatasetBatches,
    IterableBatches,
    as_global_batches,
    as_tensor,
    epoch_permutation,
    is_array_nest,
)

__all__ = [
    "ArrayBatches",
    "AutoShardPolicy",
    "CollatedDataset",
    "DatasetBatches",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "InputWorkers",
    "IterableBatches",
    "NumpyDataset",
    "as_global_batches",
    "as_tensor",
    "collate_rows",
    "datasets",
    "epoch_permutation",
    "is_array_nest",
    "make_v1_iterator",
    "split_global_batch",
    "split_sizes",
]
