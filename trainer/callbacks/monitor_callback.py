"""What the callbacks that read one value of the logs (their ``monitor``) share: ``mode`` resolution and the
warning, once per fit, about a monitor missing from the logs.
"""

from __future__ import annotations

import warnings

from ..registry import did_you_mean
from .callback import Callback


def _monitor_mode(monitor: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}.")
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    return "max" if any(k in name for k in ("acc", "auc", "precision", "recall")) else "min"


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


def _warn_missing_monitor(callback: Callback, who: str, logs, consequence: str, per_step: str = "") -> None:
    """Warns once per ``fit`` (on the chief of a multi-worker run) that ``callback.monitor`` is not in ``logs``,
    as Keras' callbacks do; the callback then leaves that epoch (or step) alone, as before."""
    if callback._monitor_warned:
        return
    callback._monitor_warned = True
    if callback._is_chief:
        message = _missing_monitor_message(who, callback.monitor, logs or {}, consequence, per_step)
        warnings.warn(message, UserWarning, stacklevel=2)  # the callback's line
