"""The distribution-aware optimizer base class: ``apply_gradients`` is one pipeline of stages.

The stages, in this order (optax's ``chain``, ``MultiSteps`` and ``apply_if_finite``, and Keras 3's fixed
order, are the models); each is a small object with its own state, and a subclass writes only the rule:

1. **resolve**: ``None`` gradients dropped; plain parameters become variables (once per list);
2. **accumulate** (``accumulation.GradientAccumulation``, with ``gradient_accumulation_steps=N``): each
   replica adds its local gradients into its own sums, with no communication; steps 3-9 run at the
   window's last step only, on the window's sums;
3. **reduce**, once, in cross-replica context (a replica context ``merge_call``s into it): the state layout
   the strategy provides (``strategy.extended.state_layout``: ``WholeVariables``, or sharded slices)
   sums every replica's gradients: one batched ``batch_reduce_to(SUM)``, or a reduce-scatter that hands
   this worker the gradients of its slices. Gradients applied in cross-replica context are taken as
   reduced already;
4. **build** (the first update of a variable): slots for the layout's targets (``build``), weight-decay
   exclusions decided, a loaded state restored into them;
5. **divide** (``stages.divide``): an accumulation window's sums by its weight, or the gradients of an
   element-level loss by the global count of its real elements (``gradient_denominator``);
6. **gradient stages** (``stages.py``): a ``LossScaleOptimizer``'s unscaling and finite check (a step it
   skips still counts), then clipping: ``clipvalue``, ``clipnorm`` (per variable) or ``global_clipnorm``,
   on the gradient aggregated over every replica;
7. **update**, for every target and each of its copies, on its device: decoupled ``weight_decay``
   (``stages.WeightDecay``, unless ``exclude_from_weight_decay`` excluded it) → the rule
   (``update_step(gradient, variable, learning_rate)``; the built-ins run ``_update_many`` over groups of
   tensors instead, ``multi_tensor.py``) → with ``use_ema``, the copy's moving average
   (``ema.MovingAverages``; every ``ema_overwrite_frequency`` updates the copy overwritten by it);
8. **finish**: the layout makes every copy hold the update (sharded: the updated slices gathered);
9. ``iterations += 1`` (once per update, not once per replica).

The optimizer never asks which strategy runs it: where its state lives is the layout's business. Slot
variables made with ``add_variable_from_reference`` live where their target lives (mirrored under
``MirroredStrategy``, on the parameter device under ``CentralStorageStrategy``, this worker's slices
under sharded optimizer states), and ``get_slot`` inside ``update_step`` resolves to the copy that
matches the variable copy being updated. So a subclass is correct under every strategy without seeing
one. Where the layout's targets are slices of variables (``StateLayout.slices_variables``), ``build`` and
``update_step`` see 1-D slices, which is right for every element-wise rule; a rule that reads whole
variables (a norm per variable, a factorisation by shape) sets the class attribute
``elementwise_update = False`` and is refused there.

A complete optimizer (Lion, Chen et al. 2023) in a few lines::

    import torch
    from replicafit.optimizers import Optimizer

    class Lion(Optimizer):
        def __init__(self, learning_rate=1e-4, beta_1=0.9, beta_2=0.99, **kwargs):
            super().__init__(learning_rate, **kwargs)
            self.beta_1, self.beta_2 = beta_1, beta_2

        def build(self, variables):
            super().build(variables)
            for v in variables:
                self.add_variable_from_reference(v, "momentum")

        def update_step(self, gradient, variable, learning_rate):
            m = self.get_slot(variable, "momentum")
            update = torch.sign(m * self.beta_1 + gradient * (1 - self.beta_1))
            variable.assign_sub(learning_rate * update)
            m.assign(m * self.beta_2 + gradient * (1 - self.beta_2))

        def get_config(self):
            return super().get_config() | {"beta_1": self.beta_1, "beta_2": self.beta_2}

Used in a custom training loop::

    with strategy.scope():
        optimizer = Lion(learning_rate=1e-3)

    def step(x, y):
        loss = loss_fn(model(x), y).sum() / global_batch_size
        grads = torch.autograd.grad(loss, [v.value() for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    strategy.run(step, args=(x, y))
"""

from __future__ import annotations

import contextlib
import inspect

import torch

import replicafit.strategies as ds
from replicafit.strategies import context
from replicafit.strategies.state_layout import WholeVariables
from replicafit.strategies.values import local_results, value_container

from . import options, schedules, stages
from . import state as state_format
from .accumulation import (
    GradientDenominator,
    checked_window_state,
    window_state,
)
from .ema import move_averages
from .multi_tensor import MultiTensorPlans
from .resolve import VariableResolver
from .slots import Slots, initial_value
from .tensors import _no_grad

__all__ = ["Optimizer"]


class Optimizer:
    """Base class of distribution-aware optimizers (see the module docstring for the pipeline).

    Args:
      learning_rate: a float >= 0, a ``schedules.LearningRateSchedule``, or a callable
        ``step -> float``. 0 is valid, as in Keras and ``torch.optim`` (the end of a
        cosine decay, a scheduler's last epoch); negative, NaN and infinite rates are
        refused, also when a schedule returns one.
      weight_decay: decoupled weight decay: before each update
        ``variable -= variable * weight_decay * learning_rate``.
      clipnorm: clip each aggregated gradient to this L2 norm.
      clipvalue: clip each aggregated gradient's entries to ``[-clipvalue, clipvalue]``.
      global_clipnorm: scale all aggregated gradients so their joint L2 norm is at most this.
      use_ema: keep an exponential moving average of every variable the optimizer updates
        (Keras 3's argument), as a slot ``"average"`` living where the variable lives. After
        each update ``average = ema_momentum * average + (1 - ema_momentum) * variable``,
        except the first update (``iterations == 0``), which sets ``average = variable``.
        ``finalize_variable_values`` writes the averages into the variables (``Trainer.fit``
        calls it at its end, as Keras' ``fit`` does); ``averaged_weights()`` swaps them in
        for a while (to evaluate with them).
      ema_momentum: the averages' momentum, in ``[0, 1]`` (default 0.99).
      ema_overwrite_frequency: ``None`` or an int >= 1: every this many updates the
        variables are overwritten with their averages (Keras 3's rule: after the update
        whose ``iterations + 1`` is a multiple of it).
      gradient_accumulation_steps: ``None`` or an int >= 2 (Keras 3's argument): every
        replica accumulates its local gradients for this many steps, then one batched
        reduction and one update apply them. Under ``Trainer.fit`` the window equals one step
        on its batches together (each step weighs its number of examples, so partial batches
        count for what they hold) and a partial window is applied at the end of each epoch;
        in a loop of one's own each step weighs the same (Keras' mean of the N gradients)
        and ``apply_accumulated_gradients()`` applies a partial window. Unlike Keras 3,
        ``iterations`` counts updates, not steps (a schedule advances once per window).
      name: defaults to the class name in lower case (``"adamw"``), as Keras names them.

    At most one of ``clipnorm``, ``clipvalue``, ``global_clipnorm`` may be set, as in
    Keras. Unlike Keras 3, clipping applies to the gradient aggregated over replicas.
    With gradient accumulation the averages move once per update (Keras 3 moves them on
    every step, also on the steps that leave the variables unchanged); a step a
    ``LossScaleOptimizer`` skips leaves them unchanged. The arguments are read-only
    attributes of the same names.

    Example::

        optimizer = AdamW(1e-3, weight_decay=0.05, use_ema=True, ema_momentum=0.999)
        optimizer.exclude_from_weight_decay(var_names=["bias", "norm"])
    """

    #: Whether the update rule treats every element on its own (the gradient and slots of an element decide its
    #: update): then the rule is right on slices of variables, which is what sharded optimizer states give it.
    #: A rule that reads a whole tensor (a norm per variable as LAMB or LARS, a factorisation by shape as
    #: Adafactor) sets ``False``: such an optimizer refuses a layout of slices with a clear error.
    elementwise_update = True

    #: Slots ``build`` makes only while a hyper-parameter asks for them (SGD's and RMSprop's ``"momentum"``, made
    #: once ``momentum`` leaves 0). A loaded state may hold one not made yet (it is made) or lack one that is (it
    #: starts again at zero), as ``torch.optim`` keeps or lacks a momentum buffer whatever the momentum is.
    _optional_slots: tuple = ()

    #: Built-ins implement ``_update_many`` over lists of tensors (one kernel per device/dtype).
    _multi_tensor = False

    def __init__(
        self,
        learning_rate=0.001,
        *,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        gradient_accumulation_steps=None,
        name=None,
    ):
        stages.check_one_clipping(clipnorm, clipvalue, global_clipnorm)
        # The shared arguments (SHARED_ARGUMENTS), the one place they are kept: the stages are made from them,
        # and made again when one is set later (``optimizer.clipnorm = 1.0``).
        self._options = {
            "weight_decay": weight_decay,
            "clipnorm": clipnorm,
            "clipvalue": clipvalue,
            "global_clipnorm": global_clipnorm,
            "use_ema": use_ema,
            "ema_momentum": ema_momentum,
            "ema_overwrite_frequency": ema_overwrite_frequency,
            "gradient_accumulation_steps": gradient_accumulation_steps,
        }
        self._weight_decay = stages.WeightDecay(None)
        self._accumulation = None
        self._averages = None
        self.name = name or type(self).__name__.lower()
        options.configure(self)
        self._learning_rate = self._check_learning_rate(learning_rate)
        #: How many updates were applied (a mirrored ``int64`` variable, saved with the optimizer): one per
        #: ``apply_gradients``, not one per replica; with gradient accumulation one per window. Schedules
        #: read it.
        self.iterations = ds.Variable(
            0,
            dtype=torch.int64,
            trainable=False,
            name=f"{self.name}/iterations",
            aggregation=ds.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self._gradient_stages: dict = {}  # name -> stage on the reduced gradients, before clipping (loss scaling)
        self._gradient_denominator: GradientDenominator | None = None
        self._layout = None  # the StateLayout the strategy gave for the variables (made at the first build)
        self._layout_from_strategy = False  # False: made for a direct build() call (whole slots)
        self._variables: list = []  # the variables built for, in order (the state's positions)
        self._targets: list = []  # what the rule updates for them: the variables, or the layout's slices
        self._target_ids: set = set()
        self._built_ids: set = set()  # ids of the variables and targets built for
        self._slots = Slots()
        self._plans = MultiTensorPlans()
        self._pending: state_format.PendingState | None = None  # loaded, for variables not built yet
        self._known_updates: tuple | None = None  # the host's copy of ``iterations`` (``updates_so_far``)
        self._resolver = VariableResolver()  # what apply_gradients is given, as variables (plain tensors wrapped)
        self._slots_outdated = False  # a hyper-parameter asks for slots build() did not make (_slots_changed)

    # --- the shared arguments, as attributes: setting one makes the stages again -----------------------
    weight_decay = options.option("weight_decay", "The decoupled weight decay's rate (or None).")
    clipnorm = options.option("clipnorm", "The L2 norm each aggregated gradient is clipped to (or None).")
    clipvalue = options.option("clipvalue", "The bound each aggregated gradient's entries are clipped to (or None).")
    global_clipnorm = options.option(
        "global_clipnorm", "The joint L2 norm the aggregated gradients are clipped to (or None)."
    )
    use_ema = options.option("use_ema", "Whether a moving average of every variable updated is kept.")
    ema_momentum = options.option("ema_momentum", "The moving averages' momentum.")
    ema_overwrite_frequency = options.option(
        "ema_overwrite_frequency", "Every how many updates the averages overwrite."
    )
    gradient_accumulation_steps = options.option(
        "gradient_accumulation_steps", "Steps accumulated per update (or None)."
    )

    # --- learning rate ----------------------------------------------------------------------
    @staticmethod
    def _check_learning_rate(learning_rate):
        if isinstance(learning_rate, schedules.LearningRateSchedule) or callable(learning_rate):
            return learning_rate
        return state_format.check_learning_rate(learning_rate)

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update (a schedule is evaluated at ``iterations``)."""
        return self._current_learning_rate()

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        self._learning_rate = self._check_learning_rate(value)

    @property
    def learning_rate_schedule(self):
        """The schedule (or callable ``step -> float``) the learning rate follows, or ``None`` for a number.

        A callback that sets the rate (``TorchLRScheduler``) asks it first: a rate that follows a
        schedule is not a number to overwrite.

        Example::

            optimizer = optimizers.SGD(schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.5))
            optimizer.learning_rate_schedule   # the ExponentialDecay (SGD(0.1)'s is None)
        """
        rate = self._learning_rate
        return rate if callable(rate) else None

    def _current_learning_rate(self) -> float:
        rate = self._learning_rate
        if callable(rate):
            step = self.updates_so_far()
            return state_format.check_learning_rate(float(rate(step)), f"learning_rate (the schedule at step {step})")
        return rate

    # --- building and slots ------------------------------------------------------------------
    def build(self, variables) -> None:
        """Creates per-variable state; subclasses call ``super().build(variables)`` then make slots.

        ``variables`` are the targets of the optimizer's state layout: the variables themselves, or
        1-D slices of them where the strategy shards the optimizer's state. Called by the first update of
        a variable (or ``build_for``); a direct call builds whole slots for whole variables. With
        ``use_ema`` it creates each target's ``"average"`` slot.
        """
        new = [v for v in variables if id(v) not in self._built_ids and not _is_target(self, v)]
        if new:  # a direct call: whole variables, whole slots
            self._register(self._layout_for_direct_build(new), new)
        for variable in variables:
            self._built_ids.add(id(variable))
            if self._averages is not None:
                self.add_variable_from_reference(variable, "average")

    def build_for(self, variables) -> None:
        """Builds the optimizer for ``variables`` as their first update would: for the targets of the state
        layout the strategy gives them (whole variables, or this worker's slices), with the weight-decay
        exclusions decided. A state loaded before stays waiting (the next ``load_state_dict`` or update
        restores one), so the state loaded next is checked against what was built.

        ``Trainer`` calls it before it loads a checkpoint's optimizer state (as Keras builds an optimizer
        before restoring one). Call it in the variables' strategy's scope.

        Example::

            with strategy.scope():
                optimizer.build_for(model.trainable_variables)
            optimizer.load_state_dict(saved)   # checked against the variables now, not at the first step
        """
        variables = [self._resolver.variable(v) for v in variables]
        if variables:
            self._build(self._strategy_of(variables), variables)

    def _build(self, strategy, variables):
        """Builds for the variables not built for yet (their targets, through the layout), after making the
        slots a hyper-parameter asks for; returns the layout."""
        if self._slots_outdated:
            self._refresh_slots()
        layout = self._layout_for(strategy, variables)
        missing = [v for v in variables if id(v) not in self._built_ids]
        if missing:
            targets = self._register(layout, missing)
            with context.enter_or_assert_strategy(strategy):
                self.build(targets)
        return layout

    def _layout_for(self, strategy, variables):
        """The state layout: the strategy's for these variables, asked at the first update (a direct ``build``
        made whole slots: refused where the strategy would slice them)."""
        layout = self._layout
        if layout is not None and self._layout_from_strategy:
            return layout
        given = strategy.extended.state_layout(variables)
        if layout is not None and given.slices_variables:  # whole slots made by a direct build() call
            raise ValueError(
                f"{type(self).__name__} {self.name!r} was built with whole slots (a direct build() call before the "
                "strategy sharded them); with shard_optimizer_states, let the first update (or Trainer's restore) "
                "build it."
            )
        if layout is None:
            if given.slices_variables and not self.elementwise_update:
                raise ValueError(
                    f"{type(self).__name__} {self.name!r} declares elementwise_update = False (its update reads "
                    "whole variables: a norm per variable, a factorisation by shape), so its state cannot be sharded "
                    "into slices of variables (sharded optimizer states, or sharded parameters). Use it under a "
                    "strategy that keeps whole variables, such as MultiWorkerMirroredStrategy(shard_optimizer_states="
                    "False)."
                )
            self._layout = layout = given
        self._layout_from_strategy = True
        return layout

    def _layout_for_direct_build(self, variables):
        if self._layout is None:
            self._layout = WholeVariables(self._strategy_of(variables))
        return self._layout

    def _register(self, layout, variables) -> list:
        """Registers ``variables`` (positions, weight-decay decisions) with their targets; returns the targets."""
        targets = layout.extend(variables)
        by_position: dict = {}
        for target in targets:
            by_position.setdefault(id(layout.variables[layout.position_of(target)]), []).append(target)
        for variable in variables:
            self._built_ids.add(id(variable))
            self._variables.append(variable)
            self._weight_decay.decide(variable, by_position.get(id(variable), ()))
        self._targets.extend(targets)
        self._target_ids.update(id(t) for t in targets)
        return targets

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Keeps variables out of ``weight_decay`` (Keras 3's method): call it before the optimizer builds.

        Args:
          var_list: variables to exclude: our ``Variable``s, or a module's parameters
            (``model.fc.bias``; under a strategy the variable it became is excluded).
          var_names: strings; a variable whose name contains any of them is excluded
            (``["bias", "norm"]``). Names are the module's parameter names (``"fc.bias"``).

        The exclusion is decided when the optimizer builds for a variable (its first
        update, or a checkpoint restore), as in Keras 3; calling this once the optimizer has
        built raises ``ValueError``. A new call replaces the previous exclusions. Unlike Keras
        3, which joins ``var_names`` into a regular expression, names match as plain
        substrings (``"bn.weight"`` matches only that text). For ``from_torch`` optimizers the
        excluded variables form their own torch param group with ``weight_decay=0``, so
        whatever decay the torch class applies (coupled L2 for ``SGD``/``Adam``, decoupled for
        ``AdamW``) skips them.

        Example::

            optimizer = optimizers.AdamW(1e-3, weight_decay=0.05)
            optimizer.exclude_from_weight_decay(var_names=["bias", "norm"])
            optimizer.exclude_from_weight_decay(var_list=[model.embedding.weight])   # or objects
        """
        if self._variables:
            raise ValueError(
                f"exclude_from_weight_decay() can only be called before {type(self).__name__} {self.name!r} is "
                f"built (it was built for {len(self._variables)} variables by a first update or a checkpoint "
                "restore): call it right after creating the optimizer."
            )
        self._weight_decay.exclude(var_list, var_names)

    def add_variable_from_reference(self, reference_variable, name: str, initializer="zeros"):
        """A slot variable shaped like ``reference_variable`` and living on its devices.

        ``initializer``: ``"zeros"``, ``"ones"``, a number, or a callable ``(shape, dtype) ->
        tensor``.
        """
        container = value_container(reference_variable)
        slot = self._slots.get(container, name)
        if slot is not None:
            return slot
        template = local_results(container)[0]
        value = initial_value(initializer, template.shape, template.dtype)
        layout = self._layout if self._layout is not None else self._layout_for_direct_build([container])
        return self._slots.add(layout, container, name, value)

    def _slots_changed(self) -> None:
        """Says that ``build`` would now make slots it did not make before (SGD's ``momentum`` set above 0 after
        the first update, by ``TorchLRScheduler``): the next update (or ``state_dict()``) makes them for the
        targets built so far, running ``build`` again for those (``add_variable_from_reference`` returns the
        slots that exist, so only the new ones are made)."""
        self._slots_outdated = True

    def _refresh_slots(self) -> None:
        self._slots_outdated = False
        if self._targets:
            with context.enter_or_assert_strategy(self._strategy_of(self._variables)):
                self.build(list(self._targets))
            self._plans.clear()  # the multi-tensor groups follow each target's slot names

    def get_slot(self, variable, name: str):
        """The slot ``name`` of ``variable``; inside ``update_step``, the copy matching the variable copy."""
        container = value_container(variable)
        known = self._resolver.known(container)
        if known is not container:  # a plain parameter we wrapped
            container = variable = known
        slot = self._slots.get(container, name)
        if slot is None:
            raise KeyError(
                f"{type(self).__name__} has no slot {name!r} for variable {getattr(variable, 'name', '?')!r}"
                "; create it in build() with add_variable_from_reference()."
            )
        if variable is container:
            return slot
        index = context.current_mode().update_replica or 0
        return local_results(slot)[index]

    @property
    def variables(self) -> list:
        """The optimizer's own variables (``iterations`` and every slot), not the ones it updates."""
        return [self.iterations] + self._slots.variables()

    # --- the pipeline (steps 1-9 of the module docstring) ------------------------------------
    def apply_gradients(self, grads_and_vars):
        """Applies gradients to variables (the pipeline of the module docstring).

        In a replica context the gradients are this replica's; they are summed across
        replicas. In cross-replica context (or outside any strategy) they are applied as
        given. Returns ``iterations``.
        """
        grads, variables = self._resolver.resolve(grads_and_vars)  # step 1
        in_replica = context.in_replica_function()
        ctx = ds.get_replica_context() if in_replica else None
        window = None
        if self._accumulation is not None:  # step 2
            full = self._accumulation.add(ctx, grads, variables, self._strategy_of, self._positions)
            if full is None:
                return self.iterations
            window, grads = full
        if in_replica:
            return ctx.merge_call(_merge_update, args=(self, grads, variables, window))
        strategy = self._strategy_of(variables)
        reduced = window is None or window.aggregated
        if context.get_strategy() is strategy:
            return self._update(strategy, grads, variables, window, reduced)
        with context.enter_or_assert_strategy(strategy):
            return self._update(strategy, grads, variables, window, reduced)

    def _update(self, strategy, grads, variables, window=None, reduced: bool = False):
        """Steps 3-9 in cross-replica context, once per update: ``grads`` are per replica (``reduced=False``:
        summed here) or reduced already; ``window``: the accumulation window they are the sums of."""
        if window is not None and self._accumulation.window is window:
            self._accumulation.close()
        if not reduced:  # a gradient that is the very same object on every replica counts once per replica
            count = strategy.cluster.num_local_replicas  # the components of this worker
            grads = [g if isinstance(g, ds.DistributedValues) else ds.PerReplica([g] * count) for g in grads]
        layout = self._build(strategy, variables)  # step 4 (the layout first: a reduce-scatter needs its slices)
        if self._pending is not None and self._pending.checked != len(self._variables):
            self._restore_pending()
        gradients = layout.take(grads, variables) if reduced else layout.reduce(grads, variables)  # step 3
        divisor = self._divisor(strategy, window.weight if window is not None else None)
        if divisor is not None:  # step 5
            gradients.replace(stages.divide(gradients.values, divisor))
        for stage in self._gradient_pipeline():  # step 6
            values = stage(gradients.values, layout)
            if values is None:  # skipped (a loss scaler's infinities or NaNs, agreed by every worker): counted
                self._count()
                return self.iterations
            gradients.replace(values)
        learning_rate = self._current_learning_rate()
        self._prepare_step(learning_rate)
        ema = self._averages.step(self.updates_so_far()) if self._averages is not None else None
        if layout.refresh():  # a variable's memory moved (``param.data = ...``): what holds its tensors follows
            self._plans.clear()
            self._targets_moved(layout)
        direct = self._update_rule(layout, gradients, variables, learning_rate, ema)  # step 7
        layout.finish(gradients, variables, direct)  # step 8
        self._count()  # step 9
        return self.iterations

    def _gradient_pipeline(self) -> list:
        """The gradient stages of step 6, in order: those installed (a loss scaler's), then clipping."""
        stages_ = list(self._gradient_stages.values())
        if self._clipping is not None:
            stages_.append(self._clipping)
        return stages_

    def _update_rule(self, layout, gradients, variables, learning_rate: float, ema) -> bool:
        """Step 7 for the targets of ``variables``: decay, the rule, the moving average; whether the copies'
        tensors were written directly (the multi-tensor path) rather than through ``layout.update``."""
        targets = layout.targets_of(variables)
        per_copy = gradients.copies if gradients.copies is not None else layout.per_copy(gradients.values, variables)
        if self._takes_multi_tensor_path():
            self._plans.run(self, per_copy, targets, learning_rate, ema)
            return True
        for grad, target in zip(per_copy, targets):
            rate = self._weight_decay.rate_for(target)
            layout.update(target, self._update_component, (grad, learning_rate, rate, ema))
        return False

    def _update_component(self, variable, gradient, learning_rate, decay=None, ema=None):
        """One copy's update: decay, ``update_step``, then its moving average (the per-variable path)."""
        with torch.no_grad():
            if decay:
                self._weight_decay.apply(variable, decay, learning_rate)
            self.update_step(gradient, variable, learning_rate)
            if ema is not None:  # lists of one: the rule is written once (ema.move_averages)
                move_averages([self.get_slot(variable, "average").value()], [variable.value()], ema)

    def _targets_moved(self, layout) -> None:
        """The targets view other memory now (``StateLayout.refresh``): what holds their tensors follows."""

    def _takes_multi_tensor_path(self) -> bool:
        """Whether updates run as plans: the class says so and implements ``_update_many``."""
        return self._multi_tensor and type(self)._update_many is not Optimizer._update_many

    def _update_many(self, params: list, grads: list, slots: dict, learning_rate: float) -> None:
        """Built-ins: updates lists of same-device, same-dtype tensors (slots: name -> list)."""
        raise NotImplementedError

    def _divisor(self, strategy, window_weight):
        """Step 5's divisor: the window's weight, or the gradient denominator's total (``stages.divisor``)."""
        return stages.divisor(strategy, window_weight, self._gradient_denominator)

    def _prepare_step(self, learning_rate: float) -> None:
        """Computes per-apply constants once (before any variable is updated)."""

    def update_step(self, gradient, variable, learning_rate) -> None:
        """Updates one copy of ``variable`` (a ``LocalVariable``) from its aggregated ``gradient``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement update_step(gradient, variable, learning_rate)."
        )

    def _count(self) -> None:
        """``iterations += 1`` for one update (or a skipped loss-scaled step), the host copy too."""
        known = self._known_updates
        current = known is not None and known[1] == _counter_key(self.iterations)[1]
        _count_update(self.iterations)
        self._known_updates = (*_counter_key(self.iterations), known[2] + 1) if current else None

    def updates_so_far(self) -> int:
        """``int(self.iterations)`` without reading the counter back every step (on an accelerator each
        read would make the host wait for the device): a host copy kept current by ``_count``, valid while
        the counter's tensors are the ones it saw at the version it left them; any other write
        (``assign``, ``load_state_dict``) is read back once.

        Example::

            optimizer.apply_gradients(zip(grads, variables))
            optimizer.updates_so_far()   # 1, with no read from the device
        """
        key = _counter_key(self.iterations)
        known = self._known_updates
        if known is not None and known[1] == key[1]:
            return known[2]
        count = int(self.iterations)
        self._known_updates = (*key, count)
        return count

    # --- gradient accumulation (accumulation.py) -------------------------------------------------------
    @property
    def step_weight(self) -> float:
        """The weight of the next accumulated step.

        Its gradients enter the window multiplied by it, and a window's sums are divided by its steps'
        total weight.

        1 by default, every step alike (Keras' mean of the N gradients). ``Trainer.fit`` sets it to
        each step's global batch size while it accumulates (a window then equals one step on its
        batches together, partial batches included), and back to 1 at its end.

        Example::

            optimizer = optimizers.SGD(0.1, gradient_accumulation_steps=4)
            for x, y in batches:
                optimizer.step_weight = float(len(x))   # each step weighs its examples
                strategy.run(step, args=(x, y))
            optimizer.apply_accumulated_gradients()
        """
        return self._accumulation.step_weight if self._accumulation is not None else self._free_step_weight

    @step_weight.setter
    def step_weight(self, value: float) -> None:
        if self._accumulation is not None:
            self._accumulation.step_weight = value
        else:
            self._free_step_weight = value

    _free_step_weight = 1.0  # (an optimizer that does not accumulate keeps the value it is given)

    @property
    def gradient_denominator(self) -> GradientDenominator | None:
        """Where an update's divisor comes from when it is not known before backward.

        ``None`` (default), or a ``GradientDenominator(step_value, prescale)``. When set, each update
        divides the reduced gradients (an accumulation window's weighted sums) by ``total / prescale``
        instead of by the window's weight, where ``total`` is the global total of the step value
        ``step_value`` (``strategy.cluster.add_to_step``) since the previous update: it rides with the
        update's own gradient reduction, so it costs no collective. A total of 0 (nothing to learn from, e.g. every
        token padding) leaves the gradients as they are, which are then zeros.

        ``Trainer.fit`` sets it for element-level losses (the count of real tokens or pixels of the
        global batch, known only after every worker has seen its rows) and clears it at the end.

        Every worker must add the step value at every step, of one kind (here integer counts; ``0`` where a
        replica has no rows). Example (a loop of one's own: the mean over real tokens of the global batch)::

            optimizer.gradient_denominator = optimizers.GradientDenominator("tokens", prescale=1.0)

            def step(x, y):
                losses = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # 0 where y == -100
                strategy.cluster.add_to_step("tokens", (y != -100).sum())
                grads = torch.autograd.grad(losses.sum(), params)  # the sum: divided after the reduction
                optimizer.apply_gradients(zip(grads, params))

            strategy.run(step, args=(x, y))
        """
        return self._gradient_denominator

    @gradient_denominator.setter
    def gradient_denominator(self, value) -> None:
        if value is not None and not isinstance(value, GradientDenominator):
            raise TypeError(
                f"gradient_denominator must be None or a GradientDenominator(step_value, prescale), got {value!r}."
            )
        self._gradient_denominator = value

    @property
    def accumulated_steps(self) -> int:
        """Steps in the open accumulation window, not applied yet (0 without one).

        Example::

            optimizer = SGD(0.1, gradient_accumulation_steps=4)
            ...                                   # 6 steps: one update, then 2 steps
            optimizer.accumulated_steps           # 2
        """
        return self._accumulation.count if self._accumulation is not None else 0

    def apply_accumulated_gradients(self):
        """Applies the open accumulation window now, however many steps it holds (cross-replica context).

        ``Trainer.fit`` calls it at the end of every epoch, so no step is ever dropped; call it
        at the end of a loop of one's own. Nothing happens without an open window (and
        without ``gradient_accumulation_steps``). Every worker must call it (the window's
        reduction is a collective). Returns ``iterations``.

        Example::

            optimizer = optimizers.SGD(0.1, gradient_accumulation_steps=4)
            for x, y in batches:                       # 10 batches: updates after 4, 8
                strategy.run(step, args=(x, y))
            optimizer.apply_accumulated_gradients()  # ... and the last 2
        """
        accumulation = self._accumulation
        window = None if accumulation is None else accumulation.ready_to_apply(self._strategy_of, self._positions)
        if window is None:
            return self.iterations
        if context.in_replica_function():
            raise RuntimeError(
                "apply_accumulated_gradients() must be called in cross-replica context (outside strategy.run()): "
                "it reduces every replica's window at once."
            )
        strategy = self._strategy_of(window.variables)
        with context.enter_or_assert_strategy(strategy):
            if window.aggregated:
                return self._update(strategy, window.sums[0], window.variables, window, reduced=True)
            replicas = sorted(window.sums)
            grads = [ds.PerReplica([window.sums[r][i] for r in replicas]) for i in range(len(window.variables))]
            return self._update(strategy, grads, window.variables, window)

    # --- moving averages (ema.py) ---------------------------------------------------------------------
    def finalize_variable_values(self, var_list) -> None:
        """Keras 3's end-of-training hook: with ``use_ema``, writes each variable's moving average into it.

        ``var_list``: variables or a module's parameters (``model.parameters()``); those the
        optimizer keeps no average for (never updated by it) are left as they are. Every copy
        of a variable gets its own copy's average (``extended.update``), so copies stay equal;
        under ``MultiWorkerMirroredStrategy`` every worker calls it (no communication, except with
        ``shard_optimizer_states``: the averages are gathered from every worker's part then). Without
        ``use_ema`` it does nothing. ``Trainer.fit`` calls it at its end, before ``on_train_end``
        (as Keras' ``fit`` does), so the model holds the averages after training.

        Example::

            optimizer = optimizers.Adam(1e-3, use_ema=True)
            ...                                       # a training loop of one's own
            optimizer.finalize_variable_values(model.parameters())
        """
        if self._averages is None:
            return
        variables = self._averaged(var_list)
        if variables:
            self._averages.write(variables, self._layout, self._average_slot)

    @contextlib.contextmanager
    def averaged_weights(self, var_list=None):
        """Inside the block the variables hold their moving averages; after it, their trained values again.

        The callback-free way to evaluate (or save) with the averages in the middle of
        training. ``var_list`` defaults to every variable the optimizer updates; needs
        ``use_ema=True``. Call it in cross-replica context (outside ``strategy.run``).

        Example::

            with optimizer.averaged_weights():
                val_logs = trainer.evaluate(model, (x_val, y_val), batch_size=256, return_dict=True)
        """
        self.swap_in_averages(var_list, "averaged_weights()")
        try:
            yield
        finally:
            self.swap_out_averages()

    @property
    def averages_swapped_in(self) -> bool:
        """Whether the variables hold their moving averages now.

        True when swapped in by ``swap_in_averages`` (or ``averaged_weights``) and not swapped out or
        kept since.

        Example::

            if not optimizer.averages_swapped_in:
                optimizer.swap_in_averages()
        """
        return self._averages is not None and self._averages.swapped is not None

    def swap_in_averages(self, var_list=None, caller: str = "swap_in_averages()") -> None:
        """Writes the moving averages into the variables, keeping their trained values for ``swap_out_averages``.

        ``averaged_weights`` for code whose start and end are apart (``SwapEMAWeights``' swap from
        ``on_test_begin`` to ``on_test_end``). ``var_list`` defaults to every variable the optimizer
        updates; ``caller`` names the caller in the errors: ``ValueError`` without ``use_ema``,
        ``RuntimeError`` while the averages are swapped in already. Call it in cross-replica context
        (outside ``strategy.run``).

        Example::

            optimizer.swap_in_averages()
            try:
                trainer.evaluate(model, (x_val, y_val), batch_size=256)
            finally:
                optimizer.swap_out_averages()
        """
        if self._averages is None:
            raise ValueError(
                f"{caller} needs an optimizer with use_ema=True; {type(self).__name__} {self.name!r} keeps no "
                "moving averages."
            )
        if self._averages.swapped is not None:
            raise RuntimeError(f"{caller}: the averages are swapped in already (averaged_weights() do not nest).")
        variables = self._averaged(self._variables if var_list is None else var_list)
        layout = self._layout if self._layout is not None else WholeVariables(context.get_strategy())  # nothing built
        self._averages.swap_in(variables, layout, self._average_slot, caller)

    def swap_out_averages(self) -> None:
        """Puts back the trained values ``swap_in_averages`` kept (nothing when nothing is swapped in).

        Example::

            optimizer.swap_out_averages()   # at the next epoch's start: training continues from the trained values
        """
        if self._averages is not None:
            self._averages.swap_out(self._strategy_of)

    def keep_averages(self) -> None:
        """Ends a swap without putting the trained values back: the averages stay in the variables.

        For a swap that training's end makes final (``fit`` writes the averages into the model then,
        ``finalize_variable_values``). Nothing happens when nothing is swapped in.

        Example::

            optimizer.swap_in_averages()
            optimizer.keep_averages()   # the model keeps the averages; swap_out_averages() has nothing to put back
        """
        if self._averages is not None:
            self._averages.swapped = None

    def trained_values(self) -> dict:
        """``{id(variable): its first copy's trained value}`` while the averages are swapped in, else ``{}``.

        What a backup of the model must hold instead of the averages the variables hold then (a
        resumed run trains on from the trained values).

        Example::

            with optimizer.averaged_weights():
                trained = optimizer.trained_values()   # {id(variable): tensor}, the values training left
        """
        return self._averages.trained_values() if self._averages is not None else {}

    def _averaged(self, var_list) -> list:
        """The containers of ``var_list`` the optimizer was built for (each has an average), each once, in order."""
        found, seen = [], set()
        for item in var_list:
            container = self._resolver.known(item)
            if id(container) in self._built_ids and id(container) not in seen:
                seen.add(id(container))
                found.append(container)
        return found

    def _average_slot(self, target):
        return self._slots.of(target, "average")

    # --- what a torch scheduler may cycle ------------------------------------------------------------
    def torch_hyperparameters(self) -> dict:
        """The hyper-parameters besides the learning rate that a ``torch.optim.lr_scheduler`` scheduler may cycle,
        under torch's names and with their values now: ``{"betas": (beta_1, beta_2)}`` for an optimizer with
        ``beta_1`` and ``beta_2`` (``Adam``, ``AdamW``, a ``Lion`` of one's own), else ``{"momentum": ...}`` for one
        with a numeric ``momentum`` (``SGD``, ``RMSprop``; 0 too, as ``torch.optim.SGD``'s), a ``from_torch``
        optimizer's own; ``{}`` where there are none. ``TorchLRScheduler`` gives them to the torch optimizer it
        hands the scheduler (``OneCycleLR`` cycles the momentum against the rate) and writes them back with
        ``set_torch_hyperparameters``. A subclass names others by overriding both methods.

        Example::

            optimizers.SGD(0.1, momentum=0.9).torch_hyperparameters()   # {"momentum": 0.9}
        """
        if hasattr(self, "beta_1") and hasattr(self, "beta_2"):
            return {"betas": (self.beta_1, self.beta_2)}
        momentum = getattr(self, "momentum", None)
        if isinstance(momentum, (int, float)) and not isinstance(momentum, bool):
            return {"momentum": momentum}
        return {}

    def set_torch_hyperparameters(self, **values) -> None:
        """Sets hyper-parameters ``torch_hyperparameters()`` names, given under torch's names (a scheduler's
        cycle); ``ValueError`` for another name.

        Example::

            optimizer.set_torch_hyperparameters(momentum=0.85)
        """
        unknown = sorted(set(values) - set(self.torch_hyperparameters()))
        if unknown:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} has no hyper-parameters {unknown} a scheduler may set; it has "
                f"{sorted(self.torch_hyperparameters())}."
            )
        self._set_torch_hyperparameters(values)

    def _set_torch_hyperparameters(self, values: dict) -> None:
        """Sets what ``torch_hyperparameters`` named (checked by ``set_torch_hyperparameters``)."""
        if "betas" in values:
            self.beta_1, self.beta_2 = (float(b) for b in values["betas"])
        if "momentum" in values:
            self.momentum = float(values["momentum"])

    # --- around the pipeline: other entry points, and the variables it is given ------------------
    def scale_loss(self, loss):
        """The loss to differentiate: ``loss`` itself (a ``LossScaleOptimizer`` multiplies it by its scale)."""
        return loss

    def apply(self, grads, variables=None):
        """``apply_gradients(zip(grads, variables))``; ``variables`` defaults to those built for."""
        variables = self._variables if variables is None else list(variables)
        grads = list(grads)
        if len(grads) != len(variables):
            raise ValueError(f"apply() got {len(grads)} gradients for {len(variables)} variables.")
        return self.apply_gradients(zip(grads, variables))

    def minimize(self, loss, var_list):
        """Computes the gradients of ``loss`` (a scalar tensor) for ``var_list`` and applies them."""
        if callable(loss):
            loss = loss()
        var_list = list(var_list)
        if var_list and all(isinstance(v, ds.Variable) for v in var_list):
            # The strategy's gradients (sharded parameters: backward, then this worker's shards).
            grads = self._strategy_of(var_list).extended.gradients(loss, var_list)
            return self.apply_gradients(zip(grads, var_list))
        tensors = [v.value() if isinstance(v, ds.Variable) else v for v in var_list]
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        return self.apply_gradients(zip(grads, var_list))

    def _strategy_of(self, variables):
        owner = variables[0].distribute_strategy if isinstance(variables[0], ds.Variable) else None
        return owner if owner is not None else context.get_strategy()

    def _positions(self) -> dict:
        return {id(v): i for i, v in enumerate(self._variables)}

    # --- configuration and state --------------------------------------------------------------
    def get_config(self) -> dict:
        """The constructor arguments (a schedule as ``schedules.serialize`` output)."""
        rate = self._learning_rate
        if isinstance(rate, schedules.LearningRateSchedule):
            rate = schedules.serialize(rate)
        elif callable(rate):
            raise ValueError(
                "An optimizer whose learning_rate is a plain callable cannot be serialized; use a "
                "schedules.LearningRateSchedule."
            )
        return {"name": self.name, "learning_rate": rate} | {name: getattr(self, name) for name in SHARED_ARGUMENTS}

    @classmethod
    def from_config(cls, config: dict):
        """An optimizer of this class made from ``get_config()``'s output: ``cls(**config)``.

        A ``learning_rate`` given as a dict is read with ``schedules.deserialize`` first. The new optimizer
        has no state: load it with ``load_state_dict``.
        """
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = schedules.deserialize(config["learning_rate"])
        return cls(**config)

    def state_dict(self) -> dict:
        """``iterations``, the learning rate and every slot, keyed by the variable's position.

        ``{"iterations": int, "variables": [{"name", "shape"}, ...], "slots": {position: {slot name:
        tensor}}, "learning_rate": float}``: the entry at position ``i`` belongs to the ``i``-th
        variable the optimizer was built for, and ``variables`` keeps names and shapes as a
        check (the layout is described in ``replicafit.optimizers.state``). The tensors are
        aggregated copies (a snapshot), the same under every strategy (where each worker holds
        slices of the state, they are gathered from every worker: a collective). Entries loaded by
        ``load_state_dict`` for variables not built yet are included as they were loaded.

        Example::

            state = optimizer.state_dict()
            state["slots"][0]["momentum"]          # the first variable's momentum
        """
        state_format.prepare(self)
        records = state_format.describe(self._variables)
        slots = state_format.whole_slots(self)
        records, slots = state_format.with_pending(self._pending, records, slots, bool(self._variables))
        state = {"iterations": int(self.iterations), "slots": slots}
        if records is not None:
            state["variables"] = records
        window_state(self, state)
        if not callable(self._learning_rate):  # a rate set by a callback must survive a restore
            state["learning_rate"] = float(self._learning_rate)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output; entries of variables not built yet are restored when they are.

        The entry at position ``i`` goes to the ``i``-th variable the optimizer is built for.
        A state whose variables (count, names, shapes) or slots (names, shapes) do not fit
        raises ``ValueError`` naming the position and slot, and changes nothing. States of
        earlier versions, keyed by variable name, load when no two variables share a name.
        The ``"average"`` slots of ``use_ema`` are the exception: a state saved without them
        loads into an optimizer with ``use_ema`` (each average starts at its variable's value
        then), and a state with them loads into one without (they are dropped).
        """
        iterations, pending = state_format.parse(state, "slots", type(self).__name__)
        learning_rate = state.get("learning_rate")
        if learning_rate is not None and not callable(self._learning_rate):
            learning_rate = state_format.check_learning_rate(learning_rate, "learning_rate (in the optimizer state)")
        else:
            learning_rate = None
        taken, assignments = state_format.plan_restore(self, pending)  # every check before any change
        window = checked_window_state(self, state)
        self.iterations.assign(iterations)
        if self._accumulation is not None:
            self._accumulation.load(window, self._variables)
        if learning_rate is not None:
            self.learning_rate = learning_rate
        state_format.assign_all(assignments)
        pending.discard(taken, self._variables)
        self._pending = None if pending.done(len(self._variables)) else pending

    def _restore_pending(self) -> None:
        """Restores the loaded entries of variables built since ``load_state_dict``."""
        if not self._variables:
            return
        taken, assignments = state_format.plan_restore(self, self._pending)
        state_format.assign_all(assignments)
        self._pending.discard(taken, self._variables)
        if self._pending.done(len(self._variables)):
            self._pending = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, learning_rate={self._learning_rate!r})"


#: The keyword arguments every optimizer shares: ``Optimizer``'s, besides ``learning_rate`` and ``name``, read
#: from its signature (the one place they are spelt), for ``get_config`` and ``from_torch``.
SHARED_ARGUMENTS = tuple(
    name for name in inspect.signature(Optimizer.__init__).parameters if name not in ("self", "learning_rate", "name")
)


def _is_target(optimizer, variable) -> bool:
    return id(variable) in optimizer._target_ids


def _counter_key(iterations) -> tuple:
    """``(tensors, (id, version) of each)``: changes with any write to the counter's tensors (and holding
    them keeps their ids from being reused)."""
    tensors = iterations.copy_tensors()
    return tensors, tuple((id(t), t._version) for t in tensors)  # private: autograd's in-place write counter


def _count_update(iterations) -> None:
    """``iterations.assign_add(1)`` in cross-replica context, written directly into every copy for
    the kinds that hold plain copies (the same result, without the assignment's dispatch)."""
    kind = type(iterations)
    if kind is ds.LocalVariable or kind is ds.MirroredVariable:
        with _no_grad():
            for tensor in iterations.copy_tensors():
                tensor.add_(1)
        return
    iterations.assign_add(1)


def _merge_update(strategy, optimizer, grads, variables, window):
    """merge_fn of a replica-context apply: steps 3-9, once (``grads`` per replica)."""
    return optimizer._update(strategy, grads, variables, window)
