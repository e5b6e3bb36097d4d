"""The ``replicafit`` command (also ``python -m replicafit``).

::

    replicafit fit RECIPE [--set key.path=value ...] [--run-dir DIR]
                   [--workers N [--max-restarts K] [--log-all-workers]]
    replicafit evaluate RECIPE --checkpoint PATH [--set ...]
    replicafit predict RECIPE --checkpoint PATH [--output FILE.npy] [--set ...]
    replicafit validate RECIPE [--set ...]
    replicafit list [KIND]                      (KIND: recipes, strategy, model, ...)
    replicafit plot RUN_DIR

RECIPE is a YAML file, or the name of a recipe that ships with replicafit
(``replicafit fit digits_mlp``; ``replicafit list recipes`` shows them).

``--workers N`` starts N worker processes on this machine (``trainer.launch``), each running
``replicafit fit`` with the same recipe and run directory; the recipe's strategy must be a
multi-worker one (``strategy: multi_worker_mirrored``)::

    replicafit fit digits_mlp --set strategy=multi_worker_mirrored --workers 2 --max-restarts 1

Under ``torchrun`` the same command runs unchanged without ``--workers``.

``fit`` writes RUN_DIR/recipe.yaml, history.csv, checkpoints/best.pt (best ``val_loss``, or
``loss`` without validation), checkpoints/last.pt (the weights the model holds at the end),
metrics.json and, with matplotlib, history.png. When ``EarlyStopping(restore_best_weights=True)``
put an earlier epoch's weights back, last.pt holds those: the console reports the last epoch and
the restored best epoch, each named, and metrics.json says which weights last.pt holds::

    {"recipe": "digits_mlp", "final": {...the last epoch's logs...}, "final_epoch": 20, "epochs": 20,
     "checkpoint": "RUN_DIR/checkpoints/last.pt",
     "checkpoint_weights": {"epoch": 16, "restored_best": true, "monitor": "val_accuracy",
                            "moving_averages": false, "metrics": {...epoch 16's logs...}},
     "best": {"monitor": "val_accuracy", "mode": "max", "epoch": 16, "value": 0.9749}}

Epochs count from 1 there, as the console prints them (history.csv's ``epoch`` column counts from
0, as Keras' ``CSVLogger`` does). ``predict`` writes RUN_DIR/predictions.npy for a checkpoint in
RUN_DIR/checkpoints/ (``--output`` chooses another file).

A bad recipe prints one line ``file:line: key.path: problem`` and exits with status 2;
Ctrl-C prints ``interrupted`` and exits with status 130 (128 + SIGINT, as shells report it); a
worker of a multi-worker run whose peer died or stopped arriving prints one line
(``WorkerFailedError``) and exits with status 69 (``PEER_FAILED_EXIT_STATUS``, ``EX_UNAVAILABLE``:
the ``--workers`` launcher then names the worker that failed or stopped arriving, not this one). A
fit that stopped on a preemption signal (``BackupAndRestore(save_before_preemption=True)`` in the
recipe's callbacks) prints one line and exits with status 75 (``PREEMPTED_EXIT_STATUS``): rerun
the same command to resume. The ``--workers`` launcher passes SIGTERM on to the workers, exits
with 75 when they were preempted and never restarts on it (``--max-restarts`` is for failures).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import sys
import time

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replicafit", description="Train, evaluate and inspect runs described by YAML recipes."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def recipe_command(name, help_text):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("recipe", help="a recipe file (YAML) or a shipped recipe's name (`replicafit list recipes`)")
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY.PATH=VALUE",
            help="override a recipe value; the value is read as YAML (e.g. fit.epochs=3)",
        )
        return sub

    fit = recipe_command("fit", "train a model from a recipe")
    fit.add_argument("--run-dir", help="where the run's files go (default: runs/<time>-<recipe name>)")
    fit.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log for TensorBoard into RUN_DIR/tensorboard (needs: pip install 'replicafit[tensorboard]')",
    )
    fit.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="start N worker processes on this machine (the recipe's strategy: multi_worker_mirrored)",
    )
    fit.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        help="with --workers: when a worker fails, restart all workers up to K times (default 0)",
    )
    fit.add_argument(
        "--log-all-workers",
        action="store_true",
        help="with --workers: show every worker's output, prefixed [worker i] (default: the chief's only)",
    )
    evaluate = recipe_command("evaluate", "evaluate a checkpoint on the recipe's validation data")
    evaluate.add_argument("--checkpoint", required=True, help="a checkpoint written by `replicafit fit`")
    predict = recipe_command("predict", "write predictions of a checkpoint for the recipe's validation data")
    predict.add_argument("--checkpoint", required=True, help="a checkpoint written by `replicafit fit`")
    predict.add_argument(
        "--output",
        help="where to write the outputs (.npy; default: predictions.npy in the checkpoint's run directory)",
    )
    recipe_command("validate", "check a recipe without running it")
    listing = commands.add_parser("list", help="list the registered names")
    listing.add_argument(
        "kind", nargs="?", help="recipes, strategy, model, dataset, optimizer, schedule, loss, metric or callback"
    )
    plot = commands.add_parser("plot", help="draw history.png for a run directory (needs matplotlib)")
    plot.add_argument("run_dir")
    return parser


def main(argv=None) -> int:
    """Entry point of ``replicafit``; returns the exit status."""
    if argv is None:  # the command line, not a call from Python
        _import_from_the_working_directory()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, even while torch is still importing: the user knows why it stopped
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _import_from_the_working_directory() -> None:
    """A recipe's ``module:attr`` finds the user's modules in the working directory under the ``replicafit``
    command as under ``python -m replicafit`` and ``torchrun -m replicafit``, which put it on ``sys.path``
    (a console script puts its own folder there instead)."""
    if getattr(sys.flags, "safe_path", False):  # python -P / PYTHONSAFEPATH: the user asked for no such entry
        return
    try:
        here = os.getcwd()
    except OSError:  # the working directory is gone: nothing to import from it
        return
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def _main(argv) -> int:
    from replicafit._lifeline import watch_launcher

    watch_launcher()  # a launched worker: from the start, not only once it joins its cluster
    from replicafit.recipes import RecipeError

    args = _parser().parse_args(argv)
    try:
        return {
            "fit": _fit,
            "evaluate": _evaluate,
            "predict": _predict,
            "validate": _validate,
            "list": _list,
            "plot": _plot,
        }[args.command](args)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as stop:
        from .preemption import Preempted

        if not isinstance(stop, Preempted):
            raise
        print(f"replicafit: {stop}", file=sys.stderr, flush=True)  # one line, no traceback
        return stop.code
    except _UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as error:
        from replicafit.strategies import WorkerFailedError

        if not isinstance(error, WorkerFailedError):
            raise
        # Another worker died or hung: that worker's failure is the story (the launcher names it),
        # this worker's traceback is noise.
        print(f"error: {error}", file=sys.stderr)
        from .launch import PEER_FAILED_EXIT_STATUS

        return PEER_FAILED_EXIT_STATUS
    except BrokenPipeError:  # `replicafit list | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 1


class _UsageError(Exception):
    pass


def _load(args):
    from replicafit import recipes

    recipe = recipes.load(args.recipe, args.overrides)
    return recipe, recipes.validate(recipe)


def _validate(args) -> int:
    recipe, _ = _load(args)
    print(f"{recipe.path}: ok")
    return 0


def _list(args) -> int:
    from replicafit import recipes  # also registers the built-ins
    from replicafit.recipes.registry import REGISTRIES

    kinds = [args.kind] if args.kind else ["recipes", *REGISTRIES]
    for kind in kinds:
        if kind in ("recipes", "recipe"):
            print("recipes:")
            for name, path in recipes.shipped().items():
                print(f"  {name:<28} {recipes.describe(path)}")
            continue
        if kind not in REGISTRIES:
            raise _UsageError(f"unknown kind {kind!r}; kinds: recipes, {', '.join(REGISTRIES)}")
        print(f"{kind}:")
        for name, description in REGISTRIES[kind].describe():
            print(f"  {name:<28} {description}")
        if kind == "optimizer":
            from replicafit.recipes.builtins import optimizer_arguments

            print(f"  ({optimizer_arguments()})")
    return 0


def _run_dir(args, recipe) -> str:
    if args.run_dir:
        return args.run_dir
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{recipe.name}")


# Built-in strategies that run in one process: N workers of one of them would each train alone
# and write the same files.
_ONE_PROCESS_STRATEGIES = ("default", "one_device", "mirrored", "central_storage")


def _check_workers(args) -> None:
    """Usage errors of --workers/--max-restarts/--log-all-workers, before anything is loaded."""
    from .launch import launched_worker

    if args.workers is None:
        if args.max_restarts is not None or args.log_all_workers:
            flag = "--max-restarts" if args.max_restarts is not None else "--log-all-workers"
            raise _UsageError(f"{flag} goes with --workers N (it sets how the started workers run)")
        return
    if launched_worker():
        raise _UsageError("--workers starts its own workers; under torchrun leave it out")
    if args.workers < 1:
        raise _UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise _UsageError(f"--max-restarts must be at least 0, got {args.max_restarts}")


def _launch(args) -> int:
    """``--workers N``: one parse of the recipe here (a bad file or --set fails once, before any
    worker starts), the run directory chosen once, then N workers that each run ``fit``."""
    from replicafit import recipes

    from .launch import launch_local

    recipe = recipes.load(args.recipe, args.overrides)
    entry = recipe.data.get("strategy", "default")
    name = entry.get("type") if isinstance(entry, dict) else entry
    if name in _ONE_PROCESS_STRATEGIES:
        raise _UsageError(
            f"--workers needs a multi-worker strategy, and the recipe's strategy {name!r} runs in one process: "
            "set `strategy: multi_worker_mirrored` (or --set strategy=multi_worker_mirrored)"
        )
    command = [sys.executable, "-m", "replicafit", "fit", args.recipe]
    for override in args.overrides:
        command += ["--set", override]
    command += ["--run-dir", _run_dir(args, recipe)]
    if args.tensorboard:
        command.append("--tensorboard")
    status = launch_local(command, args.workers, args.max_restarts or 0, log_all_workers=args.log_all_workers)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # the run is over: a late signal must not change its status
        signal.signal(signum, signal.SIG_IGN)
    return status


def _agreed(strategy, run_dir: str) -> str:
    """Worker 0's run directory on every worker (under torchrun each worker stamps its own time)."""
    return strategy.cluster.broadcast(run_dir)  # identity on single-process strategies


def _fit(args) -> int:
    _check_workers(args)
    if args.workers is not None:
        return _launch(args)

    import yaml

    from replicafit import recipes
    from replicafit.recipes.build import TENSORBOARD_DIR

    from .callbacks import CSVLogger, ModelCheckpoint, TensorBoard
    from .model_summary import summary
    from .preemption import noting

    recipe, checked = _load(args)
    run_dir = _run_dir(args, recipe)
    built_strategy = checked.get("strategy_instance")  # a built-in one exists already: agree before building
    if built_strategy is not None:
        run_dir = _agreed(built_strategy, run_dir)
    run = recipes.build(recipe, checked, run_dir=run_dir)
    if built_strategy is None:
        run_dir = _agreed(run.strategy, run_dir)
    # Only the chief (worker 0; the one process of a single-process strategy) writes files and
    # prints; every worker still builds the same callbacks and saves (gathering state is collective).
    chief = run.strategy.extended.should_checkpoint
    if chief:
        os.makedirs(os.path.join(run_dir, "checkpoints"), exist_ok=True)
        with open(os.path.join(run_dir, "recipe.yaml"), "w") as file:
            yaml.safe_dump(recipe.data, file, sort_keys=False)
        summary(run.model, input_data=_example_input(run.train))
    extra = []
    if args.tensorboard and not any(isinstance(c, TensorBoard) for c in run.callbacks):
        extra.append(TensorBoard(os.path.join(run_dir, TENSORBOARD_DIR)))
    validating = run.fit_kwargs.get("validation_data") is not None or run.fit_kwargs.get("validation_split")
    callbacks = [
        *run.callbacks,
        *extra,
        CSVLogger(os.path.join(run_dir, "history.csv")),
        ModelCheckpoint(
            os.path.join(run_dir, "checkpoints", "best.pt"),
            monitor="val_loss" if validating else "loss",
            save_best_only=True,
        ),
    ]
    # With save_before_preemption: a signal before the first step stops the fit after it; one after the fit
    # is complete waits until the run's files are written (preemption.noting).
    signals = sorted({signum for cb in callbacks for signum in getattr(cb, "preemption_signals", ())})
    with noting(signals) as noted:
        history = run.trainer.fit(run.model, run.train, callbacks=callbacks, **run.fit_kwargs)
        final = run.trainer.save_checkpoint(os.path.join(run_dir, "checkpoints", "last.pt"))
        if chief:
            _write_fit_results(run_dir, recipe, history, callbacks, validating, final, run.trainer.optimizer)
    for signum in signals:  # the run is complete and its files written: the rest is the interpreter's exit
        signal.signal(signum, signal.SIG_IGN)
    if noted and chief:
        print(f"replicafit: {noted[0].name} received once the run was complete; its files are written", flush=True)
    return 0


def _write_fit_results(run_dir, recipe, history, callbacks, validating, final, optimizer) -> None:
    """metrics.json, history.png and the console report of a finished fit (the chief's)."""
    use_ema = bool(getattr(optimizer, "use_ema", False))
    report = _fit_report(history, callbacks, "val_loss" if validating else "loss", use_ema)
    with open(os.path.join(run_dir, "metrics.json"), "w") as file:
        json.dump({"recipe": recipe.name, **report, "checkpoint": final}, file, indent=2)
    drawn = _draw(run_dir)
    for line in _report_lines(report, os.path.basename(final)):
        print(line)
    print(f"run directory: {run_dir}" + ("" if drawn else " (pip install 'replicafit[plot]' for history.png)"))


def _fit_report(history, callbacks, checkpoint_monitor: str, use_ema: bool = False) -> dict:
    """What metrics.json holds besides the recipe and the checkpoint's path: the last epoch's logs,
    which weights last.pt holds (``checkpoint_weights``) and the best epoch of the monitored metric
    (``best``: the EarlyStopping's monitor, else ``checkpoint_monitor``). Epochs count from 1."""
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
    from .callbacks import EarlyStopping, SwapEMAWeights

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
    from .callbacks import EarlyStopping

    stoppers = [c for c in callbacks if isinstance(c, EarlyStopping) and math.isfinite(getattr(c, "best", math.inf))]
    stopper = next((c for c in reversed(stoppers) if c.restore_best_weights), stoppers[-1] if stoppers else None)
    if stopper is not None:
        best = stopper.best_epoch + 1
        return {"monitor": stopper.monitor, "mode": stopper.mode, "epoch": best, "value": stopper.best}
    return _first_best([e + 1 for e in history.epoch], checkpoint_monitor, history.history.get(checkpoint_monitor))


def _first_best(epochs, monitor: str, values, mode: str = "min") -> dict | None:
    """``{"monitor", "mode", "epoch", "value"}`` of the first best finite value (None without one)."""
    if not values or len(values) != len(epochs):
        return None
    finite = [(v, e) for e, v in zip(epochs, values) if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return None
    best = min(finite, key=lambda p: p[0]) if mode == "min" else max(finite, key=lambda p: p[0])
    return {"monitor": monitor, "mode": mode, "epoch": best[1], "value": best[0]}


def _format_number(value) -> str:
    """4 decimals, or 4 significant digits below 1e-3 (a learning rate of 3e-5 is not 0.0000): the
    progress bar's format."""
    from .callbacks.progbar_logger import _format_value

    return _format_value(float(value)) if isinstance(value, (int, float)) else str(value)


def _report_lines(report: dict, checkpoint: str = "last.pt") -> list:
    """The end of ``replicafit fit``'s output: the last epoch's values and, when EarlyStopping restored an
    earlier epoch's weights into the checkpoint, that epoch's, each line saying whose values they are;
    the validation accuracy on one line of its own (both values, named, when they differ)."""
    final, last, weights = report["final"], report["final_epoch"], report["checkpoint_weights"]
    if weights is None:
        return ["final: no epoch ran"]

    def values(logs) -> str:
        keys = [k for k in logs if k.startswith("val_")] or list(logs)
        shown = ", ".join(f"{k} {_format_number(logs[k])}" for k in keys if k != "val_accuracy")
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
        accuracy = f"validation accuracy: {_format_number(final['val_accuracy'])}"
        restored = weights["metrics"].get("val_accuracy")
        if weights["epoch"] != last and restored is not None:
            accuracy = (
                f"validation accuracy: {_format_number(restored)} in {checkpoint} (best epoch {weights['epoch']}), "
                f"{_format_number(final['val_accuracy'])} at the last epoch ({last})"
            )
        elif weights["epoch"] != last:
            accuracy += f" at the last epoch ({last})"
        lines.append(accuracy)
    return lines


def _example_input(train):
    """The first two rows of the training inputs, for the model summary's output shapes (or None)."""
    # A tuple is (x, y) arrays; a list is a list of batches, a Dataset or DataLoader has no row slice.
    inputs = train[0] if isinstance(train, tuple) and train else None
    try:
        return inputs[:2] if inputs is not None and len(inputs) else None
    except TypeError:  # not an array: the summary goes without shapes
        return None


def _checkpointed_run(args):
    from replicafit import recipes

    from .checkpoint import CheckpointError

    recipe, checked = _load(args)
    run = recipes.build(recipe, checked)
    try:
        run.trainer.load_checkpoint(args.checkpoint, model=run.model)
    except CheckpointError as error:
        raise _UsageError(str(error)) from None
    except (RuntimeError, ValueError) as error:  # the checkpoint does not fit this recipe's model
        raise _UsageError(_mismatch_message(args, run.model, error)) from None
    data = run.validation if run.validation is not None else run.train
    return run, data


def _checkpoint_run_dir(checkpoint) -> str | None:
    """RUN_DIR for a checkpoint at RUN_DIR/checkpoints/NAME.pt, where `replicafit fit` saves (a folder
    with the run's recipe.yaml); None for a checkpoint anywhere else."""
    folder = os.path.dirname(os.fspath(checkpoint)) or os.curdir
    run_dir = os.path.normpath(os.path.join(folder, os.pardir))
    if os.path.basename(os.path.abspath(folder)) == "checkpoints" and os.path.isfile(
        os.path.join(run_dir, "recipe.yaml")
    ):
        return run_dir
    return None


def _named(keys, most: int = 6) -> str:
    shown = ", ".join(keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _mismatch_message(args, model, error) -> str:
    """A checkpoint whose model state does not fit the recipe's model: which keys and shapes differ,
    and what to pass instead, in the command's terms (the Python API's own hint, strict=False, is not
    an option of the command)."""
    from .checkpoint import CheckpointError, load

    try:
        saved = load(args.checkpoint, kind="checkpoint")["model"]
    except (CheckpointError, KeyError, TypeError):
        saved = {}
    expected = model.state_dict()
    differences = []
    only_saved = [k for k in saved if k not in expected]
    only_model = [k for k in expected if k not in saved]
    reshaped = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(expected[k].shape)}"
        for k in saved
        if k in expected and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(expected[k].shape)
    ]
    if only_saved:
        differences.append(f"only in the checkpoint: {_named(only_saved)}")
    if only_model:
        differences.append(f"only in the recipe's model: {_named(only_model)}")
    if reshaped:
        differences.append(f"shapes differ, checkpoint vs model: {_named(reshaped, 3)}")
    if not differences:  # not a key or shape mismatch: torch's own first line, less the Python API's hint
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        differences.append(first.split(" Pass strict=False")[0])
    run_dir = _checkpoint_run_dir(args.checkpoint)
    fix = "pass the recipe it was trained with"
    if run_dir is not None:
        recipe = os.path.join(run_dir, "recipe.yaml")
        fix += f", the run's own: `replicafit {args.command} {recipe} --checkpoint {args.checkpoint}`"
    if args.overrides:
        fix += ", without --set overrides that change the model"
    return (
        f"{args.checkpoint} does not match the recipe's model: it was saved from a different model "
        f"({'; '.join(differences)}). To use it, {fix}."
    )


def _evaluate(args) -> int:
    run, data = _checkpointed_run(args)
    batch = run.evaluate_kwargs.get("batch_size") or run.fit_kwargs.get("batch_size")
    logs = run.trainer.evaluate(
        run.model, data, batch_size=batch, steps=run.evaluate_kwargs.get("steps"), verbose=0, return_dict=True
    )
    if run.strategy.extended.should_checkpoint:  # across workers every worker evaluates; the chief reports
        print(json.dumps(logs, indent=2))
    return 0


def _predict(args) -> int:
    import numpy as np

    run, data = _checkpointed_run(args)
    inputs = data[0] if isinstance(data, tuple) else data
    batch = run.evaluate_kwargs.get("batch_size") or run.fit_kwargs.get("batch_size")
    outputs = run.trainer.predict(run.model, inputs, batch_size=batch, verbose=0)
    if not run.strategy.extended.should_checkpoint:  # across workers every worker predicts; the chief writes
        return 0
    output, where = args.output, ""
    if output is None:
        run_dir = _checkpoint_run_dir(args.checkpoint)
        output = os.path.join(run_dir, "predictions.npy") if run_dir is not None else "predictions.npy"
        if run_dir is None:
            where = (
                f" (in the current directory: {args.checkpoint} is not in a run directory's checkpoints/ folder; "
                "--output FILE.npy chooses the file)"
            )
    np.save(output, outputs.numpy())
    print(f"wrote {tuple(outputs.shape)} predictions to {output}{where}")
    return 0


def _plot(args) -> int:
    if not os.path.exists(os.path.join(args.run_dir, "history.csv")):
        raise _UsageError(f"{args.run_dir} has no history.csv: is it a run directory of `replicafit fit`?")
    if _plot_spec(args.run_dir) is None:
        raise _UsageError(f"{os.path.join(args.run_dir, 'history.csv')} holds no epoch yet: nothing to draw")
    if not _draw(args.run_dir):
        raise _UsageError("plotting needs matplotlib: pip install 'replicafit[plot]'")
    print(f"wrote {os.path.join(args.run_dir, 'history.png')}")
    return 0


def _column(rows, name: str) -> list:
    return [float(r[name]) if r.get(name) not in (None, "") else math.nan for r in rows]


def _plot_spec(run_dir: str) -> dict | None:
    """What history.png shows (None for a history without epochs): a title (the recipe's name and the
    run directory's), one panel per quantity (loss and each metric, train and validation values per
    epoch, axis labels) and the best epoch of the monitored metric, marked on its panel: metrics.json's
    ``best`` (the EarlyStopping's monitor, else val_loss or loss, what best.pt keeps), or for a run
    directory without one, the first minimum of val_loss (loss without validation)."""
    with open(os.path.join(run_dir, "history.csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        return None
    try:
        with open(os.path.join(run_dir, "metrics.json")) as file:
            metrics = json.load(file)
    except (OSError, ValueError):
        metrics = {}
    epochs = [int(r["epoch"]) + 1 for r in rows]
    names = [k for k in rows[0] if k not in ("epoch", "learning_rate") and not k.startswith("val_")]
    names.sort(key=lambda name: name != "loss")  # the loss first (history.csv orders its columns by name)
    panels = []
    for name in names:
        series = {"train": _column(rows, name)}
        if f"val_{name}" in rows[0]:
            series["validation"] = _column(rows, f"val_{name}")
        panels.append({"name": name, "xlabel": "epoch", "ylabel": name, "series": series})
    best = metrics.get("best") if isinstance(metrics.get("best"), dict) else None
    if best is None:
        monitor = "val_loss" if "val_loss" in rows[0] else "loss"
        best = _first_best(epochs, monitor, _column(rows, monitor)) if monitor in rows[0] else None
    mark = None
    if best is not None and best["monitor"].removeprefix("val_") in names:
        mark = {
            "panel": best["monitor"].removeprefix("val_"),
            "series": "validation" if best["monitor"].startswith("val_") else "train",
            "epoch": best["epoch"],
            "value": best["value"],
            "label": f"best {best['monitor']}: {_format_number(best['value'])} (epoch {best['epoch']})",
        }
    run_name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    recipe = metrics.get("recipe")
    return {
        "title": f"recipe {recipe}, run {run_name}" if recipe else f"run {run_name}",
        "epochs": epochs,
        "panels": panels,
        "best": mark,
    }


def _draw(run_dir: str) -> bool:
    """history.png from ``_plot_spec``. False without matplotlib (or without an epoch to draw)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    spec = _plot_spec(run_dir)
    if spec is None:
        return False
    panels, mark = spec["panels"], spec["best"]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False, layout="constrained")
    figure.suptitle(spec["title"])
    for axis, panel in zip(axes[0], panels):
        for label, values in panel["series"].items():
            axis.plot(spec["epochs"], values, label=label)
        if mark is not None and mark["panel"] == panel["name"]:
            axis.axvline(mark["epoch"], color="gray", linestyle=":", linewidth=1)
            axis.plot([mark["epoch"]], [mark["value"]], "r*", markersize=12, label=mark["label"])
        axis.set_xlabel(panel["xlabel"])
        axis.set_ylabel(panel["ylabel"])
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend()
    figure.savefig(os.path.join(run_dir, "history.png"), dpi=100)
    plt.close(figure)
    return True


if __name__ == "__main__":
    sys.exit(main())
