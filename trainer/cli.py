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

A bad recipe prints one line ``file:line: key.path: problem`` and exits with status 2;
Ctrl-C prints ``interrupted`` and exits with status 130 (128 + SIGINT, as shells report it); a
worker of a multi-worker run whose peer died or stopped arriving prints one line
(``WorkerFailedError``) and exits with status 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
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
    predict.add_argument("--checkpoint", required=True)
    predict.add_argument("--output", default="predictions.npy", help="where to write the outputs (.npy)")
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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, even while torch is still importing: the user knows why it stopped
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv) -> int:
    from .recipes import RecipeError

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
        return 1
    except BrokenPipeError:  # `replicafit list | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 1


class _UsageError(Exception):
    pass


def _load(args):
    from . import recipes

    recipe = recipes.load(args.recipe, args.overrides)
    return recipe, recipes.validate(recipe)


def _validate(args) -> int:
    recipe, _ = _load(args)
    print(f"{recipe.path}: ok")
    return 0


def _list(args) -> int:
    from . import recipes  # also registers the built-ins
    from .registry import REGISTRIES

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
            from .builtins import optimizer_arguments

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
    from . import recipes
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
    return launch_local(command, args.workers, args.max_restarts or 0, log_all_workers=args.log_all_workers)


def _agreed(strategy, run_dir: str) -> str:
    """Worker 0's run directory on every worker (under torchrun each worker stamps its own time)."""
    return strategy.extended._broadcast_object(run_dir)  # identity on single-process strategies


def _fit(args) -> int:
    _check_workers(args)
    if args.workers is not None:
        return _launch(args)

    import yaml

    from . import recipes
    from .callbacks import CSVLogger, ModelCheckpoint
    from .model_summary import summary
    from .tensorboard import TensorBoard

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
        extra.append(TensorBoard(os.path.join(run_dir, recipes.TENSORBOARD_DIR)))
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
    history = run.trainer.fit(run.model, run.train, callbacks=callbacks, **run.fit_kwargs)
    final = run.trainer.save_checkpoint(os.path.join(run_dir, "checkpoints", "last.pt"))
    if not chief:
        return 0
    results = {key: values[-1] for key, values in history.history.items() if values}
    with open(os.path.join(run_dir, "metrics.json"), "w") as file:
        json.dump({"final": results, "epochs": len(history.epoch), "checkpoint": final}, file, indent=2)
    drawn = _draw(run_dir, quiet=True)
    summary = [f"{k} {v:.4f}" for k, v in results.items() if k.startswith("val_")] or [
        f"{k} {v:.4f}" for k, v in results.items()
    ]
    print("final: " + ", ".join(summary))
    if "val_accuracy" in results:
        print(f"validation accuracy: {results['val_accuracy']:.4f}")
    print(f"run directory: {run_dir}" + ("" if drawn else " (pip install 'replicafit[plot]' for history.png)"))
    return 0


def _example_input(train):
    """The first two rows of the training inputs, for the model summary's output shapes (or None)."""
    # A tuple is (x, y) arrays; a list is a list of batches, a Dataset or DataLoader has no row slice.
    inputs = train[0] if isinstance(train, tuple) and train else None
    try:
        return inputs[:2] if inputs is not None and len(inputs) else None
    except TypeError:  # not an array: the summary goes without shapes
        return None


def _checkpointed_run(args):
    from . import recipes
    from .checkpoint import CheckpointError

    recipe, checked = _load(args)
    run = recipes.build(recipe, checked)
    try:
        run.trainer.load_checkpoint(args.checkpoint, model=run.model)
    except CheckpointError as error:
        raise _UsageError(str(error)) from None
    except (RuntimeError, ValueError) as error:  # the checkpoint does not fit this recipe's model
        raise _UsageError(
            f"{args.checkpoint} does not match the recipe's model: {str(error).splitlines()[0]}"
        ) from None
    data = run.validation if run.validation is not None else run.train
    return run, data


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
    if run.strategy.extended.should_checkpoint:  # across workers every worker predicts; the chief writes
        np.save(args.output, outputs.numpy())
        print(f"wrote {tuple(outputs.shape)} predictions to {args.output}")
    return 0


def _plot(args) -> int:
    if not os.path.exists(os.path.join(args.run_dir, "history.csv")):
        raise _UsageError(f"{args.run_dir} has no history.csv: is it a run directory of `replicafit fit`?")
    if not _draw(args.run_dir, quiet=False):
        raise _UsageError("plotting needs matplotlib: pip install 'replicafit[plot]'")
    print(f"wrote {os.path.join(args.run_dir, 'history.png')}")
    return 0


def _draw(run_dir: str, quiet: bool) -> bool:
    """history.png: loss and each metric per epoch, train and validation. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    with open(os.path.join(run_dir, "history.csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        return False
    epochs = [int(r["epoch"]) + 1 for r in rows]
    names = [k for k in rows[0] if k not in ("epoch", "learning_rate") and not k.startswith("val_")]
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5), squeeze=False)
    for axis, name in zip(axes[0], names):
        axis.plot(epochs, [float(r[name]) for r in rows], label="train")
        if f"val_{name}" in rows[0]:
            axis.plot(epochs, [float(r[f"val_{name}"]) for r in rows], label="validation")
        axis.set_title(name)
        axis.set_xlabel("epoch")
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(run_dir, "history.png"), dpi=100)
    plt.close(figure)
    return True


if __name__ == "__main__":
    sys.exit(main())
