"""replicafit: TensorFlow's ``tf.distribute`` programming model and Keras-style training on PyTorch.

One import root for everything. The packages are ``replicafit.strategies`` (the
distribution runtime), ``replicafit.data`` (distributed datasets), ``replicafit.optimizers``
(distribution-aware optimizers), ``replicafit.trainer`` (``Trainer.fit``, callbacks),
``replicafit.recipes`` (YAML recipes: a run in one file) and ``replicafit.cli`` (the
``replicafit`` command). The everyday names are re-exported here and loaded on first use, so
``import replicafit`` itself imports nothing heavy (not even torch).

Example::

    import replicafit as rf

    strategy = rf.MirroredStrategy(["cpu:0", "cpu:1"])
    trainer = rf.Trainer(strategy=strategy, optimizer=rf.optimizers.Adam(1e-3), metrics=["accuracy"], seed=0)
    history = trainer.fit(model, (x, y), batch_size=64, epochs=5, validation_split=0.2)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_SUBPACKAGES = ("strategies", "data", "optimizers", "trainer")

# public name -> the package that defines it (loaded on first access)
_EXPORTS = {
    # the distribution runtime
    "Strategy": "strategies",
    "OneDeviceStrategy": "strategies",
    "MirroredStrategy": "strategies",
    "CentralStorageStrategy": "strategies",
    "FullyShardedStrategy": "strategies",
    "MultiWorkerMirroredStrategy": "strategies",
    "WorkerFailedError": "strategies",
    "ReduceOp": "strategies",
    "Variable": "strategies",
    "VariableAggregation": "strategies",
    "VariableSynchronization": "strategies",
    "CommunicationOptions": "strategies",
    "PerReplica": "strategies",
    "Mirrored": "strategies",
    "get_strategy": "strategies",
    "has_strategy": "strategies",
    "get_replica_context": "strategies",
    "in_cross_replica_context": "strategies",
    # training
    "Trainer": "trainer",
    "Callback": "trainer",
    "EarlyStopping": "trainer",
    "ModelCheckpoint": "trainer",
    "BackupAndRestore": "trainer",
    "TensorBoard": "trainer",
    "summary": "trainer",
}

# literal, so that type checkers see the lazily loaded names too (a test keeps it equal to the tables)
__all__ = [
    "__version__",
    "strategies",
    "data",
    "optimizers",
    "trainer",
    "Strategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "CentralStorageStrategy",
    "FullyShardedStrategy",
    "MultiWorkerMirroredStrategy",
    "WorkerFailedError",
    "ReduceOp",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "CommunicationOptions",
    "PerReplica",
    "Mirrored",
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "in_cross_replica_context",
    "Trainer",
    "Callback",
    "EarlyStopping",
    "ModelCheckpoint",
    "BackupAndRestore",
    "TensorBoard",
    "summary",
]


# The layers, from the bottom: strategies; data and optimizers on them (neither on the other); trainer; recipes;
# cli. A module imports its own layer and those below only (tests/test_layering.py). One call goes up: a
# strategy's dataset methods (experimental_distribute_dataset, ...) hand the dataset to the data layer, which is
# built on the strategies. The strategies ask for the role and the root, above every layer, names its module.
_ROLES = {"input layer": f"{__name__}.data.input_layer"}


def layer_provider(role: str):
    """The module that plays ``role`` for a lower layer, imported on first use: the one way a layer reaches a
    higher one (the strategies' dataset methods reach the data layer as ``"input layer"``).

    Example::

        >>> import replicafit
        >>> replicafit.layer_provider("input layer").__name__
        'replicafit.data.input_layer'
    """
    try:
        return importlib.import_module(_ROLES[role])
    except KeyError:
        raise LookupError(f"No layer of replicafit plays {role!r}; the roles are {sorted(_ROLES)}.") from None


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        module = importlib.import_module(f"{__name__}.{name}")
    elif name in _EXPORTS:
        module = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = module  # later lookups skip __getattr__
    return module


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names load lazily
    from . import data, optimizers, strategies, trainer
    from .strategies import (
        CentralStorageStrategy,
        CommunicationOptions,
        FullyShardedStrategy,
        Mirrored,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        PerReplica,
        ReduceOp,
        Strategy,
        Variable,
        VariableAggregation,
        VariableSynchronization,
        WorkerFailedError,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from .trainer import BackupAndRestore, Callback, EarlyStopping, ModelCheckpoint, TensorBoard, Trainer, summary
