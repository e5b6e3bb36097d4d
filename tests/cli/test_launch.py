"""The local launcher (``cli/launch.py``) and the CLI's ``--workers`` flags.

The workers here are tiny ``python -c`` programs (no torch), so each test takes well under a
second or two: environment per rank, exit statuses, the first failure named and the others
stopped, restarts, Ctrl-C, and no process left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from replicafit import cli
from replicafit.cli import launch
from replicafit.cli.command import COMMANDS
from replicafit.cli.launch import launch_local, launched_worker

PY = sys.executable
WORKER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "REPLICAFIT_RESTART_COUNT",
    "OMP_NUM_THREADS",
)

# Shared prelude of the worker programs: rank, attempt, and a bounded wait for a file.
PRELUDE = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
attempt = int(os.environ["REPLICAFIT_RESTART_COUNT"])
d = sys.argv[1]
def wait_for(name, seconds=20):
    end = time.monotonic() + seconds
    while not os.path.exists(os.path.join(d, name)) and time.monotonic() < end:
        time.sleep(0.01)
def touch(name, text=""):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name))
"""


def worker(body: str, tmp_path) -> list:
    return [PY, "-c", PRELUDE + body, str(tmp_path)]


def gone(pid: int, seconds: float = 2.0) -> bool:
    """Whether ``pid`` has ended: no such process, or a zombie (ended, waiting for its parent, which
    for a worker's orphaned child is init), within ``seconds`` (a signal takes a moment to act)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as file:
                if file.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except OSError:  # gone meanwhile, or no /proc: the kill(0) above decides next time
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def started(monkeypatch):
    """Every process the launcher starts; after the test none of them (nor any pid listed in
    ``started.extra``, e.g. a worker's own child) may be alive."""
    procs, extra = [], []
    real = subprocess.Popen

    def recording(*args, **kwargs):
        proc = real(*args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(launch.subprocess, "Popen", recording)
    recording.procs, recording.extra = procs, extra
    yield recording
    left = [p.pid for p in procs if not gone(p.pid)] + [pid for pid in extra if not gone(pid)]
    assert not left, f"processes left running: {left}"
    assert all(p.returncode is not None for p in procs), "a worker was not reaped"


@pytest.mark.timeout(30)
def test_every_worker_gets_its_rank_and_the_shared_rendezvous(tmp_path, started):
    body = f"import json; touch(f'env{{rank}}', json.dumps({{k: os.environ.get(k) for k in {WORKER_VARS!r}}}))"
    env = {k: v for k, v in os.environ.items() if k not in WORKER_VARS}
    assert launch_local(worker(body, tmp_path), 3, env=env, cpu_count=7) == 0
    envs = [json.loads((tmp_path / f"env{rank}").read_text()) for rank in range(3)]
    for rank, seen in enumerate(envs):
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "3"
        assert seen["MASTER_ADDR"] == "127.0.0.1"
        assert seen["REPLICAFIT_RESTART_COUNT"] == "0"
        assert seen["OMP_NUM_THREADS"] == "2"  # 7 cores // 3 workers
    assert len({seen["MASTER_PORT"] for seen in envs}) == 1 and 0 < int(envs[0]["MASTER_PORT"]) < 65536
    assert len(started.procs) == 3


@pytest.mark.timeout(30)
def test_a_users_omp_num_threads_is_kept_and_one_thread_is_the_least(tmp_path, started):
    body = "touch(f'omp{rank}', os.environ['OMP_NUM_THREADS'])"
    assert launch_local(worker(body, tmp_path), 2, env=dict(os.environ, OMP_NUM_THREADS="5"), cpu_count=8) == 0
    assert (tmp_path / "omp1").read_text() == "5"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert launch_local(worker(body, tmp_path), 2, env=env, cpu_count=1) == 0
    assert (tmp_path / "omp1").read_text() == "1"


@pytest.mark.timeout(30)
def test_only_the_chiefs_stdout_is_shown_unless_log_all_workers(tmp_path, started, capfd):
    body = "print(f'hello from {rank}'); print(f'note from {rank}', file=sys.stderr)"
    assert launch_local(worker(body, tmp_path), 2) == 0
    out, err = capfd.readouterr()
    assert "hello from 0" in out and "hello from 1" not in out
    assert "note from 0" in err and "note from 1" not in err  # kept for a failure only
    assert launch_local(worker(body, tmp_path), 2, log_all_workers=True) == 0
    out, err = capfd.readouterr()
    assert "hello from 0" in out and "[worker 1] hello from 1" in out
    assert "[worker 1] note from 1" in err


@pytest.mark.timeout(30)
def test_a_failing_worker_is_named_and_its_siblings_and_their_children_are_stopped(tmp_path, started, capfd):
    body = """
if rank == 0:
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    touch("grandchild", str(child.pid))
    time.sleep(60)
else:
    wait_for("grandchild")
    print("worker 1 is about to fail", file=sys.stderr)
    sys.exit(3)
"""
    start = time.monotonic()
    status = launch_local(worker(body, tmp_path), 2, grace_seconds=5.0)
    elapsed = time.monotonic() - start
    started.extra.append(int((tmp_path / "grandchild").read_text()))
    assert status == 3
    assert elapsed < 30  # not the sibling's 60 s: SIGTERM stopped it (and its child, in its process group)
    err = capfd.readouterr().err
    assert "replicafit: worker 1 failed first (exit code 3); stopping the other workers" in err
    assert "worker 1 is about to fail" in err  # its stderr tail
    assert started.procs[0].returncode < 0  # the sibling was signalled, it did not finish


@pytest.mark.timeout(30)
def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, started, capfd):
    body = """
if rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    touch("ignoring")
    time.sleep(60)
wait_for("ignoring")
sys.exit(2)
"""
    assert launch_local(worker(body, tmp_path), 2, grace_seconds=0.5) == 2
    assert started.procs[1].returncode == -9
    assert "worker 0 failed first (exit code 2)" in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_a_worker_killed_by_a_signal_is_named_with_the_signal(tmp_path, started, capfd):
    body = "os.kill(os.getpid(), signal.SIGKILL) if rank == 1 else time.sleep(60)"
    assert launch_local(worker(body, tmp_path), 2) == 1
    err = capfd.readouterr().err
    assert "replicafit: worker 1 failed first (exit code -9, killed by SIGKILL); stopping the other workers" in err


@pytest.mark.timeout(30)
def test_max_restarts_restarts_all_workers_with_the_attempt_number(tmp_path, started, capfd):
    body = """
touch(f"attempt{attempt}-rank{rank}", os.environ["MASTER_PORT"])
if attempt == 0 and rank == 1:
    wait_for("attempt0-rank0")  # fail only once worker 0 has started (it may still be importing)
    sys.exit(1)
if attempt == 0:
    time.sleep(60)
"""
    assert launch_local(worker(body, tmp_path), 2, max_restarts=1) == 0
    markers = sorted(p.name for p in tmp_path.iterdir())
    assert markers == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    assert len(started.procs) == 4
    err = capfd.readouterr().err
    assert "worker 1 failed first (exit code 1)" in err
    assert err.count("replicafit: restarting all 2 workers (restart 1 of 1)") == 1


@pytest.mark.timeout(30)
def test_when_every_attempt_fails_the_last_status_is_returned(tmp_path, started, capfd):
    body = "sys.exit(4 if rank == 0 else 0)"
    assert launch_local(worker(body, tmp_path), 2, max_restarts=2) == 4
    err = capfd.readouterr().err
    assert "(restart 1 of 2)" in err and "(restart 2 of 2)" in err
    assert err.count("worker 0 failed first (exit code 4)") == 3
    assert len(started.procs) == 6


@pytest.mark.timeout(30)
def test_ctrl_c_is_forwarded_to_the_workers_and_reraised(tmp_path, started):
    body = """
def stop(signum, frame):
    touch(f"sigint{rank}")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
touch(f"ready{rank}")
if rank == 0:
    wait_for("ready1")
    os.kill(os.getppid(), signal.SIGINT)  # as if the user pressed Ctrl-C in the launcher's terminal
time.sleep(60)
"""
    with pytest.raises(KeyboardInterrupt):
        launch_local(worker(body, tmp_path), 2, grace_seconds=5.0)
    assert (tmp_path / "sigint0").exists() and (tmp_path / "sigint1").exists()
    assert [p.returncode for p in started.procs] == [130, 130]


@pytest.mark.timeout(60)
def test_workers_end_themselves_and_their_children_when_the_launcher_is_killed(tmp_path):
    # SIGKILL (or the OOM killer) gives the launcher no chance to stop its workers: they watch it.
    body = """
from replicafit.lifeline import watch_launcher
assert watch_launcher() and not watch_launcher()  # one watch per process
assert "REPLICAFIT_LAUNCHER_FD" not in os.environ  # the worker's own children do not watch
import subprocess
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
touch(f"pids{rank}", f"{os.getpid()} {child.pid}")
time.sleep(60)
"""
    code = "import sys; from replicafit.cli.launch import launch_local; launch_local(sys.argv[1:], 2)"
    launcher = subprocess.Popen(
        [PY, "-c", code, *worker(body, tmp_path)], start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    pids = []
    try:
        deadline = time.monotonic() + 40
        while not all((tmp_path / f"pids{rank}").exists() for rank in (0, 1)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.02)
        pids = [int(pid) for rank in (0, 1) for pid in (tmp_path / f"pids{rank}").read_text().split()]
        launcher.kill()
        assert [pid for pid in pids if not gone(pid, seconds=10)] == []
        _, err = launcher.communicate(timeout=10)  # EOF: nothing holds the chief's stderr any more
        assert "replicafit: worker 0: the launcher is gone; ending this worker" in err
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)


def test_watching_the_launcher_needs_the_launchers_pipe(monkeypatch, tmp_path):
    from replicafit import lifeline as _lifeline

    monkeypatch.setattr(_lifeline, "_lifeline_watched", False)
    monkeypatch.delenv(_lifeline.LIFELINE_ENV, raising=False)
    assert not _lifeline.watch_launcher()  # not a launched worker
    with open(tmp_path / "file", "w") as file:  # a descriptor that is not a pipe (say, reused)
        monkeypatch.setenv(_lifeline.LIFELINE_ENV, str(file.fileno()))
        assert not _lifeline.watch_launcher()
    monkeypatch.setenv(_lifeline.LIFELINE_ENV, "not a number")
    assert not _lifeline.watch_launcher() and not _lifeline._lifeline_watched


@pytest.mark.timeout(10)
def test_bad_arguments_are_refused_before_anything_starts(started):
    for bad in (dict(num_workers=0), dict(num_workers=2, max_restarts=-1), dict(num_workers=True)):
        with pytest.raises(ValueError):
            launch_local([PY, "-c", "pass"], **bad)
    with pytest.raises(ValueError, match="non-empty list"):
        launch_local(f"{PY} -c pass", 1)
    assert started.procs == []


def test_launched_worker_reads_rank_and_world_size():
    assert launched_worker({"RANK": "0", "WORLD_SIZE": "2"})
    assert not launched_worker({"RANK": "0"})
    assert not launched_worker({})


# --- the CLI ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-restarts", "1"], "--max-restarts goes with --workers N"),
        (["--log-all-workers"], "--log-all-workers goes with --workers N"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--workers", "2", "--max-restarts", "-1"], "--max-restarts must be at least 0"),
        (["--workers", "2"], "the recipe's strategy 'mirrored' runs in one process"),
    ],
)
def test_cli_usage_errors_of_workers_exit_2_with_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("no worker may start"))
    assert cli.main(["fit", "digits_mlp", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err


@pytest.mark.timeout(60)
def test_cli_refuses_workers_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("no worker may start"))
    assert cli.main(["fit", "digits_mlp", "--set", "strategy=multi_worker_mirrored", "--workers", "2"]) == 2
    out, err = capsys.readouterr()
    assert err == "error: --workers starts its own workers; under torchrun leave it out\n" and out == ""


@pytest.mark.timeout(60)
def test_cli_workers_starts_fit_once_per_worker_with_one_run_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    calls = []
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: calls.append((a, k)) or 7)
    argv = ["fit", "digits_mlp", "--set", "strategy={type: multi_worker_mirrored}", "--set", "fit.epochs=1"]
    assert cli.main([*argv, "--workers", "3", "--max-restarts", "2", "--tensorboard"]) == 7
    (command, workers, restarts), kwargs = calls[0]
    assert command[:5] == [sys.executable, "-m", "replicafit", "fit", "digits_mlp"]
    assert command[5:9] == ["--set", "strategy={type: multi_worker_mirrored}", "--set", "fit.epochs=1"]
    assert command[9] == "--run-dir" and "digits_mlp" in command[10] and command[11:] == ["--tensorboard"]
    assert (workers, restarts, kwargs) == (3, 2, {"log_all_workers": False, "chief_completes": True})
    assert not os.path.exists(command[10])  # the chief creates it, not the launcher
    calls.clear()
    run_dir = str(tmp_path / "run")
    assert cli.main([*argv, "--run-dir", run_dir, "--workers", "1", "--log-all-workers"]) == 7
    (command, workers, restarts), kwargs = calls[0]
    assert command[9:] == ["--run-dir", run_dir] and (workers, restarts) == (1, 0)
    assert kwargs == {"log_all_workers": True, "chief_completes": True}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["fully_sharded", "{type: fully_sharded, timeout_seconds: 60}"])
def test_cli_workers_takes_a_fully_sharded_recipe_too(monkeypatch, strategy):
    monkeypatch.delenv("RANK", raising=False)
    calls = []
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: calls.append(a) or 0)
    assert cli.main(["fit", "digits_mlp", "--set", f"strategy={strategy}", "--workers", "2"]) == 0
    (command, workers, restarts) = calls[0]
    assert command[5:7] == ["--set", f"strategy={strategy}"] and (workers, restarts) == (2, 0)


def test_the_workers_flag_and_its_error_name_both_multi_worker_strategies(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("no worker may start"))
    assert cli.main(["fit", "digits_mlp", "--set", "strategy=one_device", "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "`strategy: multi_worker_mirrored` or `strategy: fully_sharded`" in err
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    assert "multi_worker_mirrored or fully_sharded" in " ".join(capsys.readouterr().out.split())


@pytest.mark.timeout(30)
def test_a_worker_whose_peer_failed_prints_one_line_and_exits_1(capsys, monkeypatch):
    from replicafit.strategies import WorkerFailedError

    def fit(args):
        raise WorkerFailedError("Worker 0 of 2: another worker died or stopped arriving during batch_reduce_to")

    monkeypatch.setitem(COMMANDS, "fit", fit)
    assert cli.main(["fit", "digits_mlp"]) == launch.PEER_FAILED_EXIT_STATUS == 69
    err = capsys.readouterr().err
    assert err == "error: Worker 0 of 2: another worker died or stopped arriving during batch_reduce_to\n"


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_stops_the_workers_and_says_so(tmp_path):
    """Regression: it exited 143 with no message (Ctrl-C says ``interrupted``)."""
    body = """
def stop(signum, frame):
    touch(f"sigterm{rank}")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
touch(f"ready{rank}")
time.sleep(60)
"""
    with launched_until_ready(body, tmp_path) as launcher:
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 143
        assert "replicafit: SIGTERM received; the workers were stopped" in err
        assert (tmp_path / "sigterm0").exists() and (tmp_path / "sigterm1").exists()


@contextlib.contextmanager
def launched_until_ready(body: str, tmp_path):
    """A launcher process of 2 workers running ``body``, once both touched ``ready{rank}``; killed with its
    group at the end if still running."""
    code = "import sys; from replicafit.cli.launch import launch_local; sys.exit(launch_local(sys.argv[1:], 2))"
    launcher = subprocess.Popen(
        [PY, "-c", code, *worker(body, tmp_path)], start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 40
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.02)
        yield launcher
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_worker_still_running_after_the_others_exited_0_is_named_and_stopped(tmp_path, started, capfd):
    """Regression: a worker that hung while the others had finished kept the launcher waiting forever."""
    body = """
if rank == 1:
    time.sleep(60)  # stuck (e.g. while exiting)
"""
    begin = time.monotonic()
    status = launch_local(worker(body, tmp_path), 2, grace_seconds=1.0, exit_seconds=2.0)
    assert status == 1 and time.monotonic() - begin < 30
    err = capfd.readouterr().err
    assert "worker 1 is still running 2 s after worker(s) 0 exited: it is stuck; stopping it" in err
    assert "failed first" not in err


@pytest.mark.timeout(60)
def test_workers_preempted_end_the_launch_with_75_and_no_restart(tmp_path, started, capfd):
    """A worker exiting with PREEMPTED_EXIT_STATUS has not failed: no restart, and 75 passed on."""
    body = """
touch(f"attempt{attempt}-{rank}")
sys.exit(75)
"""
    status = launch_local(worker(body, tmp_path), 2, max_restarts=2)
    assert status == launch.PREEMPTED_EXIT_STATUS == 75
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt0-0", "attempt0-1"]  # never restarted
    err = capfd.readouterr().err
    assert "the workers were preempted and wrote their backup (exit status 75)" in err
    assert "failed first" not in err and "restarting" not in err


@pytest.mark.timeout(60)
def test_a_worker_preempted_while_another_fails_is_a_failure(tmp_path, started, capfd):
    body = """
if rank == 1:
    wait_for("preempted0")
    sys.exit(3)
touch("preempted0")
sys.exit(75)
"""
    assert launch_local(worker(body, tmp_path), 2) == 3
    assert "worker 1 failed first (exit code 3)" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_reaches_each_worker_once_and_their_preemption_is_passed_on(tmp_path):
    """The launcher forwards SIGTERM to the worker processes (not their children), waits for them to
    save, and exits 75 with one line; a second SIGTERM while they save changes nothing."""
    body = """
import subprocess
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
def stop(signum, frame):
    touch(f"sigterm{rank}")
    wait_for("second")  # saving: the launcher got a second SIGTERM meanwhile
    touch(f"child{rank}", str(child.poll()))  # the worker's own child was left alone
    child.kill()
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
touch(f"ready{rank}")
time.sleep(60)
"""
    with launched_until_ready(body, tmp_path) as launcher:
        launcher.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not all((tmp_path / f"sigterm{rank}").exists() for rank in (0, 1)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the workers got no SIGTERM"
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        (tmp_path / "second").write_text("")
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 75, err
        assert "SIGTERM received; the workers stopped at an agreed step and wrote their backup" in err
        assert [(tmp_path / f"child{rank}").read_text() for rank in (0, 1)] == ["None", "None"]


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_of_workers_that_finish_cleanly_is_status_0(tmp_path):
    """Regression: the workers exited 0 (the signal came as they finished) and the launcher said 143."""
    body = """
signal.signal(signal.SIGTERM, lambda signum, frame: touch(f"sigterm{rank}"))
touch(f"ready{rank}")
wait_for(f"sigterm{rank}")
"""
    with launched_until_ready(body, tmp_path) as launcher:
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 0, err


@pytest.mark.timeout(60)
def test_a_stopped_worker_is_named_not_the_one_that_gave_up_waiting_for_it(tmp_path, started, capfd):
    """Regression: with worker 1 SIGSTOPped, worker 0's collective timed out and the launcher said "worker 0
    failed first (exit code 1)" (16 of 16 trials). The one that gave up (69) is not the cause; the one
    still running is named."""
    body = """
if rank == 1:
    touch("stopping")
    os.kill(os.getpid(), signal.SIGSTOP)
wait_for("stopping")
time.sleep(0.3)
sys.exit(69)  # what replicafit fit returns on WorkerFailedError
"""
    status = launch_local(worker(body, tmp_path), 2, grace_seconds=1.0)
    assert status == 1
    err = capfd.readouterr().err
    assert "worker 1 (stopped by a signal) stopped arriving: worker(s) 0 gave up waiting in a collective" in err
    assert "(exit code 69)" in err and "failed first" not in err


@pytest.mark.timeout(60)
def test_a_worker_that_fails_just_after_the_others_gave_up_on_it_is_named_as_failed(tmp_path, started, capfd):
    body = """
if rank == 1:
    wait_for("gave_up")
    time.sleep(0.3)
    sys.exit(5)
touch("gave_up")
sys.exit(69)
"""
    assert launch_local(worker(body, tmp_path), 2, grace_seconds=2.0) == 5
    err = capfd.readouterr().err
    assert "worker 1 failed first (exit code 5)" in err and "stopped arriving" not in err


@pytest.mark.timeout(30)
def test_a_worker_that_fails_after_the_chief_completed_the_run_neither_fails_nor_restarts_it(tmp_path, started, capfd):
    body = """
if rank == 1:
    wait_for("chief-done")
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
touch(f"ran-{attempt}")
touch("chief-done")
"""
    assert launch_local(worker(body, tmp_path), 2, max_restarts=1, chief_completes=True) == 0
    assert not os.path.exists(tmp_path / "ran-1")  # not started again: a restart would train the run again
    said = "worker 1 ended (exit code -9, killed by SIGKILL) after the chief had finished the run"
    assert said in capfd.readouterr().err
    # A launcher not told so takes it as a failure (and restarts).
    os.remove(tmp_path / "chief-done")
    assert launch_local(worker(body, tmp_path), 2, max_restarts=1) == 1
    assert os.path.exists(tmp_path / "ran-1")


@pytest.mark.timeout(60)
def test_a_survivor_that_says_it_saves_is_waited_for_before_the_others_are_stopped(tmp_path, started, capfd):
    body = """
from replicafit.lifeline import tell_launcher
if rank == 1:
    wait_for("saving")
    sys.exit(3)
if rank == 0:
    signal.signal(signal.SIGTERM, lambda *a: (touch("sigterm"), sys.exit(143)))
    tell_launcher("saving")
    touch("saving")
    time.sleep(2.5)  # longer than grace_seconds: a survivor writing its backup
    touch("saved")
    sys.exit(69)
"""
    assert launch_local(worker(body, tmp_path), 2, grace_seconds=0.5, rescue_seconds=20) == 3
    assert os.path.exists(tmp_path / "saved") and not os.path.exists(tmp_path / "sigterm")
    # Past rescue_seconds it is stopped all the same.
    for name in ("saving", "saved"):
        os.remove(tmp_path / name)
    assert launch_local(worker(body, tmp_path), 2, grace_seconds=0.5, rescue_seconds=1) == 3
    assert os.path.exists(tmp_path / "sigterm") and not os.path.exists(tmp_path / "saved")


@pytest.mark.timeout(60)
def test_a_worker_whose_fit_watches_for_a_peers_failure_gets_time_to_notice_it(tmp_path, started, capfd):
    body = """
from replicafit.lifeline import tell_launcher
if rank == 1:
    wait_for("watching")
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *a: (touch("sigterm"), sys.exit(143)))
tell_launcher("watching")
touch("watching")
time.sleep(2.0)  # its step: it notices the failure at its next collective, after grace_seconds
tell_launcher("saving")
time.sleep(0.5)
touch("saved")
sys.exit(69)
"""
    assert launch_local(worker(body, tmp_path), 2, grace_seconds=0.5, rescue_seconds=20) == 3
    assert os.path.exists(tmp_path / "saved") and not os.path.exists(tmp_path / "sigterm")
