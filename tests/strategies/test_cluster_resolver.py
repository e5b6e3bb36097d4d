"""Cluster resolvers of MultiWorkerMirroredStrategy: torchrun env, TF_CONFIG, explicit, detection order.

Every environment is a plain dict passed as ``environ``; the real ``os.environ`` is never touched.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from replicafit.strategies import cluster_resolver as cr
from replicafit.strategies.cluster_resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)

FIELDS = (
    "num_workers",
    "worker_index",
    "master_address",
    "master_port",
    "task_type",
    "task_id",
    "local_rank",
    "local_world_size",
    "is_chief",
)


def _fields(resolver: ClusterResolver) -> dict:
    return {name: getattr(resolver, name) for name in FIELDS}


def _torchrun(**overrides) -> dict:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "abc",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def _tf_config(cluster=None, task=None) -> dict:
    config = {
        "cluster": cluster if cluster is not None else {"chief": ["a:2222"], "worker": ["b:2223", "c:2224"]},
        "task": task if task is not None else {"type": "worker", "index": 1},
    }
    return {"TF_CONFIG": json.dumps(config)}


@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr(cr, "_local_gpus", lambda: [])


@pytest.fixture
def three_gpus(monkeypatch):
    monkeypatch.setattr(cr, "_local_gpus", lambda: ["cuda:0", "cuda:1", "cuda:2"])


# --- SimpleClusterResolver ---------------------------------------------------------------


def test_simple_one_worker_defaults():
    r = SimpleClusterResolver(1, 0)
    assert _fields(r) == {
        "num_workers": 1,
        "worker_index": 0,
        "master_address": "127.0.0.1",
        "master_port": 0,
        "task_type": "worker",
        "task_id": 0,
        "local_rank": 0,
        "local_world_size": 1,
        "is_chief": True,
    }
    assert r.local_devices() is None
    assert r.cluster_spec() == {"worker": ["127.0.0.1"]}
    assert isinstance(r, ClusterResolver)


def test_simple_several_workers():
    r = SimpleClusterResolver(3, 2, "host-a", 1234, devices=["CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"])
    assert (r.num_workers, r.worker_index, r.task_id, r.is_chief) == (3, 2, 2, False)
    assert (r.master_address, r.master_port) == ("host-a", 1234)
    assert r.local_devices() == ("cpu:0", "cpu:1")
    assert r.cluster_spec() == {"worker": ["host-a:1234", "<unknown>", "<unknown>"]}


def test_simple_single_device_string_is_accepted():
    assert SimpleClusterResolver(1, 0, devices="cpu").local_devices() == ("cpu:0",)


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((0, 0), {}, "num_workers"),
        ((2.0, 0), {"port": 1}, "num_workers"),
        ((True, 0), {}, "num_workers"),
        ((2, -1), {"port": 1}, "worker_index"),
        ((2, 2), {"port": 1}, "worker_index"),
        ((2, "0"), {"port": 1}, "worker_index"),
        ((2, 0), {}, "port"),
        ((2, 0), {"port": 0}, "port"),
        ((2, 0), {"port": 65536}, "port"),
        ((2, 0), {"port": "29500"}, "port"),
        ((1, 0), {"port": -5}, "port"),
        ((1, 0), {"address": ""}, "address"),
        ((1, 0), {"address": None}, "address"),
        ((1, 0), {"devices": []}, "devices"),
        ((1, 0), {"devices": ["cpu:0", "CPU:0"]}, "devices"),
    ],
)
def test_simple_bad_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        SimpleClusterResolver(*args, **kwargs)


def test_simple_unknown_device_is_refused():
    with pytest.raises(ValueError, match="Unknown device 'tpu:0'"):
        SimpleClusterResolver(1, 0, devices=["tpu:0"])


# --- TorchrunClusterResolver -------------------------------------------------------------


def test_torchrun_reads_every_variable():
    r = TorchrunClusterResolver(_torchrun())
    assert _fields(r) == {
        "num_workers": 4,
        "worker_index": 3,
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "task_type": "worker",
        "task_id": 3,
        "local_rank": 1,
        "local_world_size": 2,
        "is_chief": False,
    }
    assert r.cluster_spec() == {"worker": ["10.0.0.1:29500", "<unknown>", "<unknown>", "<unknown>"]}
    assert TorchrunClusterResolver(_torchrun(RANK="0")).is_chief


def test_torchrun_defaults():
    r = TorchrunClusterResolver({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": " 1234 "})
    assert (r.master_address, r.master_port, r.local_rank, r.local_world_size) == ("127.0.0.1", 1234, 0, 1)
    one = TorchrunClusterResolver({"RANK": "0", "WORLD_SIZE": "1"})
    assert (one.num_workers, one.master_port) == (1, 0)


def test_torchrun_reads_the_mapping_it_is_given_not_os_environ():
    assert "RANK" not in os.environ or os.environ["RANK"] != "5"
    assert TorchrunClusterResolver({"RANK": "5", "WORLD_SIZE": "6", "MASTER_PORT": "80"}).worker_index == 5


@pytest.mark.parametrize(
    "overrides, variable, fragment",
    [
        ({"RANK": None}, "RANK", "not set"),
        ({"WORLD_SIZE": None}, "WORLD_SIZE", "not set"),
        ({"RANK": "one"}, "RANK='one'", "non-negative integer"),
        ({"RANK": "-1"}, "RANK='-1'", "non-negative integer"),
        ({"RANK": "1.0"}, "RANK='1.0'", "non-negative integer"),
        ({"RANK": ""}, "RANK=''", "non-negative integer"),
        ({"RANK": "4"}, "RANK='4'", "WORLD_SIZE=4"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0'", "integer >= 1"),
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE='x'", "integer >= 1"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK='2'", "LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_RANK": "-2"}, "LOCAL_RANK='-2'", "non-negative integer"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": None}, "LOCAL_RANK='1'", "1 when LOCAL_WORLD_SIZE is not set"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'", "integer >= 1"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE='8'", "WORLD_SIZE=4"),
        ({"MASTER_PORT": None}, "MASTER_PORT", "not set"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'", "integer >= 1"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT='0'", "integer >= 1"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000'", "1..65535"),
        ({"MASTER_ADDR": "  "}, "MASTER_ADDR", "host name or IP address"),
    ],
)
def test_torchrun_malformed(overrides, variable, fragment):
    with pytest.raises(ValueError) as info:
        TorchrunClusterResolver(_torchrun(**overrides))
    assert variable in str(info.value) and fragment in str(info.value), str(info.value)


def test_torchrun_detected():
    assert TorchrunClusterResolver.detected({"TORCHELASTIC_RUN_ID": "x"})
    assert TorchrunClusterResolver.detected({"RANK": "0", "WORLD_SIZE": "1"})
    assert not TorchrunClusterResolver.detected({"RANK": "0"})
    assert not TorchrunClusterResolver.detected({"WORLD_SIZE": "1"})
    assert not TorchrunClusterResolver.detected({})


def test_torchrun_local_devices_without_cuda(no_gpus):
    assert TorchrunClusterResolver(_torchrun()).local_devices() is None
    explicit = TorchrunClusterResolver(_torchrun(), devices=["cpu:1", "cpu:0"])
    assert explicit.local_devices() == ("cpu:1", "cpu:0")


def test_torchrun_local_devices_with_cuda(three_gpus):
    # several processes per node: one GPU each, by LOCAL_RANK (DDP's convention)
    assert TorchrunClusterResolver(_torchrun()).local_devices() == ("cuda:1",)
    # one process per node: every visible GPU (TensorFlow's convention)
    one_per_node = TorchrunClusterResolver(_torchrun(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"))
    assert one_per_node.local_devices() == ("cuda:0", "cuda:1", "cuda:2")
    # explicit devices win
    assert TorchrunClusterResolver(_torchrun(), devices=["cpu:0"]).local_devices() == ("cpu:0",)


def test_torchrun_local_rank_beyond_the_gpus(three_gpus):
    r = TorchrunClusterResolver(_torchrun(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4"))
    with pytest.raises(ValueError, match=r"LOCAL_RANK.*only 3 CUDA device"):
        r.local_devices()


def test_torchrun_bad_devices_argument():
    with pytest.raises(ValueError, match="devices"):
        TorchrunClusterResolver(_torchrun(), devices=[])


def test_environ_must_be_a_mapping():
    with pytest.raises(ValueError, match="environ"):
        TorchrunClusterResolver(["RANK=0"])
    with pytest.raises(ValueError, match="environ"):
        resolve_cluster("RANK=0")


# --- TFConfigClusterResolver -------------------------------------------------------------


def test_tf_config_worker_after_the_chief():
    r = TFConfigClusterResolver(_tf_config())
    assert _fields(r) == {
        "num_workers": 3,
        "worker_index": 2,
        "master_address": "a",
        "master_port": 2222,
        "task_type": "worker",
        "task_id": 1,
        "local_rank": 0,
        "local_world_size": 1,
        "is_chief": False,
    }
    assert r.cluster_spec() == {"chief": ["a:2222"], "worker": ["b:2223", "c:2224"]}
    spec = r.cluster_spec()
    spec["worker"].append("d:1")
    assert r.cluster_spec()["worker"] == ["b:2223", "c:2224"], "cluster_spec() returns a copy"


def test_tf_config_chief():
    r = TFConfigClusterResolver(_tf_config(task={"type": "chief", "index": 0}))
    assert (r.worker_index, r.task_type, r.task_id, r.is_chief) == (0, "chief", 0, True)


def test_tf_config_workers_only_and_ipv6():
    env = _tf_config(cluster={"worker": ["[::1]:5000", "[::1]:5001"]}, task={"type": "worker", "index": 0})
    r = TFConfigClusterResolver(env)
    assert (r.num_workers, r.worker_index, r.is_chief) == (2, 0, True)
    assert (r.master_address, r.master_port) == ("::1", 5000)
    assert r.cluster_spec() == {"worker": ["[::1]:5000", "[::1]:5001"]}


def test_tf_config_ignores_evaluator_entries_and_extra_keys():
    config = json.loads(_tf_config()["TF_CONFIG"])
    config["cluster"]["evaluator"] = ["e:1"]
    config["environment"] = "cloud"
    config["rpc_layer"] = "grpc"
    r = TFConfigClusterResolver({"TF_CONFIG": json.dumps(config)})
    assert r.num_workers == 3
    assert "evaluator" not in r.cluster_spec()


def test_tf_config_local_devices(three_gpus):
    assert TFConfigClusterResolver(_tf_config()).local_devices() == ("cuda:0", "cuda:1", "cuda:2")
    assert TFConfigClusterResolver(_tf_config(), devices=["CPU:2"]).local_devices() == ("cpu:2",)


def test_tf_config_local_devices_without_cuda(no_gpus):
    assert TFConfigClusterResolver(_tf_config()).local_devices() is None
    assert TFConfigClusterResolver(_tf_config(), devices="cpu:1").local_devices() == ("cpu:1",)


def _raw(config) -> dict:
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


GOOD_CLUSTER = {"worker": ["a:1", "b:2"]}
GOOD_TASK = {"type": "worker", "index": 0}


@pytest.mark.parametrize(
    "environ, fragment",
    [
        ({}, "is not set"),
        (_raw("  "), "is not set"),
        (_raw("{not json"), "not valid JSON"),
        (_raw([1, 2]), "JSON object"),
        (_raw({"task": GOOD_TASK}), "cluster must be an object"),
        (_raw({"cluster": {"worker": "a:1"}, "task": GOOD_TASK}), "cluster.worker must be a list"),
        (_raw({"cluster": {"trainer": ["a:1"]}, "task": GOOD_TASK}), "cluster.trainer is not a task type"),
        (_raw({"cluster": {"worker": ["a"]}, "task": GOOD_TASK}), "cluster.worker[0] 'a' is malformed"),
        (_raw({"cluster": {"worker": ["a:1", "b:x"]}, "task": GOOD_TASK}), "cluster.worker[1] 'b:x'"),
        (_raw({"cluster": {"worker": [":1"]}, "task": GOOD_TASK}), "cluster.worker[0]"),
        (_raw({"cluster": {"worker": ["a:0"]}, "task": GOOD_TASK}), "1..65535"),
        (_raw({"cluster": {"worker": ["a:70000"]}, "task": GOOD_TASK}), "1..65535"),
        (_raw({"cluster": {"worker": [5]}, "task": GOOD_TASK}), "cluster.worker[0] must be a 'host:port'"),
        (_raw({"cluster": {"worker": ["a:1", "a:1"]}, "task": GOOD_TASK}), "more than once"),
        (_raw({"cluster": {"chief": ["a:1", "b:1"]}, "task": GOOD_TASK}), "cluster.chief"),
        (_raw({"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": GOOD_TASK}), "cluster.ps"),
        (_raw({"cluster": {"evaluator": ["e:1"]}, "task": GOOD_TASK}), "no 'chief' or 'worker' task"),
        (_raw({"cluster": GOOD_CLUSTER}), "task must be an object"),
        (_raw({"cluster": GOOD_CLUSTER, "task": {"index": 0}}), "task.type must be 'chief' or 'worker'"),
        (_raw({"cluster": GOOD_CLUSTER, "task": {"type": "ps", "index": 0}}), "not supported"),
        (_raw({"cluster": GOOD_CLUSTER, "task": {"type": "evaluator", "index": 0}}), "task.type 'evaluator'"),
        (_raw({"cluster": GOOD_CLUSTER, "task": {"type": "worker"}}), "task.index must be an int"),
        (_raw({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": "1"}}), "task.index must be an int"),
        (_raw({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": True}}), "task.index must be an int"),
        (
            _raw({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": 3}}),
            "task.index 3 is out of range for 2 'worker' tasks",
        ),
        (
            _raw({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": -1}}),
            "task.index -1 is out of range",
        ),
        (
            _raw({"cluster": GOOD_CLUSTER, "task": {"type": "chief", "index": 0}}),
            "out of range for 0 'chief' tasks",
        ),
    ],
)
def test_tf_config_malformed(environ, fragment):
    with pytest.raises(ValueError) as info:
        TFConfigClusterResolver(environ)
    message = str(info.value)
    assert message.startswith("TF_CONFIG"), message
    assert fragment in message, message


def test_tf_config_detected():
    assert TFConfigClusterResolver.detected(_tf_config())
    assert not TFConfigClusterResolver.detected({})
    assert not TFConfigClusterResolver.detected({"TF_CONFIG": ""})
    assert not TFConfigClusterResolver.detected({"TF_CONFIG": json.dumps({"task": GOOD_TASK})})
    assert not TFConfigClusterResolver.detected({"TF_CONFIG": json.dumps({"cluster": {}, "task": GOOD_TASK})})
    assert not TFConfigClusterResolver.detected({"TF_CONFIG": json.dumps({"cluster": {"worker": []}})})
    # a malformed TF_CONFIG is detected, so that building the resolver reports it
    assert TFConfigClusterResolver.detected({"TF_CONFIG": "{oops"})
    assert TFConfigClusterResolver.detected({"TF_CONFIG": json.dumps({"cluster": {"worker": "a:1"}})})


# --- resolve_cluster ---------------------------------------------------------------------


def test_resolve_nothing_set_is_one_local_worker():
    r = resolve_cluster({})
    assert type(r) is SimpleClusterResolver
    assert (r.num_workers, r.worker_index, r.master_port) == (1, 0, 0)


def test_resolve_torchrun():
    assert type(resolve_cluster(_torchrun())) is TorchrunClusterResolver
    assert type(resolve_cluster({"RANK": "0", "WORLD_SIZE": "1"})) is TorchrunClusterResolver


def test_resolve_tf_config():
    assert type(resolve_cluster(_tf_config())) is TFConfigClusterResolver


def test_resolve_torchrun_wins_over_tf_config():
    r = resolve_cluster({**_tf_config(), **_torchrun()})
    assert type(r) is TorchrunClusterResolver
    assert r.num_workers == 4


def test_resolve_reports_a_malformed_environment():
    with pytest.raises(ValueError, match="RANK"):
        resolve_cluster({"TORCHELASTIC_RUN_ID": "x"})
    with pytest.raises(ValueError, match="TF_CONFIG"):
        resolve_cluster({"TF_CONFIG": "{oops"})


def test_resolve_tf_config_without_a_cluster_is_local():
    r = resolve_cluster({"TF_CONFIG": json.dumps({"cluster": {}, "task": {}})})
    assert type(r) is SimpleClusterResolver and r.num_workers == 1


def test_resolve_defaults_to_os_environ(monkeypatch):
    # No mutation of os.environ: resolve_cluster(None) must look at the same mapping.
    seen = []
    monkeypatch.setattr(cr, "_environ", lambda environ: seen.append(environ) or {})
    assert resolve_cluster().num_workers == 1
    assert seen[0] is None


def test_default_environ_is_os_environ():
    assert cr._environ(None) is os.environ


# --- repr --------------------------------------------------------------------------------


def test_repr_shows_the_fields():
    text = repr(SimpleClusterResolver(2, 1, "h", 99, devices=["cpu:0", "cpu:1"]))
    assert text == (
        "SimpleClusterResolver(num_workers=2, worker_index=1, master_address='h', master_port=99, "
        "task_type='worker', task_id=1, local_rank=0, local_world_size=1, devices=['cpu:0', 'cpu:1'])"
    )
    assert repr(TorchrunClusterResolver(_torchrun())).startswith(
        "TorchrunClusterResolver(num_workers=4, worker_index=3, master_address='10.0.0.1', master_port=29500, "
    )
    assert "task_type='worker', task_id=1" in repr(TFConfigClusterResolver(_tf_config()))
    assert repr(resolve_cluster({})).endswith("devices=None)")


def test_local_gpus_matches_torch():
    expected = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    assert cr._local_gpus() == expected
