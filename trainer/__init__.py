"""Keras-style training on the distribution runtime: ``Trainer(...).fit(model, dataset)``.

Example::

    from replicafit.trainer import Trainer
    trainer = Trainer(strategy=strategy, optimizer="adam", loss="cross_entropy", metrics=["accuracy"], seed=0)
    history = trainer.fit(model, (x, y), batch_size=64, epochs=10, validation_split=0.2)

Rooms: the training core is ``trainer.py`` (``Trainer``: its steps, ``fit``, ``evaluate``, ``predict``), which
composes a few objects of their own: ``compile_loss.py`` (``CompileLoss``: the loss per output, an element-level
loss's reduction), ``compile_metrics.py`` (``CompileMetrics``: the loss trackers and metrics),
``input_checks.py`` (``InputChecks``: the checks on the first batch), ``training_state.py``
(``TrainingState``: where training stands, what checkpoints and backups keep, with ``replica_states.py``) and,
per fit, ``fit_loop.py`` (``FitLoop``: the epochs, steps, validation and preemption under a ``FitPlan``);
beside them ``arguments.py`` (the plain arguments at the entry), ``inputs.py`` (the data as the trainer
reads it, its ``Cursor``) and ``model_io.py`` (the model's inputs and outputs). Then ``callbacks/`` (every
callback, one per file, a shared monitor base; ``TensorBoard`` among them, and the trackers ``MLflowLogger`` and
``WandbLogger``), ``losses.py``, ``metrics.py``,
``checkpoint.py`` (the file format), ``model_summary.py`` (``summary``), ``preemption.py`` (saving before
preemption) and ``spelling.py`` (the did-you-mean hint of error messages). The recipe system
(``replicafit.recipes``) and the ``replicafit`` command with its launcher (``replicafit.cli``) live in packages
of their own above this one.
"""

from . import callbacks, checkpoint, losses, metrics
from . import preemption as _preemption
from .callbacks import (
    BackupAndRestore,
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    LambdaCallback,
    LearningRateScheduler,
    MLflowLogger,
    ModelCheckpoint,
    ProgbarLogger,
    ReduceLROnPlateau,
    SwapEMAWeights,
    TensorBoard,
    TerminateOnNaN,
    TorchLRScheduler,
    WandbLogger,
)
from .checkpoint import CheckpointError
from .model_summary import ModelSummary, summary
from .preemption import Preempted
from .torch_metrics import TorchMetric
from .trainer import Trainer

#: The exit status of a run that saved its backup and stopped on a preemption signal
#: (``BackupAndRestore(save_before_preemption=...)``): 75, ``EX_TEMPFAIL`` ("try again"). ``fit``
#: raises ``Preempted`` with it; the command and the ``--workers`` launcher exit with it, and a
#: batch script requeues the job on it.
PREEMPTED_EXIT_STATUS = _preemption.PREEMPTED_EXIT_STATUS

__all__ = [
    "PREEMPTED_EXIT_STATUS",
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "CheckpointError",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "MLflowLogger",
    "ModelCheckpoint",
    "ModelSummary",
    "Preempted",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "SwapEMAWeights",
    "TensorBoard",
    "TerminateOnNaN",
    "TorchLRScheduler",
    "TorchMetric",
    "Trainer",
    "WandbLogger",
    "callbacks",
    "checkpoint",
    "losses",
    "metrics",
    "summary",
]
