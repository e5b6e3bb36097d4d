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
what each worker reads under ``MultiWorkerMirroredStrategy`` and ``FullyShardedStrategy``,
``data.AutoShardPolicy``).

The model entry takes the model's arguments and one key that is a conversion in Python:
``sync_batchnorm: true`` (``nn.SyncBatchNorm.convert_sync_batchnorm(model)``): every BatchNorm layer
normalizes with the statistics of the whole global batch, across replicas and workers.

A bad recipe gives one message naming the file, the line and the key path:

.. code-block:: text

    recipe.yaml:7: optimizer.learning_rat: unknown argument of 'sgd' (did you mean 'learning_rate'?)

A recipe names code to run (``module:attr``), so it is trusted like a script; ``validate``
never calls code outside replicafit (see ``kinds``): it imports what a recipe names, checks
its kind and that the arguments bind, and constructs only replicafit's own built-ins (the
strategy, to check its devices; the data, to check its arguments; a built-in model on the
``meta`` device, to check its sizes). ``build`` calls the rest and checks what each returns.

Example::

    recipe = load("digits_mlp", overrides=["fit.epochs=1"])
    run = build(recipe)
    run.trainer.fit(run.model, run.train, **run.fit_kwargs)

**The shipped recipes** are the ``*.yaml`` files beside this package's code, installed with it, so
``replicafit fit digits_mlp`` finds one by name from any directory (``locate``); ``replicafit list
recipes`` shows them with the first comment line of each file as its description (``shipped``,
``describe``). From a checkout, ``replicafit fit recipes/digits_mlp.yaml`` reads the same file by its path.

**Rooms.** This package sits above the trainer (it builds ``Trainer`` objects) and below the
``replicafit`` command (``replicafit.cli``). This module is the public entry; the parts live beside
it, each importing only those below it: ``loader`` (reading the file: UTF-8, ``${VAR}``, bounded
YAML), ``source`` (``Recipe``, ``load``, ``locate``, the shipped recipes and the ``--set``
overrides), ``registry`` (the names a recipe can use; ``register_model``, ``register_dataset``,
``register_callback``), ``kinds`` (what a section may name and what its factory must return),
``entries`` (one entry against its factory's signature), ``calls`` (calling what a recipe names),
``monitors`` (the names callbacks monitor), ``validation`` (``validate``), ``builder`` (``build``,
``Run``), and the built-in names: ``builtins`` (registers them), ``models`` and ``datasets``.
"""

from __future__ import annotations

from . import builtins  # noqa: F401 - importing builtins registers the built-in names
from .builder import Run, build
from .loader import RecipeError
from .source import SECTIONS, Recipe, describe, load, locate, shipped
from .validation import validate

__all__ = ["RecipeError", "Recipe", "load", "locate", "shipped", "describe", "validate", "build", "Run", "SECTIONS"]
