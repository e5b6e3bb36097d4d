"""``SlurmClusterResolver`` over faked SLURM environments, and ``resolve_cluster``'s order (torchrun,
SLURM job step, TF_CONFIG, one local worker) with half a torchrun environment refused."""

from __future__ import annotations

import pytest

import replicafit.strategies.slurm as slurm
from replicafit.strategies import SimpleClusterResolver, SlurmClusterResolver, TorchrunClusterResolver
from replicafit.strategies.cluster_resolver import resolve_cluster
from replicafit.strategies.slurm import expand_hostlist, expand_tasks_per_node


def step(**overrides) -> dict:
    """Task 3 of 4 in a job step over two nodes (2 tasks each), as srun sets it."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURMD_NODENAME": "gpu08",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize(
    "hostlist,hosts",
    [
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("a[1-3,10],b5", ["a1", "a2", "a3", "a10", "b5"]),
        ("node-[009-011]", ["node-009", "node-010", "node-011"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("single", ["single"]),
        ("x[8-10]", ["x8", "x9", "x10"]),
    ],
)
def test_host_lists_expand_in_order_with_their_zero_padding(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["a[1-", "a]1[", "a[3-1]", "a[x]", "", "a,,b"])
def test_a_malformed_host_list_is_refused(hostlist):
    with pytest.raises(ValueError):
        expand_hostlist(hostlist)


def test_tasks_per_node_expand():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        expand_tasks_per_node("2(x)")


def test_a_task_of_a_job_step():
    r = SlurmClusterResolver(environ=step())
    assert (r.num_workers, r.worker_index, r.local_rank, r.local_world_size) == (4, 3, 1, 2)
    assert (r.master_address, r.master_port) == ("gpu07", 15000 + 123456 % 10000)
    assert not r.is_chief
    assert SlurmClusterResolver(port_base=20000, environ=step()).master_port == 23456
    assert SlurmClusterResolver(environ=step(MASTER_PORT="29500")).master_port == 29500


def test_the_node_of_a_task_without_its_node_name_follows_the_block_distribution():
    env = step(SLURMD_NODENAME=None, SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_TASKS_PER_NODE="2,1,1")
    env.update({"SLURM_STEP_NODELIST": "a[1-3]"})
    r = SlurmClusterResolver(environ=env)
    assert (r.local_rank, r.local_world_size) == (1, 2)
    r = SlurmClusterResolver(environ={**env, "SLURM_PROCID": "3", "SLURM_LOCALID": "0"})
    assert r.local_world_size == 1


def test_tasks_per_node_may_be_given():
    env = step(SLURM_STEP_TASKS_PER_NODE=None)
    assert SlurmClusterResolver(tasks_per_node=2, environ=env).local_world_size == 2
    assert SlurmClusterResolver(tasks_per_node=[1, 3], environ={**env, "SLURM_LOCALID": "2"}).local_world_size == 3
    with pytest.raises(ValueError, match="do not fit"):
        SlurmClusterResolver(tasks_per_node=3, environ=env)


def test_one_task_needs_no_port():
    env = step(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_STEP_NODELIST="c5")
    env["SLURM_STEP_TASKS_PER_NODE"] = "1"
    r = SlurmClusterResolver(environ=env)
    assert (r.num_workers, r.master_port, r.is_chief) == (1, 0, True)


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"SLURM_PROCID": "three"}, "SLURM_PROCID='three' is malformed"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID='4' is out of range"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is malformed"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID='2' is out of range"),
        ({"SLURM_STEP_NODELIST": "gpu[07-"}, "SLURM_STEP_NODELIST='gpu[07-' is malformed"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE='2(x)' is malformed"),
        ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, "The tasks per node ([3, 3]) do not fit"),
        ({"SLURM_JOB_ID": "job"}, "SLURM_JOB_ID='job' is malformed"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is malformed"),
        ({"SLURM_NTASKS": None}, "SLURM_NTASKS is not set"),
    ],
)
def test_a_malformed_variable_is_one_line_naming_it(overrides, named):
    with pytest.raises(
        ValueError, match="^" + named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ) as caught:
        SlurmClusterResolver(environ=step(**overrides))
    assert "\n" not in str(caught.value)


def test_gpus_of_a_task(monkeypatch):
    monkeypatch.setattr(slurm, "_local_gpus", lambda: ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    assert SlurmClusterResolver(environ=step()).local_devices() == ("cuda:1",)  # LOCALID 1 of 2 tasks
    assert SlurmClusterResolver(gpus_per_task=2, environ=step()).local_devices() == ("cuda:2", "cuda:3")
    monkeypatch.setattr(slurm, "_local_gpus", lambda: ["cuda:0"])  # --gpus-per-task 1: each sees its own
    assert SlurmClusterResolver(environ=step()).local_devices() == ("cuda:0",)
    assert SlurmClusterResolver(gpus_per_task=1, environ=step()).local_devices() == ("cuda:0",)
    monkeypatch.setattr(slurm, "_local_gpus", lambda: [])
    assert SlurmClusterResolver(environ=step()).local_devices() is None
    assert SlurmClusterResolver(environ=step(), devices=["cpu:0"]).local_devices() == ("cpu:0",)


def test_resolve_cluster_picks_slurm_only_inside_a_job_step():
    assert type(resolve_cluster(step())) is SlurmClusterResolver
    allocation = step(SLURM_STEP_ID=None)  # an salloc shell or a batch script: one process
    assert type(resolve_cluster(allocation)) is SimpleClusterResolver
    torchrun = {**step(), "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}  # torchrun under srun
    assert type(resolve_cluster(torchrun)) is TorchrunClusterResolver


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set but RANK and WORLD_SIZE are not"),
    ],
)
def test_half_a_torchrun_environment_is_refused(env, fragment):
    """Regression: RANK=1 alone gave a one-worker strategy that trained alone as the chief."""
    with pytest.raises(ValueError, match=fragment):
        resolve_cluster(env)


def test_a_master_address_or_port_alone_is_harmless():
    assert resolve_cluster({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}).num_workers == 1
