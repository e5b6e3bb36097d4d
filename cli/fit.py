"""``replicafit fit``: the run directory, the callbacks the command adds, the files it writes and its report;
with ``--workers N``, the local launcher (``launch``) instead."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from .parser import UsageError, load_recipe
from .plot import draw
from .reports import fit_report, report_lines

__all__ = ["fit"]


def _run_dir(args, recipe) -> str:
    if args.run_dir:
        return args.run_dir
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{recipe.name}")


# Built-in strategies that run in one process: N workers of one of them would each train alone
# and write the same files. The multi-worker ones (multi_worker_mirrored, fully_sharded) and a user's
# own strategies run under --workers N.
_ONE_PROCESS_STRATEGIES = ("default", "one_device", "mirrored", "central_storage")


def _check_workers(args) -> None:
    """Usage errors of --workers/--max-restarts/--min-workers/--log-all-workers, before anything is loaded."""
    from .launch import launched_worker

    if args.workers is None:
        if args.max_restarts is not None or args.log_all_workers or args.min_workers is not None:
            flag = (
                "--max-restarts"
                if args.max_restarts is not None
                else "--min-workers"
                if args.min_workers is not None
                else "--log-all-workers"
            )
            raise UsageError(f"{flag} goes with --workers N (it sets how the started workers run)")
        return
    if launched_worker():
        raise UsageError("--workers starts its own workers; under torchrun leave it out")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    if args.min_workers is not None and not 1 <= args.min_workers <= args.workers:
        raise UsageError(f"--min-workers must be between 1 and --workers ({args.workers}), got {args.min_workers}")
    if args.min_workers is not None and not args.max_restarts:
        raise UsageError("--min-workers goes with --max-restarts K (it says how the restarts go on)")


def _launch(args) -> int:
    """``--workers N``: one parse of the recipe here (a bad file or --set fails once, before any
    worker starts), the run directory chosen once, then N workers that each run ``fit``."""
    from replicafit import recipes

    from .launch import launch_local

    recipe = recipes.load(args.recipe, args.overrides)
    entry = recipe.data.get("strategy", "default")
    name = entry.get("type") if isinstance(entry, dict) else entry
    if name in _ONE_PROCESS_STRATEGIES:
        raise UsageError(
            f"--workers needs a multi-worker strategy, and the recipe's strategy {name!r} runs in one process: "
            "set `strategy: multi_worker_mirrored` or `strategy: fully_sharded` (or --set strategy=...)"
        )
    command = [sys.executable, "-m", "replicafit", "fit", args.recipe]
    for override in args.overrides:
        command += ["--set", override]
    command += ["--run-dir", _run_dir(args, recipe)]
    if args.tensorboard:
        command.append("--tensorboard")
    # The chief's status 0 is the run's: it writes the run's files after every worker's last collective.
    extra = {"chief_completes": True} | ({"min_workers": args.min_workers} if args.min_workers is not None else {})
    status = launch_local(command, args.workers, args.max_restarts or 0, log_all_workers=args.log_all_workers, **extra)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # the run is over: a late signal must not change its status
        signal.signal(signum, signal.SIG_IGN)
    return status


def _agreed(strategy, run_dir: str) -> str:
    """Worker 0's run directory on every worker (under torchrun each worker stamps its own time)."""
    return strategy.cluster.broadcast(run_dir)  # identity on single-process strategies


def fit(args) -> int:
    """``replicafit fit RECIPE``: trains, writes the run directory and reports; with ``--workers N``, starts
    N workers on this machine that each run it.

    Every worker builds the same run and callbacks; only the chief writes files and prints.

    Example::

        argv = ["fit", "digits_mlp", "--set", "fit.epochs=1", "--run-dir", "runs/mine"]
        status = fit(build_parser().parse_args(argv))  # runs/mine/{recipe.yaml, history.csv, checkpoints/, ...}
    """
    _check_workers(args)
    if args.workers is not None:
        return _launch(args)

    import yaml

    from replicafit import recipes
    from replicafit.recipes.builder import TENSORBOARD_DIR
    from replicafit.trainer import BackupAndRestore, CSVLogger, ModelCheckpoint, TensorBoard, summary
    from replicafit.trainer.preemption import noting

    recipe, checked = load_recipe(args)
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
    backups = [cb for cb in callbacks if isinstance(cb, BackupAndRestore)]
    signals = sorted({signum for cb in backups for signum in cb.preemption_signals})
    with noting(signals) as noted:
        history = run.trainer.fit(run.model, run.train, callbacks=callbacks, **run.fit_kwargs)
        final = _save_last(run, os.path.join(run_dir, "checkpoints", "last.pt"))
        if chief:
            _write_fit_results(run_dir, recipe, history, callbacks, validating, final, run.trainer.optimizer)
    for signum in signals:  # the run is complete and its files written: the rest is the interpreter's exit
        signal.signal(signum, signal.SIG_IGN)
    if noted and chief:
        print(f"replicafit: {noted[0].name} received once the run was complete; its files are written", flush=True)
    return 0


def _save_last(run, path) -> str:
    """``last.pt`` of a trained run. A peer lost meanwhile (the run trained, its backup deleted): where every worker
    holds the whole state, each survivor goes on alone and the chief writes its own, so the run is complete (a
    restart would train it again); else ``WorkerFailedError``."""
    from replicafit.strategies import WorkerFailedError

    try:
        return run.trainer.save_checkpoint(path)
    except WorkerFailedError:
        strategy = run.strategy
        if not strategy.cluster.failed or not strategy.extended.capabilities.whole_state_on_every_worker:
            raise
        with strategy.cluster.alone():
            final = run.trainer.save_checkpoint(path)
        if strategy.extended.should_checkpoint:
            print(
                "replicafit: a peer was lost after the run was trained; this worker wrote its files alone",
                file=sys.stderr,
                flush=True,
            )
        return final


def _write_fit_results(run_dir, recipe, history, callbacks, validating, final, optimizer) -> None:
    """metrics.json, history.png and the console report of a finished fit (the chief's)."""
    use_ema = optimizer.use_ema
    report = fit_report(history, callbacks, "val_loss" if validating else "loss", use_ema)
    with open(os.path.join(run_dir, "metrics.json"), "w") as file:
        json.dump({"recipe": recipe.name, **report, "checkpoint": final}, file, indent=2)
    drawn = draw(run_dir)
    for line in report_lines(report, os.path.basename(final)):
        print(line)
    print(f"run directory: {run_dir}" + ("" if drawn else " (pip install 'replicafit[plot]' for history.png)"))


def _example_input(train):
    """The first two rows of the training inputs, for the model summary's output shapes (or None)."""
    # A tuple is (x, y) arrays; a list is a list of batches, a Dataset or DataLoader has no row slice.
    inputs = train[0] if isinstance(train, tuple) and train else None
    try:
        return inputs[:2] if inputs is not None and len(inputs) else None
    except TypeError:  # not an array: the summary goes without shapes
        return None
