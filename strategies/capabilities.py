"""``StrategyCapabilities``: what a strategy declares about itself, for the layers above to ask.

The trainer, the optimizers, callbacks and a user's code ask ``strategy.extended.capabilities`` what they
need to know about a strategy (does every worker hold the whole state, are updates gathered after the step)
instead of probing its attributes: a new strategy says what it can do in one place.

Example::

    >>> import replicafit.strategies as ds
    >>> caps = ds.MirroredStrategy(["cpu:0", "cpu:1"]).extended.capabilities
    >>> caps.whole_state_on_every_worker, caps.shards_optimizer_states, caps.defers_updates
    (True, False, False)
"""

from __future__ import annotations

import dataclasses

__all__ = ["StrategyCapabilities"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyCapabilities:
    """A strategy's declaration (``StrategyExtended.capabilities``).

    Attributes:
      whole_state_on_every_worker: every worker holds the whole model and the whole optimizer state, so
        any one worker's copy is complete (a checkpoint may be written from it alone; a surviving worker
        holds the whole run).
      shards_optimizer_states: each worker keeps the optimizer state of its part of the variables only
        (``state_layout`` gives slices of them).
      shards_parameters: each worker holds its chunk of every parameter of a distributed module (and of its
        gradients and optimizer state): checkpoints are written sharded, every worker its part.
      sharded_checkpoints: checkpoints and backups are written sharded (``trainer.sharded_checkpoint``: every
        worker writes its part of the state, nothing is gathered), as where parameters or optimizer states are
        sharded.
      defers_updates: the communication of an update may run on past the step that made it
        (``settle_updates`` finishes it): code that reads variables between steps settles them first.

    Example::

        class MyExtended(ds.StrategyExtended):
            @property
            def capabilities(self):
                return ds.StrategyCapabilities(whole_state_on_every_worker=True)
    """

    whole_state_on_every_worker: bool = True
    shards_optimizer_states: bool = False
    shards_parameters: bool = False
    sharded_checkpoints: bool = False
    defers_updates: bool = False
