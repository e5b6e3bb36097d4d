"""The cluster contract: what a layer above the strategies may ask about the workers.

The trainer, its callbacks, the data layer, the optimizers and a user's own callback ask
``strategy.cluster`` (never a strategy's private state) whether this worker is the chief, how
many workers there are and which one this is, and ask it to broadcast an object from the chief,
gather objects from every worker, agree on a flag (any/all) or a small sum, or wait at a barrier.
Lightning Fabric's ``Strategy`` (``broadcast``, ``all_gather``, ``reduce_boolean_decision``,
``barrier``) has the same size.

Two implementations: ``Cluster`` for one process (trivial: no communication, every answer is this
worker's own) and ``CollectiveCluster`` for the workers of a ``MultiWorkerMirroredStrategy`` (each
call one small host-side collective, bounded by ``CommunicationOptions.timeout_seconds``; a dead or
stuck worker is a ``WorkerFailedError`` naming the operation). Every worker must make the same calls
in the same order, as with any collective.

Example::

    >>> import replicafit.strategies as ds
    >>> cluster = ds.MirroredStrategy(["cpu:0", "cpu:1"]).cluster
    >>> cluster.is_chief, cluster.num_workers, cluster.worker_index
    (True, 1, 0)
    >>> cluster.broadcast({"seed": 7}), cluster.all_gather(3), cluster.any(False), cluster.sum(4)
    ({'seed': 7}, [3], False, 4)
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["Cluster", "CollectiveCluster"]


def _ints(value) -> tuple[list, bool]:
    """``value`` (a Python int, or a list or tuple of them) as a list, and whether it was one int."""
    single = isinstance(value, int)
    values = [value] if single else list(value) if isinstance(value, (list, tuple)) else None
    if values is None or not all(isinstance(v, int) for v in values):
        raise TypeError(
            f"cluster.sum() sums Python ints (or a list of them), got {type(value).__name__}: {value!r}. "
            "Convert a tensor first (int(t), t.tolist())."
        )
    return [int(v) for v in values], single


class Cluster:
    """The workers of one process: a cluster of one, where every question answers itself.

    Args:
      num_local_replicas: the replicas of this worker (``len(strategy.extended.worker_devices)``).

    Attributes:
      num_workers: how many workers (processes) the strategy spans.
      worker_index: this worker's index, ``0 ... num_workers - 1``.
      num_local_replicas: the replicas of this worker.

    Every method that communicates takes ``what``: the operation's name in the
    ``WorkerFailedError`` raised when a worker dies or stops arriving.

    Example (a user's callback that writes a file on the chief only)::

        class SaveNotes(Callback):
            def on_epoch_end(self, epoch, logs=None):
                cluster = self.trainer.strategy.cluster
                if cluster.is_chief:
                    Path("notes.txt").write_text(f"epoch {epoch}: {logs}")
                cluster.barrier("notes written")  # no worker reads the file before it exists
    """

    num_workers = 1
    worker_index = 0

    def __init__(self, num_local_replicas: int = 1, step_values=None):
        self.num_local_replicas = num_local_replicas
        self._step_values = step_values

    @property
    def is_chief(self) -> bool:
        """Whether this worker is the chief (worker 0), the one that writes files."""
        return self.worker_index == 0

    @property
    def first_replica_id(self) -> int:
        """The global id of this worker's first replica (``worker_index * num_local_replicas``)."""
        return self.worker_index * self.num_local_replicas

    def broadcast(self, obj, what: str = "broadcasting the chief's value"):
        """The chief's ``obj`` on every worker (any picklable object). Across workers on accelerators, the
        object's tensors there arrive on each worker's own first device; host tensors stay on the host."""
        return obj

    def all_gather(self, obj, what: str = "gathering an object from every worker") -> list:
        """Every worker's ``obj`` (picklable), in worker order; tensors on an accelerator arrive on this
        worker's first device, as in ``broadcast``."""
        return [obj]

    def any(self, flag, what: str = "agreeing on a flag") -> bool:
        """Whether ``flag`` is true on any worker."""
        return bool(flag)

    def all(self, flag, what: str = "agreeing on a flag") -> bool:
        """Whether ``flag`` is true on every worker."""
        return bool(flag)

    def sum(self, value, what: str = "summing a count over the workers"):
        """``value`` (a Python int, or a list of ints summed element-wise) summed over the workers."""
        values, single = _ints(value)
        return values[0] if single else values

    def start_sum(self, value, what: str = "summing a count over the workers"):
        """``sum(value)`` started now: returns ``finish()``, which waits for it and gives the sum.
        Other calls may be made while it is in flight; every started sum must be finished."""
        result = self.sum(value, what)
        return lambda: result

    def barrier(self, name: str = "barrier") -> None:
        """Waits until every worker reaches the barrier ``name`` (named in the error when a worker
        never arrives)."""

    def add_to_step(self, name: str, value) -> None:
        """Adds this replica's ``value`` (a non-negative int, a 0/1 flag, an integer tensor of one
        element; or a float, or a floating tensor of one element) to the step value ``name``; in
        cross-replica context, this worker's value. The next SUM reduction (in a training step, the
        optimizer's gradient reduction) carries it, with no collective of its own (``step_values.py``)."""
        self._step_values.add(name, value)

    def step_total(self, name: str) -> torch.Tensor:
        """What was added to the step value ``name`` since the previous ``step_total(name)``, summed
        over every replica of every worker and over the reductions that carried it: an int64 scalar
        tensor (float64 for floating values) on the reduction's device. Reading it starts the next
        count from zero. A part still pending is reduced now, on its own (a collective across workers:
        every worker asks)."""
        return self._step_values.total(name)

    def step_value_waiting(self, name: str) -> bool:
        """Whether a part of the step value ``name`` still waits for a reduction to carry it, with no
        communication: ``step_total(name)`` would then reduce it on its own (a collective). The same
        on every worker that adds alike. A reader that must not add a collective to a step reads the
        total only once nothing waits (``BackupAndRestore(save_before_preemption=True)`` does)."""
        return self._step_values.waiting(name)

    def discard_step_value(self, name: str) -> None:
        """Forgets what was added to the step value ``name`` and not read yet (what a step that never
        finished left behind), with no communication: every worker discards alike, at the same point.
        ``Trainer.fit`` does it for its own step value as it starts."""
        self._step_values.discard(name)

    def input_channel(self) -> Cluster:
        """This cluster for the input pipeline: the same calls on a channel of their own, so the
        input's prefetch thread never interleaves its collectives with the main thread's (workers
        pair collectives by their order on a channel)."""
        return self

    @property
    def failed(self) -> bool:
        """True once a collective of the cluster raised ``WorkerFailedError`` (a worker died or stopped arriving;
        never in one process). A cluster that failed makes no collective again, except within ``alone()``."""
        return False

    def alone(self):
        """A context in which every call of this cluster answers with this worker's part alone, as in a cluster
        of one (``all_gather`` gives ``[obj]``, ``sum`` this worker's value, ``barrier`` passes), and reductions of
        distributed values combine this worker's replicas only. For a survivor after a worker's failure
        (``failed``): it reads its own state through the code that reads it across workers, to write a backup
        on its own. Raises ``RuntimeError`` where the cluster has not failed (the others would wait). In one
        process nothing changes.

        Example::

            try:
                trainer.fit(model, data)
            except WorkerFailedError:
                with cluster.alone():
                    state = trainer.training_state(epoch, step)   # this worker's own view
        """
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(worker {self.worker_index} of {self.num_workers})"


class CollectiveCluster(Cluster):
    """The workers of a ``MultiWorkerMirroredStrategy``: each call one host-side collective.

    Built by the strategy over its ``Collective`` (``collective.py``); ``group`` names the process
    group the calls use (``"control"``; ``"input"`` for ``input_channel()``).
    """

    def __init__(self, collective, num_local_replicas: int, step_values=None, group: str = "control"):
        super().__init__(num_local_replicas, step_values)
        self._collective = collective
        self._group = group
        self.num_workers = collective.world_size
        self.worker_index = collective.rank

    def broadcast(self, obj, what: str = "broadcasting the chief's value"):
        return self._collective.broadcast_object(obj, what, group=self._group)

    def all_gather(self, obj, what: str = "gathering an object from every worker") -> list:
        return self._collective.all_gather_object(obj, what, group=self._group)

    def any(self, flag, what: str = "agreeing on a flag") -> bool:
        return self.sum(int(bool(flag)), what) > 0

    def all(self, flag, what: str = "agreeing on a flag") -> bool:
        return self.sum(int(bool(flag)), what) == self.num_workers

    def sum(self, value, what: str = "summing a count over the workers"):
        values, single = _ints(value)
        total = self._collective.sum_ints(values, what, group=self._group)
        return total[0] if single else total

    def start_sum(self, value, what: str = "summing a count over the workers"):
        values, single = _ints(value)
        finish = self._collective.start_sum_ints(values, what, group=self._group)
        return (lambda: finish()[0]) if single else finish

    def barrier(self, name: str = "barrier") -> None:
        self._collective.barrier(f"barrier {name!r}", group=self._group)

    def input_channel(self) -> Cluster:
        return CollectiveCluster(self._collective, self.num_local_replicas, self._step_values, group="input")

    @property
    def failed(self) -> bool:
        return self._collective.failed

    def alone(self):
        return self._collective.alone()
