"""``CallbackList``: the callbacks of one ``fit``, ``evaluate`` or ``predict`` as the trainer sees them: their
hooks called in order, which logs they read, which keep state, whether one may stop training alone.
"""

from __future__ import annotations

from .callback import Callback, _overrides
from .history import History

_BATCH_HOOKS = (
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


# Hooks at whose end a callback that saves the training state (``_saves_training_state``: BackupAndRestore)
# saves it: it acts after every other callback (before History, which the saved state expects
# not to have recorded the epoch yet), so the state it saves is the one the step or epoch ends with (a
# learning-rate scheduler's step included), wherever it stands in the list.
_SAVING_HOOKS = ("on_train_batch_end", "on_epoch_end")


class CallbackList:
    """Calls every callback's hook in order (at the end of a step or an epoch, the callbacks that save the
    training state after the others). ``wants_batch_logs`` tells the trainer whether any callback reads
    per-batch logs (only then are metrics read every step)."""

    def __init__(self, callbacks=(), trainer=None, model=None, params=None):
        self.callbacks = list(callbacks)
        self._saving_last = _saving_last(self.callbacks)
        #: The callback whose hook runs now, else None, which tells where a hook that raised stopped.
        self.current = None
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be Callback instances, got {type(cb).__name__}.")
            cb.set_trainer(trainer)
            cb.set_model(model)
            cb.set_params(params or {})
        self.refresh()

    def refresh(self) -> None:
        """Asks the callbacks again which per-batch logs they read (``fit`` does after ``on_train_begin``,
        when a callback may know more, e.g. which scheduler it built)."""
        self.wants_batch_logs = {hook: any(cb.wants_logs(hook) for cb in self.callbacks) for hook in _BATCH_HOOKS}

    def wants_logs_now(self, hook: str) -> bool:
        """Whether any callback reads the logs of the batch about to end (``wants_batch_logs`` says
        whether any ever does)."""
        return self.wants_batch_logs[hook] and any(cb.wants_logs_now(hook) for cb in self.callbacks)

    def stateful(self) -> dict:
        """``{key: callback}`` of the callbacks that keep state in checkpoints and backups (``state_dict``/
        ``load_state_dict``), keyed by class name and rank among callbacks of that class."""
        found, seen = {}, {}
        for cb in self.callbacks:
            if getattr(cb, "_keeps_state", False):
                name = type(cb).__name__
                found[f"{name}_{seen.get(name, 0)}"] = cb
                seen[name] = seen.get(name, 0) + 1
        return found

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args) -> None:
        """Calls ``hook`` (``"on_epoch_end"``...) with ``args`` on every callback, in order; at
        ``on_train_batch_end`` and ``on_epoch_end`` the callbacks that save the training state
        (``BackupAndRestore``) come after the others, just before ``History``. Every callback gets the same
        ``logs`` dict, so what one adds the later ones see.

        Example::

            callback_list.call("on_epoch_end", epoch, logs)
        """
        for cb in self._saving_last if hook in _SAVING_HOOKS else self.callbacks:
            self.current = cb
            getattr(cb, hook)(*args)
        self.current = None


def _saving_last(callbacks: list) -> list:
    """``callbacks`` with those that save the training state moved just before ``History`` (else to the end)."""
    saving = [cb for cb in callbacks if getattr(cb, "_saves_training_state", False)]
    if not saving:
        return callbacks
    rest = [cb for cb in callbacks if not getattr(cb, "_saves_training_state", False)]
    at = next((i for i, cb in enumerate(rest) if isinstance(cb, History)), len(rest))
    return rest[:at] + saving + rest[at:]


def may_stop_training_alone(callbacks) -> bool:
    """Whether a callback might set ``stop_training`` on one worker only: any callback that is not
    one of the built-ins acting on the (global) logs alone. A subclass of a built-in counts as the
    user's (it may decide otherwise), unless it sets ``_decides_from_logs = True`` itself."""
    return any(not type(cb).__dict__.get("_decides_from_logs", False) for cb in callbacks)


def may_touch_variables_between_steps(callbacks) -> bool:
    """Whether a callback's per-batch training hooks (``on_train_batch_begin``/``_end``) might read or write the
    model's variables: any callback that implements one and is not one of the built-ins known to leave them
    alone (a subclass of a built-in counts as the user's unless it sets ``leaves_variables_alone =
    True`` itself). Under sharded optimizer states the trainer finishes gathering a step's updated values before
    such hooks run; otherwise the gather runs on through them."""
    hooks = ("on_train_batch_begin", "on_train_batch_end")
    return any(
        not _says_it_leaves_them(cb) and any(_overrides(cb, h) or h in vars(cb) for h in hooks) for cb in callbacks
    )


def _says_it_leaves_them(callback) -> bool:
    own = type(callback).__dict__.get("leaves_variables_alone", False)  # the class's own word (a property: asked)
    return bool(own.__get__(callback) if isinstance(own, property) else own)
