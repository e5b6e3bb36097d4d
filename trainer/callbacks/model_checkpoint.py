"""``ModelCheckpoint``: saves the model (or the whole trainer) every epoch or every ``save_freq`` steps, or
only when the monitored value improves.
"""

from __future__ import annotations

import os

from replicafit.strategies.parameter_shards import sharded_state_dict

from ._periodic import _Periodic
from .callback import _AttributeState
from .monitor_callback import MonitorCallback


class ModelCheckpoint(_AttributeState, _Periodic, MonitorCallback):
    """Saves a checkpoint after every epoch (or every ``save_freq`` steps).

    ``filepath`` may name ``{epoch}`` and any log key (``"ckpt-{epoch:02d}-{val_loss:.3f}.pt"``).
    ``save_best_only`` keeps only improvements of ``monitor`` (``mode`` min/max/auto).
    ``save_weights_only`` writes the model's state dict alone; otherwise a full trainer
    checkpoint (model, optimizer, epoch, RNG). Files are written atomically; under a strategy that writes
    sharded checkpoints (``FullyShardedStrategy``) each is a sharded checkpoint directory at the path instead
    (``trainer.sharded_checkpoint``: every worker writes its shards; ``Trainer.load_checkpoint`` reads it on any
    number of workers, ``trainer.save_checkpoint`` exports one file). With ``save_best_only``, a
    ``monitor`` missing from the logs is a ``UserWarning`` once per fit (the logged names and a close one,
    as Keras warns), and nothing is saved while it is missing. Checkpoints and backups keep its state (the
    best value, the steps counted towards ``save_freq``).
    """

    leaves_variables_alone = _Periodic.leaves_variables_alone  # saves within epochs only with a step save_freq

    _STATE = ("best", "_steps")
    _decides_from_logs = True
    _monitor_owner = "ModelCheckpoint(save_best_only=True)"
    _without_monitor = "No checkpoint is saved while it is missing."

    def __init__(
        self,
        filepath,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold=None,
    ):
        super().__init__(save_freq, monitor=monitor)
        self.filepath = os.fspath(filepath)
        self.verbose = verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.mode = self._resolve_mode(mode)
        self.best = initial_value_threshold

    def _on_step(self, epoch, batch, logs):
        self._save(epoch, logs, batch=batch)

    def _on_epoch(self, epoch, logs):
        self._save(epoch, logs)

    def _save(self, epoch, logs, batch=None):
        path = self.filepath.format(epoch=epoch + 1, batch=(batch or 0) + 1, **logs)
        if self.save_best_only:
            current = self._monitor_value(logs, per_step="save_freq='epoch'" if batch is not None else "")
            if current is None or not self._is_improvement(current, self.best):
                return
            self.best = current
        # Under a strategy that shards parameters, a sharded checkpoint directory at the path (every worker writes
        # its shards; trainer.save_checkpoint(path) exports one file when one is wanted).
        capabilities = self.trainer.strategy.extended.capabilities
        if self.save_weights_only:  # (sharded only where the weights are: a file that torch.load reads otherwise)
            with sharded_state_dict():  # (sharded parameters stay sharded: nothing gathered for a directory)
                state = self.trainer.model_state_dict()  # every worker takes part
            self.trainer.write_checkpoint(state, path, sharded=capabilities.shards_parameters)
        else:
            self.trainer.save_checkpoint(path, sharded=capabilities.sharded_checkpoints)
        if self.verbose:
            self._print(f"Epoch {epoch + 1}: saved {path}")
