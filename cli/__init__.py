"""The ``replicafit`` command (also ``python -m replicafit``) and its local launcher.

.. code-block:: text

    replicafit fit RECIPE [--set key.path=value ...] [--run-dir DIR]
                   [--workers N [--max-restarts K [--min-workers M]] [--log-all-workers]]
    replicafit evaluate RECIPE --checkpoint PATH [--set ...]
    replicafit predict RECIPE --checkpoint PATH [--output FILE.npy] [--set ...]
    replicafit validate RECIPE [--set ...]
    replicafit list [KIND]                      (KIND: recipes, strategy, model, ...)
    replicafit plot RUN_DIR

RECIPE is a YAML file, or the name of a recipe that ships with replicafit
(``replicafit fit digits_mlp``; ``replicafit list recipes`` shows them).

``--workers N`` starts N worker processes on this machine (``launch``), each running
``replicafit fit`` with the same recipe and run directory; the recipe's strategy must be a
multi-worker one (``strategy: multi_worker_mirrored``, or ``strategy: fully_sharded`` to shard the
parameters, gradients and optimizer state across the workers):

.. code-block:: bash

    replicafit fit digits_mlp --set strategy=multi_worker_mirrored --workers 2 --max-restarts 1
    replicafit fit digits_mlp --set "strategy={type: fully_sharded, timeout_seconds: 300}" --workers 2

Under ``torchrun`` the same command runs unchanged without ``--workers``.

``fit`` writes RUN_DIR/recipe.yaml, history.csv, checkpoints/best.pt (best ``val_loss``, or
``loss`` without validation), checkpoints/last.pt (the weights the model holds at the end),
metrics.json and, with matplotlib, history.png. When ``EarlyStopping(restore_best_weights=True)``
put an earlier epoch's weights back, last.pt holds those: the console reports the last epoch and
the restored best epoch, each named, and metrics.json says which weights last.pt holds:

.. code-block:: text

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
(``WorkerFailedError``, saying which surviving worker wrote the backup of the last step every worker
finished, or why none was written) and exits with status 69 (``PEER_FAILED_EXIT_STATUS``,
``EX_UNAVAILABLE``: "a peer failed; restart to resume"): the ``--workers`` launcher then names the worker
that failed or stopped arriving, not this one, and with ``--max-restarts K`` starts every worker again
from that backup (``--min-workers M``: with one worker fewer, down to M, after the same worker failed in
two attempts in a row). A
fit that stopped on a preemption signal (``BackupAndRestore(save_before_preemption=True)`` in the
recipe's callbacks) prints one line and exits with status 75 (``PREEMPTED_EXIT_STATUS``): rerun
the same command to resume. The ``--workers`` launcher passes SIGTERM on to the workers, exits
with 75 when they were preempted and never restarts on it (``--max-restarts`` is for failures).

**Rooms.** This package sits above the recipe system (``replicafit.recipes``), which it runs; nothing
below imports it. ``command`` (``main``: one command run, what stops it turned into an exit status),
``parser`` (the arguments, ``UsageError``, the recipe they name), ``fit`` (``replicafit fit``: the run
directory and its files), ``reports`` (metrics.json and the console's report), ``evaluation``
(``replicafit evaluate`` and ``predict``), ``listing`` (``replicafit validate`` and ``list``), ``plot``
(history.png) and ``launch`` (``launch_local``: the workers of ``--workers N``).

Example::

    from replicafit.cli import main

    status = main(["fit", "digits_mlp", "--set", "fit.epochs=1", "--run-dir", "runs/mine"])
"""

from __future__ import annotations

from . import launch
from .command import main

__all__ = ["main", "launch"]
