"""The ``replicafit`` command (also ``python -m replicafit``).

::

    replicafit fit RECIPE [--set key.path=value ...] [--run-dir DIR]
    replicafit evaluate RECIPE --checkpoint PATH [--set ...]
    replicafit predict RECIPE --checkpoint PATH [--output FILE.npy] [--set ...]
    replicafit validate RECIPE [--set ...]
    replicafit list [KIND]                      (KIND: recipes, strategy, model, ...)
    replicafit plot RUN_DIR

RECIPE is a YAML file, or the name of a recipe that ships with replicafit
(``replicafit fit digits_mlp``; ``replicafit list recipes`` shows them).

A bad recipe prints one line ``file:line: key.path: problem`` and exits with status 2;
Ctrl-C prints ``interrupted`` and exits with status 130 (128 + SIGINT, as shells report it).
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
    return 0


def _run_dir(args, recipe) -> str:
    if args.run_dir:
        return args.run_dir
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{recipe.name}")


def _fit(args) -> int:
    import yaml

    from . import recipes
    from .callbacks import CSVLogger, ModelCheckpoint
    from .model_summary import summary
    from .tensorboard import TensorBoard

    recipe, checked = _load(args)
    run_dir = _run_dir(args, recipe)
    run = recipes.build(recipe, checked, run_dir=run_dir)
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
    print(json.dumps(logs, indent=2))
    return 0


def _predict(args) -> int:
    import numpy as np

    run, data = _checkpointed_run(args)
    inputs = data[0] if isinstance(data, tuple) else data
    batch = run.evaluate_kwargs.get("batch_size") or run.fit_kwargs.get("batch_size")
    outputs = run.trainer.predict(run.model, inputs, batch_size=batch, verbose=0)
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
