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
        """Sets ``self.trainer``, the ``Trainer`` that runs the hooks (Keras has no such object: its model
        plays the part). Called by ``CallbackList`` when each ``fit`` or ``evaluate`` starts, before any hook."""
        self.trainer = trainer

    def set_model(self, model) -> None:
        """Sets ``self.model``: the user's ``torch.nn.Module`` as passed to ``fit``/``evaluate`` (replica 0 of
        the distributed model, ``self.trainer.model``). Called by ``CallbackList`` before any hook."""
        self.model = model

    def set_params(self, params: dict) -> None:
        """Sets ``self.params``. ``fit`` passes ``{"epochs", "steps", "verbose"}`` (``steps``: per epoch, None
        when the data's length is unknown; ``verbose``: the resolved level, 0, 1 or 2); ``evaluate`` passes
        its own ``{"steps", "verbose"}`` arguments as given. Called by ``CallbackList`` before any hook."""
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

    #: Set ``True`` in a callback class whose ``**kwargs`` go elsewhere than to its base class (``TorchLRScheduler``:
    #: the scheduler's arguments): a recipe's checks then let keyword arguments through that its signature does
    #: not name, for the code they go to to check.
    forwards_kwargs = False

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

    def on_train_begin(self, logs=None):
        """Called once at the start of ``fit``, before the first step (the first batch has been read and
        checked, the metrics built, ``trainer.stop_training`` reset to False); ``logs`` is ``{}``.

        ``BackupAndRestore`` restores a backup here. The callbacks' saved states (a backup's, or those of a
        checkpoint loaded before ``fit``) are loaded after every callback's ``on_train_begin``, whatever the
        order: a stateful callback resets its state here and finds the saved one in place afterwards.
        """

    def on_train_end(self, logs=None):
        """Called once when ``fit`` ends normally (all epochs done, or ``stop_training``), after the model got
        the optimizer's moving averages (``use_ema``); not when ``fit`` raises (a ``Preempted`` exit included).

        ``logs``: the last epoch's logs, as ``on_epoch_end`` left them (``{}`` when no epoch ran, e.g. a run
        resumed after its last epoch).
        """

    def on_epoch_begin(self, epoch, logs=None):
        """Called at the start of every epoch of ``fit``, after the metrics were reset and before its first
        step (also for the epoch a backup resumes in the middle, whose metrics then hold the backup's totals
        of the steps before it); ``logs`` is ``{}``.

        Args:
          epoch: the epoch's index, from 0, counting from the start of training (``initial_epoch`` and
            resumed epochs included); the progress bar shows ``epoch + 1``.
        """

    def on_epoch_end(self, epoch, logs=None):
        """Called at the end of every epoch of ``fit``, after its last step and its validation.

        Args:
          epoch: the epoch's index, from 0 (as in ``on_epoch_begin``).
          logs: ``{name: float}``: the epoch's loss (``"loss"``, and ``"<output>_loss"`` per output) and
            metrics, each the mean over all the epoch's steps, then the validation values prefixed with
            ``val_`` where validation ran. The values are global: aggregated over every replica and
            worker, so every worker gets the same ones. The same dict goes to every callback in order:
            a key a callback adds (``learning_rate``) is seen by those after it, by ``History`` (after the
            user's callbacks) and by the progress bar.

        Setting ``self.trainer.stop_training = True`` ends ``fit`` after this epoch (on any worker: every
        worker stops).
        """

    def on_train_batch_begin(self, batch, logs=None):
        """Called before every training step of ``fit``, only when some callback implements it; ``logs`` is
        ``{}``.

        Args:
          batch: the step's index within the epoch, from 0 (a resumed epoch goes on from the backup's step).

        Under sharded optimizer states, a callback whose class sets ``leaves_variables_alone = True`` may
        see the variables before the last step's update has reached them.
        """

    def on_train_batch_end(self, batch, logs=None):
        """Called after every training step of ``fit``.

        Args:
          batch: the step's index within the epoch, from 0 (as in ``on_train_batch_begin``).
          logs: the epoch's values so far (the means over its steps up to this one, as Keras 3's batch
            logs), global as ``on_epoch_end``'s and without ``val_`` values; read before the hook runs,
            and only at the steps where a callback reads them (``wants_logs_now``: a progress bar asks
            at most every 0.1 s), else ``{}``. Across workers they are read at every step, on every
            worker, as soon as a callback on any worker reads them. Reading them costs a host
            synchronisation.

        Setting ``self.trainer.stop_training = True`` ends the epoch after this step (its validation and
        ``on_epoch_end`` still run) and then ``fit``. Unless the class sets ``leaves_variables_alone``, the
        variables hold this step's update here.
        """

    def on_test_begin(self, logs=None):
        """Called at the start of ``evaluate`` (its callbacks), and of each epoch's validation in ``fit``
        (``fit``'s callbacks, before ``on_epoch_end``); ``logs`` is ``{}``. The model is in eval mode."""

    def on_test_end(self, logs=None):
        """Called at the end of ``evaluate`` and of each validation in ``fit``, after the last batch (not when
        the evaluation raises).

        ``logs``: the evaluation's ``{name: float}`` (``"loss"`` and the metrics, without the ``val_`` prefix
        that ``fit`` adds in the epoch's logs), global over every replica and worker. In ``fit`` the
        training accumulators have been put back by then, and the model is in training mode again.
        """

    def on_test_batch_begin(self, batch, logs=None):
        """Called before every evaluation step (``evaluate`` and ``fit``'s validation); ``batch`` is the step's
        index from 0, ``logs`` is ``{}``."""

    def on_test_batch_end(self, batch, logs=None):
        """Called after every evaluation step; ``batch`` is the step's index from 0. ``logs`` is always ``{}``
        (unlike Keras, the metrics are not read per evaluation step: ``on_test_end`` has the values)."""

    def on_predict_begin(self, logs=None):
        """Keras' hook at the start of ``predict``. ``Trainer.predict`` takes no callbacks and calls none of
        the predict hooks; a loop of one's own may call them (``CallbackList.call``)."""

    def on_predict_end(self, logs=None):
        """Keras' hook at the end of ``predict``; ``Trainer.predict`` does not call it (see
        ``on_predict_begin``)."""

    def on_predict_batch_begin(self, batch, logs=None):
        """Keras' hook before every prediction step; ``Trainer.predict`` does not call it (see
        ``on_predict_begin``)."""

    def on_predict_batch_end(self, batch, logs=None):
        """Keras' hook after every prediction step; ``Trainer.predict`` does not call it (see
        ``on_predict_begin``)."""


class _AttributeState:
    """A callback whose state is a few of its attributes (``_STATE``), kept in checkpoints and backups so
    that a resumed run goes on as the uninterrupted one (``fit`` restores them after every callback's
    ``on_train_begin`` has reset its own)."""

    _keeps_state = True
    _STATE: tuple = ()

    def state_dict(self) -> dict:
        """The attributes that make this callback's progress (a patience counter, the best value so
        far), by name; checkpoints and backups save it, so a resumed fit goes on counting where it stopped."""
        return {name: getattr(self, name, None) for name in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        """Sets the attributes that ``state_dict`` returned; names missing from ``state`` keep their values."""
        for name in self._STATE:
            if name in state:
                setattr(self, name, state[name])


def _overrides(callback: Callback, hook: str) -> bool:
    method = getattr(type(callback), hook, None)
    return method is not None and method is not getattr(Callback, hook)
