"""``strategy.scope()`` and the check of the context that cross-replica methods need.

Entering a strategy's scope pushes its cross-replica context on the one context stack (``context.py``);
the default strategy's scope changes nothing (its replica context stays in force). Mixing strategies is
refused with TensorFlow's message.

Example::

    with strategy.scope():           # cross-replica context: variables made here are distributed
        v = ds.Variable(1.0)
"""

from __future__ import annotations

from . import context

__all__ = ["CROSS_REPLICA_ONLY", "StrategyScope", "require_cross_replica"]

#: TensorFlow's message for a cross-replica method called inside a replica function.
CROSS_REPLICA_ONLY = "Method requires being in cross-replica context, use get_replica_context().merge_call()"


def require_cross_replica(strategy, message: str = CROSS_REPLICA_ONLY) -> None:
    """Raises unless we are in ``strategy``'s cross-replica context or the default context."""
    mode = context.current_mode()
    ctx = mode.replica_context
    if ctx is not None and not ctx._is_default:
        if ctx.strategy is strategy:
            raise RuntimeError(message)
        raise context.mixing_error(ctx.strategy, strategy)
    if mode.strategy is not strategy and mode.strategy is not context.default_strategy():
        raise context.mixing_error(mode.strategy, strategy)


class StrategyScope:
    """``strategy.scope()``: enters the strategy's cross-replica context (re-entering it is fine)."""

    def __init__(self, strategy):
        self._strategy = strategy
        self._mode = None

    def __enter__(self):
        strategy = self._strategy
        mode = context.current_mode()
        default = context.default_strategy()
        if mode.replica_context is not None and not mode.replica_context._is_default:
            if mode.strategy is strategy:
                raise RuntimeError(CROSS_REPLICA_ONLY)
            raise context.mixing_error(mode.strategy, strategy)
        if mode.strategy is not strategy and mode.strategy is not default:
            if strategy is default:
                raise RuntimeError("Must not nest tf.distribute.Strategy scopes.")
            raise context.mixing_error(mode.strategy, strategy)
        if strategy is default:
            # The default strategy's scope changes nothing: still its replica context.
            self._mode = context.Mode(strategy, context.default_replica_context(), None)
        else:
            self._mode = context.Mode(strategy, None, strategy)
        context.push(self._mode)
        return strategy

    def __exit__(self, *exc):
        context.pop(self._mode)
        return False
