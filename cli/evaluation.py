"""``replicafit evaluate`` and ``replicafit predict``: a checkpoint loaded into the recipe's model, run on
its validation data. A checkpoint that does not fit the model is one message naming the keys and shapes
that differ, and the recipe to pass instead."""

from __future__ import annotations

import json
import os

from .parser import UsageError, load_recipe

__all__ = ["evaluate", "predict"]


def _checkpointed_run(args):
    from replicafit import recipes
    from replicafit.trainer import CheckpointError

    recipe, checked = load_recipe(args)
    run = recipes.build(recipe, checked)
    try:
        run.trainer.load_checkpoint(args.checkpoint, model=run.model)
    except CheckpointError as error:
        raise UsageError(str(error)) from None
    except (RuntimeError, ValueError) as error:  # the checkpoint does not fit this recipe's model
        raise UsageError(_mismatch_message(args, run.model, error)) from None
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
    from replicafit.trainer.checkpoint import CheckpointError, load

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


def evaluate(args) -> int:
    """``replicafit evaluate RECIPE --checkpoint PATH``: prints the checkpoint's losses and metrics on the
    recipe's validation data (its training data without one) as JSON.

    Example::

        argv = ["evaluate", "digits_mlp", "--checkpoint", "runs/mine/checkpoints/last.pt"]
        status = evaluate(build_parser().parse_args(argv))  # prints {"loss": ..., "accuracy": ...}
    """
    run, data = _checkpointed_run(args)
    batch = run.evaluate_kwargs.get("batch_size") or run.fit_kwargs.get("batch_size")
    logs = run.trainer.evaluate(
        run.model, data, batch_size=batch, steps=run.evaluate_kwargs.get("steps"), verbose=0, return_dict=True
    )
    if run.strategy.extended.should_checkpoint:  # across workers every worker evaluates; the chief reports
        print(json.dumps(logs, indent=2))
    return 0


def predict(args) -> int:
    """``replicafit predict RECIPE --checkpoint PATH [--output FILE.npy]``: writes the checkpoint's outputs
    for the recipe's validation data (default: predictions.npy in the checkpoint's run directory).

    Example::

        argv = ["predict", "digits_mlp", "--checkpoint", "runs/mine/checkpoints/last.pt"]
        status = predict(build_parser().parse_args(argv))  # writes runs/mine/predictions.npy
    """
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
    np.save(output, outputs.detach().cpu().numpy())  # (predictions on a GPU come to the host first)
    print(f"wrote {tuple(outputs.shape)} predictions to {output}{where}")
    return 0
