"""Built-in models for recipes: ``mlp``, ``cnn`` and ``linear``.

Example::

    >>> import torch
    >>> model = mlp(inputs=64, outputs=10, hidden=[32], dropout=0.1)
    >>> model(torch.zeros(2, 64)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import operator

from torch import nn

__all__ = ["mlp", "cnn", "linear"]

_ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
}


def _positive(name: str, value) -> int:
    """``value`` as an int if it is a positive integer (NumPy's too); else a ValueError naming the
    argument, which a recipe reports at that key."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def _positive_sizes(name: str, values) -> tuple:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    return tuple(_positive(f"{name}[{index}]", value) for index, value in enumerate(values))


def _dropout(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"dropout must be in [0, 1), got {value!r}")
    return value


def _activation(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


def mlp(
    inputs: int,
    outputs: int,
    hidden: list[int] = (128,),
    activation: str = "relu",
    dropout: float = 0.0,
    batch_norm: bool = False,
) -> nn.Module:
    """Multi-layer perceptron: Linear -> [BatchNorm] -> activation -> [Dropout] per hidden layer.

    Outputs are logits (pair with ``cross_entropy``) or values (``mse``). Every size must be a
    positive integer (a ``ValueError`` names the one that is not).
    """
    width, outputs = _positive("inputs", inputs), _positive("outputs", outputs)
    hidden, dropout = _positive_sizes("hidden", hidden), _dropout(dropout)
    _activation(activation)
    layers: list = []
    for size in hidden:
        layers.append(nn.Linear(width, size))
        if batch_norm:
            layers.append(nn.BatchNorm1d(size))
        layers.append(_activation(activation))
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


class _CNN(nn.Module):
    def __init__(self, in_channels, outputs, image_size, channels, dropout, batch_norm=False):
        super().__init__()
        layers, width, size = [], in_channels, image_size
        for count in channels:
            layers.append(nn.Conv2d(width, count, kernel_size=3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(count))
            layers += [nn.ReLU(), nn.MaxPool2d(2)]
            width, size = count, max(1, size // 2)
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout) if dropout else nn.Identity(), nn.Linear(width * size * size, outputs)
        )
        self.in_channels, self.image_size = in_channels, image_size

    def forward(self, x):
        if x.dim() == 2:  # flat pixels: restore the image
            x = x.reshape(-1, self.in_channels, self.image_size, self.image_size)
        elif x.dim() == 3:
            x = x.unsqueeze(1)
        return self.head(self.features(x))


def cnn(
    outputs: int,
    in_channels: int = 1,
    image_size: int = 8,
    channels: list[int] = (16, 32),
    dropout: float = 0.0,
    batch_norm: bool = False,
) -> nn.Module:
    """A small convolutional network for square images: (Conv 3x3 -> [BatchNorm] -> ReLU -> MaxPool) per
    entry of ``channels``, then a linear head. Accepts images ``(N, C, H, W)``, ``(N, H, W)`` or flat pixels.
    With ``batch_norm`` the convolutions have no bias (the BatchNorm's shift replaces it)."""
    return _CNN(
        _positive("in_channels", in_channels),
        _positive("outputs", outputs),
        _positive("image_size", image_size),
        _positive_sizes("channels", channels),
        _dropout(dropout),
        bool(batch_norm),
    )


def linear(inputs: int, outputs: int = 1) -> nn.Module:
    """A linear model: linear regression with ``mse``, logistic regression with ``binary_crossentropy``
    (``from_logits``) or ``cross_entropy``."""
    return nn.Linear(_positive("inputs", inputs), _positive("outputs", outputs))
