"""Reduction ops, variable aggregation/synchronization enums and communication options.

Example::

    >>> ReduceOp("sum") is ReduceOp.SUM
    True
    >>> ReduceOp.from_variable_aggregation(VariableAggregation.MEAN)
    <ReduceOp.MEAN: 'MEAN'>
    >>> CommunicationOptions(bytes_per_pack=50 * 2**20).bytes_per_pack
    52428800
"""

from __future__ import annotations

import enum

__all__ = [
    "ReduceOp",
    "VariableAggregation",
    "VariableSynchronization",
    "CommunicationImplementation",
    "CommunicationOptions",
]


class _CaseInsensitiveEnum(enum.Enum):
    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            for member in cls:
                if member.value == value.upper():
                    return member
        return None


class VariableAggregation(_CaseInsensitiveEnum):
    """How the values written by several replicas to one variable are combined.

    ``NONE``: not combined (an error in replica context for mirrored variables here,
    see ``docs/porting/tensorflow.md``); ``SUM``; ``MEAN``; ``ONLY_FIRST_REPLICA``: the
    value of replica 0 is taken.
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


class VariableSynchronization(_CaseInsensitiveEnum):
    """When a distributed variable's copies are kept equal.

    ``AUTO`` (the strategy picks, ``ON_WRITE`` for the strategies here), ``NONE`` (not
    supported by distribution strategies), ``ON_WRITE`` (every write updates every
    copy: ``MirroredVariable``), ``ON_READ`` (each replica writes its own copy; reading
    across replicas aggregates: ``SyncOnReadVariable``).
    """

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


class ReduceOp(_CaseInsensitiveEnum):
    """How values of several replicas are combined: ``SUM`` or ``MEAN``.

    Strings are accepted wherever a ``ReduceOp`` is: ``"sum"``, ``"MEAN"``.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: VariableAggregation) -> ReduceOp:
        """The reduce op of a variable aggregation (``SUM`` or ``MEAN``)."""
        aggregation = VariableAggregation(aggregation)
        if aggregation is VariableAggregation.SUM:
            return ReduceOp.SUM
        if aggregation is VariableAggregation.MEAN:
            return ReduceOp.MEAN
        raise ValueError(
            f"Could not convert from `VariableAggregation` {aggregation} to `ReduceOp` type: "
            "only SUM and MEAN aggregations are reductions."
        )


def as_reduce_op(reduce_op) -> ReduceOp:
    """Normalizes ``"sum"``/``"MEAN"``/``ReduceOp`` to a ``ReduceOp``; clear error otherwise."""
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    if isinstance(reduce_op, VariableAggregation):
        raise TypeError(
            f"Expected `reduce_op` to be a `replicafit.strategies.ReduceOp`, not: {reduce_op!r}; "
            "use ReduceOp.from_variable_aggregation() to convert an aggregation."
        )
    if isinstance(reduce_op, str):
        try:
            return ReduceOp(reduce_op)
        except ValueError:
            pass
        raise ValueError(f"{reduce_op!r} is not a valid ReduceOp: use 'SUM' or 'MEAN'.")
    raise TypeError(f"Expected `reduce_op` to be a `replicafit.strategies.ReduceOp` or a string, not: {reduce_op!r}")


class CommunicationImplementation(_CaseInsensitiveEnum):
    """Which collective implementation cross-device communication uses.

    ``AUTO`` lets the strategy pick; ``RING`` is the host (gloo-style) path; ``NCCL``
    requires CUDA devices.

    Across worker processes on gloo, ``AUTO`` sums a small buffer (at most 1 MiB gathered over the
    workers) with one all-gather and a local sum in worker order, in half the message rounds of gloo's
    ring all-reduce; ``RING`` sums with the ring all-reduce at every size, as DDP on gloo does.
    TensorFlow's ``AUTO`` has no such choice.

    Example::

        >>> CommunicationImplementation("ring") is CommunicationImplementation.RING
        True
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Options for cross-device communication (``tf.distribute.experimental.CommunicationOptions``).

    Args:
      bytes_per_pack: tensors of a batched reduction are packed into flat buffers of
        at most this many bytes (a tensor larger than that gets a pack of its own);
        ``0`` packs everything of one dtype and device set together.
      timeout_seconds: how long a replica may wait for the others at a rendezvous
        (``merge_call``, collectives, and the end of the replica function) before the call
        fails with a ``TimeoutError`` naming the replicas that did not arrive and the last
        collective each reached; ``run`` then returns within about that time whichever
        replica is stuck (every replica runs on a thread of its own, the caller only
        watches), and the strategy stays usable. A long step that every replica takes
        alike is not a timeout, nor is a slow ``merge_fn``. ``None`` waits as long as the
        other replicas are alive (a stall is logged, see ``set_stall_warning_seconds``).
        TensorFlow's timeout covers collectives only.
      implementation: a ``CommunicationImplementation`` or its name.

    Example::

        options = CommunicationOptions(bytes_per_pack=4 * 2**20, timeout_seconds=60)
        strategy.extended.batch_reduce_to("SUM", pairs, options=options)
    """

    __slots__ = ("bytes_per_pack", "timeout_seconds", "implementation")

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: float | None = None,
        implementation=CommunicationImplementation.AUTO,
    ):
        if not isinstance(bytes_per_pack, int) or isinstance(bytes_per_pack, bool) or bytes_per_pack < 0:
            raise ValueError(f"Argument `bytes_per_pack` must be >=0, Received {bytes_per_pack}.")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"Argument `timeout_seconds` must be None or > 0, received {timeout_seconds!r}.")
        try:
            implementation = CommunicationImplementation(implementation)
        except ValueError:
            raise ValueError(
                f"Argument `implementation` must be one of {[m.value for m in CommunicationImplementation]}, "
                f"received {implementation!r}."
            ) from None
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def merge(self, other: CommunicationOptions | None) -> CommunicationOptions:
        """A copy of ``self`` where the non-default fields of ``other`` win."""
        if other is None:
            return self
        return CommunicationOptions(
            bytes_per_pack=other.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=other.timeout_seconds if other.timeout_seconds is not None else self.timeout_seconds,
            implementation=(
                other.implementation
                if other.implementation is not CommunicationImplementation.AUTO
                else self.implementation
            ),
        )

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation})"
        )
