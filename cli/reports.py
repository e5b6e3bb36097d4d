"""What ``replicafit fit`` reports at its end: metrics.json's contents and the console's last lines.

``fit_report`` says which epoch's weights the final checkpoint holds (the last epoch's, or the best one
an ``EarlyStopping(restore_best_weights=True)`` put back; the optimizer's moving averages or not) and the
best epoch of the monitored metric; ``report_lines`` says it in words. Epochs count from 1, as the console
prints them.
"""

from __future__ import annotations

import math

__all__ = ["fit_report", "report_lines", "first_best", "format_number"]


def fit_report(history, callbacks, checkpoint_monitor: str, use_ema: bool = False) -> dict:
    """What metrics.json holds besides the recipe and the checkpoint's path: the last epoch's logs,
    which weights last.pt holds (``checkpoint_weights``) and the best epoch of the monitored metric
    (``best``: the EarlyStopping's monitor, else ``checkpoint_monitor``). Epochs count from 1.

    Example::

        report = fit_report(history, callbacks, "val_loss")
        report["final_epoch"], report["best"]["epoch"]  # e.g. 20, 16
    """
    return {
        "final": {key: values[-1] for key, values in history.history.items() if values},
        "final_epoch": history.epoch[-1] + 1 if history.epoch else None,
        "epochs": len(history.epoch),
        "checkpoint_weights": _checkpoint_weights(history, callbacks, use_ema),
        "best": _best_epoch(history, callbacks, checkpoint_monitor),
    }


def _epoch_logs(history, epoch: int) -> dict:
    """The logs of ``epoch`` (0-based, as ``History.epoch`` counts); {} for an epoch this fit did not run."""
    if epoch not in history.epoch:
        return {}
    index = history.epoch.index(epoch)
    return {key: values[index] for key, values in history.history.items() if len(values) == len(history.epoch)}


_NOTES = {  # (val_ values measured with the averages, checkpoint holds the averages) -> the mismatch, said
    (True, False): "the val_ values were measured with the optimizer's moving averages, the checkpoint holds the "
    "trained weights (SwapEMAWeights(swap_on_epoch=True) first in the callbacks keeps the averages)",
    (False, True): "the val_ values were measured with the trained weights, the checkpoint holds the optimizer's "
    "moving averages (fit ends with them, as Keras' does; SwapEMAWeights validates with them)",
}


def _checkpoint_weights(history, callbacks, use_ema: bool) -> dict | None:
    """Which weights the model holds after ``fit`` (what last.pt saves): the last epoch's, or the best
    epoch's that an ``EarlyStopping(restore_best_weights=True)`` put back (the last such callback in the
    list restores last). With ``use_ema`` fit ends with the optimizer's moving averages in the model; a
    restored epoch's weights are the averages when a ``SwapEMAWeights(swap_on_epoch=True)`` comes before
    the EarlyStopping (it swaps them in at each epoch's end, before the EarlyStopping keeps a copy)."""
    from replicafit.trainer import EarlyStopping, SwapEMAWeights

    if not history.epoch:
        return None
    stoppers = [c for c in callbacks if isinstance(c, EarlyStopping) and c.restore_best_weights]
    stopper = next((c for c in reversed(stoppers) if c.best_weights is not None), None)
    if stopper is None:
        epoch, averaged = history.epoch[-1], use_ema
    else:
        before = callbacks[: next(i for i, c in enumerate(callbacks) if c is stopper)]
        epoch, averaged = stopper.best_epoch, any(isinstance(c, SwapEMAWeights) and c.swap_on_epoch for c in before)
    weights = {
        "epoch": epoch + 1,
        "restored_best": stopper is not None,
        "monitor": stopper.monitor if stopper is not None else None,
        "moving_averages": averaged,
        "metrics": _epoch_logs(history, epoch),
    }
    measured = any(isinstance(c, SwapEMAWeights) for c in callbacks)  # validation ran with the averages
    if (measured, averaged) in _NOTES:
        weights["note"] = _NOTES[measured, averaged]
    return weights


def _best_epoch(history, callbacks, checkpoint_monitor: str) -> dict | None:
    """The best epoch of the monitored metric: the EarlyStopping's own (its ``min_delta``,
    ``start_from_epoch``), else the first minimum of ``checkpoint_monitor`` (what best.pt keeps)."""
    from replicafit.trainer import EarlyStopping

    stoppers = [c for c in callbacks if isinstance(c, EarlyStopping) and math.isfinite(getattr(c, "best", math.inf))]
    stopper = next((c for c in reversed(stoppers) if c.restore_best_weights), stoppers[-1] if stoppers else None)
    if stopper is not None:
        best = stopper.best_epoch + 1
        return {"monitor": stopper.monitor, "mode": stopper.mode, "epoch": best, "value": stopper.best}
    return first_best([e + 1 for e in history.epoch], checkpoint_monitor, history.history.get(checkpoint_monitor))


def first_best(epochs, monitor: str, values, mode: str = "min") -> dict | None:
    """``{"monitor", "mode", "epoch", "value"}`` of the first best finite value (None without one).

    Example::

        >>> first_best([1, 2, 3], "val_loss", [0.5, 0.25, 0.25])
        {'monitor': 'val_loss', 'mode': 'min', 'epoch': 2, 'value': 0.25}
    """
    if not values or len(values) != len(epochs):
        return None
    finite = [(v, e) for e, v in zip(epochs, values) if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return None
    best = min(finite, key=lambda p: p[0]) if mode == "min" else max(finite, key=lambda p: p[0])
    return {"monitor": monitor, "mode": mode, "epoch": best[1], "value": best[0]}


def format_number(value) -> str:
    """4 decimals, or 4 significant digits below 1e-3 (a learning rate of 3e-5 is not 0.0000): the
    progress bar's format.

    Example::

        >>> format_number(0.97493), format_number(3e-05), format_number("n/a")
        ('0.9749', '3.0000e-05', 'n/a')
    """
    from replicafit.trainer.callbacks.progbar_logger import format_value

    return format_value(float(value)) if isinstance(value, (int, float)) else str(value)


def report_lines(report: dict, checkpoint: str = "last.pt") -> list:
    """The end of ``replicafit fit``'s output: the last epoch's values and, when EarlyStopping restored an
    earlier epoch's weights into the checkpoint, that epoch's, each line saying whose values they are;
    the validation accuracy on one line of its own (both values, named, when they differ).

    Example::

        for line in report_lines(fit_report(history, callbacks, "val_loss")):
            print(line)  # "final (epoch 20, saved in last.pt): val_loss 0.1103", "validation accuracy: 0.9749"
    """
    final, last, weights = report["final"], report["final_epoch"], report["checkpoint_weights"]
    if weights is None:
        return ["final: no epoch ran"]

    def values(logs) -> str:
        keys = [k for k in logs if k.startswith("val_")] or list(logs)
        shown = ", ".join(f"{k} {format_number(logs[k])}" for k in keys if k != "val_accuracy")
        return f": {shown}" if shown else ""

    saved = f"saved in {checkpoint}" + (" as the optimizer's moving averages" if weights["moving_averages"] else "")
    if weights["epoch"] == last:
        best = f", the best by {weights['monitor']}" if weights["restored_best"] else ""
        lines = [f"final (epoch {last}{best}, {saved}){values(final)}"]
    else:
        best = f"best epoch ({weights['epoch']}) by {weights['monitor']}, restored and {saved}"
        lines = [f"last epoch ({last}){values(final)}", f"{best}{values(weights['metrics'])}"]
    if "note" in weights:
        lines.append(f"note: {weights['note']}")
    if "val_accuracy" in final:
        accuracy = f"validation accuracy: {format_number(final['val_accuracy'])}"
        restored = weights["metrics"].get("val_accuracy")
        if weights["epoch"] != last and restored is not None:
            accuracy = (
                f"validation accuracy: {format_number(restored)} in {checkpoint} (best epoch {weights['epoch']}), "
                f"{format_number(final['val_accuracy'])} at the last epoch ({last})"
            )
        elif weights["epoch"] != last:
            accuracy += f" at the last epoch ({last})"
        lines.append(accuracy)
    return lines
