"""Cluster resolvers: who the workers are, which one this process is, where they meet.

A ``MultiWorkerMirroredStrategy`` runs the same program in every worker process. A
cluster resolver answers, for this process: how many workers there are
(``num_workers``), which one it is (``worker_index``, the global rank), where the
rendezvous store lives (``master_address``/``master_port``, hosted by worker 0) and which
devices its replicas use (``local_devices()``). The names follow TensorFlow's
``tf.distribute.cluster_resolver`` (``ClusterResolver``, ``SimpleClusterResolver``,
``TFConfigClusterResolver``, ``task_type``, ``task_id``, ``cluster_spec()``); torch's
launcher gets ``TorchrunClusterResolver``, SLURM's ``srun`` ``SlurmClusterResolver`` (``slurm.py``).

**Environment variables.** The library reads the environment in the recipe loader only; the
cluster resolvers are the one sanctioned exception (as TensorFlow reads ``TF_CONFIG`` in
``TFConfigClusterResolver``). Nothing else in the library touches ``os.environ``. Every
resolver takes ``environ`` (a mapping, default ``os.environ``) so that tests and tools can
describe an environment without mutating the real one; it is read once, when the resolver
is built.

Example::

    >>> env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    >>> resolve_cluster(env)
    TorchrunClusterResolver(num_workers=2, worker_index=1, master_address='10.0.0.1', master_port=29500, \
task_type='worker', task_id=1, local_rank=0, local_world_size=1, devices=None)
    >>> resolve_cluster({}).num_workers            # nothing set: one local worker
    1
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

from .devices import canonicalize_list, list_logical_devices

__all__ = [
    "ClusterResolver",
    "SimpleClusterResolver",
    "TorchrunClusterResolver",
    "TFConfigClusterResolver",
    "resolve_cluster",
]

_DEFAULT_ADDRESS = "127.0.0.1"
_INT = re.compile(r"^[+-]?\d+$")
# Task types that take part in MultiWorkerMirroredStrategy's collectives, in worker order.
_COLLECTIVE_TASKS = ("chief", "worker")


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    if environ is None:
        return os.environ
    if not isinstance(environ, Mapping):
        raise ValueError(f"`environ` must be a mapping of variable names to strings or None, got {environ!r}.")
    return environ


def _local_gpus() -> list[str]:
    """The visible CUDA devices, canonical spelling (a function so that tests can replace it)."""
    return [d for d in list_logical_devices() if d.startswith("cuda:")]


def _gpu_devices(local_rank: int, local_world_size: int, hint: str) -> tuple[str, ...] | None:
    """The GPUs a worker uses when no ``devices`` were given; ``None`` without CUDA.

    Several processes per node: ``cuda:LOCAL_RANK`` (DDP's convention). One process per
    node: every visible GPU (TensorFlow's convention).
    """
    gpus = _local_gpus()
    if not gpus:
        return None
    if local_world_size == 1:
        return tuple(gpus)
    if local_rank >= len(gpus):
        raise ValueError(
            f"{hint}: local rank {local_rank} of {local_world_size} processes on this node needs its own GPU "
            f"(cuda:{local_rank}), but only {len(gpus)} CUDA device(s) are visible ({', '.join(gpus)}). "
            f"Start at most {len(gpus)} processes per node, or pass devices=[...] to the cluster resolver."
        )
    return (f"cuda:{local_rank}",)


def _check_int(value, name: str, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}.")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"`{name}` must be {expected}, got {value}.")
    return value


def _check_devices(devices) -> tuple[str, ...] | None:
    if devices is None:
        return None
    if isinstance(devices, (list, tuple)) and not devices:
        raise ValueError("`devices` must name at least one device (or be None to let the strategy decide).")
    return canonicalize_list(devices, "devices")


class ClusterResolver:
    """Base class: the cluster as seen from one worker process.

    Properties: ``num_workers``, ``worker_index`` (global rank of this process, 0-based),
    ``master_address``/``master_port`` (the rendezvous store, hosted by worker 0;
    port ``0`` when there is one worker and no store is needed), ``task_type``
    (``"worker"`` or ``"chief"``), ``task_id``, ``local_rank``/``local_world_size``
    (this process among the workers on its node), ``is_chief`` (worker 0, the one that
    writes files). Methods: ``cluster_spec()`` and ``local_devices()``.

    Use one of the subclasses (``SimpleClusterResolver``, ``TorchrunClusterResolver``,
    ``TFConfigClusterResolver``) or subclass it and call ``super().__init__`` with the
    fields. Unlike TensorFlow's abstract ``ClusterResolver``, the fields are plain values
    fixed when the resolver is built, and ``master_address``/``master_port`` replace
    ``master()`` (torch rendezvous through a store, not a gRPC target).

    Example::

        >>> r = SimpleClusterResolver(2, 0, "127.0.0.1", 29500)
        >>> r.num_workers, r.worker_index, r.is_chief, r.cluster_spec()
        (2, 0, True, {'worker': ['127.0.0.1:29500', '<unknown>']})
    """

    def __init__(
        self,
        *,
        num_workers: int,
        worker_index: int,
        master_address: str,
        master_port: int,
        task_type: str = "worker",
        task_id: int | None = None,
        local_rank: int = 0,
        local_world_size: int = 1,
        devices: tuple[str, ...] | None = None,
        attempt: int = 0,
        shared_store: bool = False,
    ) -> None:
        self._attempt = attempt
        self._shared_store = shared_store
        self._num_workers = num_workers
        self._worker_index = worker_index
        self._master_address = master_address
        self._master_port = master_port
        self._task_type = task_type
        self._task_id = worker_index if task_id is None else task_id
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        self._devices = devices

    @property
    def num_workers(self) -> int:
        """How many worker processes take part (in TensorFlow's terms, the ``chief`` plus the ``worker`` tasks)."""
        return self._num_workers

    @property
    def worker_index(self) -> int:
        """This process' global rank, ``0 <= worker_index < num_workers``."""
        return self._worker_index

    @property
    def master_address(self) -> str:
        """Host of the rendezvous store (worker 0's host)."""
        return self._master_address

    @property
    def master_port(self) -> int:
        """Port of the rendezvous store; ``0`` for a single worker that needs no store."""
        return self._master_port

    @property
    def task_type(self) -> str:
        """``"chief"`` or ``"worker"`` (TensorFlow's task type)."""
        return self._task_type

    @property
    def task_id(self) -> int:
        """Index of this task among the tasks of its ``task_type``."""
        return self._task_id

    @property
    def local_rank(self) -> int:
        """Index of this process among the worker processes on its node."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """How many worker processes run on this node."""
        return self._local_world_size

    @property
    def attempt(self) -> int:
        """This worker's count of restarts, 0 at first and one more each time its launcher restarted it
        (torchrun's ``TORCHELASTIC_RESTART_COUNT``). Only a count: under an elastic rendezvous each agent counts
        its own restarts, so the workers of one start may hold different counts (``shared_store`` says how they
        meet)."""
        return self._attempt

    @property
    def shared_store(self) -> bool:
        """True where the store at ``master_address:master_port`` is the launcher's own, shared by every start of
        the job (torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE``); then the workers of each start meet
        in a store worker 0 starts for them, whose port it notes there. False where worker 0 hosts it (the
        ``--workers`` launcher, SLURM, ``TF_CONFIG``)."""
        return self._shared_store

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0, the one that writes checkpoints and logs."""
        return self._worker_index == 0

    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster as TensorFlow spells it, ``{"worker": ["host:port", ...]}``, as best known.

        Worker 0 is the store's ``host:port`` (just ``host`` when there is no store); the
        addresses of other workers are not known to a torch rendezvous and read
        ``"<unknown>"``. ``TFConfigClusterResolver`` returns its ``chief``/``worker`` lists.
        """
        first = f"{self._master_address}:{self._master_port}" if self._master_port else self._master_address
        return {"worker": [first] + ["<unknown>"] * (self._num_workers - 1)}

    def local_devices(self) -> tuple[str, ...] | None:
        """The devices this worker's replicas use (``"cpu:0"``, ``"cuda:1"``, ...).

        ``None`` lets the strategy decide (every visible GPU, else ``"cpu:0"``).
        """
        return self._devices

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_workers={self._num_workers}, worker_index={self._worker_index}, "
            f"master_address={self._master_address!r}, master_port={self._master_port}, "
            f"task_type={self._task_type!r}, task_id={self._task_id}, local_rank={self._local_rank}, "
            f"local_world_size={self._local_world_size}, devices={list(self._devices) if self._devices else None})"
        )


class SimpleClusterResolver(ClusterResolver):
    """A cluster given explicitly: ``num_workers`` processes, this one is ``worker_index``.

    Args:
      num_workers: how many worker processes take part (an int >= 1).
      worker_index: this process' rank, ``0 <= worker_index < num_workers``.
      address: host of worker 0, where the rendezvous store listens.
      port: the store's port (1..65535); required when ``num_workers > 1``.
      devices: this worker's devices (``["cpu:0", "cpu:1"]`` for two logical-CPU replicas),
        any spelling ``devices.canonicalize`` accepts; ``None`` lets the strategy decide.

    Differs from TensorFlow's ``SimpleClusterResolver(cluster_spec, master, task_type,
    task_id, ...)``: torch workers meet at one store, so the address and port of worker 0
    are all that is needed, not every task's address.

    Example (one process per worker)::

        resolver = SimpleClusterResolver(2, worker_index, "127.0.0.1", 29500, devices=["cpu:0"])
        strategy = ds.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    """

    def __init__(
        self,
        num_workers: int,
        worker_index: int,
        address: str = _DEFAULT_ADDRESS,
        port: int | None = None,
        devices=None,
    ) -> None:
        _check_int(num_workers, "num_workers", 1)
        _check_int(worker_index, "worker_index", 0)
        if worker_index >= num_workers:
            raise ValueError(
                f"`worker_index` must be in 0..{num_workers - 1} for num_workers={num_workers}, got {worker_index}."
            )
        if not isinstance(address, str) or not address.strip():
            raise ValueError(f"`address` must be a non-empty host name or IP address, got {address!r}.")
        if port is None:
            if num_workers > 1:
                raise ValueError(
                    f"`port` is required with num_workers={num_workers}: the port (1..65535) on which worker 0 "
                    f"at {address!r} hosts the rendezvous store, the same on every worker."
                )
            port = 0
        else:
            _check_int(port, "port", 1, 65535)
        super().__init__(
            num_workers=num_workers,
            worker_index=worker_index,
            master_address=address.strip(),
            master_port=port,
            devices=_check_devices(devices),
        )


def _env_int(env: Mapping[str, str], name: str, low: int, default: int | None = None) -> int:
    """An integer environment variable, >= ``low``; ``default`` when absent (required when None)."""
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ValueError(
                f"{name} is not set: TorchrunClusterResolver reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                f"(and LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; launch with torchrun or set {name}."
            )
        return default
    text = str(raw).strip()
    if not _INT.match(text) or int(text) < low:
        what = "a non-negative integer" if low == 0 else f"an integer >= {low}"
        raise ValueError(f"{name}={raw!r} is malformed: expected {what}.")
    return int(text)


class TorchrunClusterResolver(ClusterResolver):
    """The cluster that ``torchrun`` (or ``replicafit fit --workers N``) describes in the environment.

    Reads ``RANK`` (→ ``worker_index``), ``WORLD_SIZE`` (→ ``num_workers``), ``LOCAL_RANK``
    and ``LOCAL_WORLD_SIZE`` (default 0 and 1 when absent), ``MASTER_ADDR`` (default
    ``"127.0.0.1"``) and ``MASTER_PORT`` (required when ``WORLD_SIZE > 1``). Malformed
    values raise ``ValueError`` naming the variable, its value and what is expected.

    ``local_devices()``: the ``devices`` argument if given; else, with CUDA,
    ``cuda:LOCAL_RANK`` when several processes share a node (DDP's convention) or every
    visible GPU when one process runs per node (TensorFlow's); else ``None`` (the strategy
    uses ``"cpu:0"``). ``task_type`` is ``"worker"`` and ``task_id`` the rank.

    Example::

        # torchrun --nnodes 1 --nproc-per-node 2 train.py
        resolver = TorchrunClusterResolver()        # RANK=1 in the second process
        resolver.worker_index, resolver.num_workers  # (1, 2)
    """

    def __init__(self, environ: Mapping[str, str] | None = None, devices=None) -> None:
        env = _environ(environ)
        world_size = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        if rank >= world_size:
            raise ValueError(f"RANK={env['RANK']!r} is out of range: expected 0 <= RANK < WORLD_SIZE={world_size}.")
        local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", 1, default=1)
        if local_world_size > world_size:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']!r} is out of range: expected at most "
                f"WORLD_SIZE={world_size} processes on one node."
            )
        local_rank = _env_int(env, "LOCAL_RANK", 0, default=0)
        if local_rank >= local_world_size:
            unset = "" if "LOCAL_WORLD_SIZE" in env else " (1 when LOCAL_WORLD_SIZE is not set)"
            raise ValueError(
                f"LOCAL_RANK={env['LOCAL_RANK']!r} is out of range: expected 0 <= LOCAL_RANK < "
                f"LOCAL_WORLD_SIZE={local_world_size}{unset}."
            )
        address = env.get("MASTER_ADDR", _DEFAULT_ADDRESS).strip()
        if not address:
            raise ValueError("MASTER_ADDR='' is malformed: expected the host name or IP address of rank 0.")
        if "MASTER_PORT" in env or world_size > 1:
            port = _env_int(env, "MASTER_PORT", 1)
            if port > 65535:
                raise ValueError(f"MASTER_PORT={env['MASTER_PORT']!r} is malformed: expected a port in 1..65535.")
        else:
            port = 0
        super().__init__(
            num_workers=world_size,
            worker_index=rank,
            master_address=address,
            master_port=port,
            local_rank=local_rank,
            local_world_size=local_world_size,
            devices=_check_devices(devices),
            attempt=_env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, default=0),
            shared_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true",
        )

    @staticmethod
    def detected(environ: Mapping[str, str] | None = None) -> bool:
        """Whether the environment comes from torchrun.

        ``TORCHELASTIC_RUN_ID`` is set (as ``torch.distributed.is_torchelastic_launched``
        checks), or both ``RANK`` and ``WORLD_SIZE`` are.
        """
        env = _environ(environ)
        return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)

    def local_devices(self) -> tuple[str, ...] | None:
        if self._devices is not None:
            return self._devices
        return _gpu_devices(self._local_rank, self._local_world_size, "LOCAL_RANK/LOCAL_WORLD_SIZE")


def _tf_error(message: str) -> ValueError:
    return ValueError(f"TF_CONFIG: {message}")


def _split_address(address, path: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) → ``(host, port)``."""
    if not isinstance(address, str):
        raise _tf_error(f"{path} must be a 'host:port' string, got {address!r}.")
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _tf_error(f"{path} {address!r} is malformed: expected 'host:port' with a port in 1..65535.")
    return host, int(port)


def _parse_tf_config(text: str) -> tuple[dict[str, list[str]], str, int]:
    """Validates ``TF_CONFIG`` and returns ``(cluster of chief/worker lists, task type, task index)``."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise _tf_error(
            f"is not valid JSON ({error}); expected e.g. "
            '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}.'
        ) from None
    if not isinstance(config, dict):
        raise _tf_error(f"must be a JSON object with 'cluster' and 'task', got {type(config).__name__}.")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict):
        raise _tf_error(f"cluster must be an object mapping task types to 'host:port' lists, got {cluster!r}.")
    for job, addresses in cluster.items():
        if job not in (*_COLLECTIVE_TASKS, "ps", "evaluator"):
            raise _tf_error(f"cluster.{job} is not a task type: expected 'chief', 'worker' (or 'evaluator').")
        if not isinstance(addresses, list):
            raise _tf_error(f"cluster.{job} must be a list of 'host:port' strings, got {addresses!r}.")
        for i, address in enumerate(addresses):
            _split_address(address, f"cluster.{job}[{i}]")
    if cluster.get("ps"):
        raise _tf_error(
            "cluster.ps names parameter servers, which MultiWorkerMirroredStrategy does not use "
            "(TensorFlow's ParameterServerStrategy is not supported); list only 'chief' and 'worker' tasks."
        )
    if len(cluster.get("chief", [])) > 1:
        raise _tf_error(f"cluster.chief must list at most one task, got {len(cluster['chief'])}.")
    ordered = [a.strip() for job in _COLLECTIVE_TASKS for a in cluster.get(job, [])]
    if not ordered:
        raise _tf_error("cluster lists no 'chief' or 'worker' task; expected at least one.")
    duplicates = sorted({a for a in ordered if ordered.count(a) > 1})
    if duplicates:
        raise _tf_error(f"cluster names {duplicates} more than once; every task needs its own 'host:port'.")

    task = config.get("task")
    if not isinstance(task, dict):
        raise _tf_error(f"task must be an object like {{'type': 'worker', 'index': 0}}, got {task!r}.")
    task_type, index = task.get("type"), task.get("index")
    if task_type in ("ps", "evaluator"):
        raise _tf_error(
            f"task.type {task_type!r} is not supported by MultiWorkerMirroredStrategy, which runs only "
            "'chief' and 'worker' tasks (TensorFlow's side-car evaluator and parameter servers are not)."
        )
    if task_type not in _COLLECTIVE_TASKS:
        raise _tf_error(f"task.type must be 'chief' or 'worker', got {task_type!r}.")
    if not isinstance(index, int) or isinstance(index, bool):
        raise _tf_error(f"task.index must be an int, got {index!r}.")
    count = len(cluster.get(task_type, []))
    if not 0 <= index < count:
        raise _tf_error(f"task.index {index} is out of range for {count} {task_type!r} tasks.")
    return {job: [a.strip() for a in cluster[job]] for job in _COLLECTIVE_TASKS if job in cluster}, task_type, index


class TFConfigClusterResolver(ClusterResolver):
    """The cluster that TensorFlow's ``TF_CONFIG`` JSON describes.

    ``TF_CONFIG`` looks like ``{"cluster": {"chief": ["host:port"], "worker": ["host:port", ...]},
    "task": {"type": "worker", "index": 1}}``. Workers are ordered chief first (if any),
    then the workers; ``worker_index`` is this task's position in that order, and the first
    of them (the chief, else worker 0) hosts the rendezvous store on its port.
    ``"evaluator"`` entries in the cluster are ignored (they take no part in the
    collectives); an ``"evaluator"`` or ``"ps"`` task, or ``"ps"`` entries, raise
    ``ValueError``: MultiWorkerMirroredStrategy runs only chief and worker tasks.
    Malformed JSON, missing keys, a bad index or a bad ``"host:port"`` raise ``ValueError``
    naming ``TF_CONFIG`` and the key path.

    ``local_devices()``: the ``devices`` argument if given; else every visible GPU (one
    process per node, TensorFlow's convention); else ``None`` (``"cpu:0"``).

    Example::

        >>> env = {"TF_CONFIG": '{"cluster": {"chief": ["a:2222"], "worker": ["b:2222", "c:2222"]},'
        ...                     ' "task": {"type": "worker", "index": 1}}'}
        >>> r = TFConfigClusterResolver(env)
        >>> r.worker_index, r.num_workers, r.master_address, r.master_port, r.task_type, r.task_id
        (2, 3, 'a', 2222, 'worker', 1)
    """

    def __init__(self, environ: Mapping[str, str] | None = None, devices=None) -> None:
        text = _environ(environ).get("TF_CONFIG")
        if text is None or not str(text).strip():
            raise _tf_error(
                "is not set; expected JSON such as "
                '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}.'
            )
        cluster, task_type, task_id = _parse_tf_config(str(text))
        ordered = [a for job in _COLLECTIVE_TASKS for a in cluster.get(job, [])]
        host, port = _split_address(ordered[0], "cluster.chief[0]" if cluster.get("chief") else "cluster.worker[0]")
        self._cluster = cluster
        super().__init__(
            num_workers=len(ordered),
            worker_index=task_id + (len(cluster.get("chief", [])) if task_type == "worker" else 0),
            master_address=host,
            master_port=port,
            task_type=task_type,
            task_id=task_id,
            devices=_check_devices(devices),
        )

    @staticmethod
    def detected(environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``TF_CONFIG`` is set, non-empty and names a cluster of at least one task.

        A ``TF_CONFIG`` that is not valid JSON counts as detected, so that building the
        resolver reports the mistake instead of silently running one local worker.
        """
        text = _environ(environ).get("TF_CONFIG")
        if text is None or not str(text).strip():
            return False
        try:
            config = json.loads(text)
        except json.JSONDecodeError:
            return True
        if not isinstance(config, dict):
            return True
        cluster = config.get("cluster")
        if not isinstance(cluster, dict):
            return cluster is not None
        return any(not isinstance(tasks, list) or tasks for tasks in cluster.values())

    def cluster_spec(self) -> dict[str, list[str]]:
        """The ``chief`` and ``worker`` lists of ``TF_CONFIG`` (copies)."""
        return {job: list(addresses) for job, addresses in self._cluster.items()}

    def local_devices(self) -> tuple[str, ...] | None:
        if self._devices is not None:
            return self._devices
        return _gpu_devices(0, 1, "TF_CONFIG")


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The cluster this process belongs to, detected from the environment.

    In order: a torchrun environment (``TorchrunClusterResolver``), then a SLURM job step
    (``SlurmClusterResolver``: ``srun`` sets ``SLURM_STEP_ID``; an ``salloc`` shell is one local
    worker), then ``TF_CONFIG`` (``TFConfigClusterResolver``), else one local worker
    (``SimpleClusterResolver(1, 0)``, TensorFlow's local case). This is what
    ``MultiWorkerMirroredStrategy(cluster_resolver=None)`` uses. Half a torchrun environment
    (``RANK`` without ``WORLD_SIZE``, the reverse, or ``LOCAL_RANK`` without them) is a ``ValueError``
    naming what is missing, not one worker training alone as the chief; ``MASTER_ADDR`` and
    ``MASTER_PORT`` alone are harmless (SLURM scripts export them).

    Example::

        >>> resolve_cluster({})
        SimpleClusterResolver(num_workers=1, worker_index=0, master_address='127.0.0.1', master_port=0, \
task_type='worker', task_id=0, local_rank=0, local_world_size=1, devices=None)
    """
    from .slurm import SlurmClusterResolver  # (it builds on this module)

    env = _environ(environ)
    if TorchrunClusterResolver.detected(env):
        return TorchrunClusterResolver(env)
    if SlurmClusterResolver.detected(env):
        return SlurmClusterResolver(environ=env)
    partial = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name in env]
    if partial:
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in env]
        raise ValueError(
            f"{' and '.join(partial)} {'is' if len(partial) == 1 else 'are'} set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: a torchrun environment needs RANK and WORLD_SIZE (and "
            "MASTER_ADDR, MASTER_PORT); set them all, or unset "
            f"{' and '.join(partial)} to run one local worker."
        )
    if TFConfigClusterResolver.detected(env):
        return TFConfigClusterResolver(env)
    return SimpleClusterResolver(1, 0)
