"""Device names: torch and TensorFlow spellings, availability errors, logical CPUs."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_gpus

import replicafit.strategies as ds
from replicafit.strategies.devices import canonicalize, canonicalize_list, torch_device

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.fixture
def restore_cpu_count():
    before = ds.get_logical_cpu_count()
    yield before
    ds.set_logical_cpu_count(before)
    assert ds.get_logical_cpu_count() == before


@pytest.mark.parametrize(
    "spec, canonical",
    [
        ("cpu", "cpu:0"),
        ("cpu:0", "cpu:0"),
        ("CPU:1", "cpu:1"),
        ("Cpu:1", "cpu:1"),
        ("/cpu:0", "cpu:0"),
        ("/CPU:1", "cpu:1"),
        ("/device:CPU:0", "cpu:0"),
        ("/device:cpu:1", "cpu:1"),
        ("/job:localhost/replica:0/task:0/device:CPU:0", "cpu:0"),
        ("/job:localhost/replica:0/task:0/device:CPU:1", "cpu:1"),
        (torch.device("cpu"), "cpu:0"),
        (torch.device("cpu", 1), "cpu:1"),
    ],
)
def test_canonical_spellings(spec, canonical):
    assert canonicalize(spec) == canonical


def test_canonical_devices_reach_the_strategies():
    strategy = ds.MirroredStrategy(["/job:localhost/replica:0/task:0/device:CPU:0", "CPU:1"])
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1")
    assert ds.OneDeviceStrategy(torch.device("cpu")).extended.worker_devices == ("cpu:0",)
    assert ds.OneDeviceStrategy("/cpu:1").extended.worker_devices == ("cpu:1",)


def test_logical_cpus_share_host_memory():
    assert torch_device("cpu:0") == torch.device("cpu")
    assert torch_device("cpu:1") == torch.device("cpu")


@pytest.mark.skipif(HAS_GPU, reason="checks the error raised when there is no GPU")
@pytest.mark.parametrize("spec", ["GPU:0", "gpu:0", "/gpu:0", "/device:GPU:0", "cuda:0", "cuda:1", "cuda"])
def test_gpu_without_gpus_names_what_is_available(spec):
    with pytest.raises(ValueError) as info:
        canonicalize(spec)
    message = str(info.value)
    assert spec in message  # names the device
    assert "cpu:0" in message  # and what is available
    assert "available" in message.lower()


@pytest.mark.skipif(HAS_GPU, reason="checks the error raised when there is no GPU")
def test_strategies_refuse_missing_gpus():
    with pytest.raises(ValueError, match="cuda:0"):
        ds.OneDeviceStrategy("cuda:0")
    with pytest.raises(ValueError, match="GPU:0"):
        ds.MirroredStrategy(["GPU:0", "GPU:1"])


@pytest.mark.gpu
@requires_gpus(1)
def test_gpu_spellings_with_a_gpu():
    assert canonicalize("GPU:0") == "cuda:0"
    assert canonicalize("/gpu:0") == "cuda:0"
    assert canonicalize("/job:localhost/replica:0/task:0/device:GPU:0") == "cuda:0"
    assert canonicalize(torch.device("cuda", 0)) == "cuda:0"
    assert torch_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.parametrize("spec", ["tpu:0", "TPU:0", "/device:TPU:0", "xla:0", "", "cpu:0:1", "cpu:-1", "cpu:x"])
def test_unknown_devices(spec):
    with pytest.raises(ValueError) as info:
        canonicalize(spec)
    assert repr(spec) in str(info.value) or spec in str(info.value)
    assert "cpu:0" in str(info.value)  # says what is available


@pytest.mark.parametrize("spec", [3, None, 1.5, ["cpu:0"]])
def test_non_device_types(spec):
    with pytest.raises(ValueError):
        canonicalize(spec)


def test_cpu_index_out_of_range():
    with pytest.raises(ValueError) as info:
        canonicalize("cpu:9999")
    assert "cpu:9999" in str(info.value)
    assert "cpu:0" in str(info.value)
    with pytest.raises(ValueError, match="cpu:9999"):
        ds.MirroredStrategy(["cpu:0", "cpu:9999"])
    with pytest.raises(ValueError, match="cpu:9999"):
        ds.OneDeviceStrategy("cpu:9999")


@pytest.mark.skipif(HAS_GPU, reason="without GPUs the default is the host")
def test_mirrored_default_devices_without_gpus():
    assert ds.MirroredStrategy().extended.worker_devices == ("cpu:0",)
    assert ds.MirroredStrategy().num_replicas_in_sync == 1
    assert ds.MirroredStrategy([]).extended.worker_devices == ("cpu:0",)
    assert ds.CentralStorageStrategy().extended.worker_devices == ("cpu:0",)
    assert ds.CentralStorageStrategy().extended.parameter_devices == ("cpu:0",)


@pytest.mark.gpu
@requires_gpus(1)
def test_mirrored_default_devices_with_gpus():
    expected = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    assert ds.MirroredStrategy().extended.worker_devices == expected


@pytest.mark.parametrize(
    "devices",
    [["cpu:0", "cpu:0"], ["cpu:0", "/device:CPU:0"], ["cpu", "cpu:0"], ["cpu:1", "CPU:0", "cpu:1"]],
)
def test_duplicate_devices(devices):
    with pytest.raises(ValueError, match="[Dd]uplicate"):
        ds.MirroredStrategy(devices)
    with pytest.raises(ValueError, match="[Dd]uplicate"):
        ds.CentralStorageStrategy(devices)
    with pytest.raises(ValueError, match="[Dd]uplicate"):
        canonicalize_list(devices)


def test_canonicalize_list():
    assert canonicalize_list(["CPU:0", "/cpu:1"]) == ("cpu:0", "cpu:1")
    assert canonicalize_list("cpu:1") == ("cpu:1",)
    with pytest.raises(ValueError):
        canonicalize_list([])


def test_list_logical_devices(restore_cpu_count):
    devices = ds.list_logical_devices()
    cpus = [d for d in devices if d.startswith("cpu:")]
    assert cpus == [f"cpu:{i}" for i in range(ds.get_logical_cpu_count())]
    assert devices[: len(cpus)] == cpus  # CPUs first
    gpus = [d for d in devices if d.startswith("cuda:")]
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_default_logical_cpu_count_allows_eight_replicas():
    assert ds.get_logical_cpu_count() >= 8
    assert canonicalize("cpu:7") == "cpu:7"


def test_set_logical_cpu_count(restore_cpu_count):
    ds.set_logical_cpu_count(3)
    assert ds.get_logical_cpu_count() == 3
    assert canonicalize("cpu:2") == "cpu:2"
    with pytest.raises(ValueError, match="cpu:3"):
        canonicalize("cpu:3")
    assert [d for d in ds.list_logical_devices() if d.startswith("cpu")] == ["cpu:0", "cpu:1", "cpu:2"]

    ds.set_logical_cpu_count(16)
    assert canonicalize("cpu:15") == "cpu:15"  # the cached rejection is not kept
    assert canonicalize("CPU:12") == "cpu:12"
    strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(16)])
    assert strategy.num_replicas_in_sync == 16

    ds.set_logical_cpu_count(2)
    with pytest.raises(ValueError, match="cpu:12"):
        canonicalize("cpu:12")  # a previously accepted name is checked again
    # strategies already built keep their devices
    assert strategy.extended.worker_devices[-1] == "cpu:15"


@pytest.mark.parametrize("count", [0, -1, 2.0, True, "4", None])
def test_set_logical_cpu_count_validation(restore_cpu_count, count):
    with pytest.raises(ValueError):
        ds.set_logical_cpu_count(count)
    assert ds.get_logical_cpu_count() == restore_cpu_count


# --- logical GPUs (set_logical_device_configuration), the naming checked without a GPU ---------------


@pytest.fixture
def two_physical_gpus(monkeypatch):
    """Names as a two-GPU machine would have them (only names and placements: nothing runs on them)."""
    from replicafit.strategies import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 2)
    devices._clear_caches()
    yield devices
    devices._gpu_split.clear()
    devices._clear_caches()
    monkeypatch.undo()
    devices._clear_caches()


def test_a_split_gpu_gives_logical_gpus_numbered_as_tensorflow_numbers_them(two_physical_gpus):
    assert [d for d in ds.list_logical_devices() if d.startswith("cuda")] == ["cuda:0", "cuda:1"]
    ds.set_logical_device_configuration("GPU:0", 2)
    assert ds.get_logical_device_configuration("cuda:0") == 2
    assert ds.get_logical_device_configuration("/gpu:1") == 1
    assert [d for d in ds.list_logical_devices() if d.startswith("cuda")] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [torch_device(f"cuda:{i}") for i in range(3)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert canonicalize("GPU:2") == "cuda:2"
    assert canonicalize(torch.device("cuda", 1)) == "cuda:2"  # a torch.device is a physical GPU
    assert canonicalize(torch.device("cuda", 0)) == "cuda:0"
    with pytest.raises(ValueError, match="cuda:3") as info:
        canonicalize("cuda:3")
    assert "logical GPUs on 2 physical" in str(info.value)
    assert canonicalize_list(["cuda:0", "cuda:1"]) == ("cuda:0", "cuda:1")  # two devices, one GPU
    ds.set_logical_device_configuration("cuda:0", 1)  # undone
    assert [torch_device(f"cuda:{i}") for i in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="cuda:2"):
        canonicalize("cuda:2")


def test_logical_gpus_sharing_a_gpu_are_reduced_on_it_not_by_nccl(two_physical_gpus, monkeypatch):
    from replicafit.strategies import mirrored

    monkeypatch.setattr(mirrored, "_nccl_available", lambda: True)
    assert isinstance(mirrored._default_cross_device_ops(("cuda:0", "cuda:1")), ds.NcclAllReduce)
    ds.set_logical_device_configuration("cuda:0", 2)
    assert isinstance(mirrored._default_cross_device_ops(("cuda:0", "cuda:1")), ds.ReductionToOneDevice)
    assert isinstance(mirrored._default_cross_device_ops(("cuda:1", "cuda:2")), ds.NcclAllReduce)
    assert mirrored.local_gpus() == ["cuda:0", "cuda:1", "cuda:2"]  # MirroredStrategy()'s default devices


def test_logical_device_configuration_errors(two_physical_gpus, restore_cpu_count):
    for count in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive int"):
            ds.set_logical_device_configuration("cuda:0", count)
    with pytest.raises(ValueError, match="cuda:0 ... cuda:1"):
        ds.set_logical_device_configuration("cuda:2", 2)
    with pytest.raises(ValueError, match="physical 'cpu' or 'cuda:N'"):
        ds.set_logical_device_configuration("tpu:0", 2)
    ds.set_logical_device_configuration("CPU:0", 3)  # the CPU: the number of logical CPUs
    assert ds.get_logical_cpu_count() == 3 == ds.get_logical_device_configuration("cpu")


@pytest.mark.skipif(HAS_GPU, reason="checks the error raised when there is no GPU")
def test_splitting_a_gpu_without_one_says_so():
    with pytest.raises(ValueError, match="no CUDA device"):
        ds.set_logical_device_configuration("cuda:0", 2)
