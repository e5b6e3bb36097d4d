"""Built-in datasets for recipes: ``digits``, ``classification``, ``regression``, ``npz``, ``csv``.

Each returns ``{"train": (x, y), "validation": (x, y) or None, "task": ..., "inputs": ...,
"classes": ...}``; the recipe's ``fit`` gets the arrays.

Example::

    >>> info = digits(validation_split=0.2, seed=0)
    >>> info["train"][0].shape, info["validation"][0].shape, info["classes"]
    ((1438, 64), (359, 64), 10)
"""

from __future__ import annotations

import csv as csv_module
import os

import numpy as np

from replicafit.data import datasets as shipped

__all__ = ["digits", "classification", "regression", "npz", "csv"]


def _split(x, y, validation_split: float, shuffle: bool, seed: int):
    if not 0 <= validation_split < 1:
        raise ValueError(f"validation_split must be in [0, 1), got {validation_split}")
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(x))
        x, y = x[order], y[order]
    cut = len(x) - int(round(len(x) * validation_split))
    validation = (x[cut:], y[cut:]) if cut < len(x) else None
    return (x[:cut], y[:cut]), validation


def _info(x, y, validation_split, shuffle, seed, task):
    train, validation = _split(x, y, validation_split, shuffle, seed)
    classes = int(y.max()) + 1 if task == "classification" else None
    return {
        "train": train,
        "validation": validation,
        "task": task,
        "inputs": int(np.prod(x.shape[1:])),
        "classes": classes,
    }


def digits(
    validation_split: float = 0.2, shuffle: bool = True, images: bool = False, normalize: bool = True, seed: int = 0
) -> dict:
    """The bundled UCI handwritten digits (1,797 8x8 images, 10 classes; CC BY 4.0).

    ``shuffle`` mixes the examples once (seeded) before the validation split: the file is
    ordered by writer.
    """
    x, y = shipped.load_digits(images=images, normalize=normalize)
    return _info(x, y, validation_split, shuffle, seed, "classification")


def classification(
    n_samples: int = 1000,
    n_features: int = 20,
    n_classes: int = 2,
    n_informative: int = None,
    class_sep: float = 1.0,
    noise: float = 1.0,
    validation_split: float = 0.2,
    seed: int = 0,
) -> dict:
    """Seeded Gaussian clusters (``replicafit.data.datasets.make_classification``)."""
    x, y = shipped.make_classification(
        n_samples,
        n_features,
        n_classes=n_classes,
        n_informative=n_informative,
        class_sep=class_sep,
        noise=noise,
        seed=seed,
    )
    return _info(x, y, validation_split, False, seed, "classification")


def regression(
    n_samples: int = 1000,
    n_features: int = 10,
    n_informative: int = None,
    noise: float = 0.1,
    bias: float = 0.0,
    validation_split: float = 0.2,
    seed: int = 0,
) -> dict:
    """A seeded linear regression problem (``replicafit.data.datasets.make_regression``); targets shaped ``(n, 1)``."""
    x, y = shipped.make_regression(
        n_samples, n_features, n_informative=n_informative, noise=noise, bias=bias, seed=seed
    )
    return _info(x, y.reshape(-1, 1), validation_split, False, seed, "regression")


def _task_labels(labels: np.ndarray, task: str) -> np.ndarray:
    if task == "classification":
        if not np.allclose(labels, np.round(labels)):
            raise ValueError("classification labels must be integers")
        return labels.astype(np.int64)
    if task == "regression":
        return labels.astype(np.float32).reshape(len(labels), -1)
    raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")


def npz(
    path: str,
    features: str = "x",
    labels: str = "y",
    task: str = "classification",
    validation_split: float = 0.0,
    shuffle: bool = False,
    seed: int = 0,
) -> dict:
    """Arrays from a NumPy ``.npz`` file: ``features`` and ``labels`` name the arrays."""
    if not os.path.exists(path):
        raise ValueError(f"no such file: {path!r}")
    with np.load(path, allow_pickle=False) as archive:
        missing = [name for name in (features, labels) if name not in archive.files]
        if missing:
            raise ValueError(f"{path} has no array(s) {missing}; it holds {sorted(archive.files)}")
        x, y = archive[features].astype(np.float32), archive[labels]
    return _info(x, _task_labels(y, task), validation_split, shuffle, seed, task)


def csv(
    path: str,
    label: str,
    features: list = None,
    task: str = "classification",
    delimiter: str = ",",
    validation_split: float = 0.0,
    shuffle: bool = False,
    seed: int = 0,
) -> dict:
    """A CSV file with a header: ``label`` names the target column, ``features`` the inputs
    (default: every other column). Values must be numbers."""
    if not os.path.exists(path):
        raise ValueError(f"no such file: {path!r}")
    with open(path, newline="") as file:
        reader = csv_module.reader(file, delimiter=delimiter)
        header = next(reader, None)
        rows = [row for row in reader if row]
    if header is None:
        raise ValueError(f"{path} is empty")
    columns = features if features is not None else [c for c in header if c != label]
    missing = [c for c in list(columns) + [label] if c not in header]
    if missing:
        raise ValueError(f"{path} has no column(s) {missing}; its columns are {header}")
    try:
        table = np.array(
            [[float(row[header.index(c)]) for c in list(columns) + [label]] for row in rows], dtype=np.float64
        )
    except (ValueError, IndexError) as error:
        raise ValueError(f"{path}: every value must be a number ({error})") from None
    x, y = table[:, :-1].astype(np.float32), table[:, -1]
    return _info(x, _task_labels(y, task), validation_split, shuffle, seed, task)
