"""``WandbLogger``: a fit's config, metrics and files in a Weights & Biases run (extra: ``replicafit[wandb]``)."""

from __future__ import annotations

import os
import secrets
import string

from .tracker import Tracker

__all__ = ["WandbLogger"]

_ID_ALPHABET = string.ascii_lowercase + string.digits  # the characters of W&B's own run ids


class WandbLogger(Tracker):
    """Records a ``fit`` in a Weights & Biases run: config, metrics per epoch, ``history.csv``, the recipe.

    Optionally the best checkpoint too. Needs ``pip install "replicafit[wandb]"`` (wandb is imported when the run
    opens, off the training thread).

    Offline by default where W&B has no credentials (no ``WANDB_API_KEY``, no ``wandb login``) and no mode is
    set (``mode``, ``WANDB_MODE``): the run is written under ``run_dir/wandb/offline-run-*`` (``replicafit fit``
    sets ``run_dir`` to its run directory; without one, ``./wandb`` as W&B does) for ``wandb sync`` later.

    - Config: the trainer's settings (``optimizer``, ``learning_rate``, ``optimizer_config``, ``loss``,
      ``strategy``, ``replicas``, ``workers``, ``batch_size``, ``epochs``, ``steps_per_epoch``, ``seed``,
      ``precision``) and, from a recipe, the resolved recipe under ``recipe``.
    - Metrics: every epoch's logs under the ``History``'s own keys with ``epoch`` (from 0) as their step metric
      (``define_metric``); with ``log_every_n_steps``, ``batch/<key>`` every N optimizer updates with
      ``batch/step`` (the update count) as theirs.
    - Files, when ``fit`` ends: ``history.csv`` and ``recipe.yaml`` of ``run_dir`` and ``artifacts`` as run files
      (``run.save``), and with ``log_checkpoint`` the best checkpoint as a ``model`` artifact.

    Only the chief sends. A thread of its own talks to W&B, so no step waits for it; any error from wandb warns
    once and ends tracking for the fit, and the end of ``fit`` waits at most ``flush_timeout`` seconds. A fit
    resumed by ``BackupAndRestore`` continues the same run: the run's id is chosen here and kept in the
    backup, and ``wandb.init(id=..., resume="allow")`` reopens it.

    Args:
      project: the W&B project; None: W&B's (``WANDB_PROJECT``, else its default).
      entity: the team or user; None: W&B's default.
      name: the run's display name; None: the run directory's name, else W&B's generated one.
      tags: tags of the run (``["baseline"]``).
      mode: ``"online"``, ``"offline"`` or ``"disabled"``; None: as above.
      init_kwargs: more arguments of ``wandb.init`` (``{"group": "sweep-3", "notes": "..."}``).
      run_dir: the run's folder (``replicafit fit`` sets it to its run directory): W&B's ``wandb/`` folder
        go there, and ``history.csv``, ``recipe.yaml`` and ``checkpoints/best.pt`` are found there.
      log_every_n_steps: also send the training logs every N optimizer updates as ``batch/<key>``; None: per epoch
        only. Reading the logs costs a host synchronisation at those steps.
      log_checkpoint: ``True``: send ``run_dir/checkpoints/best.pt`` (``replicafit fit``'s best checkpoint) when
        ``fit`` ends; a path: that file (a ``ModelCheckpoint(save_best_only=True)``'s); ``False``: none.
      artifacts: more files to send when ``fit`` ends (a ``CSVLogger``'s file outside a run directory, say).
      flush_timeout: the most seconds the end of ``fit`` waits for what is still queued (default 10).

    Example::

        trainer.fit(model, (x, y), epochs=10, callbacks=[WandbLogger(project="digits", run_dir="runs/a")])
        # later: wandb sync runs/a/wandb/offline-run-*

    In a recipe: ``callbacks: [{type: wandb_logger, project: digits, log_every_n_steps: 100}]``.

    Where it differs from ``wandb.integration.keras.WandbMetricsLogger``: epoch values keep the ``History``'s own
    names (no ``epoch/`` prefix), the run is its own (``reinit="create_new"``: a run the user opened is left
    alone), and a failing tracker never fails the fit.
    """

    _decides_from_logs = True
    leaves_variables_alone = True
    _library, _module, _extra = "W&B", "wandb", "wandb"

    def __init__(
        self,
        project: str | None = None,
        *,
        entity: str | None = None,
        name: str | None = None,
        tags: list | None = None,
        mode: str | None = None,
        init_kwargs: dict | None = None,
        run_dir=None,
        log_every_n_steps: int | None = None,
        log_checkpoint=False,
        artifacts=(),
        flush_timeout: float = 10.0,
    ):
        super().__init__(
            run_dir=run_dir,
            log_every_n_steps=log_every_n_steps,
            log_checkpoint=log_checkpoint,
            artifacts=artifacts,
            flush_timeout=flush_timeout,
        )
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"mode must be 'online', 'offline', 'disabled' or None, got {mode!r}.")
        if tags is not None and (isinstance(tags, str) or not all(isinstance(t, str) for t in tags)):
            raise ValueError(f"tags must be a list of strings, got {tags!r}.")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise ValueError(f"init_kwargs must be a dict of wandb.init arguments, got {type(init_kwargs).__name__}.")
        self.project, self.entity, self.name = project, entity, name
        self.tags = list(tags) if tags is not None else None
        self.mode = mode
        self.init_kwargs = dict(init_kwargs or {})

    def _new_run(self, saved):
        return _WandbRun(self, saved or {})


def default_mode(wandb) -> str | None:
    """The mode a ``WandbLogger`` without ``mode`` asks for: None (W&B decides) where a mode is set or W&B has
    credentials, else ``"offline"``.

    Example::

        import wandb
        default_mode(wandb)  # 'offline' on a machine that never ran `wandb login`
    """
    try:
        if "mode" in wandb.setup().settings.model_fields_set:  # WANDB_MODE or a settings file
            return None
    except Exception:  # noqa: BLE001 - a wandb without this settings object: ask for credentials only
        pass
    return None if wandb.login(prompt=False, verify=False) else "offline"


class _WandbRun:
    """One fit's W&B run; every method but ``state`` runs on the tracker's thread."""

    def __init__(self, logger: WandbLogger, saved: dict):
        self._logger = logger
        # Chosen here, not by W&B: a backup written before the run opened still names it.
        self.run_id = saved.get("run_id") or "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
        self._run = None
        self._defined: set = set()
        self._epochs_sent = 0
        self._steps_sent = 0

    @property
    def key(self) -> str:
        return self.run_id

    def state(self) -> dict:
        return {"run_id": self.run_id}

    def open(self) -> None:
        import wandb

        logger = self._logger
        if logger.run_dir is not None:
            os.makedirs(logger.run_dir, exist_ok=True)
        arguments = {
            "project": logger.project,
            "entity": logger.entity,
            "name": logger.name or (os.path.basename(logger.run_dir) if logger.run_dir else None),
            "tags": logger.tags,
            "dir": logger.run_dir,
            "mode": logger.mode or default_mode(wandb),
            "id": self.run_id,
            "resume": "allow",
            "reinit": "create_new",
        }
        self._run = run = wandb.init(**{**arguments, **logger.init_kwargs})
        # Online, a resumed run's summary holds where the interrupted attempt got to (offline it is empty).
        epoch, step = run.summary.get("epoch"), run.summary.get("batch/step")
        self._epochs_sent = int(epoch) + 1 if isinstance(epoch, (int, float)) else 0
        self._steps_sent = int(step) if isinstance(step, (int, float)) else 0
        run.define_metric("epoch")
        run.define_metric("batch/step")
        run.define_metric("batch/*", step_metric="batch/step")

    def log_params(self, params: dict) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict, step: int, per_epoch: bool) -> None:
        if per_epoch:
            if step < self._epochs_sent:
                return  # sent by the interrupted attempt this fit resumes
            for key in metrics.keys() - self._defined:
                self._run.define_metric(key, step_metric="epoch")
                self._defined.add(key)
            self._run.log({**metrics, "epoch": step})
        elif step > self._steps_sent:
            self._run.log({**{f"batch/{k}": v for k, v in metrics.items()}, "batch/step": step})

    def log_file(self, path: str) -> None:
        self._run.save(path, base_path=os.path.dirname(path), policy="now")

    def log_checkpoint(self, path: str) -> None:
        import wandb

        artifact = wandb.Artifact(f"model-{self._run.id}", type="model")
        if os.path.isdir(path):  # a sharded checkpoint
            artifact.add_dir(path, name=os.path.basename(path))
        else:
            artifact.add_file(path)
        self._run.log_artifact(artifact)

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)
