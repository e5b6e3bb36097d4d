"""``Tracker``: what the experiment trackers (``MLflowLogger``, ``WandbLogger``) share: what they send and when,
the run a resumed fit goes on with, and how a tracker that fails or stalls stays away from training.

What they send, on the chief only (``strategy.cluster.is_chief``; the other workers do nothing):

- parameters, once per fit, after the first step (when the global batch size is known): the trainer's settings
  (``optimizer``, ``learning_rate``, ``optimizer_config``, ``loss``, ``strategy``, ``replicas``, ``workers``,
  ``batch_size``, ``epochs``, ``steps_per_epoch``, ``seed``, ``precision``) and, in a run directory of
  ``replicafit fit``, its resolved ``recipe.yaml`` under ``recipe``;
- every epoch's logs under the ``History``'s own keys (``loss``, ``accuracy``, ``val_loss``...), the epoch (from 0,
  as ``CSVLogger`` counts) as the step;
- with ``log_every_n_steps``, the training logs every N optimizer updates as ``batch/<key>``, the update count
  (``optimizer.iterations``, the step of ``TensorBoard``'s batch scalars) as the step: the ``batch/`` prefix
  keeps them apart from the epoch series, which never start with it;
- when ``fit`` ends: the run directory's ``history.csv`` and ``recipe.yaml``, the files listed in ``artifacts``
  and, with ``log_checkpoint``, the best checkpoint.

A thread of its own makes the tracker's calls, in order, from a bounded queue, so no step waits for a
tracker: a server that answers slowly, retries for minutes or not at all only delays the thread. The first
exception from the tracker's library warns once (a ``RuntimeWarning``) and ends tracking for that fit;
training goes on. At the end of ``fit`` the queued calls get at most ``flush_timeout`` seconds.

The run's id is part of the callback's state (``state_dict``), which ``BackupAndRestore``'s backups keep: a fit
that resumes from a backup continues the same run, and the epochs the interrupted attempt had sent already are
not sent twice.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import inspect
import numbers
import os
import queue
import threading
import time
import warnings

from .callback import Callback

__all__ = ["Tracker"]

_QUEUE_SIZE = 1000  # calls waiting for the thread; a tracker that far behind loses the newest (warned once)

# (sender, run) of each run this process sends to, by the run's key, until its fit ends. A fit that raised gets
# no on_train_end: a later fit of the same run (resumed from its backup in this process) lets that sender finish
# and closes its run before it opens the run again, so it sees what the interrupted attempt sent (and W&B
# does not refuse an id still in use).
_SENDERS: dict = {}


def require(module: str, extra: str, owner: str) -> None:
    """Raises ``ImportError`` with the install hint when the optional ``module`` is not installed; looks it up
    without importing it (``replicafit validate`` constructs the callbacks of a recipe and must stay light)."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f'{owner} needs the `{module}` package, an optional extra: pip install "replicafit[{extra}]" '
            f"(or pip install {module})."
        )


class _Sender:
    """Runs a tracker's calls in order on a daemon thread; ``submit`` never blocks (a full queue drops the call)."""

    def __init__(self, name: str, before=None):
        self._before = before  # called first on the thread, its errors ignored
        self._queue: queue.Queue = queue.Queue(_QUEUE_SIZE)
        self.failure = None  # (what it was doing, the exception) of the first call that raised
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, call, *args) -> None:
        if self.failure is not None:
            return
        try:
            self._queue.put_nowait((what, call, args))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        if self._before is not None:
            try:
                self._before()
            except Exception:  # noqa: BLE001 - the earlier attempt's run may never have opened
                pass
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, call, args = item
            if self.failure is None:
                try:
                    call(*args)
                except Exception as error:  # noqa: BLE001 - whatever the tracker's library raises ends tracking, not training
                    self.failure = (what, error)

    def finish(self, timeout: float) -> bool:
        """Lets the queued calls run, waiting at most ``timeout`` seconds; whether they all ran."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class Tracker(Callback):
    """The base of ``MLflowLogger`` and ``WandbLogger`` (see the module's docstring for what they send).

    A subclass names its library (``_library``, ``_module``, ``_extra``) and makes the object that talks to
    it (``_new_run(saved)``), whose methods run on the tracker's thread: ``open()``, ``log_params(params)``,
    ``log_metrics(metrics, step, per_epoch)``, ``log_file(path)``, ``log_checkpoint(path)``, ``close()``; and,
    read on the training thread, ``key`` (a string naming the run from the start, kept in its state) and
    ``state()``, the dict of plain values that backups keep.

    Args:
      run_dir: the run's folder: its local store or offline files, its ``history.csv`` and ``recipe.yaml``, its
        ``checkpoints/best.pt``. ``replicafit fit`` sets it to its run directory.
      log_every_n_steps: also send the training logs every N optimizer updates (``batch/<key>``); None: per epoch
        only. Reading the logs costs a host synchronisation at those steps.
      log_checkpoint: ``True``: send ``run_dir/checkpoints/best.pt`` (``replicafit fit``'s best checkpoint) when
        ``fit`` ends; a path: that checkpoint; ``False``: none.
      artifacts: more files to send when ``fit`` ends (a ``CSVLogger``'s file outside a run directory, say).
      flush_timeout: the most seconds the end of ``fit`` waits for the tracker to take what is queued.

    Example::

        class MyTracker(Tracker):
            _library, _module, _extra = "Acme", "acme", "acme"

            def _new_run(self, saved):
                return AcmeRun(self, saved)  # open(), log_params(), log_metrics(), ..., state()
    """

    _keeps_state = True  # the run's id, so that a resumed fit continues the run
    _state_on_chief = True  # (the chief alone makes the calls)
    _decides_from_logs = True  # never stops training: no agreement across workers per step
    leaves_variables_alone = True  # its batch hook reads the update count and the logs, never the variables
    _library = ""  # "MLflow"
    _module = ""  # the package imported lazily, "mlflow"
    _extra = ""  # replicafit's extra that installs it

    def __init__(
        self,
        *,
        run_dir=None,
        log_every_n_steps: int | None = None,
        log_checkpoint=False,
        artifacts=(),
        flush_timeout: float = 10.0,
    ):
        super().__init__()
        require(self._module, self._extra, type(self).__name__)
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be a positive integer or None, got {log_every_n_steps!r}.")
        if isinstance(flush_timeout, bool) or not isinstance(flush_timeout, (int, float)) or flush_timeout < 0:
            raise ValueError(f"flush_timeout must be a number of seconds >= 0, got {flush_timeout!r}.")
        if isinstance(artifacts, (str, bytes, os.PathLike)):
            artifacts = [artifacts]
        self.run_dir = os.path.abspath(os.fspath(run_dir)) if run_dir is not None else None
        self.log_every_n_steps = log_every_n_steps
        self.log_checkpoint = log_checkpoint if isinstance(log_checkpoint, bool) else os.fspath(log_checkpoint)
        self.artifacts = [os.fspath(path) for path in artifacts]
        self.flush_timeout = float(flush_timeout)
        self._run = self._sender = self._saved = self._at_exit = None
        self._active = False  # this process tracks (the chief)
        self._params_sent = False
        self._last_step = None  # the update count of the last batch/ values sent
        self._warned = False

    def _new_run(self, saved: dict | None):
        """The object that talks to the library for one fit (constructed on the training thread: no I/O)."""
        raise NotImplementedError

    # --- state kept in backups ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"run": ...}``: what identifies the run (its id, its store); a fit that restores it continues that run."""
        run = self._run.state() if self._run is not None else self._saved
        return {"run": dict(run or {})}

    def load_state_dict(self, state: dict) -> None:
        """The run a resumed fit continues (``BackupAndRestore``'s backup, or a checkpoint loaded before ``fit``)."""
        self._saved = dict(state.get("run") or {}) or None

    # --- hooks --------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        """Starts afresh: the run opens at the first epoch, once a restored state (the run to go on with) is in
        place; only the chief tracks."""
        if self.log_checkpoint is True and self.run_dir is None:
            raise ValueError(
                f"{type(self).__name__}(log_checkpoint=True) sends run_dir/checkpoints/best.pt and run_dir is not "
                "set: give run_dir, or the checkpoint's path as log_checkpoint."
            )
        self._run = self._sender = self._saved = None
        self._params_sent, self._last_step, self._warned = False, None, False
        self._active = self.trainer.strategy.cluster.is_chief

    def on_epoch_begin(self, epoch, logs=None):
        """Opens the run (first epoch), or reports a failure of the tracker."""
        if self._started():
            self._report()

    def on_train_batch_end(self, batch, logs=None):
        """Sends the parameters after the first step, and the ``batch/`` values every ``log_every_n_steps``."""
        if not self._started():
            return
        if not self._params_sent:
            self._send_params()
        if self.log_every_n_steps is not None and logs and self._step_due():
            self._last_step = self.trainer.optimizer.updates_so_far()
            self._send("sending the step's logs", "log_metrics", _numbers(logs), self._last_step, False)

    def on_epoch_end(self, epoch, logs=None):
        """Sends the epoch's logs at step ``epoch``."""
        if not self._started():
            return
        if not self._params_sent:
            self._send_params()
        self._send("sending the epoch's logs", "log_metrics", _numbers(logs or {}), epoch, True)
        self._report()

    def on_train_end(self, logs=None):
        """Sends the files, closes the run and waits (at most ``flush_timeout`` s) for the queued calls."""
        if not self._started():
            return
        if not self._params_sent:
            self._send_params()
        files, checkpoint = self._end_files()
        for path in files:
            self._send(f"sending {os.path.basename(path)}", "log_file", path)
        if checkpoint is not None:
            self._send("sending the checkpoint", "log_checkpoint", checkpoint)
        self._send("closing the run", "close")
        sender = self._sender
        finished = sender.finish(self.flush_timeout)
        atexit.unregister(self._at_exit)
        if _SENDERS.get(self._run.key, (None,))[0] is sender:
            del _SENDERS[self._run.key]
        self._report(finished)

    def _wants_logs(self, hook: str) -> bool:
        return hook == "on_train_batch_end" and self.log_every_n_steps is not None

    def _wants_logs_now(self, hook: str) -> bool:
        return self._wants_logs(hook) and self._active and self._step_due()

    # --- sending ------------------------------------------------------------------------------------------
    def _started(self) -> bool:
        """Whether this process tracks; opens the run on first use (after ``load_state_dict`` had its turn)."""
        if not self._active:
            return False
        if self._sender is None:
            self._run = self._new_run(self._saved)
            earlier = _SENDERS.get(self._run.key)
            before = None if earlier is None else functools.partial(_end_interrupted, *earlier, self.flush_timeout)
            self._sender = _Sender(f"replicafit-{type(self).__name__}", before)
            _SENDERS[self._run.key] = (self._sender, self._run)
            self._send("opening the run", "open")
            # A fit that raises gets no on_train_end: at exit what is queued still goes out, boundedly, and the
            # run is closed as failed (else it would stay "running" in the tracker for ever).
            self._at_exit = functools.partial(_end_at_exit, self._sender, self._run, self.flush_timeout)
            atexit.register(self._at_exit)
        return True

    def _send(self, what: str, method: str, *args) -> None:
        self._sender.submit(what, getattr(self._run, method), *args)

    def _step_due(self) -> bool:
        step = self.trainer.optimizer.updates_so_far()
        # An accumulation window's steps share one update count: it is sent once.
        return step % self.log_every_n_steps == 0 and step != self._last_step

    def _send_params(self) -> None:
        self._params_sent = True
        params = self._parameters()
        recipe = os.path.join(self.run_dir, "recipe.yaml") if self.run_dir is not None else None
        self._sender.submit("sending the parameters", _log_params, self._run, params, recipe)

    def _parameters(self) -> dict:
        """The trainer's settings, read through its public surface."""
        trainer = self.trainer
        strategy, optimizer = trainer.strategy, trainer.optimizer
        try:
            config = dict(optimizer.get_config())
        except Exception:  # noqa: BLE001 - an optimizer without a config (a plain callable rate) is named only
            config = {}
        name = config.pop("name", type(optimizer).__name__)
        rate = config.pop("learning_rate", None)
        return {
            "optimizer": name,
            "learning_rate": rate if rate is not None else float(optimizer.learning_rate),
            "optimizer_config": {k: v for k, v in config.items() if v is not None},
            "loss": _loss_name(trainer.loss),
            "strategy": type(strategy).__name__,
            "replicas": strategy.num_replicas_in_sync,
            "workers": strategy.cluster.num_workers,
            "batch_size": trainer.global_batch_size,
            "epochs": self.params.get("epochs"),
            "steps_per_epoch": self.params.get("steps"),
            "seed": trainer.seed,
            "precision": trainer.precision,
        }

    def _end_files(self) -> tuple:
        """The files sent when ``fit`` ends and the checkpoint (or None); a file asked for and missing warns."""
        found = [os.path.join(self.run_dir, n) for n in ("history.csv", "recipe.yaml")] if self.run_dir else []
        files = [path for path in found if os.path.exists(path)]
        checkpoint = self.log_checkpoint
        if checkpoint is True:
            checkpoint = os.path.join(self.run_dir, "checkpoints", "best.pt")
        asked = self.artifacts + ([checkpoint] if checkpoint else [])
        missing = [path for path in asked if not os.path.exists(path)]
        if missing:
            warnings.warn(
                f"{type(self).__name__}: not sent, no such file: {', '.join(missing)}.", UserWarning, stacklevel=3
            )
        files += [path for path in self.artifacts if os.path.exists(path)]
        return files, (checkpoint if checkpoint and os.path.exists(checkpoint) else None)

    def _report(self, finished: bool = True) -> None:
        """Warns, once per fit, that the tracker failed, fell behind or was not waited for."""
        sender = self._sender
        if self._warned or sender is None:
            return
        name, library = type(self).__name__, self._library
        if sender.failure is not None:
            what, error = sender.failure
            detail = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            message = (
                f"{library} failed while {what} ({type(error).__name__}{': ' + detail if detail else ''}); "
                f"nothing more is sent to {library} in this fit"
            )
        elif not finished:
            message = (
                f"{library} had not taken everything after {self.flush_timeout:g} s at the end of fit "
                "(flush_timeout); the rest is left to a background thread"
            )
        elif sender.dropped:
            message = f"{library} fell behind: {sender.dropped} calls were dropped"
        else:
            return
        self._warned = True
        warnings.warn(f"{name}: {message}. Training goes on.", RuntimeWarning, stacklevel=3)


def _end_at_exit(sender: _Sender, run, timeout: float) -> None:
    """At exit, after a fit that raised: its queued calls (at most ``timeout`` s), then its run closed as failed
    (where a later fit of the same run, resumed in this process, has not taken it over)."""
    if _SENDERS.get(run.key, (None,))[0] is not sender:
        return
    if sender.finish(timeout) and sender.failure is None:
        try:
            run.close(failed=True)
        except Exception:  # noqa: BLE001 - at exit, a tracker that fails has nothing left to stop
            pass


def _end_interrupted(sender: _Sender, run, timeout: float) -> None:
    """The attempt of the same run whose fit raised (no ``on_train_end``): its queued calls, then its run closed."""
    if sender.finish(timeout):
        run.close()


def _log_params(run, params: dict, recipe_path) -> None:
    """On the tracker's thread: the parameters, with the run directory's resolved recipe under ``recipe``."""
    if recipe_path is not None and os.path.exists(recipe_path):
        import yaml

        with open(recipe_path) as file:
            recipe = yaml.safe_load(file)
        if isinstance(recipe, dict):
            params = dict(params, recipe=recipe)
    run.log_params(params)


def _numbers(logs: dict) -> dict:
    return {k: float(v) for k, v in logs.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def _loss_name(loss):
    if loss is None:
        return "the model's own"
    if isinstance(loss, dict):
        return {key: _loss_name(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return [_loss_name(value) for value in loss]
    return loss.__name__ if inspect.isfunction(loss) else type(loss).__name__


def flatten(params: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}, "c": [{"d": 2}]}`` as ``{"a.b": 1, "c.0.d": 2}`` (a list of scalars stays one value).

    Example::

        flatten({"optimizer_config": {"beta_1": 0.9}})  # {"optimizer_config.beta_1": 0.9}
    """
    flat = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)) and any(isinstance(item, dict) for item in value):
            flat.update(flatten(dict(enumerate(value)), f"{name}."))
        else:
            flat[name] = value
    return flat
