"""Runs a function in N worker processes on gloo over loopback, each bounded in time.

``run_workers(path, name, n)`` starts ``n`` fresh interpreters (one intra-op thread each),
calls ``name(worker_index, num_workers, port, **kwargs)`` from the file ``path`` in every one
and returns each worker's outcome: ``{"ok": bool, "result": ..., "error": str, "seconds": float,
"exitcode": int}``. A worker that fails or outlives the deadline is ended by its pid; no
process outlives the call. Processes are started fresh (not forked): the test process has
replica threads, which a fork would copy mid-flight.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))  # tests/: where this module lives

_CHILD = """
import sys
sys.path.insert(0, {here!r})
from multiworker_harness import _child_main
_child_main()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(path, name, num_workers, *, timeout=60.0, kwargs=None, grace=5.0, env=None) -> list:
    """Each worker's outcome (see the module docstring); raises ``TimeoutError`` past ``timeout``."""
    port = free_port()
    outdir = tempfile.mkdtemp(prefix="rf-mw-")
    try:
        return _run_in(outdir, path, name, num_workers, port, timeout, kwargs, grace, env)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)  # the specs and outcomes are read: leave nothing behind


def _run_in(outdir, path, name, num_workers, port, timeout, kwargs, grace, env) -> list:
    procs = []
    child_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for rank in range(num_workers):
        spec = pickle.dumps((os.path.abspath(path), name, rank, num_workers, port, kwargs or {}, outdir))
        spec_path = os.path.join(outdir, f"spec-{rank}.pkl")
        with open(spec_path, "wb") as file:
            file.write(spec)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD.format(here=_HERE), spec_path],
                env=child_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"workers still running after {timeout} s")
            if failed_at is None and any(p.poll() is not None for p in procs):
                failed_at = now  # one is done: the others get ``grace`` seconds to finish or notice
            if failed_at is not None and now - failed_at > grace:
                break  # the others had their chance to notice; end them below
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    outcomes = []
    for rank, p in enumerate(procs):
        out_path = os.path.join(outdir, f"out-{rank}.pkl")
        stderr = p.stderr.read().decode(errors="replace")
        p.stderr.close()
        if os.path.exists(out_path):
            with open(out_path, "rb") as file:
                outcome = pickle.load(file)
        else:
            outcome = {"ok": False, "result": None, "error": f"no result (stderr: {stderr[-2000:]})", "seconds": None}
        outcome["exitcode"] = p.returncode
        outcome["stderr"] = stderr
        outcomes.append(outcome)
    return outcomes


def results(outcomes) -> list:
    """The results, or an ``AssertionError`` showing every failed worker's error."""
    failed = [f"worker {i}: {o['error']}" for i, o in enumerate(outcomes) if not o["ok"]]
    assert not failed, "\n".join(failed)
    return [o["result"] for o in outcomes]


def _child_main() -> None:
    import importlib.util
    import traceback

    import torch

    torch.set_num_threads(1)
    with open(sys.argv[1], "rb") as file:
        path, name, rank, num_workers, port, kwargs, outdir = pickle.load(file)
    spec = importlib.util.spec_from_file_location("_mw_scenarios", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    start = time.monotonic()
    try:
        result = getattr(module, name)(rank, num_workers, port, **kwargs)
        outcome = {"ok": True, "result": result, "error": None}
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        outcome = {"ok": False, "result": None, "error": "".join(traceback.format_exception(error))[-4000:]}
        outcome["error_type"] = type(error).__name__
    outcome["seconds"] = time.monotonic() - start
    tmp = os.path.join(outdir, f"out-{rank}.pkl.tmp")
    with open(tmp, "wb") as file:
        pickle.dump(outcome, file)
    os.replace(tmp, os.path.join(outdir, f"out-{rank}.pkl"))
    sys.stdout.flush()
    os._exit(0 if outcome["ok"] else 1)
