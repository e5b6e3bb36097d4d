"""Building a run from a validated recipe: ``build`` calls the code the recipe names and returns a ``Run``.

The strategy, the data, the model (its sizes from the data where the recipe leaves them out), the optimizer
(in the strategy's scope, with its schedule and weight-decay exclusions), the loss, the metrics and the
callbacks (``SwapEMAWeights`` first with ``use_ema``), and the ``Trainer``; each factory's result is refused
unless it is of its section's kind (``calls``), and the data's form is checked against the batch size
before ``fit`` would refuse it mid-call.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

from .calls import build_entry, dataset_info, model_inputs, type_at, with_written_name
from .entries import entry_name, factory_parameters
from .source import Recipe
from .validation import check_batchnorm_to_sync, check_shard_units, validate

__all__ = ["build", "Run", "TENSORBOARD_DIR"]


@dataclass
class Run:
    """Everything a recipe builds: the strategy, the model, the data (``info``: what the dataset factory
    returned, as a dict), the ``Trainer``, the recipe's callbacks and the arguments of ``fit`` and
    ``evaluate``.

    Example::

        run = build(load("digits_mlp", overrides=["fit.epochs=1"]))
        history = run.trainer.fit(run.model, run.train, callbacks=run.callbacks, **run.fit_kwargs)
    """

    recipe: Recipe
    strategy: object
    model: object
    info: dict
    trainer: object
    callbacks: list
    fit_kwargs: dict
    evaluate_kwargs: dict

    @property
    def train(self):
        """The training data, in the form the dataset gave it (what ``fit`` takes)."""
        return self.info["train"]

    @property
    def validation(self):
        """The validation data the dataset gave, or None (``fit_kwargs`` holds it as ``validation_data``)."""
        return self.info.get("validation")


TENSORBOARD_DIR = "tensorboard"


def build(recipe: Recipe, checked: dict | None = None, run_dir=None) -> Run:
    """Validates (unless given the result) and constructs the strategy, data, model, trainer and callbacks.

    This calls the code the recipe names, and refuses what a factory returns unless it is of its
    section's kind (see ``kinds``). With ``run_dir``, a callback whose ``log_dir`` the recipe leaves
    out (``{type: tensorboard}``) logs into ``run_dir/tensorboard``, and one that takes a ``run_dir`` the recipe
    leaves out (``{type: mlflow_logger}``) gets the run directory itself.
    """
    import torch

    from replicafit.data import InputOptions
    from replicafit.trainer import SwapEMAWeights, Trainer

    checked = checked or validate(recipe)
    data = recipe.data
    seed = data.get("seed")
    strategy = checked.get("strategy_instance")
    if strategy is None:
        strategy = build_entry(recipe, ("strategy",), "strategy", *checked["strategy"])
    info = checked.get("data_instance")
    if info is None:
        info = dataset_info(recipe, build_entry(recipe, ("data",), "dataset", *checked["data"]))
    model_factory, model_args = checked["model"]
    extra = model_inputs(model_factory, model_args, info)
    _check_model_inputs(recipe, model_factory, model_args, extra, info)
    if seed is not None:
        torch.manual_seed(seed)
    model = build_entry(recipe, ("model",), "model", model_factory, model_args, **extra)
    if checked.get("sync_batchnorm"):
        model = _synchronized(recipe, model)
    check_shard_units(recipe, strategy, model)
    with strategy.scope():
        optimizer_factory, optimizer_args = checked["optimizer"]
        if "schedule" in checked:
            schedule = build_entry(recipe, ("optimizer", "learning_rate"), "schedule", *checked["schedule"])
            optimizer_args = dict(optimizer_args, learning_rate=schedule)
        optimizer = build_entry(recipe, ("optimizer",), "optimizer", optimizer_factory, optimizer_args)
        if checked["decay_exclusions"]:
            optimizer.exclude_from_weight_decay(var_names=checked["decay_exclusions"])
    loss = build_entry(recipe, ("loss",), "loss", *checked["loss"])
    metric_names = [entry_name(m) for m in data.get("metrics", []) or []]
    metrics = [
        factory
        if factory in ("accuracy", "crossentropy")
        else build_entry(recipe, ("metrics", i), "metric", factory, with_written_name(args, factory, metric_names[i]))
        for i, (factory, args) in enumerate(checked["metrics"])
    ]
    callbacks = [
        build_entry(recipe, ("callbacks", i), "callback", f, _in_run_dir(f, a, run_dir))
        for i, (f, a) in enumerate(checked["callbacks"])
    ]
    if optimizer.use_ema and not any(isinstance(c, SwapEMAWeights) for c in callbacks):
        # With use_ema the averaged model is the result: validation, best checkpoints and early stopping
        # judge (and keep) the averages. A recipe that lists swap_ema_weights itself decides.
        callbacks.insert(0, SwapEMAWeights(swap_on_epoch=True))
    precision = str(data.get("precision", "32"))
    policy = checked.get("auto_shard_policy")
    options = None if policy is None else InputOptions(auto_shard_policy=policy)
    trainer = Trainer(
        strategy=strategy,
        optimizer=optimizer,
        loss=loss,
        metrics=metrics,
        seed=seed,
        precision=precision,
        input_options=options,
    )
    fit_kwargs = dict(checked["fit"])
    fit_kwargs.update(checked["data_batch"])
    _check_training_data(recipe, info, fit_kwargs, checked["data_batch"])
    if info.get("validation") is not None and "validation_split" not in fit_kwargs:
        fit_kwargs["validation_data"] = info["validation"]
    return Run(recipe, strategy, model, info, trainer, callbacks, fit_kwargs, dict(checked["evaluate"]))


def _synchronized(recipe: Recipe, model):
    """``model`` with its BatchNorm layers converted to ``nn.SyncBatchNorm`` (recipe key
    ``model.sync_batchnorm: true``): statistics of the whole global batch under every strategy."""
    from torch import nn

    check_batchnorm_to_sync(recipe, model)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def _check_model_inputs(recipe: Recipe, factory, args: dict, extra: dict, info=None) -> None:
    """A model size the recipe leaves out and the data does not give: refused here, with the fix."""
    from .datasets import training_data_form

    params, _ = factory_parameters(factory)
    for name, entry in (("inputs", "inputs"), ("outputs", "classes")):
        param = params.get(name)
        if param is None or param.default is not inspect.Parameter.empty or name in args or name in extra:
            continue
        # A Dataset is not scanned for its labels (datasets._examples): say how one tells its classes.
        labels = (
            "; a torch Dataset tells it by its labels when they are at hand: a TensorDataset's, or a `targets` "
            "attribute with one integer label per example (as torchvision's datasets have)"
            if name == "outputs" and info and training_data_form(info.get("train")) in ("dataset", "batches")
            else ""
        )
        raise recipe.error(
            ("model",),
            f"the model needs {name!r} and the data does not tell it: write `{name}: N` in the model section "
            f"(or have the dataset factory return {{'train': ..., '{entry}': N}}){labels}",
        )


def _check_training_data(recipe: Recipe, info: dict, fit_kwargs: dict, data_batch: dict) -> None:
    """What ``fit`` would refuse mid-call about the data's form and the batch size, refused now at its key."""
    from .datasets import training_data_form

    form = training_data_form(info["train"])
    batch_key = ("data", "batch_size") if "batch_size" in data_batch else ("fit", "batch_size")
    type_key, type_name = type_at(recipe, ("data",))
    if form == "dataset" and fit_kwargs.get("batch_size") is None:
        raise recipe.error(
            type_key,
            f"{type_name!r} gives a torch Dataset of single examples: set data.batch_size (or fit.batch_size) "
            "to cut it into batches",
        )
    if form == "batches" and fit_kwargs.get("batch_size") is not None:
        raise recipe.error(
            batch_key,
            f"{type_name!r} gives batches already (a DataLoader or another iterable of batches): remove "
            "batch_size here and set it where the batches are made",
        )
    if form == "batches" and fit_kwargs.get("validation_split"):
        raise recipe.error(
            ("fit", "validation_split"),
            f"validation_split needs arrays or a torch Dataset, and {type_name!r} gives batches: have the "
            "dataset factory return {'train': ..., 'validation': ...} instead",
        )


def _in_run_dir(factory, args: dict, run_dir) -> dict:
    parameters = factory_parameters(factory)[0] if run_dir is not None else {}
    if "run_dir" in parameters and "run_dir" not in args:  # the trackers: the run's own store and files
        args = dict(args, run_dir=run_dir)
    if "log_dir" in parameters and "log_dir" not in args:
        return dict(args, log_dir=os.path.join(run_dir, TENSORBOARD_DIR))
    return args
