"""``SlurmClusterResolver``: the cluster of a SLURM job step (``srun``), from SLURM's variables.

Every task of ``srun`` is one worker: ``SLURM_PROCID`` is its index, ``SLURM_NTASKS`` the number of
workers, ``SLURM_LOCALID`` its place on its node. The rendezvous store is hosted by worker 0, on the
first host of ``SLURM_STEP_NODELIST`` (SLURM's compressed host lists: ``gpu[07-08]``,
``a[1-3,10],b5``, ``node-[009-011]``), at ``MASTER_PORT`` if set, else at a port derived from the
job id (``port_base + SLURM_JOB_ID % 10000``: every task of the step computes the same one, and two
jobs on one node rarely collide). ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) says how many tasks run
on each node; this task's node is ``SLURMD_NODENAME``, or the block distribution's.

Only a job step is a cluster: an ``salloc`` shell or a batch script has ``SLURM_*`` variables too but
runs one process, so ``detected`` needs ``SLURM_STEP_ID`` (set by ``srun``) and ``resolve_cluster``
tries SLURM only then.

Example::

    >>> env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
    ...        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "4242"}
    >>> r = SlurmClusterResolver(environ=env)
    >>> r.worker_index, r.num_workers, r.master_address, r.master_port, r.local_rank, r.local_world_size
    (3, 4, 'gpu07', 19242, 1, 2)
    >>> expand_hostlist("a[1-3,10],b5")
    ['a1', 'a2', 'a3', 'a10', 'b5']
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from .cluster_resolver import ClusterResolver, _check_devices, _check_int, _environ, _local_gpus

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' without its '['")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError("a '[' without its ']'")
    parts.append(current)
    return parts


def _expand_one(host: str) -> list[str]:
    """One host pattern (``rack[1-2]-n[01-02]``: bracket groups expand as a product, zero padding kept)."""
    pieces = re.split(r"(\[[^\]]*\])", host)
    choices = []
    for piece in pieces:
        if not (piece.startswith("[") and piece.endswith("]")):
            choices.append([piece])
            continue
        values = []
        for item in piece[1:-1].split(","):
            match = _RANGE.match(item.strip())
            if not match:
                raise ValueError(f"{item!r} is not a number or a range such as 07-08")
            first, last = match.group(1), match.group(2) or match.group(1)
            if int(last) < int(first):
                raise ValueError(f"the range {item!r} runs backwards")
            width = len(first) if first.startswith("0") else 0
            values += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
        choices.append(values)
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_hostlist(hostlist: str) -> list[str]:
    """The hosts of a SLURM host list, in order (``"gpu[07-08],c5"`` → ``["gpu07", "gpu08", "c5"]``).

    Example::

        >>> expand_hostlist("node-[009-011]")
        ['node-009', 'node-010', 'node-011']
    """
    hosts = []
    for part in _split_top(hostlist.strip()):
        if not part.strip():
            raise ValueError("an empty host name")
        hosts += _expand_one(part.strip())
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node (``"2(x3),1"`` → ``[2, 2, 2, 1]``).

    Example::

        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts = []
    for item in text.split(","):
        match = _COUNT.match(item.strip())
        if not match:
            raise ValueError(f"{item!r} is not a count such as 2 or 2(x3)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _variable(env: Mapping[str, str], name: str, parse, expected: str, *fallbacks: str):
    """``parse`` of the first of ``name`` and ``fallbacks`` that is set; a ``ValueError`` naming it."""
    for key in (name, *fallbacks):
        raw = env.get(key)
        if raw is None:
            continue
        try:
            return parse(raw)
        except ValueError as error:
            raise ValueError(f"{key}={raw!r} is malformed: expected {expected} ({error}).") from None
    raise ValueError(
        f"{name} is not set: SlurmClusterResolver reads the variables srun sets in a job step (SLURM_PROCID, "
        "SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE); run under srun."
    )


def _count(low: int):
    def parse(raw: str) -> int:
        text = raw.strip()
        if not re.fullmatch(r"\d+", text) or int(text) < low:
            raise ValueError(f"a whole number >= {low}")
        return int(text)

    return parse


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a SLURM job step (``tf.distribute.cluster_resolver.SlurmClusterResolver``'s name;
    see the module docstring for the variables it reads).

    Args:
      port_base: the rendezvous port is ``port_base + SLURM_JOB_ID % 10000`` unless ``MASTER_PORT`` is
        set (default 15000: ports 15000..24999).
      gpus_per_task: GPUs each task uses; with it, a task that sees more GPUs than that (SLURM bound
        the node's GPUs to every task) takes ``cuda:[LOCAL_ID * gpus_per_task ...]``, one that sees
        exactly that many takes them all. ``None``: as ``TorchrunClusterResolver`` (every visible GPU
        with one task per node, else ``cuda:LOCAL_ID``; a task bound to fewer GPUs than the node's
        tasks takes what it sees).
      tasks_per_node: how many tasks run on each node (an int, or a list per node in host-list order),
        instead of ``SLURM_STEP_TASKS_PER_NODE``.
      environ: the environment to read (default ``os.environ``), read once.
      devices: this worker's devices, instead of the GPUs above.

    Differs from TensorFlow's: no ``jobs`` (every task is a worker of ``MultiWorkerMirroredStrategy``),
    no ``gpus_per_node``/``auto_set_gpu`` (``CUDA_VISIBLE_DEVICES`` is SLURM's, and left alone), and
    the rendezvous is one store on worker 0's host rather than a gRPC address per task.

    Example::

        # srun --ntasks 4 --ntasks-per-node 2 replicafit fit recipe.yaml
        strategy = ds.MultiWorkerMirroredStrategy(cluster_resolver=ds.SlurmClusterResolver())
    """

    def __init__(
        self,
        port_base: int = 15000,
        gpus_per_task: int | None = None,
        tasks_per_node=None,
        environ: Mapping[str, str] | None = None,
        devices=None,
    ) -> None:
        env = _environ(environ)
        _check_int(port_base, "port_base", 1, 65535)
        if gpus_per_task is not None:
            _check_int(gpus_per_task, "gpus_per_task", 1)
        num_workers = _variable(env, "SLURM_NTASKS", _count(1), "the number of tasks", "SLURM_STEP_NUM_TASKS")
        rank = _variable(env, "SLURM_PROCID", _count(0), "this task's rank")
        if rank >= num_workers:
            raise ValueError(f"SLURM_PROCID={env['SLURM_PROCID']!r} is out of range: expected < {num_workers} tasks.")
        hosts = _variable(env, "SLURM_STEP_NODELIST", expand_hostlist, "a host list", "SLURM_JOB_NODELIST")
        counts = self._tasks_per_node(env, tasks_per_node, hosts, num_workers)
        node = self._node_of(env, hosts, counts, rank)
        local_rank = _variable(env, "SLURM_LOCALID", _count(0), "this task's index on its node")
        if local_rank >= counts[node]:
            raise ValueError(
                f"SLURM_LOCALID={env['SLURM_LOCALID']!r} is out of range: {hosts[node]} runs {counts[node]} task(s)."
            )
        port = 0
        if num_workers > 1:
            if "MASTER_PORT" in env:
                port = _variable(env, "MASTER_PORT", _count(1), "a port in 1..65535")
            else:
                port = port_base + _variable(env, "SLURM_JOB_ID", _count(0), "the job id", "SLURM_JOBID") % 10000
            if port > 65535:
                raise ValueError(
                    f"The rendezvous port {port} is out of range (1..65535): lower port_base or set MASTER_PORT."
                )
        self._gpus_per_task = gpus_per_task
        super().__init__(
            num_workers=num_workers,
            worker_index=rank,
            master_address=hosts[0],
            master_port=port,
            local_rank=local_rank,
            local_world_size=counts[node],
            devices=_check_devices(devices),
        )

    @staticmethod
    def _tasks_per_node(env, tasks_per_node, hosts: list, num_workers: int) -> list:
        if tasks_per_node is None:
            counts = _variable(
                env,
                "SLURM_STEP_TASKS_PER_NODE",
                expand_tasks_per_node,
                "counts such as 2(x3),1",
                "SLURM_TASKS_PER_NODE",
            )
        elif isinstance(tasks_per_node, int) and not isinstance(tasks_per_node, bool):
            counts = [_check_int(tasks_per_node, "tasks_per_node", 1)] * len(hosts)
        else:
            counts = [_check_int(c, "tasks_per_node[...]", 1) for c in tasks_per_node]
        if len(counts) != len(hosts) or sum(counts) != num_workers:
            raise ValueError(
                f"The tasks per node ({counts}) do not fit the step's {len(hosts)} host(s) ({', '.join(hosts)}) and "
                f"{num_workers} task(s): check SLURM_STEP_TASKS_PER_NODE or tasks_per_node."
            )
        return counts

    @staticmethod
    def _node_of(env, hosts: list, counts: list, rank: int) -> int:
        """This task's node: ``SLURMD_NODENAME``, else the block distribution's (tasks fill nodes in order)."""
        name = env.get("SLURMD_NODENAME")
        if name in hosts:
            return hosts.index(name)
        total = 0
        for node, count in enumerate(counts):
            total += count
            if rank < total:
                return node
        return len(counts) - 1

    @staticmethod
    def detected(environ: Mapping[str, str] | None = None) -> bool:
        """Whether this process is a task of a SLURM job step (``srun``): ``SLURM_STEP_ID`` and
        ``SLURM_PROCID`` are set. An ``salloc`` shell or a batch script is not (it is one process)."""
        env = _environ(environ)
        return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env

    def local_devices(self) -> tuple[str, ...] | None:
        if self._devices is not None:
            return self._devices
        gpus, per_task = _local_gpus(), self._gpus_per_task
        if not gpus:
            return None
        if per_task is not None:
            if len(gpus) == per_task:  # SLURM bound this task's GPUs: they are all it sees
                return tuple(gpus)
            first = self._local_rank * per_task
            if first + per_task > len(gpus):
                raise ValueError(
                    f"SLURM_LOCALID={self._local_rank} with gpus_per_task={per_task} needs cuda:{first}.."
                    f"cuda:{first + per_task - 1}, but only {len(gpus)} CUDA device(s) are visible."
                )
            return tuple(gpus[first : first + per_task])
        if self._local_world_size == 1 or len(gpus) < self._local_world_size:
            return tuple(gpus)  # one task per node (TensorFlow's), or each task sees its own (--gpus-per-task)
        return (gpus[self._local_rank],)  # the node's GPUs seen by every task: one each (DDP's)
