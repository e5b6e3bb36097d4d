"""The one context stack: which strategy is current and in which context we are.

Each thread has a stack of modes, pushed only by ``Strategy.scope()``, ``run`` (one
replica context per replica), ``merge_call`` and ``extended.update``, each popping in
``finally``. An empty stack is the *default context*: the default strategy (one
replica, the current device) with its replica context.

| where | ``get_replica_context()`` | ``in_cross_replica_context()`` | ``get_strategy()`` |
| --- | --- | --- | --- |
| no scope | the default replica context | False | the default strategy |
| ``with s.scope()`` | None | True | s |
| inside ``s.run(fn)`` | that replica's context | False | s |
| inside ``merge_fn`` | None | True | s |

Example::

    >>> import replicafit.strategies as ds
    >>> ds.has_strategy()
    False
    >>> s = ds.OneDeviceStrategy("cpu")
    >>> with s.scope():
    ...     ds.get_strategy() is s, ds.in_cross_replica_context()
    (True, True)
"""

from __future__ import annotations

import contextlib
import threading

__all__ = [
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "in_replica_function",
    "get_replica_context",
    "get_cross_replica_context",
    "experimental_set_strategy",
]


class Mode:
    """One entry of the context stack."""

    __slots__ = ("strategy", "replica_context", "cross_replica", "update_replica", "is_set_strategy")

    def __init__(self, strategy, replica_context=None, cross_replica=None, update_replica=None):
        self.strategy = strategy
        self.replica_context = replica_context
        self.cross_replica = cross_replica
        self.update_replica = update_replica
        self.is_set_strategy = False


class _Local(threading.local):
    def __init__(self):
        self.stack: list[Mode] = []


_local = _Local()
_defaults: dict = {}


def set_default_strategy(strategy, replica_context) -> None:
    """Registers the default strategy (called once by ``default_strategy.py``)."""
    _defaults["mode"] = Mode(strategy, replica_context, None)


def default_strategy():
    return _defaults["mode"].strategy


def default_replica_context():
    """The default strategy's one replica context (in force outside any scope)."""
    return _defaults["mode"].replica_context


def current_mode() -> Mode:
    """The innermost mode of this thread (the default mode when the stack is empty)."""
    stack = _local.stack
    return stack[-1] if stack else _defaults["mode"]


def current_stack() -> list:
    """This thread's stack (the list itself)."""
    return _local.stack


def swap_stack(stack: list) -> list:
    """Puts ``stack`` in force on this thread and returns the one it replaces (the replica
    runner gives each replica that shares a thread its own stack)."""
    previous, _local.stack = _local.stack, stack
    return previous


def stack_depth() -> int:
    return len(_local.stack)


@contextlib.contextmanager
def entered(mode: Mode):
    """Pushes ``mode`` for the duration of the block.

    On the way out the stack is cut back to its depth on entry, so a scope that user
    code inside left open cannot leak into the caller.
    """
    stack = _local.stack
    depth = len(stack)
    stack.append(mode)
    try:
        yield mode
    finally:
        del stack[depth:]


def truncate(depth: int) -> None:
    """Cuts this thread's stack back to ``depth`` entries."""
    del _local.stack[depth:]


def mixing_error(current, new) -> RuntimeError:
    return RuntimeError(f"Mixing different tf.distribute.Strategy objects: {current} is not {new}")


@contextlib.contextmanager
def enter_or_assert_strategy(strategy):
    """Enters ``strategy``'s scope when no strategy is current; refuses a different one.

    Inside ``strategy``'s own scope, replica or merge_fn it changes nothing.
    """
    current = current_mode().strategy
    if current is strategy:
        yield
        return
    if current is not default_strategy():
        raise mixing_error(current, strategy)
    with strategy.scope():
        yield


def push(mode: Mode) -> None:
    _local.stack.append(mode)


def pop(mode: Mode) -> None:
    stack = _local.stack
    if not stack or stack[-1] is not mode:
        raise RuntimeError(
            "Strategy scopes were exited out of order: exit `with strategy.scope()` blocks in the "
            "reverse order of entering them."
        )
    stack.pop()


def get_strategy():
    """The current strategy: the one whose scope or replica we are in, else the default.

    Example::

        with strategy.scope():
            assert strategies.get_strategy() is strategy
    """
    return current_mode().strategy


def has_strategy() -> bool:
    """Whether a strategy other than the default one is current."""
    return current_mode().strategy is not default_strategy()


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` or a ``merge_fn``; False in a replica and by default."""
    return current_mode().cross_replica is not None


def in_replica_function() -> bool:
    """Whether this code runs inside ``strategy.run`` (a replica's function), rather than in the
    default replica context that holds outside any scope or in cross-replica context. Not in
    TensorFlow, where a layer asks ``get_replica_context()`` and compares it with the default one.

    Example::

        strategy.run(lambda: in_replica_function())   # PerReplica{0: True, 1: True}
        in_replica_function()                         # False
    """
    ctx = current_mode().replica_context
    return ctx is not None and not ctx._is_default


def get_replica_context():
    """The ``ReplicaContext`` of the replica running this code, or ``None`` in cross-replica context.

    Outside any scope this is the default strategy's replica context.

    Example::

        def step():
            ctx = strategies.get_replica_context()
            return ctx.replica_id_in_sync_group

        strategy.run(step)   # PerReplica{0: 0, 1: 1}
    """
    return current_mode().replica_context


def get_cross_replica_context():
    """The strategy when in cross-replica context (a scope, a ``merge_fn``), else ``None``."""
    return current_mode().cross_replica


def experimental_set_strategy(strategy) -> None:
    """Makes ``strategy`` current for this thread as if ``scope()`` were entered for good.

    ``None`` returns to the default strategy. Must not be called inside a scope.

    Example::

        strategies.experimental_set_strategy(strategy)
        v = strategies.Variable(1.0)      # a MirroredVariable
        strategies.experimental_set_strategy(None)
    """
    stack = _local.stack
    others = [m for m in stack if not m.is_set_strategy]
    if others:
        raise RuntimeError("Must not be called inside a `replicafit.strategies.Strategy` scope.")
    del stack[:]
    if strategy is not None:
        if strategy is default_strategy():
            return
        mode = Mode(strategy, None, strategy)
        mode.is_set_strategy = True
        stack.append(mode)
