"""``main``: the ``replicafit`` command's entry point, which runs one command and turns what stops it into
an exit status and one line (a bad recipe or a wrong option: 2; Ctrl-C: 130; a worker whose peer failed:
69; preempted: 75)."""

from __future__ import annotations

import os
import sys

from . import evaluation, fit, listing, plot
from .parser import UsageError, build_parser

__all__ = ["main", "COMMANDS", "EXIT_USAGE", "EXIT_INTERRUPTED"]

#: The exit status of a bad recipe, an unknown recipe name, a checkpoint that does not fit or a wrong option.
EXIT_USAGE = 2
#: The exit status after Ctrl-C: 128 + SIGINT, what a shell reports for a command it stopped.
EXIT_INTERRUPTED = 130

#: The commands by name: each takes the parsed arguments and returns the exit status.
COMMANDS = {
    "fit": fit.fit,
    "evaluate": evaluation.evaluate,
    "predict": evaluation.predict,
    "validate": listing.validate,
    "list": listing.list_names,
    "plot": plot.plot,
}


def main(argv=None) -> int:
    """Entry point of ``replicafit`` (``python -m replicafit``); returns the exit status.

    ``argv``: the arguments after the command's name; None reads ``sys.argv`` (and, as ``python -m`` does,
    lets a recipe's ``module:attr`` import modules of the working directory).

    Example::

        import sys
        from replicafit.cli import main

        sys.exit(main(["validate", "digits_mlp"]))  # prints ".../digits_mlp.yaml: ok", exits 0
    """
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
    from replicafit.lifeline import watch_launcher

    watch_launcher()  # a launched worker: from the start, not only once it joins its cluster
    from replicafit.recipes import RecipeError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as stop:
        from replicafit.trainer import Preempted

        if not isinstance(stop, Preempted):
            raise
        print(f"replicafit: {stop}", file=sys.stderr, flush=True)  # one line, no traceback
        return stop.code
    except UsageError as error:
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
