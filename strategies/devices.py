"""Device names: parsing torch and TensorFlow spellings into one canonical form.

Every device in this package is a canonical string ``"cpu:N"`` or ``"cuda:N"``
(``"mps:0"`` where Apple's backend exists). ``"cpu:0"``, ``"cpu:1"``, ... are
*logical* CPU devices: distinct replicas that all live in host memory, exactly as
TensorFlow's logical CPU devices (``tf.config.set_logical_device_configuration``).
How many exist is set with :func:`set_logical_cpu_count` (default: 8, or the
number of cores if larger).

``"cuda:N"`` are GPUs: one per physical GPU unless a GPU is split into several *logical*
GPUs with :func:`set_logical_device_configuration` (TensorFlow's function of that name):
several replicas on one physical GPU, each with its own computation, numbered
consecutively over the physical GPUs as TensorFlow numbers its logical GPUs.

Example::

    >>> canonicalize("/job:localhost/replica:0/task:0/device:CPU:1")
    'cpu:1'
    >>> canonicalize("GPU:0")  # doctest: +SKIP
    'cuda:0'
    >>> torch_device("cpu:3")
    device(type='cpu')
"""

from __future__ import annotations

import functools
import os
import re

import torch

__all__ = [
    "canonicalize",
    "canonicalize_list",
    "torch_device",
    "list_logical_devices",
    "set_logical_cpu_count",
    "get_logical_cpu_count",
    "set_logical_device_configuration",
    "get_logical_device_configuration",
    "default_device",
]

_logical_cpus = max(8, os.cpu_count() or 1)

_TF_FULL = re.compile(r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?/device:([a-z_]+):(\d+)$")
_SHORT = re.compile(r"^/?([a-z_]+)(?::(\d+))?$")
_TYPE_ALIASES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps"}


def set_logical_cpu_count(count: int) -> None:
    """Sets how many logical CPU devices (``cpu:0`` ... ``cpu:{count-1}``) exist.

    The counterpart of TensorFlow's ``tf.config.set_logical_device_configuration``
    for CPUs. Strategies already built keep their devices.

    Example::

        ds.set_logical_cpu_count(16)
        strategy = ds.MirroredStrategy([f"cpu:{i}" for i in range(16)])
    """
    global _logical_cpus
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"set_logical_cpu_count() needs a positive int, got {count!r}.")
    _logical_cpus = count
    _clear_caches()


def get_logical_cpu_count() -> int:
    """Returns the number of logical CPU devices (see :func:`set_logical_cpu_count`)."""
    return _logical_cpus


def _cuda_count() -> int:
    """Physical CUDA devices of this process."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_gpu_split: dict[int, int] = {}  # physical GPU index -> number of logical GPUs on it (absent: 1)


def _logical_gpus() -> list[int]:
    """The physical GPU index of each logical GPU ``cuda:0``, ``cuda:1``, ... (identity unless split)."""
    physical = []
    for index in range(_cuda_count()):
        physical += [index] * _gpu_split.get(index, 1)
    return physical


def _clear_caches() -> None:
    _canonicalize_str.cache_clear()
    torch_device.cache_clear()


def set_logical_device_configuration(device, count: int) -> None:
    """Splits a physical device into ``count`` logical devices (``tf.config.set_logical_device_configuration``).

    ``device`` names a physical device: ``"cuda:N"`` (``"GPU:N"``) or ``"cpu"``. A GPU split in
    ``count`` gives ``count`` logical GPUs on it, each a replica device of its own with its own
    computation, variables and random stream, sharing the GPU's memory and its stream: what
    several GPUs would do, on one (to test multi-GPU code, or to train as a multi-GPU run would on
    a one-GPU machine). Logical GPUs are numbered consecutively over the physical GPUs, as
    TensorFlow numbers them: split ``cuda:0`` of a two-GPU machine in 2 and the logical GPUs are
    ``cuda:0``, ``cuda:1`` (physical 0) and ``cuda:2`` (physical 1). ``count=1`` undoes the split.
    For the CPU it sets the number of logical CPUs (:func:`set_logical_cpu_count`). Strategies
    already built keep their devices.

    Replicas that share a physical GPU take turns on it, as logical CPUs do on the host, and
    are reduced on the GPU (``ReductionToOneDevice``; NCCL needs distinct GPUs).

    Differences from TensorFlow: ``count`` is a number rather than a list of
    ``LogicalDeviceConfiguration`` (no per-device memory limit: torch's caching allocator is
    shared by the logical GPUs of one physical GPU), and it may be changed at any time rather than
    only before the runtime starts. A ``torch.device("cuda", k)`` always means physical GPU ``k``
    (its first logical GPU where it is split); a string ``"cuda:N"`` names logical GPU ``N``.

    Example::

        ds.set_logical_device_configuration("cuda:0", 2)
        strategy = ds.MirroredStrategy(["cuda:0", "cuda:1"])   # two replicas on the one GPU
        ds.set_logical_device_configuration("cuda:0", 1)       # back to one GPU, one device
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"set_logical_device_configuration() needs a positive int count, got {count!r}.")
    kind, index = _physical(device)
    if kind == "cpu":
        set_logical_cpu_count(count)
        return
    if count == 1:
        _gpu_split.pop(index, None)
    else:
        _gpu_split[index] = count
    _clear_caches()


def get_logical_device_configuration(device) -> int:
    """How many logical devices the physical ``device`` (``"cuda:N"``, ``"cpu"``) is split into.

    Example::

        >>> get_logical_device_configuration("cpu") == get_logical_cpu_count()
        True
    """
    kind, index = _physical(device)
    return _logical_cpus if kind == "cpu" else _gpu_split.get(index, 1)


def _physical(device) -> tuple[str, int]:
    """``("cpu", 0)`` or ``("cuda", physical index)`` of a physical device's name."""
    if isinstance(device, torch.device):
        device = device.type if device.index is None else f"{device.type}:{device.index}"
    kind, index = _parse(device) if isinstance(device, str) else (None, None)
    if kind == "cpu":
        return "cpu", 0
    if kind == "cuda":
        index = index or 0
        if index < _cuda_count():
            return "cuda", index
        raise ValueError(
            f"Cannot configure {device!r}: this process has "
            + (f"CUDA devices cuda:0 ... cuda:{_cuda_count() - 1}." if _cuda_count() else "no CUDA device.")
        )
    raise ValueError(f"Logical devices are configured on a physical 'cpu' or 'cuda:N' device, got {device!r}.")


def _parse(spec: str) -> tuple:
    """``(kind, index or None)`` of a torch or TensorFlow spelling; ``(None, None)`` if it is none."""
    text = spec.strip().lower()
    match = _TF_FULL.match(text) or _SHORT.match(text)
    if match is None or match.group(1) not in _TYPE_ALIASES:
        return None, None
    return _TYPE_ALIASES[match.group(1)], None if match.group(2) is None else int(match.group(2))


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def list_logical_devices() -> list[str]:
    """Every device a strategy may use here, canonical spelling, CPUs first.

    Example::

        >>> list_logical_devices()[:2]
        ['cpu:0', 'cpu:1']
    """
    devices = [f"cpu:{i}" for i in range(_logical_cpus)]
    devices += [f"cuda:{i}" for i in range(len(_logical_gpus()))]
    if _mps_available():
        devices.append("mps:0")
    return devices


def _available_text() -> str:
    gpus = len(_logical_gpus())
    text = (
        f"cpu:0 ... cpu:{_logical_cpus - 1} (logical CPUs; replicafit.strategies.set_logical_cpu_count() sets how many)"
    )
    text += f", cuda:0 ... cuda:{gpus - 1}" if gpus else ", and no CUDA device"
    if _gpu_split:
        text += f" (logical GPUs on {_cuda_count()} physical; set_logical_device_configuration() splits a GPU)"
    return text


@functools.lru_cache(maxsize=256)
def _canonicalize_str(spec: str) -> str:
    kind, index = _parse(spec)
    if kind is None:
        raise ValueError(
            f"Unknown device {spec!r}: expected a torch or TensorFlow device name such as "
            f"'cpu:0', 'cuda:1', 'GPU:0' or '/job:localhost/replica:0/task:0/device:CPU:0'. "
            f"Available devices: {_available_text()}."
        )
    if index is None:  # "cuda": the current GPU (its first logical one); "cpu": cpu:0
        index = _logical_gpus().index(torch.cuda.current_device()) if kind == "cuda" and _cuda_count() else 0
    limit = {"cpu": _logical_cpus, "cuda": len(_logical_gpus()), "mps": 1 if _mps_available() else 0}[kind]
    if index >= limit:
        raise ValueError(f"Device {spec!r} is not available. Available devices: {_available_text()}.")
    return f"{kind}:{index}"


def canonicalize(device) -> str:
    """Returns the canonical ``"type:index"`` name of ``device``.

    Accepts torch spellings (``"cpu"``, ``"cuda:1"``, ``torch.device``), TensorFlow
    spellings (``"GPU:0"``, ``"/gpu:0"``, ``"CPU:1"``, ``"/device:CPU:0"``,
    ``"/job:localhost/replica:0/task:0/device:CPU:0"``), case-insensitively.
    ``"cpu"`` means ``"cpu:0"`` and ``"cuda"`` the current CUDA device.
    Raises ``ValueError`` naming the device and what is available when it is unknown
    or not present on this machine.
    """
    if isinstance(device, torch.device):
        if device.type == "cuda" and device.index is not None and _gpu_split:
            physical = device.index  # a torch.device is a physical GPU: its first logical GPU
            if physical >= _cuda_count():
                raise ValueError(f"Device {device!r} is not available. Available devices: {_available_text()}.")
            return f"cuda:{_logical_gpus().index(physical)}"
        device = device.type if device.index is None else f"{device.type}:{device.index}"
    if not isinstance(device, str):
        raise ValueError(f"A device must be a string or torch.device, got {type(device).__name__}: {device!r}.")
    return _canonicalize_str(device)


canonicalize.cache_clear = _clear_caches  # type: ignore[attr-defined]


def canonicalize_list(devices, what: str = "devices") -> tuple[str, ...]:
    """Canonicalizes a list of devices; rejects an empty list and duplicates."""
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    result = tuple(canonicalize(d) for d in devices)
    if not result:
        raise ValueError(f"`{what}` must name at least one device.")
    duplicates = sorted({d for d in result if result.count(d) > 1})
    if duplicates:
        raise ValueError(f"No duplicates allowed in `{what}` argument: {list(devices)!r} names {duplicates} twice.")
    return result


@functools.lru_cache(maxsize=256)
def torch_device(device: str) -> torch.device:
    """The ``torch.device`` holding the memory of a canonical device.

    Logical CPUs all map to ``torch.device("cpu")``, logical GPUs to their physical GPU.
    """
    kind, _, index = canonicalize(device).partition(":")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", _logical_gpus()[int(index)])
    return torch.device(kind, int(index))


def default_device() -> str:
    """The canonical name of torch's current default device (the default strategy's)."""
    getter = getattr(torch, "get_default_device", None)
    dev = getter() if getter is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return canonicalize(dev)
