"""Built-in datasets for recipes: ``digits``, ``classification``, ``regression``, ``npz``, ``csv``.

Each returns ``{"train": (x, y), "validation": (x, y) or None, "task": ..., "inputs": ...,
"classes": ...}``; the recipe's ``fit`` gets the arrays. A recipe's own dataset factory may
return that dict, or just the training data in any form ``fit`` takes (``as_info``).

Example::

    >>> info = digits(validation_split=0.2, seed=0)
    >>> info["train"][0].shape, info["validation"][0].shape, info["classes"]
    ((1438, 64), (359, 64), 10)
"""

from __future__ import annotations

import csv as csv_module
import os
from collections.abc import Mapping

import numpy as np
import torch

from replicafit.data import datasets as shipped
from replicafit.data import is_array_nest
from replicafit.strategies.describe import describe_value

__all__ = ["digits", "classification", "regression", "npz", "csv", "as_info", "target_width", "training_data_form"]

_FORMS = "(x, y) arrays, a torch Dataset, or a DataLoader or another iterable of batches"


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


def training_data_form(value) -> str | None:
    """Which of fit's data forms ``value`` is: ``"arrays"``, ``"dataset"`` (a map-style torch Dataset, batched
    by the trainer) or ``"batches"`` (a DataLoader or another iterable of batches); None for anything else."""
    if is_array_nest(value):
        return "arrays"
    if isinstance(value, torch.utils.data.Dataset) and not isinstance(value, torch.utils.data.IterableDataset):
        return "dataset"
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        return None
    return "batches"


def as_info(value) -> dict:
    """What a dataset factory returned, as the dict a recipe reads: ``train``, ``validation``, ``inputs``, ``classes``.

    A dict with ``train`` is taken as it is (a dict without it is an error, even one of arrays, which
    ``fit`` would read as inputs without targets); anything else ``fit`` takes (``(x, y)`` arrays, a torch
    ``Dataset``, a ``DataLoader`` or another iterable of batches) is the training data. Where the dict
    leaves them out, ``inputs`` (features per example) and ``classes`` (for integer labels) are read
    from the arrays or a ``TensorDataset``'s tensors; from another map-style Dataset, ``inputs`` from
    its first example and ``classes`` from its ``targets`` or ``labels`` attribute, without going
    through the examples (see ``_examples``). A ``ValueError`` says what is wrong.

    Example::

        >>> info = as_info((np.zeros((8, 3), np.float32), np.arange(8) % 2))
        >>> info["inputs"], info["classes"], info["validation"]
        (3, 2, None)
        >>> info = as_info(torch.utils.data.TensorDataset(torch.zeros(8, 3), torch.arange(8) % 4))
        >>> info["inputs"], info["classes"]
        (3, 4)
    """
    if isinstance(value, Mapping) and "train" in value:
        for part in ("train", "validation"):
            if value.get(part) is not None and training_data_form(value[part]) is None:
                raise ValueError(
                    f"returned a dict whose {part!r} entry is {describe_value(value[part])}: expected {_FORMS}"
                )
        return {**_read_sizes(value["train"]), "validation": None, **dict(value)}
    if isinstance(value, Mapping) or training_data_form(value) is None:  # a dict is always the dict form
        what = "a dict without a 'train' entry" if isinstance(value, Mapping) else describe_value(value)
        raise ValueError(
            f"returned {what}, not a dataset (expected {_FORMS}, or a dict with 'train' and optionally 'validation')"
        )
    return {**_read_sizes(value), "train": value, "validation": None}


def _read_sizes(train) -> dict:
    """``inputs`` and ``classes`` as far as they can be read without going through the data (``_examples``)."""
    try:
        x, y, every = _examples(train)
        sizes = {"inputs": int(np.prod(tuple(x.shape[1:])))} if isinstance(x, (np.ndarray, torch.Tensor)) else {}
        if every and _integer_labels(y):
            sizes["classes"] = int(y.max()) + 1
        return sizes
    except Exception:  # noqa: BLE001 - a hint only: the model section can say inputs/outputs itself
        return {}


def target_width(train) -> int | None:
    """The width of 2-D targets (one-hot labels, several regression targets): a model's ``outputs``.

    Example::

        >>> target_width((np.zeros((4, 3), np.float32), np.zeros((4, 2), np.float32)))
        2
    """
    try:
        _, y, _ = _examples(train)
    except Exception:  # noqa: BLE001 - a hint only, as _read_sizes
        return None
    return int(y.shape[1]) if isinstance(y, (np.ndarray, torch.Tensor)) and y.ndim == 2 else None


def _examples(train) -> tuple:
    """``(x, y, every)``: features and targets with the examples first, read without going through the data.

    ``every``: ``y`` holds every example's target (so integer labels tell the class count). Arrays and a
    ``TensorDataset``'s tensors are in memory: all of them. Another map-style ``Dataset`` (a ``DataLoader``'s
    too) is not scanned (each example may be a file to read and transform): its first example gives the
    input size (and a vector target's width), and its class count comes from a ``targets`` or ``labels``
    attribute holding one label per example, as torchvision's datasets have; a ``Subset`` (``random_split``)
    takes its indices' labels from the dataset under it. ``(None, None, False)`` where nothing tells.
    """
    form = training_data_form(train)
    if form == "arrays":
        return (
            (train[0], train[1] if len(train) > 1 else None, True) if isinstance(train, tuple) else (train, None, True)
        )
    dataset = train if form == "dataset" else getattr(train, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not isinstance(dataset, torch.utils.data.Dataset):
        return None, None, False
    labels = _labels(dataset)
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return dataset.tensors[0], labels, labels is not None
    first = dataset[0] if len(dataset) else None
    x, y = (
        (first[0], first[1] if len(first) > 1 else None)
        if isinstance(first, (tuple, list)) and first
        else (first, None)
    )
    x = x[None] if isinstance(x, (np.ndarray, torch.Tensor)) else None
    if labels is not None:
        return x, labels, True
    return x, (y[None] if isinstance(y, (np.ndarray, torch.Tensor)) else None), False


def _labels(dataset):
    """Every example's target where the dataset holds them in memory (see ``_examples``), else None."""
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return dataset.tensors[1] if len(dataset.tensors) > 1 else None
    if isinstance(dataset, torch.utils.data.Subset):
        labels = _labels(dataset.dataset)
        return None if labels is None else labels[torch.as_tensor(list(dataset.indices), dtype=torch.long)]
    for name in ("targets", "labels"):
        labels = getattr(dataset, name, None)
        if isinstance(labels, list) and labels and all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
            labels = torch.tensor(labels)
        if isinstance(labels, (np.ndarray, torch.Tensor)) and len(labels) == len(dataset):
            return torch.as_tensor(labels)
    return None


def _integer_labels(y) -> bool:
    if isinstance(y, np.ndarray):
        return y.ndim == 1 and len(y) > 0 and np.issubdtype(y.dtype, np.integer)
    if isinstance(y, torch.Tensor):
        return (
            y.dim() == 1
            and y.numel() > 0
            and not y.dtype.is_floating_point
            and not y.dtype.is_complex
            and (y.dtype is not torch.bool)
        )
    return False
