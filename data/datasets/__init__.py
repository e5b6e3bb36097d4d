"""Data sets that ship with the project, and seeded synthetic generators.

Nothing is downloaded: ``load_digits`` reads the file bundled in this package, and the
generators make their data from a seed.

Example::

    >>> from replicafit.data import datasets
    >>> x, y = datasets.load_digits()
    >>> x.shape, y.shape, x.dtype, y.dtype
    ((1797, 64), (1797,), dtype('float32'), dtype('int64'))
    >>> x, y = datasets.make_classification(n_samples=8, n_features=4, seed=0)
    >>> x.shape, sorted(set(y.tolist()))
    ((8, 4), [0, 1])
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

__all__ = ["load_digits", "make_classification", "make_regression"]

_DIGITS_FILE = os.path.join(os.path.dirname(__file__), "digits.npz")
_DIGITS_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"


def load_digits(*, images: bool = False, normalize: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The UCI optical handwritten digits: 1,797 images of 8×8 pixels, 10 classes.

    Args:
      images: return ``x`` as ``(1797, 8, 8)`` images instead of ``(1797, 64)`` rows.
      normalize: scale pixels from ``0..16`` to ``0..1``.

    Returns ``(x, y)``: ``x`` float32 pixels, ``y`` int64 labels 0..9. Source and licence
    (CC BY 4.0): ``data/datasets/README.md``.

    Example::

        x, y = load_digits(normalize=True)
        trainer.fit(model, (x, y), batch_size=64, validation_split=0.2)
    """
    try:
        with np.load(_DIGITS_FILE, allow_pickle=False) as archive:
            pixels, target = archive["images"], archive["target"]
        intact = hashlib.sha256(pixels.tobytes() + target.tobytes()).hexdigest() == _DIGITS_SHA256
    except Exception as error:  # noqa: BLE001 - any damage (zip, header, contents) means the same thing
        raise RuntimeError(
            f"The bundled digits file {_DIGITS_FILE} cannot be read ({type(error).__name__}: {error}); "
            "reinstall replicafit."
        ) from error
    if not intact:
        raise RuntimeError(
            f"The bundled digits file {_DIGITS_FILE} is damaged (checksum mismatch); reinstall replicafit."
        )
    x = pixels.astype(np.float32)
    if normalize:
        x /= 16.0
    if not images:
        x = x.reshape(len(x), 64)
    return x, target.astype(np.int64)


def make_classification(
    n_samples: int = 100,
    n_features: int = 20,
    *,
    n_classes: int = 2,
    n_informative: int | None = None,
    class_sep: float = 1.0,
    noise: float = 1.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded synthetic classification problem: Gaussian clusters around class centres.

    Each class gets a centre on a random vertex of a hypercube of side ``2 * class_sep``
    in the first ``n_informative`` features; samples add Gaussian noise of scale
    ``noise`` to every feature. Classes are balanced (sizes differ by at most one), rows
    shuffled.

    Returns ``(x, y)``: float32 ``(n_samples, n_features)``, int64 labels ``0..n_classes-1``.

    Example::

        x, y = make_classification(1000, 16, n_classes=4, seed=1)
    """
    if n_samples < 1 or n_features < 1 or n_classes < 2:
        raise ValueError(
            "make_classification needs n_samples >= 1, n_features >= 1 and n_classes >= 2, got "
            f"{n_samples}, {n_features}, {n_classes}."
        )
    informative = n_features if n_informative is None else n_informative
    if not 1 <= informative <= n_features:
        raise ValueError(f"n_informative must be between 1 and n_features ({n_features}), got {informative}.")
    rng = np.random.default_rng(seed)
    centres = np.zeros((n_classes, n_features))
    centres[:, :informative] = rng.choice([-class_sep, class_sep], size=(n_classes, informative))
    y = np.arange(n_samples) % n_classes
    rng.shuffle(y)
    x = centres[y] + noise * rng.standard_normal((n_samples, n_features))
    return x.astype(np.float32), y.astype(np.int64)


def make_regression(
    n_samples: int = 100,
    n_features: int = 10,
    *,
    n_informative: int | None = None,
    noise: float = 0.0,
    bias: float = 0.0,
    seed: int = 0,
    return_coef: bool = False,
):
    """A seeded synthetic linear regression problem: ``y = x @ coef + bias + noise``.

    ``x`` is standard normal; the first ``n_informative`` coefficients are drawn from
    ``U(-10, 10)``, the rest are 0.

    Returns ``(x, y)`` (float32, ``y`` of shape ``(n_samples,)``), plus ``coef`` when
    ``return_coef``.

    Example::

        x, y, coef = make_regression(500, 8, noise=0.1, seed=3, return_coef=True)
    """
    if n_samples < 1 or n_features < 1:
        raise ValueError(f"make_regression needs n_samples >= 1 and n_features >= 1, got {n_samples}, {n_features}.")
    informative = n_features if n_informative is None else n_informative
    if not 0 <= informative <= n_features:
        raise ValueError(f"n_informative must be between 0 and n_features ({n_features}), got {informative}.")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, n_features))
    coef = np.zeros(n_features)
    coef[:informative] = rng.uniform(-10.0, 10.0, informative)
    y = x @ coef + bias + noise * rng.standard_normal(n_samples)
    out = (x.astype(np.float32), y.astype(np.float32))
    return (*out, coef.astype(np.float32)) if return_coef else out
