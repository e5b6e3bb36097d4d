"""``BackupAndRestore(save_before_preemption=...)`` in one process: a signal stops ``fit`` at the next step
boundary with one complete backup and ``Preempted`` (exit status 75), and the rerun equals the
uninterrupted run bit for bit, wherever the signal came (a step, the last step of an epoch or of the
fit, validation, twice, inside an accumulation window). The multi-worker agreement is in
``test_multi_worker_preemption.py``; the CLI and the launcher there too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import make_strategy

from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Callback, Preempted, Trainer, checkpoint
from replicafit.trainer.preemption import PREEMPTED_EXIT_STATUS, preemption_signals

STEPS = 5  # 36 rows in batches of 8: 5 steps per epoch, the last partial; 3 epochs


def data(n=36, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


def model(batch_norm=False):
    with torch.random.fork_rng():
        torch.manual_seed(1)
        norm = [torch.nn.BatchNorm1d(8)] if batch_norm else []
        return torch.nn.Sequential(torch.nn.Linear(4, 8), *norm, torch.nn.ReLU(), torch.nn.Linear(8, 2))


class SignalAt(Callback):
    """Sends ``signum`` to this process at the end of the (0-based, over the fit) training step ``step``,
    of validation step ``val_step`` of epoch ``val_epoch``, or of epoch ``epoch_end``; ``times`` signals
    in a row."""

    def __init__(self, step=None, val_epoch=None, val_step=None, signum=signal.SIGTERM, times=1, epoch_end=None):
        super().__init__()
        self.step, self.val_epoch, self.val_step, self.signum, self.times = step, val_epoch, val_step, signum, times
        self.epoch_end = epoch_end
        self.seen, self.epoch = 0, None

    def _send(self):
        for _ in range(self.times):
            os.kill(os.getpid(), self.signum)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.seen == self.step:
            self._send()
        self.seen += 1

    def on_test_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.val_epoch, self.val_step):
            self._send()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch_end:
            self._send()


class Steps(Callback):
    """Every (epoch, step) trained, in order."""

    def __init__(self):
        super().__init__()
        self.trained, self.epoch = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.trained.append((self.epoch, batch))


def run(
    tmp_path, *extra, strategy="default", accumulate=None, epochs=3, save_freq="epoch", batch_norm=False, **fit_kwargs
):
    trainer = Trainer(
        strategy=make_strategy(strategy),
        optimizer=optimizers.Adam(0.01, gradient_accumulation_steps=accumulate),
        loss="cross_entropy",
        metrics=["accuracy"],
        seed=0,
    )
    steps = Steps()
    backup = BackupAndRestore(tmp_path / "backup", save_freq=save_freq, save_before_preemption=True)
    net = model(batch_norm)
    kwargs = {"batch_size": 8, "epochs": epochs, "verbose": 0, "validation_data": data(10, seed=3), **fit_kwargs}
    history = trainer.fit(net, data(), callbacks=[*extra, steps, backup], **kwargs)
    return trainer, history, steps.trained


def assert_same(a, b):
    (trainer_a, history_a, _), (trainer_b, history_b, _) = a, b
    assert history_a.history == history_b.history and history_a.epoch == history_b.epoch
    state_a, state_b = trainer_a.model_state_dict(), trainer_b.model_state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    opt_a, opt_b = trainer_a.optimizer.state_dict(), trainer_b.optimizer.state_dict()
    assert opt_a["iterations"] == opt_b["iterations"]
    for name in opt_a["slots"]:
        assert all(torch.equal(opt_a["slots"][name][k], opt_b["slots"][name][k]) for k in opt_a["slots"][name])


CASES = {
    # name: (SignalAt arguments, where the backup resumes: (epoch, step))
    "mid_epoch": ({"step": 6}, (1, 2)),
    "first_step": ({"step": 0}, (0, 1)),
    "last_step_of_an_epoch": ({"step": 4}, (0, 5)),
    "last_step_of_the_fit": ({"step": 14}, (2, 5)),
    "validation": ({"val_epoch": 1, "val_step": 0}, (1, 5)),
    "twice": ({"step": 7, "times": 2}, (1, 3)),
    "end_of_an_epoch": ({"epoch_end": 0}, (1, 0)),
    "end_of_the_last_epoch": ({"epoch_end": 2}, (3, 0)),  # the rerun trains nothing and ends alike
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_a_signal_stops_at_the_next_step_with_one_backup_and_the_rerun_is_bit_identical(tmp_path, strategy, case):
    arguments, (epoch, step) = CASES[case]
    reference = run(tmp_path / "ref", strategy=strategy)
    with pytest.raises(Preempted) as stopped:
        run(tmp_path, SignalAt(**arguments), strategy=strategy)
    assert stopped.value.code == PREEMPTED_EXIT_STATUS == 75 and isinstance(stopped.value, SystemExit)
    assert (stopped.value.epoch, stopped.value.step, stopped.value.signal_name) == (epoch, step, "SIGTERM")
    state = checkpoint.load(tmp_path / "backup" / "backup.pt", kind="backup")
    assert (state["epoch"], state["step"]) == (epoch, step)
    assert state["optimizer"]["iterations"] == epoch * STEPS + step  # nothing trained after the agreed step
    assert_same(run(tmp_path, strategy=strategy), reference)


@pytest.mark.timeout(120)
def test_the_trained_steps_of_both_runs_are_the_uninterrupted_runs_once_each(tmp_path):
    reference = run(tmp_path / "ref")
    steps = Steps()
    with pytest.raises(Preempted):
        run(tmp_path, SignalAt(step=8), steps)
    resumed = run(tmp_path)
    assert steps.trained + resumed[2] == reference[2]  # none twice, none missing
    assert_same(resumed, reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_inside_an_accumulation_window_the_stop_is_the_next_step_and_the_window_resumes(tmp_path, strategy):
    reference = run(tmp_path / "ref", strategy=strategy, accumulate=3)
    with pytest.raises(Preempted) as stopped:
        run(tmp_path, SignalAt(step=6), strategy=strategy, accumulate=3)
    assert (stopped.value.epoch, stopped.value.step) == (1, 2)  # mid-window: the window is in the backup
    assert_same(run(tmp_path, strategy=strategy, accumulate=3), reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["mirrored2", "mirrored3"])
def test_per_replica_batch_norm_statistics_resume_mid_epoch_bit_identical(tmp_path, strategy):
    """Regression: each replica's BatchNorm statistics are its own until the epoch's end, and a backup held
    their mean: the rerun's statistics (and with 3 replicas its val_loss) differed."""
    reference = run(tmp_path / "ref", strategy=strategy, batch_norm=True)
    with pytest.raises(Preempted):
        run(tmp_path, SignalAt(step=6), strategy=strategy, batch_norm=True)
    resumed = run(tmp_path, strategy=strategy, batch_norm=True)
    assert_same(resumed, reference)
    for trainer in (resumed[0], reference[0]):
        assert any("running_mean" in name for name in trainer.model_state_dict())


@pytest.mark.timeout(120)
def test_with_steps_per_epoch_and_per_step_backups(tmp_path):
    kwargs = {"steps_per_epoch": 4, "save_freq": 3}
    reference = run(tmp_path / "ref", **kwargs)
    with pytest.raises(Preempted) as stopped:
        run(tmp_path, SignalAt(step=5), **kwargs)  # (1, 2): not a multiple of save_freq: written at the stop
    assert (stopped.value.epoch, stopped.value.step) == (1, 2)
    assert_same(run(tmp_path, **kwargs), reference)


@pytest.mark.timeout(120)
def test_a_listed_signal_preempts_and_the_others_keep_their_action(tmp_path):
    trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=0)
    backup = BackupAndRestore(tmp_path, save_before_preemption=["SIGUSR1"])
    assert backup.preemption_signals == (signal.SIGUSR1,)
    with pytest.raises(Preempted) as stopped:
        trainer.fit(model(), data(), batch_size=8, callbacks=[SignalAt(step=2, signum=signal.SIGUSR1), backup])
    assert stopped.value.signal_name == "SIGUSR1" and (stopped.value.epoch, stopped.value.step) == (0, 3)


def test_save_before_preemption_values():
    assert preemption_signals(False) == ()
    assert preemption_signals(True) == (signal.SIGTERM,)
    assert preemption_signals("usr1") == (signal.SIGUSR1,)
    assert preemption_signals(["SIGTERM", signal.SIGUSR1, "SIGTERM"]) == (signal.SIGTERM, signal.SIGUSR1)
    with pytest.raises(ValueError, match="'SIGFOO', which is not a signal"):
        BackupAndRestore("b", save_before_preemption="SIGFOO")
    with pytest.raises(ValueError, match="cannot catch SIGKILL: no process can"):
        BackupAndRestore("b", save_before_preemption=[signal.SIGTERM, "KILL"])
    with pytest.raises(ValueError, match="must be True, False, a signal or a list"):
        BackupAndRestore("b", save_before_preemption=[])


@pytest.mark.timeout(120)
def test_without_save_before_preemption_the_signal_keeps_its_handler(tmp_path):
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=0)
        backup = BackupAndRestore(tmp_path)
        trainer.fit(model(), data(), batch_size=8, callbacks=[SignalAt(step=1, signum=signal.SIGUSR1), backup])
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.timeout(120)
def test_a_fit_that_raises_puts_the_handler_back(tmp_path):
    class Boom(Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyError("boom")

    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=0)
    with pytest.raises(KeyError):
        trainer.fit(
            model(), data(), batch_size=8, callbacks=[Boom(), BackupAndRestore(tmp_path, save_before_preemption=True)]
        )
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.timeout(120)
def test_outside_the_main_thread_it_warns_and_preempt_stops_the_fit(tmp_path):
    """Python installs signal handlers from the main thread only: there it warns, and ``backup.preempt()``
    (from a handler of one's own) stops the fit alike."""
    backup = BackupAndRestore(tmp_path, save_before_preemption=True)

    class AskAt(Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                backup.preempt()

    outcome = {}

    def target():
        trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=0)
        try:
            with pytest.warns(RuntimeWarning, match="fit runs outside the main thread"):
                trainer.fit(model(), data(), batch_size=8, callbacks=[AskAt(), backup], verbose=0)
        except Preempted as stop:
            outcome["stop"] = stop
        except BaseException as error:  # noqa: BLE001 - reported to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert (outcome["stop"].epoch, outcome["stop"].step, outcome["stop"].signal_name) == (0, 2, "SIGTERM")


def test_two_backups_that_save_before_preemption_are_refused(tmp_path):
    trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=0)
    backups = [BackupAndRestore(tmp_path / name, save_before_preemption=True) for name in "ab"]
    with pytest.raises(ValueError, match="2 BackupAndRestore callbacks save before preemption"):
        trainer.fit(model(), data(), batch_size=8, callbacks=backups)


LOADER_SCRIPT = """
import os, subprocess, sys, torch
from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Callback, Trainer

class Scheduler(Callback):  # another process signals every process of the job, as SLURM does at a preemption
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and not os.path.exists(sys.argv[2]):
            open(sys.argv[2], "w").close()
            subprocess.run(["kill", "-TERM", "--", f"-{os.getpgrp()}"], start_new_session=True, check=True)

generator = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=generator)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", seed=0)
backup = BackupAndRestore(sys.argv[1], save_before_preemption=True)
trainer.fit(model, loader, epochs=2, callbacks=[Scheduler(), backup], verbose=0)
print("weights", float(sum(p.sum() for p in model.parameters())))
"""


@pytest.mark.timeout(120)
def test_a_signal_to_every_process_spares_the_data_loaders_workers(tmp_path):
    """Regression: SIGTERM to the whole process group (a scheduler's preemption) ended the DataLoader's
    worker processes, and the fit failed with "DataLoader worker ... is killed by signal" instead of saving."""
    script = tmp_path / "fit.py"
    script.write_text(LOADER_SCRIPT)
    argv = [sys.executable, str(script), str(tmp_path / "backup"), str(tmp_path / "signalled")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    stopped = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env, start_new_session=True)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr and "DataLoader worker" not in stopped.stderr
    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env, start_new_session=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (tmp_path / "signalled").unlink()
    (tmp_path / "signalled").mkdir()  # (never signals: the path exists)
    straight = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "b2"), str(tmp_path / "signalled")],
        capture_output=True, text=True, timeout=100, env=env, start_new_session=True,
    )  # fmt: skip
    assert resumed.stdout.split()[-1] == straight.stdout.split()[-1]


def test_noting_holds_signals_and_a_preempted_exit_ignores_them_from_then_on():
    from replicafit.trainer.preemption import noting

    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        with noting([signal.SIGUSR1]) as noted:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert noted == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # put back after a normal exit
        with pytest.raises(Preempted), noting([signal.SIGUSR1]):
            raise Preempted("SIGUSR1", "b/backup.pt", 1, 2)
        # The process is exiting with 75: a second signal meanwhile must not turn it into 128 + signal.
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)
