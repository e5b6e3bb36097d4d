"""Saving before preemption: ``BackupAndRestore(save_before_preemption=True)``.

On a shared cluster a job is preempted: the scheduler sends SIGTERM (SLURM's ``--signal=USR1@90``
can send SIGUSR1 earlier), waits a grace period, then kills. With ``save_before_preemption`` the
signals listed (SIGTERM by default) no longer end the process: the handler only notes the signal,
and ``fit`` stops at the next step boundary that every worker agrees on, the chief writes the backup
(atomically, as every backup), and ``fit`` raises ``Preempted`` — a ``SystemExit`` whose code is
``PREEMPTED_EXIT_STATUS`` (75, ``EX_TEMPFAIL``: "try again"). Uncaught, it ends the process quietly
with that status; ``replicafit fit`` and its ``--workers`` launcher pass it on and do not restart
on it (the scheduler requeues the job; ``--max-restarts`` is for failures). Running the same ``fit``
again resumes from the backup and trains no step twice.

**Where every worker stops** (the agreed step boundary):

* one process: after the training step during which the signal came (nothing to agree on);
* across workers, a training step: each worker adds its flag (0 or 1) to the step's values
  (``cluster.add_to_step``), which ride with the gradient reduction the step makes anyway; after the
  step, once a reduction has carried them, every worker reads the same total and stops if it is not
  zero. No collective is added to a step. A step with no reduction of its own (inside a gradient
  accumulation window, a custom ``train_step`` that reduces nothing) carries nothing: the flags wait
  for the next reduction (the window's last step) or the epoch's end;
* during validation: a small non-blocking sum every few validation steps (about every 50 ms of
  validation, the stride the chief proposes in each sum), started at one check and read at the
  next (``cluster.start_sum``), so every worker stops at the same validation step; the backup is
  the one of the end of the epoch's training steps (validation runs again on resume);
* at the end of an epoch: the flags join the sum that agrees on ``stop_training`` (no collective of
  their own).

A signal during the backup write, or a second signal, only notes the signal again: the backup
written is one complete file. A signal after the last agreed boundary (the last epoch's end) lets
``fit`` finish: the job is done. Signal handlers can only be installed from the main thread: ``fit``
running in another thread warns and leaves the signals alone; call ``BackupAndRestore.preempt()``
(thread-safe) from a handler of your own there.

A scheduler signals every process of the job (SLURM does), a ``DataLoader``'s worker processes
included, which torch ends on SIGTERM: while a fit watches, the loaders it iterates start their
worker processes ignoring the signals (``replicafit.data.loader_signals``).

Before ``fit`` installs its handlers (the interpreter starting, the recipe being read) a signal has
its usual action, unless ``noting(signals)`` holds it: ``replicafit fit`` notes them from the
recipe's build on, so a signal before the first step stops the fit after it, and one while the
finished run's files are written lets them be written (the run is complete: status 0). Nothing
trained is lost either way: the process had trained nothing since its last backup.

Example::

    backup = BackupAndRestore("backup", save_before_preemption=True)
    trainer.fit(model, data, epochs=50, callbacks=[backup])   # SIGTERM: backup written, exit 75
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import warnings

from replicafit.data import loader_signals

__all__ = ["PREEMPTED_EXIT_STATUS", "Preempted", "PreemptionWatch", "noting", "preemption_signals"]

PREEMPTED_EXIT_STATUS = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, the job may run again
STEP_VALUE = "replicafit/preemption"  # the step value the workers' flags ride in
CHECK_SECONDS = 0.05  # validation: about this long between two agreements on the flags
MAX_STRIDE = 64  # ... and at most this many validation steps
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


class Preempted(SystemExit):
    """``fit`` stopped on a preemption signal after its backup was written; the run resumes from it.

    A ``SystemExit``: uncaught, the process exits quietly with ``code`` (``PREEMPTED_EXIT_STATUS``,
    75), as TensorFlow's preemption handler exits. Catch it to do something of your own first.

    Attributes:
      code: ``PREEMPTED_EXIT_STATUS``.
      signal_name: the signal this worker received (``"SIGTERM"``), or ``None`` where another worker
        received it.
      path: the backup written.
      epoch, step: where the resumed ``fit`` goes on (``step`` training steps of ``epoch`` done).

    Example::

        try:
            trainer.fit(model, data, epochs=50, callbacks=[BackupAndRestore("b", save_before_preemption=True)])
        except Preempted as stop:
            print(f"preempted; resume from {stop.path}")
            raise
    """

    def __init__(self, signal_name, path: str, epoch: int, step: int):
        super().__init__(PREEMPTED_EXIT_STATUS)
        self.signal_name, self.path, self.epoch, self.step = signal_name, path, epoch, step

    def __str__(self) -> str:
        cause = self.signal_name or "a preemption signal to another worker"
        return (
            f"fit stopped on {cause} at epoch {self.epoch}, after step {self.step}; the backup {self.path!r} is "
            f"written. Run the same fit again to resume (exit status {PREEMPTED_EXIT_STATUS}: preempted)."
        )


class PreemptedInValidation(Exception):
    """Every worker agreed to stop during ``fit``'s validation (raised by the validation loop, caught by
    ``fit``, which writes the backup of the epoch's training steps)."""


def preemption_signals(value) -> tuple:
    """The signals of ``save_before_preemption``: ``False`` none, ``True`` SIGTERM; else a signal (a
    ``signal.Signals``, its number or name, ``"SIGUSR1"`` or ``"USR1"``) or a list of them."""
    if value is False or value is None:
        return ()
    if value is True:
        return (signal.SIGTERM,)
    items = [value] if isinstance(value, (str, int, signal.Signals)) else value
    if isinstance(items, (list, tuple)) and items:
        return tuple(dict.fromkeys(_signal(item) for item in items))
    raise ValueError(
        "save_before_preemption must be True, False, a signal or a list of signals (SIGTERM, 'SIGUSR1'), "
        f"got {value!r}."
    )


def _signal(item) -> signal.Signals:
    try:
        if isinstance(item, str):
            name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
            found = signal.Signals[name]
        elif isinstance(item, int) and not isinstance(item, bool):
            found = signal.Signals(item)
        else:
            raise ValueError
    except (KeyError, ValueError):
        raise ValueError(
            f"save_before_preemption names {item!r}, which is not a signal of this system: use a name such as "
            "'SIGTERM' or 'SIGUSR1', or a signal.Signals."
        ) from None
    if found.name in _UNCATCHABLE:
        raise ValueError(f"save_before_preemption cannot catch {found.name}: no process can. Use SIGTERM or SIGUSR1.")
    return found


class _Notes:
    """A signal handler that only notes the signals it gets (``noting``)."""

    def __init__(self):
        self.noted: list = []

    def __call__(self, signum, frame) -> None:
        self.noted.append(signal.Signals(signum))


@contextlib.contextmanager
def noting(signals):
    """Within the block, ``signals`` are noted rather than acted on (main thread; elsewhere nothing changes):
    a ``fit`` that starts within it takes the ones noted before as a preemption. Yields the list of the
    signals noted. ``replicafit fit`` holds it around ``fit`` and the writing of the run's files.

    Example::

        with noting([signal.SIGTERM]) as noted:
            trainer.fit(model, data, callbacks=[BackupAndRestore("b", save_before_preemption=True)])
            trainer.save_checkpoint("last.pt")   # a SIGTERM now waits until it is written
    """
    notes = _Notes()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            previous[signum] = signal.signal(signum, notes)
    try:
        yield notes.noted
    except Preempted:
        for signum in previous:  # the process exits with 75: a late second signal must not make it 143
            signal.signal(signum, signal.SIG_IGN)
        raise
    except BaseException:
        _restore(previous)
        raise
    _restore(previous)


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class PreemptionWatch:
    """The signals of one ``fit`` and the workers' agreement on them (see the module docstring).

    Args:
      signals: what ``preemption_signals`` gives.
      cluster: the strategy's ``cluster``.
    """

    def __init__(self, signals, cluster):
        self.signals = tuple(signals)
        self.cluster = cluster
        self.received = None  # the first signal noted (a signal.Signals), else None
        self._previous: dict = {}
        self._in_flight = None  # validation's started sum: finish() gives the flags of the check before
        self.begin_validation()
        self._spared = None  # while installed: loaders start their worker processes ignoring the signals
        self._late = None  # on an accelerator: the last step's total on its way to the host

    # --- the signals --------------------------------------------------------------------------
    def install(self) -> None:
        """Notes the signals from now on, instead of their previous action (main thread only: elsewhere
        a warning, and the signals keep their action)."""
        if threading.current_thread() is not threading.main_thread():
            names = ", ".join(s.name for s in self.signals)
            warnings.warn(
                f"BackupAndRestore(save_before_preemption=...) cannot catch {names}: fit runs outside the main "
                "thread, and Python installs signal handlers from the main thread only. The signals keep their "
                "action; install a handler in the main thread that calls backup.preempt().",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        for signum in self.signals:
            self._previous[signum] = previous = signal.signal(signum, self._noted)
            if isinstance(previous, _Notes) and signum in previous.noted:  # it came before this fit began
                self.request(signum)
        self._spared = loader_signals.ignored_in_loader_workers(self.signals)  # (a scheduler signals them too)
        self._spared.__enter__()

    def uninstall(self) -> None:
        """Puts back the signals' previous handlers (once; nothing when ``install`` installed none)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        spared, self._spared = self._spared, None
        if spared is not None:
            spared.__exit__(None, None, None)

    def _noted(self, signum, frame) -> None:
        self.request(signum)

    def request(self, signum=signal.SIGTERM) -> None:
        """Notes a preemption (what the handler does; thread-safe: one assignment)."""
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def local(self) -> int:
        return int(self.received is not None)

    # --- the agreement ------------------------------------------------------------------------
    def before_step(self) -> None:
        """Across workers: this worker's flag joins the step's values (they ride with its reduction)."""
        if self.cluster.num_workers > 1:
            self.cluster.add_to_step(STEP_VALUE, self.local)

    def after_step(self) -> bool:
        """Whether every worker stops now, after a training step (agreed; no collective of its own). On an
        accelerator the total is read one step late (copied to the host as it comes, read when the next
        step ends), so the host never waits for this step's reduction."""
        if self.cluster.num_workers == 1:
            return self.received is not None
        if self.cluster.step_value_waiting(STEP_VALUE):
            return False  # no reduction carried this step's flags yet: the next one will
        total = self.cluster.step_total(STEP_VALUE)
        if total.device.type != "cuda":
            return int(total) > 0
        earlier, self._late = self._late, _on_host(total)
        return earlier is not None and _read(earlier) > 0

    def in_validation(self) -> bool:
        """Whether every worker stops now, after a validation step. At each check the sum started at the
        check before is read and the next one started; checks come every ``stride`` steps, the stride
        the chief proposed in that sum (about ``CHECK_SECONDS`` of validation, at most ``MAX_STRIDE``
        steps), so every worker checks at the same steps and the sums cost little however short a
        validation step is."""
        if self.cluster.num_workers == 1:
            return self.received is not None
        self._val_steps += 1
        if self._val_steps < self._next_check:
            return False
        if self._in_flight is not None:
            flags, stride = self._in_flight()
            self._in_flight = None
            if flags:
                return True
            self._stride = max(1, min(MAX_STRIDE, stride))
        now = time.monotonic()
        proposal = 0
        if self.cluster.is_chief:  # (the others propose 0: the sum is the chief's proposal)
            per_step = (now - self._checked_at) / max(1, self._val_steps - self._checked_step)
            proposal = max(1, min(MAX_STRIDE, math.ceil(CHECK_SECONDS / max(per_step, 1e-6))))
        self._checked_at, self._checked_step = now, self._val_steps
        self._in_flight = self.cluster.start_sum([self.local, proposal], "agreeing on a preemption signal")
        self._next_check = self._val_steps + self._stride
        return False

    def end_validation(self) -> None:
        """Finishes validation's last started sum (every started sum is finished; the epoch's end
        agrees on the flags again)."""
        finish, self._in_flight = self._in_flight, None
        if finish is not None:
            finish()

    def begin_validation(self) -> None:
        """A validation begins: its checks start afresh (the first after its first step)."""
        self._val_steps, self._next_check, self._stride = 0, 1, 1
        self._checked_at, self._checked_step = time.monotonic(), 0

    def at_epoch_end(self, stop_training: bool) -> tuple:
        """``(stop_training on any worker, preempted on any worker)`` in one sum across workers."""
        if self.cluster.num_workers == 1:
            return stop_training, self.received is not None
        stop, preempted = self.cluster.sum([int(bool(stop_training)), self.local], "agreeing to stop")
        return stop > 0, preempted > 0

    def start(self) -> None:
        """A fit begins: what an interrupted fit left in the step value is dropped, on every worker alike."""
        self._late = None
        if self.cluster.num_workers > 1:
            self.cluster.discard_step_value(STEP_VALUE)


def _on_host(total):
    """``(host copy, event)``: ``total`` (a CUDA tensor) copied to pinned host memory without waiting."""
    import torch

    host = torch.empty((), dtype=total.dtype, pin_memory=True)
    host.copy_(total, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _read(copied) -> int:
    """The value of an ``_on_host`` copy (waits for that copy only, not for the work queued since)."""
    host, event = copied
    event.synchronize()
    return int(host)
