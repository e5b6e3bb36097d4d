"""``CompileLoss``: the trainer's loss as its steps compute it (Keras 3's ``CompileLoss``), and the state of
an element-level loss's reduction over the whole global batch while a fit runs.

One loss, or (a model with several outputs) a dict or list of them whose per-example losses are summed,
each output's also tracked in the metrics' ``<output>_loss``. A per-example loss: each replica's share is
its examples' losses summed and divided by the step's global batch size. An element-level loss (a
prediction per token or pixel: ``losses`` module docstring) is the loss's own mean over the whole global
batch instead: each replica sums its element losses, divides them by a constant of the fit (the
*prescale*, which keeps float16 gradients in the mean's range) and adds its count of real elements to the
step (``cluster.add_to_step``); the count rides with the gradient reduction and the optimizer divides the
reduced gradients by the global total (``optimizer.gradient_denominator``).

Used by ``Trainer`` (its steps, ``compute_loss``), ``InputChecks`` (the loss the first batch is checked
against), ``CompileMetrics`` (a metric resolved from an output's loss), the fit's setup and ``FitLoop``
(the element-level reduction begins and ends with each fit) and ``TrainingState`` (an open accumulation
window's count of real elements, which checkpoints and backups keep).

Example::

    compiled = CompileLoss("cross_entropy", strategy, compiled_metrics)
    terms = compiled.terms(y, y_pred, sample_weight)  # in a replica: LossTerms(total, count, per_example)
    loss = compiled.step_loss(terms, global_batch_size)  # the replica's share of the step's loss
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Mapping

import torch

from replicafit import optimizers
from replicafit.strategies import nest
from replicafit.strategies.step_values import wide_float

from . import losses
from .inputs import rows, unpack

__all__ = ["CompileLoss", "output_names", "output_part"]

_DENOMINATOR = "replicafit/loss denominator"  # the step value of an element-level loss's real elements


def output_names(outputs) -> list:
    """The names of a model's several outputs: a dict's keys, else ``output_0``, ``output_1``, ...

    Example::

        >>> output_names({"classes": 0, "flag": 1}), output_names((0, 1))
        (['classes', 'flag'], ['output_0', 'output_1'])
    """
    if isinstance(outputs, Mapping):
        return list(outputs.keys())
    return [f"output_{i}" for i in range(len(outputs))]


def output_part(structure, name):
    """The part of ``structure`` (labels or predictions of several outputs) for the output ``name``.

    Example::

        >>> output_part((10, 20), "output_1"), output_part({"flag": 3}, "flag")
        (20, 3)
    """
    if isinstance(structure, Mapping):
        return structure[name]
    return structure[int(name.rsplit("_", 1)[1])]


class CompileLoss:
    """The trainer's loss, per output, and the element-level reduction of a running fit.

    Args:
      loss: ``Trainer``'s ``loss`` argument: a name, a callable, a torch loss module, a dict/list of them
        (one per output), or None (the loss the model returns).
      strategy: the trainer's strategy (its cluster carries an element-level loss's counts).
      compiled_metrics: the ``CompileMetrics`` whose ``<output>_loss`` trackers follow each output's loss.

    Attributes (read in every step; written only here, ``counts_items`` by the entry checks' decision):
      element_denominator: the ``optimizers.GradientDenominator`` of an element-level loss while a fit
        runs, else None.
      count_floating: whether the element-level step value is a float (class weights) or an int (a count).
      counts_items: ``loss=None`` with a model that divides its loss by the ``num_items_in_batch`` it is
        given (Hugging Face's loss kwargs; probed on a fit's first batch).

    Example::

        compiled = CompileLoss({"classes": "cross_entropy", "flag": "binary_crossentropy"}, strategy, metrics)
        compiled.loss_for("flag")  # the BinaryCrossentropy of the output "flag"
    """

    def __init__(self, loss, strategy, compiled_metrics):
        if loss is None:  # the model's own: it returns a loss when its inputs hold the labels
            self.loss = None
        elif isinstance(loss, (Mapping, list)):
            self.loss = nest.map_structure(losses.get, loss)
        else:
            self.loss = losses.get(loss)
        self._strategy = strategy
        self._metrics = compiled_metrics
        self._untracked = threading.local()  # untracked(): a forward pass counted nowhere
        self.element_denominator = None
        self.count_floating = False
        self.counts_items = False
        self._window_count = None  # a restored open window's real elements (float), until the next fit starts

    def loss_for(self, name):
        """The loss of the output ``name`` (``output_names``); the one loss where there is one.

        Example::

            compiled.loss_for("output_1")  # the second of loss=[...]
        """
        if isinstance(self.loss, Mapping):
            return self.loss[name]
        if isinstance(self.loss, list):
            return self.loss[int(name.rsplit("_", 1)[1])]
        return self.loss

    def terms(self, y, y_pred, sample_weight, per_example: bool) -> losses.LossTerms:
        """This replica's ``losses.LossTerms`` of the loss; several outputs are each reduced per example,
        summed, and tracked per output (``CompileMetrics.update_output_loss``).

        Example::

            terms = compiled.terms(y, y_pred, None, per_example=True)  # terms.per_example: one loss per row
        """
        if not isinstance(y_pred, (Mapping, tuple, list)):
            return self.loss.terms(y, y_pred, sample_weight, per_example=per_example)
        total = None
        for name in output_names(y_pred):
            loss = self.loss_for(name)
            terms = loss.terms(output_part(y, name), output_part(y_pred, name), sample_weight, True)
            if not getattr(self._untracked, "on", False):
                self._metrics.update_output_loss(name, terms.per_example.detach())
            total = terms.per_example if total is None else total + terms.per_example
        return losses.LossTerms(total.sum(), total.shape[0], total)

    @contextlib.contextmanager
    def untracked(self):
        """On this thread, ``terms`` tracks no per-output loss: for a forward pass that counts nowhere (the stand-in
        row of a replica without rows, which takes part in gathering sharded parameters).

        Example::

            with compiled.untracked():
                terms = compiled.terms(y, y_pred, None, per_example=True)
        """
        outer = getattr(self._untracked, "on", False)
        self._untracked.on = True
        try:
            yield
        finally:
            self._untracked.on = outer

    def step_loss(self, terms: losses.LossTerms, global_batch_size: int) -> torch.Tensor:
        """The replica's loss to differentiate: its share of the global batch's loss (the divisor of an
        element-level loss is applied after the reduction, its count added to the step here).

        Example::

            loss = compiled.step_loss(terms, trainer.global_batch_size)  # in a replica's train_step
        """
        denominator = self.element_denominator
        if denominator is None:
            return terms.total / global_batch_size
        # One kind on every worker, decided when fit started: a count of real elements rides exactly as an
        # integer; a sum of class weights as a float.
        count = terms.count
        if self.count_floating:
            count = torch.as_tensor(count, dtype=wide_float(terms.total.device))
        self._strategy.cluster.add_to_step(denominator.step_value, count)
        return terms.total / denominator.prescale

    def add_no_elements(self) -> None:
        """An empty replica's part of an element-level step: no real element, of the step value's kind (every
        worker carries the same step values).

        Example::

            if compiled.element_denominator is not None:
                compiled.add_no_elements()  # a replica with no row this step
        """
        denominator = self.element_denominator
        self._strategy.cluster.add_to_step(denominator.step_value, 0.0 if self.count_floating else 0)

    def start_element_reduction(self, first, first_rows, optimizer, *, single_output: bool, builtin_step: bool):
        """An element-level loss (``losses`` module docstring) in the built-in step (``builtin_step``: the
        built-in ``train_step`` and ``compute_loss``) of a model with one output: its real elements' weight
        rides with each update's reduction (``optimizer.gradient_denominator``); each replica divides its
        loss by a constant before backward, the first global batch's count of label elements (its rows
        without labels; agreed across workers), which keeps float16 gradients in the mean's range, and the
        optimizer divides by the global total over that constant after the reduction. ``first``: the first
        host batch; ``first_rows``: the rows of the whole first global batch (None: ``first``'s).

        Example::

            compiled.start_element_reduction(first, cursor.batch_size, optimizer, single_output=True,
                                              builtin_step=True)
        """
        self.element_denominator = None
        restored, self._window_count = self._window_count, None  # what a restored window counted
        x, y, _ = unpack(first)
        if self.loss is None:  # the model's own loss: element-level where it divides by num_items_in_batch
            element_level, self.count_floating = self.counts_items, False
        else:
            single_output = isinstance(self.loss, losses.Loss) and single_output
            element_level = single_output and self.loss.element_level  # several outputs: per example
            self.count_floating = getattr(self.loss, "count_floating", None) is not False  # unknown: a float
        if not (element_level and builtin_step):
            return
        leaves = [t for t in nest.flatten(y) if hasattr(t, "shape")] if y is not None else []
        per_row = math.prod(leaves[0].shape[1:]) if leaves else 1
        cluster = self._strategy.cluster
        first_rows = rows(x) if first_rows is None else first_rows  # the whole first global batch's rows
        prescale = cluster.broadcast(float(max(1, first_rows * per_row)), "agreeing on the loss's prescale")
        # What an interrupted fit left is dropped, unless its open window goes on in memory (its count with it).
        if restored is not None or not optimizer.accumulated_steps:
            cluster.discard_step_value(_DENOMINATOR)
        if restored is not None:  # a restored open window's real elements so far (counted once: the chief's)
            value = restored if cluster.is_chief else 0.0
            dtype = wide_float(self._strategy.extended.worker_devices[0]) if self.count_floating else torch.int64
            cluster.add_to_step(_DENOMINATOR, torch.tensor(value, dtype=dtype))
        self.element_denominator = optimizers.GradientDenominator(_DENOMINATOR, prescale)
        optimizer.gradient_denominator = self.element_denominator

    def end_element_reduction(self, optimizer) -> None:
        """The fit has ended: the optimizer divides by nothing of ours any more.

        Example::

            compiled.end_element_reduction(trainer.optimizer)  # however the fit ends
        """
        if self.element_denominator is not None:
            optimizer.gradient_denominator = self.element_denominator = None

    def window_count(self):
        """The real elements an open accumulation window has counted so far (a float), for a checkpoint or a
        backup: read (a collective, as the whole state is) and added back, once (the chief's; the others add
        0.0, so every worker carries the same step values). None without an element-level reduction.

        Example::

            count = compiled.window_count()  # inside save_checkpoint, on every worker alike
        """
        denominator = self.element_denominator
        if denominator is None:
            return None
        cluster = self._strategy.cluster
        total = cluster.step_total(denominator.step_value)
        cluster.add_to_step(denominator.step_value, total if cluster.is_chief else torch.zeros_like(total))
        return float(total)

    def restore_window_count(self, count) -> None:
        """A loaded open window's count of real elements (``window_count``, or None): added back to the step
        when the next fit starts its element-level reduction.

        Example::

            compiled.restore_window_count(state["optimizer"]["accumulation"].get("denominator"))
        """
        self._window_count = count
