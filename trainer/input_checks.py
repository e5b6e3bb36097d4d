"""The checks at ``fit``'s and ``evaluate``'s entry on the data (``arguments.py`` checks the plain arguments):
the data yields a batch at all; batches are ``x``, ``(x, y)`` or ``(x, y, sample_weight)`` with the labels
the loss needs; the loss takes the first batch (labels in range, torch's argument order). Each problem is
said before any replica runs, with the fix. The first batch's outputs also tell the metrics the model's
outputs and their shapes (``"accuracy"`` is resolved from them).

``InputChecks`` holds what the checks ask: the strategy (across workers the checks agree), the trainer's
``CompileLoss`` (the loss to meet) and ``CompileMetrics`` (whose specs may need the outputs' shapes), and
the ``model_io.ModelIO`` where the first batch's reading of the model's outputs is kept. ``Trainer`` makes
one and calls ``check_first_batch`` as ``fit`` and ``evaluate`` begin, then builds the metrics from what it
returns; ``first_look`` and ``checked_validation`` are the checks that need nothing of the trainer.

Example::

    first = first_look(cursor, 0, "training data", "fit()")  # ValueError if empty; the first step keeps it
    found = checks.check_first_batch(first, dm, "fit()", float_dtype=torch.float32, builtin_step=True)
    source = checked_nonempty(source, "validation data", "fit()")  # by its length where it has one
    labels = in_memory_labels((x, y))  # y: every label of in-memory data is checked against the loss
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

import replicafit.data as data_layer
from replicafit.strategies import nest
from replicafit.strategies.describe import describe_structure

from . import losses, metrics
from .inputs import as_dtype, batch_source, length_of, rows, unpack
from .model_io import call_model, counts_items, inputs_with_labels, metric_targets, model_loss, passes_keywords

__all__ = [
    "FirstBatch",
    "InputChecks",
    "checked_nonempty",
    "checked_validation",
    "first_look",
    "in_memory_labels",
    "one_shot",
]

_NOTHING = object()


class FirstBatch(NamedTuple):
    """What the first batch tells, once every check passed (alike on every worker): the model's outputs
    (``structure``: a dict, tuple or list of several, else None), one example's ``labels`` and ``outputs``
    (the shapes that resolve ``"accuracy"``; None when unknown) and whether the model's own loss counts
    items (``loss=None``: ``CompileLoss.counts_items``). ``stand_in``: where the model's forward pass gathers
    its sharded parameters, one row of the first batch (the chief's), on which a replica with an empty
    batch runs forward and backward with weight 0 (a model need not take an empty batch); else None."""

    structure: object
    labels: object
    outputs: object
    counts_items: bool
    stand_in: object = None


def first_look(cursor, pass_index: int, what: str, caller: str):
    """The host batch of the first step of pass ``pass_index`` (across workers this worker's part of the
    first global batch), read once: the cursor's next step is that batch. ``ValueError`` if the data
    yields no batch at all.

    Example::

        first = first_look(cursor, 0, "training data", "fit()")
    """
    first = cursor.peek(pass_index, 0)
    if first is None:
        raise ValueError(
            f"The {what} of {caller} is empty: it yields no batch. Pass at least one example "
            "(check the arrays, Dataset or iterable, and any filtering or splitting before it)."
        )
    return first


def checked_validation(validation_data, batch_size):
    """``validation_data``, checked to yield a batch (a one-shot iterator comes back re-chained).

    Example::

        validation_data = checked_validation((x_val, y_val), 64)
    """
    source = batch_source(validation_data, batch_size, False, None)
    checked = checked_nonempty(source, "validation data", "fit()")
    return checked if one_shot(source) else validation_data


class InputChecks:
    """The entry checks on the first batch, and what it tells the metrics.

    Args:
      strategy: the trainer's strategy (across workers every worker checks its part, and they agree).
      compiled_loss: the trainer's ``CompileLoss``: the loss the batches must meet.
      compiled_metrics: the trainer's ``CompileMetrics``: its specs say whether the outputs' shapes are needed.
      model_io: the trainer's ``model_io.ModelIO``, which the first batch's outputs decide.

    Example::

        checks = InputChecks(strategy, compiled_loss, compiled_metrics, ModelIO())
        found = checks.check_first_batch(first, dm, "fit()", float_dtype=torch.float32, builtin_step=True)
    """

    def __init__(self, strategy, compiled_loss, compiled_metrics, model_io):
        self._strategy = strategy
        self._compiled_loss = compiled_loss
        self._compiled_metrics = compiled_metrics
        self._model_io = model_io

    @property
    def _loss(self):
        return self._compiled_loss.loss

    def _probes_outputs(self) -> bool:
        """Whether the metrics need the model's outputs on a first batch: to know the outputs (unless the
        loss names them), or the shapes that resolve ``"accuracy"``."""
        resolved = any(metrics.resolved_by_shapes(spec) for spec in self._compiled_metrics.specs)
        return resolved or not isinstance(self._loss, (Mapping, list))

    def check_first_batch(
        self, first, dm, caller: str = "fit()", all_labels=None, *, float_dtype, builtin_step: bool
    ) -> FirstBatch:
        """The entry checks on ``first`` (``first_look``), alike on every worker, and what it tells the
        metrics (``_first_batch_checks``). ``dm``: the distributed model; ``all_labels``: every label of
        in-memory data (``in_memory_labels``); ``float_dtype``: the model's float type; ``builtin_step``:
        whether ``caller`` runs the built-in step and ``compute_loss`` (only then must batches meet the loss).

        Across workers each worker checks its own part of the first global batch; one whose part has no
        row checks the chief's first row instead (the chief's replicas come first in the split rule, so it
        always has rows); where the model's forward pass gathers its parameters (sharded) every worker checks
        the chief's part, so that each makes the same calls. A problem found on any worker is an error on every
        worker, and the decision
        that probes the model's loss (``loss=None``) is the chief's.

        Example::

            found = checks.check_first_batch(first, dm, "evaluate()", float_dtype=torch.float32, builtin_step=True)
            compiled_metrics.build(found.structure, found.labels, found.outputs, compiled_loss.loss_for)
        """
        cluster = self._strategy.cluster
        if cluster.num_workers == 1:
            return self._first_batch_checks(first, dm, caller, all_labels, float_dtype, builtin_step)
        stand_in = None
        if dm.gathers_parameters:  # (sharded parameters) every worker probes alike: with the chief's part
            first = cluster.broadcast(first if cluster.is_chief else None, "broadcasting the chief's first batch")
            if first is not None and rows(unpack(first)[0]) > 0:  # (on the model's device: its labels too)
                stand_in = _on_device_of(dm.module, nest.map_structure(lambda t: data_layer.as_tensor(t)[:1], first))
        empty = first is not None and rows(unpack(first)[0]) == 0
        if cluster.any(empty, "agreeing whether a worker's first batch is empty"):
            head = nest.map_structure(lambda t: data_layer.as_tensor(t)[:1], first) if cluster.is_chief else None
            head = cluster.broadcast(head, "broadcasting the chief's first row")
            first = head if empty else first
        error = found = None
        try:
            found = self._first_batch_checks(first, dm, caller, all_labels, float_dtype, builtin_step)
        except Exception as problem:  # noqa: BLE001 - every worker learns of it, then it is raised here
            error = problem
        said = cluster.all_gather(None if error is None else f"{type(error).__name__}: {error}", "the entry checks")
        if error is not None:
            raise error
        for worker, message in enumerate(said):
            if message is not None:
                raise ValueError(
                    f"Worker {worker} found a problem in its part of the first batch of {caller}: {message}"
                )
        counts = cluster.broadcast(found.counts_items, "agreeing whether the model's loss counts items")
        return found._replace(counts_items=counts, stand_in=stand_in)

    def _first_batch_checks(self, first, dm, caller, all_labels, float_dtype, built_in: bool) -> FirstBatch:
        """The checks on the first batch, and what the metrics need to know: whether the model has several
        outputs, and the shapes of each output's labels and predictions (``"accuracy"`` is resolved from
        them, as in Keras 3).

        The model (in eval mode, no gradients) is probed with one example of the first
        batch ``first``, unless the loss is a dict or list, which names the outputs, and no
        metric needs shapes. The probe's output decides, for the whole fit, what losses and
        metrics take of the model's outputs (``model_io.select_outputs``: a ``ModelOutput``'s
        logits...); a dict of inputs that ``forward`` names only in part is refused here.
        """
        structure = output = labels = None
        loss = self._loss
        self._model_io.reset()  # decided anew below, else on the first step's output
        if isinstance(loss, Mapping):
            structure = dict.fromkeys(loss)
        elif isinstance(loss, list):
            structure = [None] * len(loss)
        if first is not None and built_in:
            self._check_labels_present(first, caller)
        if first is not None:
            passes_keywords(dm.module, unpack(first)[0])  # a dict that forward names in part: said here
        if first is not None and self._probes_outputs():
            x, y, _ = unpack(first)
            if x is not None and rows(x) > 0:
                was_training = dm.module.training
                dm.module.eval()
                try:
                    with torch.no_grad():
                        probe = nest.map_structure(lambda t: data_layer.as_tensor(t)[:1], x)
                        probe = _on_device_of(dm.module, as_dtype(probe, float_dtype))
                        output = call_model(dm.module, probe)
                except (TypeError, AttributeError) as error:
                    if not isinstance(x, Mapping):
                        raise
                    raise TypeError(
                        f"The model cannot take the inputs of the first batch of {caller}: {describe_structure(x)} "
                        f"({type(error).__name__}: {error}). {_structures(caller)}"
                    ) from None
                finally:
                    dm.module.train(was_training)
                output = self._model_io.decide(output, loss, y)  # a ModelOutput's logits...
                if built_in and loss is not None:
                    _check_outputs_meet_labels(output, loss, y, caller)
                if structure is None:
                    structure = output if isinstance(output, (Mapping, tuple, list)) else None
                if y is not None:
                    labels = nest.map_structure(lambda t: data_layer.as_tensor(t)[:1], y)
                    labels = _on_device_of(dm.module, as_dtype(labels, float_dtype))
                    if built_in and structure is None and loss is not None:
                        whole = all_labels if all_labels is not None else y
                        self._check_loss_on_first_batch(whole, labels, output, caller)
                else:  # the labels in the inputs (a model's own loss): what the metrics compare, for their shapes
                    labels, output = metric_targets(dm.module, probe, None, output)
                    labels = labels[:1] if isinstance(labels, torch.Tensor) else None
        counts = loss is None and first is not None and self._probe_counts_items(first, dm, float_dtype)
        return FirstBatch(structure, labels, output, counts)

    def _probe_counts_items(self, first, dm, float_dtype) -> bool:
        """``Trainer(loss=None)``: whether the model's loss is a sum divided by the ``num_items_in_batch`` it is
        given (Hugging Face's loss kwargs). A model that takes ``**kwargs`` may ignore it (a Hugging Face
        classifier returns its own mean whatever it is given), so its signature is not enough: the loss of a
        few examples of the first batch with 1 and with 2 must halve. Eval mode, no gradients."""
        x, y, _ = unpack(first)
        module = dm.module
        total = rows(x) if x is not None else 0
        for count in sorted({min(total, 8), total}):  # a few rows; all of them if those have no real label
            head = functools.partial(_first_rows, count=count)
            probe_x = nest.map_structure(head, x)
            probe_y = None if y is None else nest.map_structure(head, y)
            inputs = _on_device_of(module, inputs_with_labels(module, as_dtype(probe_x, float_dtype), probe_y))
            if count == 0 or not counts_items(module, inputs):
                return False
            was_training = module.training
            module.eval()
            try:
                with torch.no_grad():
                    one, two = (model_loss(call_model(module, {**inputs, "num_items_in_batch": n})) for n in (1.0, 2.0))
            finally:
                module.train(was_training)
            if bool(torch.isfinite(one) and one != 0):
                return bool(torch.isclose(two * 2, one, rtol=1e-4))
        return False

    def _check_labels_present(self, first, caller: str) -> None:
        """A loss that needs labels, batches without: say which structures are understood and what arrived."""
        _, y, _ = unpack(first)
        if y is not None or not _needs_labels(self._loss):
            return
        named = [k for k in first if str(k).lower() in _LABEL_KEYS] if isinstance(first, Mapping) else []
        hint = (
            f" The labels look like they are in the dict under {named[0]!r}: yield (inputs, batch[{named[0]!r}])."
            if named
            else ""
        )
        raise ValueError(
            f"{caller} got batches without labels: the first batch is {describe_structure(first)}, which is taken as "
            f"the model's inputs x alone, and the loss {_loss_name(self._loss)} needs labels.{hint} "
            f"{_structures(caller)}"
        )

    def _check_loss_on_first_batch(self, y, labels, output, caller: str) -> None:
        """The loss on one example of the first batch, before any replica runs: labels out of range for a
        class-index loss (``y``: every label of in-memory data, else the first batch's), and a callable in
        torch's ``(input, target)`` order, are said here with the fix."""
        loss = self._loss
        if not isinstance(output, torch.Tensor) or not isinstance(labels, torch.Tensor):
            return
        classes = losses.class_count(loss, output)
        if classes is not None:
            target = data_layer.as_tensor(y) if not isinstance(y, (Mapping, tuple, list)) else None
            if target is not None and not target.is_floating_point() and target.numel():
                ignore = losses.ignore_index(loss)
                outside = (target < 0) | (target >= classes)
                if ignore is not None:
                    outside &= target != ignore
                if bool(outside.any()):
                    raise losses.labels_out_of_range(_loss_name(loss), target, classes, ignore)
        try:
            loss(labels, output)
        except Exception as error:  # noqa: BLE001 - diagnosed below, else raised as it is
            fn = loss.fn if isinstance(loss, losses._Callable) else None  # a callable of one's own
            if fn is None or not _works(fn, output, labels):
                raise
            raise ValueError(
                f"The loss {_loss_name(loss)} takes its arguments in torch's order (input, target): replicafit "
                f"calls loss(y_true, y_pred), as Keras does, and it failed on the first batch of {caller} "
                f"({type(error).__name__}: {error}). Pass loss=lambda y_true, y_pred: {_call_name(fn)}"
                f"(y_pred, y_true), or a torch loss module (torch.nn.CrossEntropyLoss()), which is called in "
                "torch's order."
            ) from None


def _on_device_of(module: torch.nn.Module, structure):
    """``structure``'s tensors on the device of ``module``'s first parameter (else buffer): the probes of a host
    batch, for a model on an accelerator (the steps get theirs placed by the input pipeline). Unchanged where the
    module holds no tensor."""
    held = next(itertools.chain(module.parameters(), module.buffers()), None)
    if held is None:
        return structure
    device = held.device

    def move(leaf):
        return leaf.to(device) if isinstance(leaf, torch.Tensor) and leaf.device != device else leaf

    return nest.map_structure(move, structure)


def _first_rows(t, count: int):
    return data_layer.as_tensor(t)[:count]


def checked_nonempty(source, what: str, caller: str):
    """``source``, after checking that it yields a batch at all: a sized source by its length, others by
    reading one batch (a one-shot iterator gets it put back in front). An empty source raises
    ``ValueError`` naming ``what`` was empty."""
    length = length_of(source)
    first = None
    if length is None:
        if one_shot(source):
            first = next(source, _NOTHING)
            if first is not _NOTHING:
                source = itertools.chain([first], source)
        else:
            batched = isinstance(source, (data_layer.ArrayBatches, data_layer.DatasetBatches))  # data's own sources
            first = next(source.iterate(0, 0) if batched else iter(source), _NOTHING)
    if length == 0 or first is _NOTHING:
        raise ValueError(
            f"The {what} of {caller} is empty: it yields no batch. Pass at least one example "
            "(check the arrays, Dataset or iterable, and any filtering or splitting before it)."
        )
    return source


def one_shot(source) -> bool:
    """An iterator that is its own iterator (a generator) can be read once only."""
    return iter(source) is source


def in_memory_labels(data):
    """The labels of ``(x, y[, w])`` arrays or tensors (checked whole at the entry), else None."""
    if isinstance(data, (tuple, list)) and len(data) in (2, 3) and isinstance(data[1], (np.ndarray, torch.Tensor)):
        return data[1]
    return None


def _structures(caller: str) -> str:
    """Which batch structures the built-in steps understand, and the fix, for ``caller`` ("fit()")."""
    return (
        "Batches are understood as x, (x, y) or (x, y, sample_weight) (tuples or lists); a dict is the "
        "model's inputs x, given to forward as keyword arguments when forward names its keys (Hugging Face's "
        "convention), else as one argument (Keras', its keys being the model's input names): pass "
        f"{caller.removesuffix('()')}(model, (x, y)), or a DataLoader that yields (inputs, labels)."
    )


def _check_outputs_meet_labels(output, loss, y, caller: str) -> None:
    """A dict of several outputs (no ``logits``), one loss and labels that are not a dict: Keras would need
    the labels per output, Hugging Face a ``logits`` entry; said before any replica runs."""
    if not isinstance(output, Mapping) or isinstance(loss, (Mapping, list)) or y is None or isinstance(y, Mapping):
        return
    raise ValueError(
        f"The model returns a dict with the entries {list(output)} on the first batch of {caller}, and the labels "
        f"are {describe_structure(y)}: a dict of several outputs is a multi-output model (Keras' convention), "
        "whose labels are a dict with the same keys (and whose loss may be a dict of them too). Pass the labels "
        f"as {{{', '.join(f'{key!r}: ...' for key in output)}}}, or return the prediction under 'logits' (the "
        "entry losses and metrics take, as of a Hugging Face model)."
    )


_LABEL_KEYS = {"y", "label", "labels", "target", "targets"}


def _loss_name(loss) -> str:
    if isinstance(loss, (Mapping, list)):
        return "given per output"
    return getattr(loss, "name", type(loss).__name__)


def _call_name(fn) -> str:
    name = getattr(fn, "__name__", "")
    return name if name.isidentifier() else "your_loss"


def _needs_labels(loss) -> bool:
    """Whether ``loss`` certainly needs labels (a built-in or torch loss; a callable of one's own may not)."""
    if isinstance(loss, Mapping):
        return any(_needs_labels(v) for v in loss.values())
    if isinstance(loss, list):
        return any(_needs_labels(v) for v in loss)
    return loss is not None and not isinstance(loss, losses._Callable)  # None: the model's own, labels in x


def _works(fn, *args) -> bool:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - only whether it works is asked
        return False
    return True
