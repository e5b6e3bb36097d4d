"""The command's arguments: the parser, the usage error, and the recipe the arguments name."""

from __future__ import annotations

import argparse

__all__ = ["build_parser", "UsageError", "load_recipe"]


def build_parser() -> argparse.ArgumentParser:
    """The ``replicafit`` command's argument parser: one subcommand per command, each with its options.

    Example::

        args = build_parser().parse_args(["fit", "digits_mlp", "--set", "fit.epochs=1"])
        args.command, args.recipe, args.overrides  # ('fit', 'digits_mlp', ['fit.epochs=1'])
    """
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
        help="start N worker processes on this machine (the recipe's strategy: multi_worker_mirrored or fully_sharded)",
    )
    fit.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        help="with --workers: when a worker fails, restart all workers up to K times (default 0)",
    )
    fit.add_argument(
        "--min-workers",
        type=int,
        metavar="M",
        help="with --max-restarts: when the same worker fails in two attempts in a row, restart with one worker "
        "fewer, down to M (default: N, always all)",
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


class UsageError(Exception):
    """A wrong use of the command's options (``--workers 0``, an unknown kind): one line, exit status 2.

    Example::

        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    """


def load_recipe(args) -> tuple:
    """``(recipe, checked)``: the recipe the arguments name, read with their ``--set`` overrides and validated.

    Raises ``RecipeError`` for a bad recipe (the command prints it in one line and exits with status 2).

    Example::

        recipe, checked = load_recipe(build_parser().parse_args(["validate", "digits_mlp"]))
    """
    from replicafit import recipes

    recipe = recipes.load(args.recipe, args.overrides)
    return recipe, recipes.validate(recipe)
