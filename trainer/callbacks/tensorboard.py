"""``TensorBoard``: Keras' callback, writing with ``torch.utils.tensorboard``.

Needs the optional ``tensorboard`` package (``pip install 'replicafit[tensorboard]'``).
The layout is Keras 3's, so dashboards and habits carry over:

- ``log_dir/train``: ``epoch_loss``, ``epoch_<metric>``, ``epoch_learning_rate`` at step
  ``epoch``; with ``update_freq`` a number of batches (or ``"batch"``: every one),
  ``batch_loss`` and ``batch_<metric>`` at step ``optimizer.iterations``; weight histograms
  ``<parameter name>/histogram`` every ``histogram_freq`` epochs.
- ``log_dir/validation``: ``epoch_loss``, ``epoch_<metric>`` of the validation data at step
  ``epoch``, and ``evaluation_<name>_vs_iterations`` at step ``optimizer.iterations`` after
  every evaluation (fit's validation and ``evaluate``).

Example::

    trainer.fit(model, (x, y), epochs=10, validation_split=0.2, callbacks=[TensorBoard("logs/run1")])
    # then: tensorboard --logdir logs

Differences from Keras: ``write_graph``, ``write_images``, ``profile_batch`` and the
embedding projector are not offered (use ``torch.profiler`` for profiles); batch-level
scalars use ``optimizer.iterations`` as their step, so a resumed or repeated ``fit`` goes on
where the last one ended instead of starting again at 0. Only the processes whose strategy
says ``extended.should_save_summary`` write (the chief, ``cluster.is_chief``, by default).
"""

from __future__ import annotations

import os
import time

from .callback import Callback

__all__ = ["TensorBoard"]


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "The TensorBoard callback needs the `tensorboard` package, which is an optional extra: "
            "pip install 'replicafit[tensorboard]' (or pip install tensorboard)."
        ) from error
    return SummaryWriter


class TensorBoard(Callback):
    """Logs losses, metrics, the learning rate and (optionally) weight histograms for TensorBoard.

    Args:
      log_dir: where the event files go (``train/`` and ``validation/`` inside).
      histogram_freq: every how many epochs to write weight histograms (0: never).
      write_steps_per_second: also log training steps per second (per epoch, and per batch
        when batch-level scalars are on).
      update_freq: ``"epoch"`` (default), ``"batch"``, or a number of batches between
        batch-level scalars. Batch-level logging reads the metrics every batch, which costs
        a host synchronisation per step.

    Example::

        TensorBoard(log_dir="logs", update_freq=50, histogram_freq=1)
    """

    _decides_from_logs = True

    def __init__(
        self,
        log_dir="logs",
        histogram_freq: int = 0,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
    ):
        super().__init__()
        self._writer_class = _summary_writer_class()  # fails here, with the install hint, not mid-training
        if isinstance(histogram_freq, bool) or not isinstance(histogram_freq, int) or histogram_freq < 0:
            raise ValueError(f"histogram_freq must be a non-negative integer, got {histogram_freq!r}.")
        if update_freq not in ("epoch", "batch") and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(f"update_freq must be 'epoch', 'batch' or a positive integer, got {update_freq!r}.")
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = 1 if update_freq == "batch" else update_freq
        if self.update_freq != "epoch":
            # Only then does the trainer read metrics per batch (see CallbackList.wants_batch_logs).
            self.on_train_batch_begin = self._batch_begin
            self.on_train_batch_end = self._batch_end
        self._writers: dict = {}
        self._fitting = False
        self._epoch_start = self._batch_start = 0.0
        self._epoch_iterations = 0

    # --- writers --------------------------------------------------------------------------
    def _writer(self, which: str):
        """The ``train`` or ``validation`` writer (made on first use: no empty event files)."""
        if which not in self._writers:
            self._writers[which] = self._writer_class(os.path.join(self.log_dir, which))
        return self._writers[which]

    def _writes(self) -> bool:
        return self.trainer is None or self.trainer.strategy.extended.should_save_summary

    def _scalars(self, which: str, prefix: str, logs: dict, step: int, suffix: str = "") -> None:
        if not self._writes():
            return
        writer = self._writer(which)
        for name, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                writer.add_scalar(f"{prefix}{name}{suffix}", value, step)

    def _close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    def _iterations(self) -> int:
        return int(self.trainer.optimizer.iterations)

    # --- hooks ------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        """Notes that a ``fit`` runs: its validations' ``on_test_end`` then leaves the writers open."""
        self._fitting = True

    def on_train_end(self, logs=None):
        """Closes the event files."""
        self._fitting = False
        self._close()

    def on_epoch_begin(self, epoch, logs=None):
        """Starts the epoch's clock and notes ``optimizer.iterations`` (for ``steps_per_second``)."""
        self._epoch_start = time.perf_counter()
        self._epoch_iterations = self._iterations()

    def _batch_begin(self, batch, logs=None):
        self._batch_start = time.perf_counter()

    def _batch_end(self, batch, logs=None):
        step = self._iterations()
        if step % self.update_freq:
            return
        logs = dict(logs or {})
        if self.write_steps_per_second:
            logs["steps_per_second"] = 1.0 / max(time.perf_counter() - self._batch_start, 1e-9)
        self._scalars("train", "batch_", logs, step)

    def on_epoch_end(self, epoch, logs=None):
        """Writes the epoch's scalars at step ``epoch``: the training logs, the optimizer's current learning
        rate (and ``steps_per_second``) as ``train/epoch_<name>``, the ``val_`` logs as
        ``validation/epoch_<name>``; weight and floating buffer histograms every ``histogram_freq`` epochs
        (epoch 0 included); then flushes the files."""
        logs = logs or {}
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        train["learning_rate"] = float(self.trainer.optimizer.learning_rate)
        if self.write_steps_per_second:
            elapsed = max(time.perf_counter() - self._epoch_start, 1e-9)
            train["steps_per_second"] = (self._iterations() - self._epoch_iterations) / elapsed
        self._scalars("train", "epoch_", train, epoch)
        validation = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        if validation:
            self._scalars("validation", "epoch_", validation, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            # Sharded parameters are gathered whole by every worker (a collective), then the chief writes them.
            gathered = self.trainer.model_state_dict() if self._sharded() else None
            if self._writes():
                self._histograms(epoch, gathered)
        for writer in self._writers.values():
            writer.flush()

    def on_test_end(self, logs=None):
        """Writes the evaluation's logs as ``validation/evaluation_<name>_vs_iterations`` at step
        ``optimizer.iterations`` (after ``fit``'s validations and ``evaluate``); a standalone ``evaluate``
        then closes the files."""
        self._scalars("validation", "evaluation_", logs or {}, self._iterations(), suffix="_vs_iterations")
        if not self._fitting:  # a standalone evaluate(): nothing more will come
            self._close()

    def _sharded(self) -> bool:
        return self.trainer.strategy.extended.capabilities.shards_parameters

    def _histograms(self, epoch: int, gathered=None) -> None:
        writer = self._writer("train")
        if gathered is not None:  # whole values of a sharded model, every worker's part gathered
            tensors = [(name, value) for name, value in gathered.items() if value.is_floating_point()]
        else:
            tensors = list(self.model.named_parameters()) + [
                (name, buffer) for name, buffer in self.model.named_buffers() if buffer.is_floating_point()
            ]
        for name, tensor in tensors:
            writer.add_histogram(f"{name}/histogram", tensor.detach().float().cpu(), epoch)
