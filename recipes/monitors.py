"""The names callbacks monitor: each built-in callback's ``monitor`` must be a value the recipe's fit logs.

``loss``, the metrics' names, their ``val_`` forms when the recipe validates, ``learning_rate`` after a callback
that logs it; a monitor that is none of these is refused at its key, with what the callback would do without it
(``training would never stop early``). Nothing is called: where the logged names depend on the user's code, an
unknown name is let through.
"""

from __future__ import annotations

from replicafit.trainer.spelling import did_you_mean

__all__ = ["check_monitors"]

from . import kinds
from .calls import with_written_name
from .entries import entry_name, factory_parameters, parameter_default
from .source import Recipe

# What a built-in callback does without its monitor: said in the message.
_WITHOUT_MONITOR = {
    "EarlyStopping": "training would never stop early",
    "ModelCheckpoint": "no checkpoint would ever be saved",
    "ReduceLROnPlateau": "the learning rate would never be reduced",
    "TorchLRScheduler": "the learning rate would never be reduced",
}


def check_monitors(recipe: Recipe, checked: dict) -> None:
    """Each built-in callback's ``monitor`` must be a value the recipe's fit logs: ``loss``, the metrics' names,
    their ``val_`` forms when the recipe validates, ``learning_rate`` after a callback that logs it.

    Nothing is called: where a name is not known without the user's code (a ``module:attr`` metric, or a
    user callback before this one, which may add to the logs), an unknown name is let through.

    Example::

        check_monitors(recipe, checked)  # checked: what validate found, every section's (factory, args)
    """
    training, complete = _logged_names(recipe, checked)
    validates = _validates(checked)
    for index, (factory, args) in enumerate(checked["callbacks"]):
        use = _monitor_use(factory, args)
        if use is None or not isinstance(use[0], str):
            continue
        monitor, per_step = use
        before = checked["callbacks"][:index]
        if any(not kinds.is_builtin("callback", f) for f, _ in before):
            continue  # the user's callback may log anything
        key = ("callbacks", index, "monitor") if "monitor" in args else ("callbacks", index)
        what = f"{entry_name(recipe.data['callbacks'][index])!r} monitors {monitor!r}"
        what += "" if "monitor" in args else " (its default)"
        if per_step:
            names = list(training)
        else:
            names = training + [f"val_{n}" for n in training if validates is not False]
            names += ["learning_rate"] if _logs_learning_rate(checked["callbacks"], index) else []
        if _logged(monitor, names, open_prefix=not kinds.is_builtin("model", checked["model"][0])):
            continue
        if monitor.startswith("val_") and per_step:
            raise recipe.error(
                key,
                f"{what}, but {per_step[0]}: a step's logs have no val_ values (validation runs at each epoch's end): "
                f"set {per_step[1]}, or monitor a value of the training steps ({', '.join(names)})",
            )
        if monitor.startswith("val_") and validates is False:
            raise recipe.error(
                key, f"{what}, but {_no_validation(checked)}, or monitor one of the values fit logs: {', '.join(names)}"
            )
        if monitor == "learning_rate" and _logs_learning_rate(checked["callbacks"], len(checked["callbacks"])):
            raise recipe.error(
                key, f"{what}, which a callback listed after this one logs: list that callback before this one"
            )
        if complete:
            consequence = _WITHOUT_MONITOR.get(factory.__name__, "it would never act")
            raise recipe.error(
                key,
                f"{what}, which this recipe's fit does not log{did_you_mean(monitor, names)}: {consequence}; "
                f"logged: {', '.join(names)}",
            )


def _monitor_use(factory, args: dict):
    """``(monitor, per-step)`` of a built-in callback that reads a monitor (None for the others, and for a
    ``model_checkpoint`` without ``save_best_only``); ``per-step``: ``(what makes it read each step's logs,
    the setting that reads the epoch's)``, or None."""
    from replicafit.trainer.callbacks import EarlyStopping, ModelCheckpoint, ReduceLROnPlateau, TorchLRScheduler

    monitor = args.get("monitor", parameter_default(factory, "monitor"))
    if factory in (EarlyStopping, ReduceLROnPlateau):
        return monitor, None
    if factory is ModelCheckpoint and args.get("save_best_only"):
        freq = args.get("save_freq", "epoch")
        return monitor, None if freq == "epoch" else (f"save_freq is {freq!r}", "save_freq: epoch")
    if factory is TorchLRScheduler and _names_plateau(args.get("factory")):
        step = args.get("interval", "epoch") == "step"
        return monitor, ("interval is 'step'", "interval: epoch") if step else None
    return None


def _names_plateau(name) -> bool:
    """Whether a ``torch_lr_scheduler``'s ``factory`` names torch's ``ReduceLROnPlateau`` (the one that monitors)."""
    import torch

    cls = getattr(torch.optim.lr_scheduler, name.rsplit(".", 1)[-1], None) if isinstance(name, str) else None
    return isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _logged_names(recipe: Recipe, checked: dict) -> tuple:
    """``(names fit logs for training: loss and the metrics, whether every metric's name is known)``.

    A metric's name is the one the trainer logs: ``accuracy``/``crossentropy`` for their aliases, the name a
    built-in metric takes from the recipe (``mae``, or its ``name`` argument). A ``module:attr`` metric's name
    is known only by calling it, which validation does not.
    """
    names, complete = ["loss"], True
    entries = recipe.data.get("metrics") or []
    for entry, (factory, args) in zip(entries, checked["metrics"]):
        if factory in ("accuracy", "crossentropy"):
            names.append(factory)
            continue
        name = None
        if kinds.is_builtin("metric", factory):
            try:
                name = factory(**with_written_name(args, factory, entry_name(entry))).name
            except Exception:  # noqa: BLE001 - bad arguments are build's to report, with their key
                name = None
        if isinstance(name, str):
            names.append(name)
        else:
            complete = False
    return names, complete


def _validates(checked: dict):
    """Whether the recipe's fit validates: True, False, or None where the user's dataset decides."""
    fit = checked["fit"]
    if "validation_split" in fit:  # fit's split wins over the data's validation set (see build)
        return bool(fit["validation_split"])
    info = checked.get("data_instance")
    return None if info is None else info.get("validation") is not None


def _no_validation(checked: dict) -> str:
    """Why a recipe's fit logs no ``val_`` values, and the keys that would add them."""
    if "validation_split" in checked["fit"]:
        dropped = (
            " (which also leaves the data's validation set out)"
            if checked.get("data_instance", {}).get("validation") is not None
            else ""
        )
        return f"fit.validation_split is 0{dropped}, so fit logs no val_ values: set it above 0 (e.g. 0.2)"
    factory, _ = checked["data"]
    data = (
        "data.validation_split (e.g. 0.2)"
        if "validation_split" in factory_parameters(factory)[0]
        else "a dataset that returns {'train': ..., 'validation': ...}"
    )
    return (
        f"the recipe has no validation data, so fit logs no val_ values: add fit.validation_split (e.g. 0.2) or {data}"
    )


def _logs_learning_rate(callbacks: list, index: int) -> bool:
    """Whether ``learning_rate`` is in the epoch's logs when callback ``index`` reads them: each callback class
    says whether it logs it, before reading its own monitor or after its step (``Callback.logs_learning_rate``;
    the class's own setting: a subclass may log otherwise, as ``may_stop_training_alone`` reads the classes)."""
    for position, (factory, _) in enumerate(callbacks):
        when = vars(factory).get("logs_learning_rate") if isinstance(factory, type) else None
        if (when and position < index) or (when == "before_monitor" and position == index):
            return True
    return False


def _logged(monitor: str, names: list, open_prefix: bool) -> bool:
    """Whether ``monitor`` is among ``names``; with ``open_prefix`` (a model of the user's, which may have
    several outputs) also ``<output>_<name>`` (``head_loss``, ``val_head_accuracy``)."""
    return monitor in names or (open_prefix and any(monitor.endswith(f"_{name}") for name in names))
