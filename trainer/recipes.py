"""YAML recipes: a whole training run in one file, checked before anything runs.

Top-level keys: ``seed``, ``precision``, ``strategy``, ``model``, ``data``, ``optimizer``,
``loss``, ``metrics``, ``callbacks``, ``fit``, ``evaluate``. Every entry is
``{type: registered-name or "package.module:attr", ...constructor arguments}`` (a plain
string for the simple cases: ``optimizer: adam``), mapping one-to-one onto the Python
constructors. ``${VAR}`` and ``${VAR:-default}`` are replaced from the environment when
the file is read (only here, never deeper in the library).

The optimizer entry takes the optimizer's arguments (``use_ema: true``, ``ema_momentum``,
``weight_decay``, ...) and one key that is a method call in Python:
``exclude_from_weight_decay: [bias, norm]`` (``optimizer.exclude_from_weight_decay(var_names=...)``).
With ``use_ema`` the averaged model is the run's result: unless the recipe lists
``swap_ema_weights`` itself, ``SwapEMAWeights(swap_on_epoch=True)`` comes first among the
callbacks, so validation, best checkpoints and early stopping judge and keep the averages.

The data entry takes the dataset's arguments, ``batch_size`` and one key of the trainer's:
``auto_shard_policy: AUTO | FILE | DATA | OFF`` (``Trainer(input_options=InputOptions(auto_shard_policy=...))``:
what each worker reads under ``MultiWorkerMirroredStrategy``, ``data.AutoShardPolicy``).

The model entry takes the model's arguments and one key that is a conversion in Python:
``sync_batchnorm: true`` (``nn.SyncBatchNorm.convert_sync_batchnorm(model)``): every BatchNorm layer
normalizes with the statistics of the whole global batch, across replicas and workers.

A bad recipe gives one message naming the file, the line and the key path::

    recipe.yaml:7: optimizer.learning_rat: unknown argument of 'sgd' (did you mean 'learning_rate'?)

A recipe names code to run (``module:attr``), so it is trusted like a script; ``validate``
never calls code outside replicafit (see ``kinds``): it imports what a recipe names, checks
its kind and that the arguments bind, and constructs only replicafit's own built-ins (the
strategy, to check its devices; the data, to check its arguments; a built-in model on the
``meta`` device, to check its sizes). ``build`` calls the rest and checks what each returns.

Example::

    recipe = load("recipes/digits_mlp.yaml", overrides=["fit.epochs=1"])
    run = build(recipe)
    run.trainer.fit(run.model, run.train, **run.fit_kwargs)

This module is the public entry; the parts live beside it, each importing only those below it:
``recipe_loader`` (reading the file), ``recipe_source`` (``Recipe``, ``load`` and the ``--set``
overrides), ``recipe_entries`` (one entry against its factory's signature), ``recipe_calls``
(calling what a recipe names), ``recipe_monitors`` (the names callbacks monitor),
``recipe_validation`` (``validate``) and ``recipe_build`` (``build``, ``Run``).
"""

from __future__ import annotations

from . import builtins  # noqa: F401 - importing builtins registers the built-in names
from .recipe_build import TENSORBOARD_DIR as TENSORBOARD_DIR  # the run folder's TensorBoard logs: cli.py reads it here
from .recipe_build import Run, build
from .recipe_loader import RecipeError
from .recipe_source import SECTIONS, Recipe, describe, load, locate, shipped
from .recipe_validation import validate

__all__ = ["RecipeError", "Recipe", "load", "locate", "shipped", "describe", "validate", "build", "Run", "SECTIONS"]
