"""Two ``torchrun --nnodes 1:2 --nproc-per-node 1`` agents on 127.0.0.1 with c10d rendezvous run one fit
(``elastic_worker.py``). One agent is SIGKILLed mid-epoch: the survivor writes the backup of the last step every
worker finished, its agent re-forms the job on one worker, which goes on from that step; the killed agent,
started again, is taken in at the next re-formation (the running worker saves at an agreed step on the agent's
SIGTERM) and the job ends on two workers, with the uninterrupted run's weights within 1e-6 and no step lost."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from multiworker_harness import free_port, results, run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "elastic_worker.py")


def _straight(rank, num_workers, port, outdir):
    """The uninterrupted run, 2 workers (run_workers' scenario: the worker script with a cluster of its own)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(num_workers), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, HERE)
    import elastic_worker

    elastic_worker.main(outdir, elastic=False)
    return True


def _agent(outdir, endpoint, name):
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic-test",
        "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60",
        "--monitor-interval", "0.2",
        WORKER, str(outdir),
    ]  # fmt: skip
    log = open(os.path.join(outdir, f"agent-{name}.log"), "a")  # noqa: SIM115 (closed by the test)
    # torch's own switch: with the agents' shared store (its default) a node that joins a running job breaks the
    # agents' next rendezvous in torch 2.13 (the new round waits for its MASTER_ADDR key, 60 s, then fails).
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def _lines(outdir, name) -> list:
    path = os.path.join(outdir, name)
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [line.split() for line in file if line.strip()]


def _wait(predicate, seconds, what, outdir):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            names = [n for n in sorted(os.listdir(outdir)) if "agent" in n]
            logs = "".join(open(os.path.join(outdir, n)).read()[-3000:] for n in names)
            pytest.fail(f"{what} did not happen within {seconds} s:\n{logs}")
        time.sleep(0.1)


def _lose_node(outdir, agent):
    """SIGKILL to an agent and its workers (torchrun starts each worker in a session of its own)."""
    with open(os.path.join(outdir, "pids", str(agent.pid))) as file:
        workers = [int(pid) for pid in file.read().split()]
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(timeout=10)


@pytest.mark.timeout(420)
def test_two_elastic_agents_lose_one_go_on_alone_and_take_it_back(tmp_path):
    reference = tmp_path / "straight"
    reference.mkdir()
    results(run_workers(__file__, "_straight", 2, timeout=120, kwargs={"outdir": str(reference)}))
    straight = torch.load(reference / "final.pt", weights_only=True)

    outdir = str(tmp_path / "elastic")
    os.makedirs(outdir)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = {}
    try:
        agents["a"] = _agent(outdir, endpoint, "a")  # the first hosts the rendezvous store: it stays
        time.sleep(1.5)
        agents["b"] = _agent(outdir, endpoint, "b")
        steps = lambda: _lines(outdir, "steps.txt")  # noqa: E731
        _wait(lambda: any(int(s[3]) >= 10 for s in steps()), 120, "ten steps on two workers", outdir)
        _lose_node(outdir, agents["b"][0])
        _wait(lambda: any(s[2] == "1" for s in steps()), 120, "a step on one worker", outdir)
        alone = max(int(s[3]) for s in steps() if s[2] == "1")
        agents["b2"] = _agent(outdir, endpoint, "b2")
        _wait(
            lambda: any(s[2] == "2" and int(s[3]) > alone for s in steps()), 120, "steps on two workers again", outdir
        )
        code = agents["a"][0].wait(timeout=180)
        assert code == 0, open(os.path.join(outdir, "agent-a.log")).read()[-3000:]
        assert agents["b2"][0].wait(timeout=60) == 0
    finally:
        for process, log in agents.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
            log.close()
    final = torch.load(os.path.join(outdir, "final.pt"), weights_only=True)
    for key, value in straight.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-6)
    # Where each start resumed: never before a step that had finished (no step lost, none trained twice).
    finished = collections.Counter(int(s[3]) for s in _lines(outdir, "steps.txt") if s[1] == "0")
    starts = [int(s[3]) for s in _lines(outdir, "starts.txt") if s[1] == "0"]
    assert len(starts) >= 3, starts  # two workers, one, two again
    assert max(finished.values()) == 1, [step for step, count in finished.items() if count > 1]
    worlds = [int(s[2]) for s in _lines(outdir, "starts.txt") if s[1] == "0"]
    assert 1 in worlds and worlds[-1] == 2, worlds
