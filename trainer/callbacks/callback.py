"""``Callback``: the base class of every callback, Keras' hooks and what the trainer asks of a callback
(which per-batch logs it reads, whether this process is the one that writes and prints).
"""

from __future__ import annotations


class Callback:
    """Base class: override the hooks you need (Keras' names and arguments).

    ``self.trainer`` is the running ``Trainer``, ``self.model`` the user's module and
    ``self.params`` ``{"epochs", "steps", "verbose"}``. Setting
    ``self.trainer.stop_training = True`` ends training after the current step.

    Example::

        class PrintLoss(Callback):
            def on_epoch_end(self, epoch, logs=None):
                print(epoch, logs["loss"])
    """

    def __init__(self):
        self.trainer = None
        self.model = None
        self.params: dict = {}

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    # Set on callbacks that act on the (global) logs alone, so decide alike on every worker.
    _decides_from_logs = False

    #: Set ``True`` in a callback class whose per-batch training hooks (``on_train_batch_begin``/``_end``)
    #: neither read nor write the model's variables (a timer, a display of the logs). Under sharded optimizer
    #: states (``MultiWorkerMirroredStrategy(shard_optimizer_states=True)``) the gather of a step's updated
    #: values then runs on through those hooks instead of being waited for before them. A subclass says so
    #: itself (it may read what its parent did not).
    #:
    #: Example::
    #:
    #:     class StepTimer(Callback):
    #:         leaves_variables_alone = True
    #:
    #:         def on_train_batch_end(self, batch, logs=None):
    #:             self.times.append(time.perf_counter())
    leaves_variables_alone = False

    # Whether ``on_epoch_end`` puts ``learning_rate`` into the epoch's logs, and when: ``"before_monitor"``
    # (before this callback reads its own monitor, which may then be ``learning_rate``), ``"after_step"`` (after
    # its own step: the callbacks after it see the value), or None. Recipes check a monitor of it with this.
    logs_learning_rate: str | None = None

    def wants_logs(self, hook: str) -> bool:
        """Whether this callback reads the logs of the per-batch ``hook`` (``"on_train_batch_end"``...): the
        trainer reads the metrics every step only when one does. A callback says so by overriding the hook,
        or ``_wants_logs`` to decide otherwise.

        Example::

            class EveryBatch(Callback):
                def on_train_batch_end(self, batch, logs=None): ...

            EveryBatch().wants_logs("on_train_batch_end"), Callback().wants_logs("on_train_batch_end")  # True, False
        """
        return self._wants_logs(hook)

    def wants_logs_now(self, hook: str) -> bool:
        """Whether this callback reads the logs of the batch about to end (``wants_logs`` says whether it ever
        does; a display that redraws now and then reads them only when it will redraw).

        Example::

            if any(cb.wants_logs_now("on_train_batch_end") for cb in callbacks):
                logs = read_the_metrics()
        """
        return self._wants_logs_now(hook)

    def _wants_logs(self, hook: str) -> bool:
        """Whether this callback reads the logs of the per-batch ``hook`` (only then are metrics read every step)."""
        return _overrides(self, hook) or hook in vars(self)

    def _wants_logs_now(self, hook: str) -> bool:
        """Whether it reads them at the batch about to end (a display that redraws now and then says
        so only when it will redraw; reading the metrics is a device synchronisation on a GPU)."""
        return self._wants_logs(hook)

    @property
    def _is_chief(self) -> bool:
        """Whether this process writes files and prints (worker 0 of a multi-worker run; always in one process)."""
        trainer = self.trainer
        return trainer is None or trainer.strategy.extended.should_checkpoint

    def _print(self, message: str) -> None:
        if self._is_chief:
            print(message, flush=True)

    def on_train_begin(self, logs=None): ...
    def on_train_end(self, logs=None): ...
    def on_epoch_begin(self, epoch, logs=None): ...
    def on_epoch_end(self, epoch, logs=None): ...
    def on_train_batch_begin(self, batch, logs=None): ...
    def on_train_batch_end(self, batch, logs=None): ...
    def on_test_begin(self, logs=None): ...
    def on_test_end(self, logs=None): ...
    def on_test_batch_begin(self, batch, logs=None): ...
    def on_test_batch_end(self, batch, logs=None): ...
    def on_predict_begin(self, logs=None): ...
    def on_predict_end(self, logs=None): ...
    def on_predict_batch_begin(self, batch, logs=None): ...
    def on_predict_batch_end(self, batch, logs=None): ...


class _AttributeState:
    """A callback whose state is a few of its attributes (``_STATE``), kept in checkpoints and backups so
    that a resumed run goes on as the uninterrupted one (``fit`` restores them after every callback's
    ``on_train_begin`` has reset its own)."""

    _keeps_state = True
    _STATE: tuple = ()

    def state_dict(self) -> dict:
        return {name: getattr(self, name, None) for name in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for name in self._STATE:
            if name in state:
                setattr(self, name, state[name])


def _overrides(callback: Callback, hook: str) -> bool:
    method = getattr(type(callback), hook, None)
    return method is not None and method is not getattr(Callback, hook)
