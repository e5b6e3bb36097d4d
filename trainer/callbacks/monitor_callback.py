"""``MonitorCallback``: the base of the callbacks that act on one value of the logs, their ``monitor``."""

from __future__ import annotations

import math
import warnings

from ..spelling import did_you_mean
from .callback import Callback


class MonitorCallback(Callback):
    """A callback that reads ``monitor`` from the logs (Keras 3's ``MonitorCallback``): ``ModelCheckpoint``
    (with ``save_best_only``), ``EarlyStopping``, ``ReduceLROnPlateau`` and ``TorchLRScheduler`` (for torch's
    ``ReduceLROnPlateau``).

    It holds what they share:

    - ``_monitor_value(logs)``: the monitored value, or None after a ``UserWarning``, once per ``fit`` and on the
      chief only, naming the logged values and a close one (the subclass says who it is and what it does
      without the value: ``_monitor_owner``, ``_without_monitor``);
    - ``_resolve_mode(mode)``: ``"min"`` or ``"max"`` (``"auto"`` guesses from the monitor's name), which the
      subclasses that compare values keep as ``self.mode``;
    - ``_worst()`` and ``_is_improvement(value, reference, min_delta)``: the best value before any, and
      whether a value improves on a reference (``EarlyStopping``'s and ``ModelCheckpoint``'s comparison;
      ``ReduceLROnPlateau`` keeps Keras' own, which adds ``min_delta`` to the reference instead).
    """

    _monitor_owner = ""  # who the missing-monitor warning says monitors, e.g. "EarlyStopping"
    _without_monitor = ""  # what the callback does while the value is missing, e.g. "... while it is missing."

    def __init__(self, monitor: str = "val_loss"):
        super().__init__()
        self.monitor = monitor
        self._monitor_warned = False  # a missing monitor is said once per fit

    def on_train_begin(self, logs=None):
        self._monitor_warned = False

    def _resolve_mode(self, mode: str) -> str:
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}.")
        if mode != "auto":
            return mode
        name = self.monitor.removeprefix("val_")
        return "max" if any(k in name for k in ("acc", "auc", "precision", "recall")) else "min"

    def _worst(self) -> float:
        """The best value so far before any value: ``inf`` where lower is better, else ``-inf``."""
        return math.inf if self.mode == "min" else -math.inf

    def _is_improvement(self, value, reference, min_delta=0) -> bool:
        """Whether ``value`` minus ``min_delta`` is better than ``reference`` (anything is better than None)."""
        if reference is None:
            return True
        return value - min_delta > reference if self.mode == "max" else value - min_delta < reference

    def _monitor_value(self, logs, per_step: str = ""):
        """``logs[monitor]``, or None where it is missing: then a ``UserWarning``, once per ``fit`` (on the chief
        of a multi-worker run) as Keras' callbacks warn, and the callback leaves that epoch (or step) alone.
        ``per_step``: the setting that reads the epoch's logs instead (see ``_missing_monitor_message``)."""
        value = (logs or {}).get(self.monitor)
        if value is None and not self._monitor_warned:
            self._monitor_warned = True
            if self._is_chief:
                message = _missing_monitor_message(
                    self._monitor_owner, self.monitor, logs or {}, self._without_monitor, per_step
                )
                warnings.warn(message, UserWarning, stacklevel=2)  # the callback's line
        return value


def _missing_monitor_message(who: str, monitor: str, available, consequence: str, per_step: str = "") -> str:
    """What a callback says when the logs it reads lack ``monitor``: the names they have, a close one, and why a
    ``val_`` name is missing (no validation, or the logs of a step; ``per_step``: the setting that reads the
    epoch's logs instead, e.g. ``"interval='epoch'"``)."""
    names = [str(name) for name in available]
    hint = did_you_mean(monitor, names)
    if monitor.startswith("val_") and not any(name.startswith("val_") for name in names):
        training = monitor.removeprefix("val_")
        instead = f", or monitor {training!r}" if training in names else ""
        hint = (
            f" (a step's logs have no val_ values, validation runs at each epoch's end: set {per_step}{instead})"
            if per_step
            else f" (no validation ran: pass validation_data or validation_split to fit{instead})"
        )
    return (
        f"{who} monitors {monitor!r}, which is not in the logs{hint}; available: {', '.join(names) or 'none'}. "
        f"{consequence}"
    )
