"""``LambdaCallback``: a callback made of plain functions, one per hook."""

from __future__ import annotations

from .callback import Callback


class LambdaCallback(Callback):
    """A callback from plain functions: ``LambdaCallback(on_epoch_end=lambda epoch, logs: ...)``."""

    def __init__(self, **hooks):
        super().__init__()
        known = {name for name in dir(Callback) if name.startswith("on_")}
        unknown = sorted(set(hooks) - known)
        if unknown:
            raise ValueError(f"Unknown callback hook(s) {unknown}; known: {sorted(known)}.")
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)
