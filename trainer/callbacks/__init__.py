"""Callbacks with Keras' hooks: progress, history, checkpoints, early stopping, resuming.

Every decision a callback takes (stop, change the learning rate, write a checkpoint)
reads ``logs``, which the trainer computes once from metric values aggregated over every
replica and every worker, so every replica and every worker agrees. Across workers only the
chief (worker 0) writes files and prints, and ``stop_training`` set on any worker stops every
worker: at each epoch's end, and after every step where a callback that is not a built-in acting
on the logs alone might set it on one worker only (``may_stop_training_alone``).

One callback per module (``early_stopping.py``, ...); the callbacks that read a monitored value
share ``monitor_callback.py``, the experiment trackers (``MLflowLogger``, ``WandbLogger``) ``tracker.py``. This
package re-exports them.

Example::

    history = trainer.fit(model, (x, y), epochs=50, validation_split=0.2, callbacks=[
        EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
        ModelCheckpoint("ckpt/epoch{epoch:02d}-{val_loss:.3f}.pt", save_best_only=True),
        BackupAndRestore("backup/"),
    ])
"""

from __future__ import annotations

from .backup_and_restore import BackupAndRestore
from .callback import Callback
from .callback_list import CallbackList
from .callback_list import may_stop_training_alone as may_stop_training_alone  # the trainer's, outside __all__
from .callback_list import may_touch_variables_between_steps as may_touch_variables_between_steps  # the trainer's
from .csv_logger import CSVLogger
from .early_stopping import EarlyStopping
from .history import History
from .lambda_callback import LambdaCallback
from .learning_rate_scheduler import LearningRateScheduler
from .mlflow_logger import MLflowLogger
from .model_checkpoint import ModelCheckpoint
from .progbar_logger import ProgbarLogger
from .progbar_logger import resolve_verbose as resolve_verbose  # the trainer's, outside __all__
from .reduce_lr_on_plateau import ReduceLROnPlateau
from .swap_ema_weights import SwapEMAWeights
from .tensorboard import TensorBoard
from .terminate_on_nan import TerminateOnNaN
from .torch_lr_scheduler import TorchLRScheduler
from .wandb_logger import WandbLogger

__all__ = [
    "Callback",
    "CallbackList",
    "History",
    "ProgbarLogger",
    "ModelCheckpoint",
    "EarlyStopping",
    "LearningRateScheduler",
    "ReduceLROnPlateau",
    "CSVLogger",
    "TerminateOnNaN",
    "LambdaCallback",
    "BackupAndRestore",
    "SwapEMAWeights",
    "TorchLRScheduler",
    "TensorBoard",
    "MLflowLogger",
    "WandbLogger",
]
