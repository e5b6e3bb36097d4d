"""``SwapEMAWeights``: evaluates (and, with ``swap_on_epoch``, checkpoints) with the optimizer's moving averages."""

from __future__ import annotations

from replicafit.strategies import context

from .callback import Callback


class SwapEMAWeights(Callback):
    """Evaluates (and, with ``swap_on_epoch``, checkpoints) with the optimizer's moving averages (Keras 3's).

    Needs an optimizer with ``use_ema=True``. Validation inside ``fit`` and ``evaluate``
    (with this callback) run with the averages swapped into the model, and the trained
    values come back after. With ``swap_on_epoch=True`` the averages are also in the model
    from the end of each epoch to the start of the next, so the callbacks after this one
    (``ModelCheckpoint``, ``EarlyStopping(restore_best_weights=True)``) see and keep the
    averaged weights: put it first in the list. Training itself always continues from the
    trained values, and ``BackupAndRestore`` backs those up, so a resumed run equals the
    uninterrupted one.

    Unlike Keras 3, the swap keeps the averages where they are (it saves the trained values
    aside instead of exchanging them), so stopping early with ``swap_on_epoch`` still ends
    with the averages in the model.

    Example::

        trainer = Trainer(optimizer=optimizers.Adam(1e-3, use_ema=True), metrics=["accuracy"])
        trainer.fit(model, data, validation_split=0.2, callbacks=[
            SwapEMAWeights(swap_on_epoch=True),
            ModelCheckpoint("best.pt", monitor="val_accuracy", save_best_only=True),
        ])

    Without a callback: ``with optimizer.averaged_weights(): trainer.evaluate(model, data)``.
    """

    def __init__(self, swap_on_epoch: bool = False):
        super().__init__()
        if not isinstance(swap_on_epoch, bool):
            raise TypeError(f"`swap_on_epoch` must be True or False, got {swap_on_epoch!r}.")
        self.swap_on_epoch = swap_on_epoch
        self._mine = None  # "test" or "epoch": why this callback swapped the averages in

    def _optimizer(self):
        optimizer = self.trainer.optimizer
        if not optimizer.use_ema:
            raise ValueError(
                "SwapEMAWeights needs an optimizer with use_ema=True (e.g. optimizers.Adam(1e-3, use_ema=True)); "
                f"the trainer's {type(optimizer).__name__} keeps no moving averages."
            )
        return optimizer

    def _swap_in(self, why: str) -> None:
        optimizer = self._optimizer()
        if not optimizer.averages_swapped_in:
            with _in_strategy(self.trainer):
                optimizer.swap_in_averages(None, "SwapEMAWeights")
            self._mine = why

    def _swap_out(self, why: str) -> None:
        if self._mine == why:
            self._mine = None
            with _in_strategy(self.trainer):
                self._optimizer().swap_out_averages()

    def on_train_begin(self, logs=None):
        """Checks that the optimizer keeps moving averages (``ValueError`` before the first epoch otherwise),
        and puts back the trained values where a failed earlier ``fit`` left the averages swapped in."""
        optimizer = self._optimizer()  # a missing use_ema is an error before the first epoch, not after it
        if optimizer.averages_swapped_in:  # left swapped in by a fit that failed between epochs
            with _in_strategy(self.trainer):
                optimizer.swap_out_averages()
        self._mine = None

    def on_epoch_begin(self, epoch, logs=None):
        """Puts the trained values back where ``swap_on_epoch`` swapped the averages in at the last epoch's end:
        training continues from them."""
        self._swap_out("epoch")

    def on_epoch_end(self, epoch, logs=None):
        """With ``swap_on_epoch``, swaps the averages into the model until the next epoch's start, so the
        callbacks after this one see them (validation has run already, with the averages)."""
        if self.swap_on_epoch:
            self._swap_in("epoch")

    def on_test_begin(self, logs=None):
        """Swaps the averages into the model for the evaluation (``evaluate``, ``fit``'s validation), unless
        they are in it already."""
        self._swap_in("test")

    def on_test_end(self, logs=None):
        """Puts the trained values back, where ``on_test_begin`` swapped the averages in."""
        self._swap_out("test")

    def on_predict_begin(self, logs=None):
        """As ``on_test_begin``, for a loop that calls the predict hooks (``Trainer.predict`` calls none: use
        ``with optimizer.averaged_weights(): trainer.predict(...)`` there)."""
        self._swap_in("test")

    def on_predict_end(self, logs=None):
        """As ``on_test_end``, for a loop that calls the predict hooks."""
        self._swap_out("test")

    def on_train_end(self, logs=None):
        """Ends a swap of the last epoch's end without putting the trained values back: ``fit`` has written the
        averages into the model by then (``finalize_variable_values``), and they stay."""
        if self._mine == "epoch":  # fit has written the averages into the model: they stay
            self._mine = None
            self.trainer.optimizer.keep_averages()


def _in_strategy(trainer):
    return context.enter_or_assert_strategy(trainer.strategy)
