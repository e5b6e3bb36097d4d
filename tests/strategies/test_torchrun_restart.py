"""Workers that torchrun restarts join the cluster again: the rendezvous store outlives them, and the addresses
the killed attempt's workers left in it sent a restarted worker to a closed socket ("Gloo connectFullMesh failed
... Connection refused", 4 of 4 tries here before the fix); each start now meets in a store of its own (worker 0's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from multiworker_harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("run", range(3))  # the stale keys sent a restarted worker astray in most tries, not all
def test_workers_restarted_by_torchrun_join_again_and_finish(run):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        os.path.join(HERE, "torchrun_restart_worker.py"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the agent and its workers
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish within 150 s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    assert "worker 0 attempt 1 done" in output and "worker 1 attempt 1 done" in output, output[-3000:]


def test_the_torchrun_resolver_reads_the_attempt():
    import replicafit.strategies as ds

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert ds.TorchrunClusterResolver(env).attempt == 0
    assert ds.TorchrunClusterResolver({**env, "TORCHELASTIC_RESTART_COUNT": "2"}).attempt == 2
    assert ds.SimpleClusterResolver(2, 0, "127.0.0.1", 29500).attempt == 0


def test_the_torchrun_resolver_reads_whether_the_agent_holds_the_store():
    import replicafit.strategies as ds

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert not ds.TorchrunClusterResolver(env).shared_store  # the launcher's workers: worker 0 hosts it
    assert ds.TorchrunClusterResolver({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}).shared_store
    assert not ds.TorchrunClusterResolver({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}).shared_store
    assert not ds.SimpleClusterResolver(2, 0, "127.0.0.1", 29500).shared_store
