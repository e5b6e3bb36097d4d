"""Distribution-aware optimizers: ``apply_gradients`` does merge_call → batch_reduce_to → update.

Example::

    from replicafit import optimizers
    optimizer = optimizers.get("adam")                       # or optimizers.Adam(1e-3)
    optimizer = optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0)
    optimizer = optimizers.from_torch(torch.optim.AdamW, lr=1e-3)
    optimizer = optimizers.Adam(1e-3, gradient_accumulation_steps=4)    # one update per 4 steps
    optimizer = optimizers.LossScaleOptimizer(optimizers.SGD(0.1))       # float16 loss scaling

Rooms: ``base.py`` (``Optimizer``: the pipeline's stages in their order, the API subclasses write
against), the stages (``accumulation.py``: the gradient accumulation window; ``stages.py``: dividing,
clipping, weight decay; ``loss_scale.py``: loss scaling, a stage of the pipeline; ``ema.py``: the
moving averages), ``multi_tensor.py`` (the built-ins' grouped ``foreach`` fast path), ``slots.py`` (slot
variables, made through the state layout the strategy provides), ``resolve.py`` (what
``apply_gradients`` is given, as variables), ``state.py`` (the saved state: its format, gathered and
restored), the update rules (``sgd.py``, ``adam.py``, ``rmsprop.py``), ``schedules.py`` and
``torch_optimizer.py`` (``from_torch``).
"""

from difflib import get_close_matches

from . import schedules
from .accumulation import GradientDenominator
from .adam import Adam, AdamW
from .base import Optimizer
from .loss_scale import LossScaleOptimizer
from .rmsprop import Adagrad, RMSprop
from .sgd import SGD
from .torch_optimizer import TorchOptimizer, from_torch

__all__ = [
    "Adagrad",
    "Adam",
    "AdamW",
    "GradientDenominator",
    "LossScaleOptimizer",
    "Optimizer",
    "RMSprop",
    "SGD",
    "TorchOptimizer",
    "from_torch",
    "get",
    "schedules",
]

_BY_NAME = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "rmsprop": RMSprop, "adagrad": Adagrad}
# Classes a config dict may name besides the built-ins (they need more than a name to be made).
_BY_CONFIG = {"torchoptimizer": TorchOptimizer, "lossscaleoptimizer": LossScaleOptimizer}


def get(identifier) -> Optimizer:
    """An optimizer from a name (``"adam"``), a config dict, or an optimizer (returned as is).

    Config dicts are ``{"class_name": "Adam", "config": {...}}`` (Keras' form) or
    ``{"class_name": "Adam", ...arguments}``.

    Example::

        get("sgd"); get({"class_name": "SGD", "config": {"learning_rate": 0.1, "momentum": 0.9}})
    """
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str):
        cls = _BY_NAME.get(identifier.lower())
        if cls is None:
            close = get_close_matches(identifier.lower(), _BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"Unknown optimizer {identifier!r}{hint}; known: {sorted(_BY_NAME)}.")
        return cls()
    if isinstance(identifier, dict):
        config = dict(identifier)
        name = str(config.pop("class_name", "")).lower()
        cls = _BY_NAME.get(name) or _BY_CONFIG.get(name)
        if cls is None:
            raise ValueError(f"Unknown optimizer class_name {name!r}; known: {sorted(_BY_NAME)}.")
        return cls.from_config(config.pop("config", config))
    raise TypeError(
        f"Cannot make an optimizer from {type(identifier).__name__}: pass a name, a config dict or an Optimizer."
    )
