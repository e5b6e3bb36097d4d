"""Making a batch of examples: ``collate_rows`` (dict rows, Hugging Face's), and ``CollatedDataset``, a
dataset of examples with the function that collates a batch of them, for ``fit``'s own batching.

A Hugging Face ``Dataset`` yields dict rows, in any format: lists of numbers (``with_format(None)``),
NumPy arrays (``"numpy"``) or tensors (``"torch"``). ``collate_rows`` stacks each column into one tensor
whatever the format, so the three give the same batches (torch's ``default_collate`` would turn a column
of Python lists into a list of tensors, one per position). Rows of different lengths need a collator that
pads them: ``CollatedDataset(dataset, collate_fn)`` gives one, and ``fit``, ``evaluate`` and ``predict``
batch, shuffle and shard it like any dataset, calling ``collate_fn`` on each batch's list of rows (on each
worker's rows of it, under ``MultiWorkerMirroredStrategy``).

Example::

    >>> rows = [{"input_ids": [1, 2, 3], "label": 0}, {"input_ids": [4, 5, 6], "label": 1}]
    >>> batch = collate_rows(rows)
    >>> batch["input_ids"].shape, batch["label"].tolist()
    (torch.Size([2, 3]), [0, 1])
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .sharding import _map_style

__all__ = ["CollatedDataset", "collate_rows"]

_PADDING_HINT = (
    "pass a collator that pads them: fit(model, data.CollatedDataset(dataset, collate_fn), batch_size=...) (the same "
    "for evaluate, predict and validation_data) or DataLoader(dataset, batch_size=..., collate_fn=collate_fn), "
    "with collate_fn e.g. transformers.DataCollatorWithPadding(tokenizer), "
    "DataCollatorForLanguageModeling(tokenizer, mlm=False) or a function of your own"
)


def collate_rows(rows):
    """A batch of examples: dict rows become one dict whose every column is a tensor, the rows stacked
    along a new first (batch) dimension.

    A column's values may be numbers, (nested) lists of numbers, NumPy arrays or tensors: a Hugging Face
    ``Dataset`` gives the same batch in any format (``with_format(None | "numpy" | "torch")``). Python
    numbers become tensors as ``torch.tensor`` makes them (integers ``int64``, floats the default float
    type). A dict value is a nested column (collated the same way), a tuple a tuple of columns; a list is
    a value, never a structure (torch's ``default_collate`` reads a list as a structure, which turns a
    column of token lists into one tensor per position). Rows that are not dicts or tuples go to
    ``default_collate``. Use it as a ``DataLoader``'s ``collate_fn`` to batch Python-format rows the way
    ``fit`` does.

    Raises ``ValueError`` naming the column for values that cannot be one tensor: strings (tokenize
    them, or drop the column), and rows of different shapes (pass a padding collator,
    ``CollatedDataset``).

    Example::

        >>> import numpy as np
        >>> batch = collate_rows([{"x": np.zeros(2, np.float32), "y": 1}, {"x": np.ones(2, np.float32), "y": 0}])
        >>> batch["x"].tolist(), batch["y"].dtype
        ([[0.0, 0.0], [1.0, 1.0]], torch.int64)
    """
    rows = list(rows)
    if not rows:
        raise ValueError("collate_rows() got no rows: a batch holds one example at least.")
    return _collate(rows, ())


def _collate(values: list, path: tuple):
    first = values[0]
    if isinstance(first, Mapping):
        return {key: _collate([_entry(value, key, path) for value in values], (*path, key)) for key in first}
    if isinstance(first, tuple) and not hasattr(first, "_fields"):
        return tuple(_collate([value[i] for value in values], (*path, i)) for i in range(len(first)))
    if not path:  # rows that are neither dicts nor tuples: torch's own rules
        return torch.utils.data.default_collate(values)
    return _column(values, path)


def _entry(row, key, path: tuple):
    if not isinstance(row, Mapping) or key not in row:
        raise ValueError(
            f"Column {_name((*path, key))} is missing from a row of the batch: every row must have the same columns "
            "(the first row's); pass a collate_fn of your own for rows that differ."
        )
    return row[key]


def _name(path: tuple) -> str:
    return repr(".".join(str(part) for part in path))


def _column(values: list, path: tuple) -> torch.Tensor:
    """One column's values as one tensor (the batch first), or ``ValueError`` naming the column."""
    if all(isinstance(value, torch.Tensor) for value in values):
        return _stack(values, path)
    if all(isinstance(value, np.ndarray) for value in values):
        for value in values:
            if value.dtype.kind in "OUSV":
                raise _not_numbers(path, value.flat[0] if value.size else value)
        # (a copy: arrays that Arrow hands out are read-only, which torch.from_numpy would warn about)
        return _stack([torch.tensor(value) for value in values], path)
    try:
        return torch.tensor(values)
    except (TypeError, ValueError, RuntimeError):
        pass  # (say why: strings, rows of different shapes, or values that are not numbers)
    return _stack([_tensor(value, path) for value in values], path)


def _tensor(value, path: tuple) -> torch.Tensor:
    """One row's value as a tensor, or ``ValueError`` naming the column."""
    if isinstance(value, torch.Tensor):
        return value
    leaf = _first_leaf(value)  # (an empty list stays one: an empty row of numbers)
    if not isinstance(leaf, (int, float, bool, np.number, np.bool_, torch.Tensor, np.ndarray, list, tuple)):
        raise _not_numbers(path, leaf)
    try:
        return torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"Column {_name(path)} has a value that is not a rectangular array of numbers ({error}): its lists "
            f"must have the same lengths within a row; {_PADDING_HINT}."
        ) from None


def _first_leaf(value):
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, np.ndarray) and value.dtype.kind in "OUSV" and value.size:
        return value.flat[0]
    return value


def _stack(tensors: list, path: tuple) -> torch.Tensor:
    shapes = [tuple(t.shape) for t in tensors]
    if len(set(shapes)) > 1:
        other = next(shape for shape in shapes if shape != shapes[0])
        raise ValueError(
            f"Column {_name(path)} has rows of different shapes in one batch ({shapes[0]} and {other}): they cannot "
            f"be stacked into one tensor. For rows of different lengths, {_PADDING_HINT}."
        )
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:  # (e.g. a float row among integer ones in Python format)
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        tensors = [t.to(dtype) for t in tensors]
    return torch.stack(tensors)


def _not_numbers(path: tuple, leaf) -> ValueError:
    what = "strings" if isinstance(leaf, (str, bytes, np.str_, np.bytes_)) else f"{type(leaf).__name__} values"
    return ValueError(
        f"Column {_name(path)} holds {what} (e.g. {leaf!r:.40}), which cannot be collated into a tensor: tokenize or "
        f"encode it into numbers and drop it (dataset.remove_columns([{_name(path[:1])}])), keep only the model's "
        "columns (dataset.select_columns([...])), or pass a collator that handles it: "
        "fit(model, data.CollatedDataset(dataset, collate_fn), batch_size=...)."
    )


class CollatedDataset:
    """A dataset of examples and the function that makes a batch of them, for the batching of ``fit``,
    ``evaluate`` and ``predict`` (``batch_size``), ``validation_data`` and ``data.as_global_batches``.

    Args:
      dataset: examples addressed by index (a Hugging Face ``Dataset``, a map-style torch ``Dataset``, a
        list): batched, shuffled and sharded by rows as any map-style dataset; or a stream of examples
        (a Hugging Face ``IterableDataset``, a torch ``IterableDataset`` of single examples): batched in
        the order it yields them, each worker reading its shard.
      collate_fn: called with a list of examples, returns the batch (a dict, tuple or tensor with the
        batch first): ``transformers.DataCollatorWithPadding(tokenizer)``,
        ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` or any function, as a ``DataLoader``'s
        ``collate_fn``. The batches are those of ``DataLoader(dataset, batch_size=..., collate_fn=...)``.

    The collator goes with the data rather than into ``fit``'s arguments: training and validation data
    may need different ones, and ``evaluate``/``predict`` take it the same way. Under several workers each
    worker collates only its replicas' rows of a global batch (as with a ``DataLoader``), so a padding
    collator pads each worker's part to its own longest row: a model that masks its padding (an
    ``attention_mask``, labels ``-100``) trains the same; pad to a fixed length (``padding="max_length"``,
    ``pad_to_multiple_of``) where the shapes must agree.

    Example::

        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = Trainer(loss=None, optimizer="adam")
        trainer.fit(gpt2, CollatedDataset(tokenized["train"], collator), batch_size=8,
                    validation_data=CollatedDataset(tokenized["validation"], collator))
    """

    def __init__(self, dataset, collate_fn):
        if not callable(collate_fn):
            raise TypeError(
                f"collate_fn must be callable (a function of a list of examples), got {type(collate_fn).__name__}."
            )
        if isinstance(dataset, CollatedDataset):
            raise TypeError(
                "The dataset is a CollatedDataset already: pass its .dataset with the collate_fn to use "
                "(one collator per batch)."
            )
        self.dataset = dataset
        self.collate_fn = collate_fn

    @property
    def by_index(self) -> bool:
        """True where the examples are addressed by index, map-style (``dataset[i]`` and ``len``), rather
        than streamed in order.

        Example::

            CollatedDataset([{"x": 1}], collate_rows).by_index   # True
        """
        return _map_style(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __repr__(self) -> str:
        return f"CollatedDataset({type(self.dataset).__name__}, collate_fn={self.collate_fn!r:.60})"
