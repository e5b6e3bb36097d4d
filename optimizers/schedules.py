"""Learning-rate schedules, with Keras 3's formulas: ``schedule(step) -> learning rate``.

The optimizer calls its schedule with ``iterations`` (the number of updates applied so
far) before each update.

Example::

    >>> from replicafit.optimizers import schedules
    >>> lr = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    >>> round(lr(10), 6), round(lr(5), 6)
    (0.05, 0.070711)
    >>> schedules.deserialize(lr.get_config() | {"class_name": "ExponentialDecay"})(10) == lr(10)
    True
"""

from __future__ import annotations

import math

__all__ = [
    "LearningRateSchedule",
    "ExponentialDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "InverseTimeDecay",
    "CosineDecay",
    "serialize",
    "deserialize",
]


class LearningRateSchedule:
    """Base class: ``__call__(step)`` returns the learning rate for that step (a float)."""

    def __call__(self, step) -> float:
        raise NotImplementedError

    def get_config(self) -> dict:
        """The constructor arguments, as a dict: ``from_config`` makes an equal schedule from it.

        A subclass of your own must define it (the base raises ``NotImplementedError``); ``repr()`` uses it.
        """
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict):
        """The schedule ``cls(**config)``, from ``get_config()``'s output."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _positive(name: str, value) -> float:
    if not value > 0:
        raise ValueError(f"`{name}` must be > 0, got {value!r}.")
    return value


def _progress(step, decay_steps, staircase: bool) -> float:
    """``step / decay_steps``, rounded down with ``staircase``."""
    p = float(step) / decay_steps
    return math.floor(p) if staircase else p


class _StepDecay(LearningRateSchedule):
    """Shared arguments of the schedules driven by ``step / decay_steps``."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps,
        decay_rate: float,
        staircase: bool = False,
        name: str | None = None,
    ):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = _positive("decay_steps", decay_steps)
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name or type(self).__name__

    def _progress(self, step) -> float:
        return _progress(step, self.decay_steps, self.staircase)

    def get_config(self) -> dict:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
            "name": self.name,
        }


class ExponentialDecay(_StepDecay):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (integer division if ``staircase``).

    Example::

        ExponentialDecay(0.1, decay_steps=1000, decay_rate=0.96, staircase=True)
    """

    def __call__(self, step) -> float:
        return self.initial_learning_rate * self.decay_rate ** self._progress(step)


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` while ``step <= boundaries[0]``, ``values[1]`` while ``step <= boundaries[1]``, ...

    Example::

        PiecewiseConstantDecay(boundaries=[100, 200], values=[1.0, 0.5, 0.1])
    """

    def __init__(self, boundaries, values, name: str = "PiecewiseConstant"):
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                f"The length of `values` ({len(values)}) must be one more than the length of "
                f"`boundaries` ({len(boundaries)})."
            )
        if list(boundaries) != sorted(boundaries):
            raise ValueError(f"`boundaries` must be increasing, got {list(boundaries)}.")
        self.boundaries = list(boundaries)
        self.values = list(values)
        self.name = name

    def __call__(self, step) -> float:
        step = float(step)
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]

    def get_config(self) -> dict:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """``(initial - end) * (1 - step / decay_steps) ** power + end``, ``step`` capped at ``decay_steps``.

    With ``cycle``, ``decay_steps`` grows to the next multiple of itself past ``step``.

    Example::

        PolynomialDecay(0.1, decay_steps=10000, end_learning_rate=0.01, power=0.5)
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        name: str = "PolynomialDecay",
    ):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = _positive("decay_steps", decay_steps)
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name

    def __call__(self, step) -> float:
        step = float(step)
        decay_steps = float(self.decay_steps)
        if self.cycle:
            multiplier = 1.0 if step == 0 else math.ceil(step / decay_steps)
            decay_steps = decay_steps * multiplier
        else:
            step = min(step, decay_steps)
        fraction = step / decay_steps
        return (self.initial_learning_rate - self.end_learning_rate) * (
            1 - fraction
        ) ** self.power + self.end_learning_rate

    def get_config(self) -> dict:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "cycle": self.cycle,
            "name": self.name,
        }


class InverseTimeDecay(_StepDecay):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (integer division if ``staircase``).

    Example::

        InverseTimeDecay(0.1, decay_steps=1.0, decay_rate=0.5)
    """

    def __call__(self, step) -> float:
        return self.initial_learning_rate / (1 + self.decay_rate * self._progress(step))


class CosineDecay(LearningRateSchedule):
    """Cosine decay, with an optional linear warmup (Keras 3's ``CosineDecay``).

    For ``step < warmup_steps`` the rate rises linearly from ``initial_learning_rate``
    to ``warmup_target``; afterwards it follows
    ``target * ((1 - alpha) * 0.5 * (1 + cos(pi * s / decay_steps)) + alpha)`` with
    ``s = min(step - warmup_steps, decay_steps)`` and ``target`` the warmup target (or
    the initial rate without warmup).

    Example::

        CosineDecay(0.0, decay_steps=1000, warmup_target=0.1, warmup_steps=100)
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        alpha: float = 0.0,
        name: str = "CosineDecay",
        warmup_target: float | None = None,
        warmup_steps: int = 0,
    ):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = _positive("decay_steps", decay_steps)
        self.alpha = alpha
        self.name = name
        self.warmup_target = warmup_target
        self.warmup_steps = warmup_steps
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}.")

    def __call__(self, step) -> float:
        step = float(step)
        if self.warmup_target is None or self.warmup_steps == 0:
            target = self.initial_learning_rate if self.warmup_target is None else self.warmup_target
            return self._decay(step, target)
        if step < self.warmup_steps:
            completed = step / self.warmup_steps
            return self.initial_learning_rate + (self.warmup_target - self.initial_learning_rate) * completed
        return self._decay(step - self.warmup_steps, self.warmup_target)

    def _decay(self, step: float, target: float) -> float:
        step = min(step, float(self.decay_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * step / self.decay_steps))
        return target * ((1 - self.alpha) * cosine + self.alpha)

    def get_config(self) -> dict:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "name": self.name,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }


_SCHEDULES = {
    cls.__name__: cls
    for cls in (ExponentialDecay, PiecewiseConstantDecay, PolynomialDecay, InverseTimeDecay, CosineDecay)
}


def serialize(schedule: LearningRateSchedule) -> dict:
    """``{"class_name": ..., "config": {...}}`` of a built-in schedule."""
    return {"class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(config: dict) -> LearningRateSchedule:
    """The schedule described by ``serialize``'s output (or a flat config with ``class_name``)."""
    config = dict(config)
    name = config.pop("class_name", None)
    if name not in _SCHEDULES:
        raise ValueError(f"Unknown learning rate schedule {name!r}; known: {sorted(_SCHEDULES)}.")
    inner = config.pop("config", config)
    return _SCHEDULES[name].from_config(inner)
