"""``MLflowLogger``: a fit's parameters, metrics and files in an MLflow run (``pip install "replicafit[mlflow]"``)."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import time
import urllib.parse
import uuid

from .tracker import Tracker, flatten

__all__ = ["MLflowLogger"]

RUN_KEY_TAG = "replicafit.run_key"  # finds the run when a backup was written before its id came back
EPOCHS_TAG = "replicafit.epochs_logged"  # the epochs sent so far: a resumed fit does not send them twice
STEPS_TAG = "replicafit.steps_logged"  # the last update count whose batch/ values were sent
DEFAULT_EXPERIMENT = "replicafit"
_PROBE_SECONDS = 3.0


class MLflowLogger(Tracker):
    """Records a ``fit`` in an MLflow run: parameters, metrics per epoch, ``history.csv``, the recipe.

    Optionally the best checkpoint too. Needs ``pip install "replicafit[mlflow]"`` (mlflow is imported when the
    run opens, off the training thread).

    The store is ``tracking_uri`` (a server, ``http://host:5000``, or any MLflow URI), else the one MLflow is
    set to (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``), else a local SQLite store: ``mlflow.db`` in
    ``run_dir`` (``replicafit fit`` sets it to its run directory), or in the working directory without one
    (MLflow's own default). An experiment this logger creates in a SQLite store keeps its artifacts in
    ``mlartifacts/`` beside the database. No server is needed: ``mlflow ui --backend-store-uri
    sqlite:///runs/<run>/mlflow.db`` shows a run directory's run.

    - Parameters: the trainer's settings (``optimizer``, ``learning_rate``, ``optimizer_config.*``, ``loss``,
      ``strategy``, ``replicas``, ``workers``, ``batch_size``, ``epochs``, ``steps_per_epoch``, ``seed``,
      ``precision``) and, from a recipe, the resolved recipe flattened (``recipe.optimizer.learning_rate``...).
    - Metrics: every epoch's logs under the ``History``'s own keys (``loss``, ``val_accuracy``...), the epoch
      (from 0) as the step; with ``log_every_n_steps``, ``batch/<key>`` every N optimizer updates, the update
      count as the step. Characters MLflow refuses in a name become ``_``.
    - Artifacts, when ``fit`` ends: ``history.csv`` and ``recipe.yaml`` of ``run_dir``, ``artifacts``, and with
      ``log_checkpoint`` the best checkpoint under ``checkpoints/``.

    Only the chief sends. A thread of its own talks to MLflow, so no step waits for it; a server that cannot be
    reached (checked with a quick connection first), or any error from mlflow, warns once and ends tracking for
    the fit, and the end of ``fit`` waits at most ``flush_timeout`` seconds for what is queued. A fit resumed by
    ``BackupAndRestore`` continues the same run (its id is in the backup); the epochs the interrupted attempt
    had sent already are not sent again.

    Args:
      tracking_uri: the MLflow store; None: as above.
      experiment_name: the experiment, created where missing; None: ``"replicafit"``.
      run_name: the run's name; None: the run directory's name, else MLflow's generated one.
      tags: tags of a new run (``{"team": "vision"}``).
      run_dir: the run's folder (``replicafit fit`` sets it to its run directory): the default store's
        ``mlflow.db`` and ``mlartifacts/`` go there, and ``history.csv``, ``recipe.yaml`` and
        ``checkpoints/best.pt`` are found there.
      log_every_n_steps: also send the training logs every N optimizer updates as ``batch/<key>``; None: per epoch
        only. Reading the logs costs a host synchronisation at those steps.
      log_checkpoint: ``True``: send ``run_dir/checkpoints/best.pt`` (``replicafit fit``'s best checkpoint) when
        ``fit`` ends; a path: that file (a ``ModelCheckpoint(save_best_only=True)``'s); ``False``: none.
      artifacts: more files to send when ``fit`` ends (a ``CSVLogger``'s file outside a run directory, say).
      flush_timeout: the most seconds the end of ``fit`` waits for what is still queued (default 10).

    Example::

        trainer.fit(model, (x, y), epochs=10, validation_split=0.2, callbacks=[
            CSVLogger("runs/a/history.csv"),
            MLflowLogger(experiment_name="digits", run_dir="runs/a", log_every_n_steps=50),
        ])
        # mlflow ui --backend-store-uri sqlite:///runs/a/mlflow.db

    In a recipe: ``callbacks: [{type: mlflow_logger, tracking_uri: "http://mlflow:5000"}]``.

    Where it differs from ``mlflow.keras.MlflowCallback``: the run is its own (no active fluent run is used or
    left behind), step values live under ``batch/`` instead of sharing the epoch series' names, and a failing
    tracker never fails the fit.
    """

    _decides_from_logs = True
    leaves_variables_alone = True
    _library, _module, _extra = "MLflow", "mlflow", "mlflow"

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        *,
        tags: dict | None = None,
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
        for name, value in (("tracking_uri", tracking_uri), ("experiment_name", experiment_name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}.")
        if tags is not None and not isinstance(tags, dict):
            raise ValueError(f"tags must be a dict of names to values, got {type(tags).__name__}.")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}

    def _new_run(self, saved):
        return _MLflowRun(self, saved or {})

    def store_uri(self) -> str:
        """The store this logger writes to (see the class's docstring); imports mlflow.

        Example::

            MLflowLogger(run_dir="runs/a").store_uri()  # 'sqlite:////home/me/runs/a/mlflow.db'
        """
        import mlflow

        if self.tracking_uri is not None:
            return self.tracking_uri
        if self.run_dir is not None and not mlflow.is_tracking_uri_set():
            return "sqlite:///" + os.path.join(self.run_dir, "mlflow.db")
        return mlflow.get_tracking_uri()


class _MLflowRun:
    """One fit's MLflow run; every method but ``state`` runs on the tracker's thread."""

    def __init__(self, logger: MLflowLogger, saved: dict):
        self._logger = logger
        self._saved = saved
        self.tracking_uri = saved.get("tracking_uri")
        self.run_key = saved.get("run_key") or uuid.uuid4().hex
        self.run_id = saved.get("run_id")
        self._client = None
        self._epochs_sent = 0  # epochs below this were sent by an interrupted attempt of this run
        self._steps_sent = 0
        self._params: dict = {}  # the run's parameters already: MLflow refuses to change one

    @property
    def key(self) -> str:
        return self.run_key

    def state(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "run_key": self.run_key, "run_id": self.run_id}

    def open(self) -> None:
        if self._logger.tracking_uri is not None:  # before the import: an unreachable server then costs nothing
            _check_reachable(self._logger.tracking_uri)
        from mlflow import MlflowClient  # seconds to import: here, off the training thread

        uri = self._logger.store_uri()
        if self._logger.tracking_uri is None:
            _check_reachable(uri)
        self._client = client = MlflowClient(tracking_uri=uri)
        run = self._previous(client, uri)
        if run is None:
            path = _sqlite_path(uri)
            if path is not None:  # the database's folder must exist for SQLite to create it
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            logger = self._logger
            name = logger.run_name or (os.path.basename(logger.run_dir) if logger.run_dir else None)
            run = client.create_run(
                self._experiment_id(client, uri), run_name=name, tags={**logger.tags, RUN_KEY_TAG: self.run_key}
            )
        else:
            tags, self._params = run.data.tags, dict(run.data.params)
            self._epochs_sent = int(tags.get(EPOCHS_TAG, 0))
            self._steps_sent = int(tags.get(STEPS_TAG, 0))
            client.update_run(run.info.run_id, status="RUNNING")
        self.tracking_uri, self.run_id = uri, run.info.run_id

    def _previous(self, client, uri):
        """The run a restored state names in this store (by id, else by its key), or None."""
        from mlflow.exceptions import MlflowException

        saved = self._saved
        if not saved.get("run_key") or saved.get("tracking_uri") not in (None, uri):
            return None
        if saved.get("run_id"):
            try:
                return client.get_run(saved["run_id"])
            except MlflowException as error:
                if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                    return None
                raise
        experiment = client.get_experiment_by_name(self._logger.experiment_name or DEFAULT_EXPERIMENT)
        if experiment is None:
            return None
        found = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{saved['run_key']}'", max_results=1
        )
        return found[0] if found else None

    def _experiment_id(self, client, uri) -> str:
        from mlflow.exceptions import MlflowException

        name = self._logger.experiment_name or DEFAULT_EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        path = _sqlite_path(uri)
        # MLflow would put a SQLite store's artifacts under ./mlruns of whatever the working directory is.
        location = None if path is None else _file_uri(os.path.join(os.path.dirname(path), "mlartifacts"))
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # another process created it meanwhile
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        values = {_name(k): str(v)[:6000] for k, v in flatten(params).items()}  # MLflow's limit on a value
        # A resumed run keeps the values it has (a parameter cannot change in MLflow) and gets the missing ones.
        entries = [Param(k, v) for k, v in values.items() if k not in self._params]
        for start in range(0, len(entries), 100):  # MLflow's limit per call
            self._client.log_batch(self.run_id, params=entries[start : start + 100])

    def log_metrics(self, metrics: dict, step: int, per_epoch: bool) -> None:
        from mlflow.entities import Metric, RunTag

        if (per_epoch and step < self._epochs_sent) or (not per_epoch and step <= self._steps_sent):
            return  # sent by the interrupted attempt this fit resumes
        now, prefix = int(time.time() * 1000), "" if per_epoch else "batch/"
        entries = [Metric(_name(prefix + k), v, now, step) for k, v in metrics.items()]
        tag = RunTag(EPOCHS_TAG, str(step + 1)) if per_epoch else RunTag(STEPS_TAG, str(step))
        for start in range(0, max(len(entries), 1), 1000):
            self._client.log_batch(self.run_id, metrics=entries[start : start + 1000], tags=[tag])

    def log_file(self, path: str) -> None:
        if os.path.isdir(path):
            self._client.log_artifacts(self.run_id, path, artifact_path=os.path.basename(path))
        else:
            self._client.log_artifact(self.run_id, path)

    def log_checkpoint(self, path: str) -> None:
        if os.path.isdir(path):  # a sharded checkpoint
            self._client.log_artifacts(self.run_id, path, artifact_path=f"checkpoints/{os.path.basename(path)}")
        else:
            self._client.log_artifact(self.run_id, path, artifact_path="checkpoints")

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _name(key: str) -> str:
    return re.sub(r"[^/\w.\- ]", "_", key)  # what MLflow accepts on every system


def _sqlite_path(uri: str) -> str | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :]
    return None if path in ("", ":memory:") else path


def _file_uri(path: str) -> str:
    return pathlib.Path(os.path.abspath(path)).as_uri()


def _check_reachable(uri: str) -> None:
    """A quick connection to an HTTP store: MLflow's own client retries an unreachable server for minutes."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=_PROBE_SECONDS):
            pass
    except OSError as error:
        raise ConnectionError(f"cannot reach the tracking server {uri} ({error})") from error
