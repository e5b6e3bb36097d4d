"""The distribution-aware optimizer base class.

``apply_gradients`` is one fixed pipeline; a subclass writes only the math:

1. drop ``None`` gradients;
2. in a replica context (inside ``strategy.run``): ``merge_call`` (runs once, in
   cross-replica context), then ONE ``extended.batch_reduce_to(SUM, grads_and_vars)``;
   in cross-replica context the given gradients are taken as already reduced;
3. gradient transforms on the aggregated gradient: ``clipvalue``, ``clipnorm`` (per
   variable) or ``global_clipnorm``;
4. for every variable, ``extended.update(var, ...)``: decoupled ``weight_decay`` (unless
   ``exclude_from_weight_decay`` excluded the variable), then ``update_step(gradient,
   variable, learning_rate)`` on each copy of the variable, on its device (built-ins use
   one multi-tensor kernel per device and dtype instead), then, with ``use_ema``, the
   copy's moving average (and, every ``ema_overwrite_frequency`` updates, the copy
   overwritten by it);
5. ``iterations += 1`` (once per apply, not once per replica).

With ``gradient_accumulation_steps=N``, step 2 waits: each replica adds its local
gradients into its own sums for N steps without any communication, and the N-th step
sends the sums through steps 2-5 (one batched reduction for the whole window, divided by
the window's total weight; see ``replicafit.optimizers.accumulation``). ``iterations``
counts updates. Between steps 2 and 3 the reduced gradients pass the optimizer's gradient
stages (``_gradient_stages``: ``name -> stage(grads)``, which returns the gradients or
``None`` to skip the update, which still counts): wrapped in a ``LossScaleOptimizer``, they
are unscaled and checked for infinities and NaNs by the wrapper's stage there.

This file is the pipeline; its parts live beside it, each a mixin of ``Optimizer``:
``accumulation`` (the window of step 2), ``ema`` (the moving averages of step 4) and
``multi_tensor`` (the built-ins' fast path of step 4).

Slot variables made with ``add_variable_from_reference`` live where their variable
lives (mirrored under ``MirroredStrategy``, on the parameter device under
``CentralStorageStrategy``), and ``get_slot`` inside ``update_step`` resolves to the copy
that matches the variable copy being updated. So a subclass is correct under every
strategy without seeing one. Under ``MultiWorkerMirroredStrategy(shard_optimizer_states=True)``
``build`` and ``update_step`` see 1-D slices of the variables (each worker's part, ``sharded.py``),
which is right for every element-wise rule; a rule that reads whole variables (a norm per
variable, a factorisation by shape) sets the class attribute ``elementwise_update = False`` and
is refused there.

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

import operator

import torch

import replicafit.strategies as ds
from replicafit.strategies import context, foreach
from replicafit.strategies.devices import canonicalize
from replicafit.strategies.values import local_results, value_container

from . import schedules
from . import state as state_format
from .accumulation import GradientAccumulation, check_accumulation_steps
from .ema import MovingAverages, _with_average, check_ema, move_averages
from .multi_tensor import MultiTensorUpdates
from .sharded import ShardedSlot, ShardedStates
from .tensors import _first_tensor, _no_grad

__all__ = ["Optimizer"]


def _check_positive(name: str, value, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{name}` must be a positive number{' or None' if allow_none else ''}, got {value!r}.")
    return float(value)


class Optimizer(GradientAccumulation, MovingAverages, MultiTensorUpdates, ShardedStates):
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
    ``LossScaleOptimizer`` skips leaves them unchanged.

    Example::

        optimizer = AdamW(1e-3, weight_decay=0.05, use_ema=True, ema_momentum=0.999)
        optimizer.exclude_from_weight_decay(var_names=["bias", "norm"])
    """

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
        if sum(x is not None for x in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise ValueError(
                "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, got "
                f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}."
            )
        self.weight_decay = None if weight_decay is None else float(weight_decay)
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(f"`weight_decay` must be >= 0, got {weight_decay!r}.")
        self.clipnorm = _check_positive("clipnorm", clipnorm)
        self.clipvalue = _check_positive("clipvalue", clipvalue)
        self.global_clipnorm = _check_positive("global_clipnorm", global_clipnorm)
        self.gradient_accumulation_steps = check_accumulation_steps(gradient_accumulation_steps)
        self.use_ema, self.ema_momentum, self.ema_overwrite_frequency = check_ema(
            use_ema, ema_momentum, ema_overwrite_frequency
        )
        self.name = name or type(self).__name__.lower()
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
        self._variables: list = []  # the model variables built for, in order
        self._built_ids: set = set()
        self._slots: dict = {}  # (id(container), slot name) -> slot variable
        self._slot_names: dict = {}  # id(container) -> [slot names]
        self._pending: state_format.PendingState | None = None  # loaded, for variables not built yet
        self._known_updates: tuple | None = None  # the host's copy of ``iterations`` (``updates_so_far``)
        self._wrapped: dict = {}  # id(raw tensor) -> (tensor, LocalVariable) for plain parameters
        self._last_resolved = None  # (the variables last given to apply_gradients, their containers)
        self._gradient_stages: dict = {}  # name -> stage on the reduced gradients (a LossScaleOptimizer's)
        self._decay_exclusions: tuple = ((), ())  # (variables or tensors, name substrings) not decayed
        self._no_decay: set = set()  # id(container) of the built variables excluded from weight decay
        self._slots_outdated = False  # a hyper-parameter asks for slots build() did not make (_slots_changed)
        self._init_accumulation()
        self._init_averages()
        self._init_plans()
        self._init_sharding()

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

        Decides, once per variable, whether weight decay applies to it (see
        ``exclude_from_weight_decay``), and with ``use_ema`` creates its ``"average"`` slot.
        """
        for variable in variables:
            if id(variable) not in self._built_ids:
                self._built_ids.add(id(variable))
                if id(variable) not in self._piece_source:  # a piece's variable is registered, decay decided
                    self._variables.append(variable)
                    if self._excluded_from_decay(variable):
                        self._no_decay.add(id(value_container(variable)))
                if self.use_ema:
                    self.add_variable_from_reference(variable, "average")

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
        objects = tuple(var_list or ())
        for item in objects:
            if not isinstance(item, (ds.Variable, torch.Tensor)):
                raise TypeError(
                    f"exclude_from_weight_decay(var_list=...) takes variables or parameters, got "
                    f"{type(item).__name__} {item!r}; pass names as var_names=[...]."
                )
        if isinstance(var_names, str):
            raise TypeError(f"var_names must be a list of strings, got the string {var_names!r}: write [{var_names!r}]")
        names = tuple(var_names or ())
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"var_names must hold non-empty strings, got {name!r}.")
        self._decay_exclusions = (objects, names)

    def _excluded_from_decay(self, variable) -> bool:
        objects, names = self._decay_exclusions
        if not objects and not names:
            return False
        name = getattr(variable, "name", None) or ""
        if any(part in name for part in names):
            return True
        # The variable itself, or one of its copies' tensors (a module's parameter is replica 0's copy).
        candidates = {id(variable), id(value_container(variable))}
        for component in local_results(value_container(variable)):
            candidates.add(id(component))
            if isinstance(component, ds.Variable):
                candidates.add(id(component.value()))
        return any(id(item) in candidates for item in objects)

    def add_variable_from_reference(self, reference_variable, name: str, initializer="zeros"):
        """A slot variable shaped like ``reference_variable`` and living on its devices.

        ``initializer``: ``"zeros"``, ``"ones"``, a number, or a callable ``(shape, dtype) ->
        tensor``.
        """
        container = value_container(reference_variable)
        key = (id(container), name)
        if key in self._slots:
            return self._slots[key]
        template = local_results(container)[0]
        shape, dtype = template.shape, template.dtype
        if initializer == "zeros":
            value = torch.zeros(shape, dtype=dtype)
        elif initializer == "ones":
            value = torch.ones(shape, dtype=dtype)
        elif callable(initializer):
            value = torch.as_tensor(initializer(shape, dtype), dtype=dtype)
        else:
            value = torch.full(shape, float(initializer), dtype=dtype)
        if id(container) in self._piece_source:  # sharded optimizer states: this worker's piece only
            slot = self._piece_slot(container, name, value)
        else:
            strategy = getattr(container, "_distribute_strategy", None) or context.get_strategy()
            with context.enter_or_assert_strategy(strategy), strategy.extended.colocate_vars_with(container):
                slot = ds.Variable(value, trainable=False, name=f"{container.name}/{name}")
        self._slots[key] = slot
        self._slot_names.setdefault(id(container), []).append(name)
        return slot

    #: Slots ``build`` makes only while a hyper-parameter asks for them (SGD's and RMSprop's ``"momentum"``, made
    #: once ``momentum`` leaves 0). A loaded state may hold one not made yet (it is made) or lack one that is (it
    #: starts again at zero), as ``torch.optim`` keeps or lacks a momentum buffer whatever the momentum is.
    _optional_slots: tuple = ()

    def _slots_changed(self) -> None:
        """Says that ``build`` would now make slots it did not make before (SGD's ``momentum`` set above 0 after
        the first update, by ``TorchLRScheduler``): the next update (or ``state_dict()``) makes them for the
        variables built so far, running ``build`` again for those (``add_variable_from_reference`` returns the
        slots that exist, so only the new ones are made)."""
        self._slots_outdated = True

    def _refresh_slots(self) -> None:
        self._slots_outdated = False
        if self._variables:
            built = self._variables if self._shards is None else self._shards.piece_variables  # sharded: the pieces
            with context.enter_or_assert_strategy(self._strategy_of(self._variables)):
                self.build(list(built))
            self._plans.clear()  # the multi-tensor groups follow each variable's slot names

    def get_slot(self, variable, name: str):
        """The slot ``name`` of ``variable``; inside ``update_step``, the copy matching the variable copy."""
        container = value_container(variable)
        wrapped = self._wrapped.get(id(container))
        if wrapped is not None and wrapped[0] is container:  # a plain parameter we wrapped
            container = variable = wrapped[1]
        try:
            slot = self._slots[(id(container), name)]
        except KeyError:
            raise KeyError(
                f"{type(self).__name__} has no slot {name!r} for variable {getattr(variable, 'name', '?')!r}"
                "; create it in build() with add_variable_from_reference()."
            ) from None
        if variable is container:
            return slot
        index = context.current_mode().update_replica or 0
        return local_results(slot)[index]

    @property
    def variables(self) -> list:
        """The optimizer's own variables (``iterations`` and every slot), not the ones it updates."""
        return [self.iterations] + list(self._slots.values())

    # --- the pipeline (steps 1-5 of the module docstring) ------------------------------------
    def apply_gradients(self, grads_and_vars):
        """Applies gradients to variables (the pipeline of the module docstring).

        In a replica context the gradients are this replica's; they are summed across
        replicas. In cross-replica context (or outside any strategy) they are applied as
        given. Returns ``iterations``.
        """
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError(
                "No gradients provided for any variable: every gradient is None. Check that the loss "
                "depends on the variables and that grad mode is enabled."
            )
        grads = [g for g, _ in pairs]
        raw = [v for _, v in pairs]
        last = self._last_resolved
        if last is not None and len(last[0]) == len(raw) and all(map(operator.is_, last[0], raw)):
            variables = last[1]  # the same variables as the previous call (a training loop): resolved once
        else:
            variables = [self._as_variable(v, i) for i, v in enumerate(raw)]
            self._last_resolved = (raw, variables)
        ctx = ds.get_replica_context()
        in_replica = context.in_replica_function()
        if self.gradient_accumulation_steps:
            return self._accumulate(ctx if in_replica else None, grads, variables)
        if in_replica:
            return ctx.merge_call(_merge_apply, args=(self, grads, variables))
        strategy = self._strategy_of(variables)
        if context.get_strategy() is strategy:
            return self._apply_aggregated(strategy, grads, variables)
        with context.enter_or_assert_strategy(strategy):
            return self._apply_aggregated(strategy, grads, variables)

    def _reduce_and_apply(self, strategy, grads, variables, divisor=None):
        """Step 2 in cross-replica context: one batched SUM of every gradient, then steps 3-5.

        A gradient that is the very same object on every replica counts once per replica.
        """
        count = strategy.cluster.num_local_replicas  # the components of this worker
        grads = [g if isinstance(g, ds.DistributedValues) else ds.PerReplica([g] * count) for g in grads]
        shards = self._sharded_build(strategy, variables)
        if shards is not None:  # a reduce-scatter: this worker's part of every gradient
            chunks, buffers = strategy.extended.reduce_scatter_gradients(shards, grads)
            return self._apply_sharded(strategy, shards, shards.piece_views(chunks), divisor, buffers)
        reduced = strategy.extended.batch_reduce_to(ds.ReduceOp.SUM, list(zip(grads, variables)))
        return self._apply_aggregated(strategy, reduced, variables, divisor=divisor)

    def _apply_aggregated(self, strategy, grads, variables, divisor=None):
        """Cross-replica part: build, transform, update, count. ``grads`` are aggregated
        (an accumulation window's sums, to be divided by ``divisor``)."""
        shards = self._sharded_build(strategy, variables)
        if shards is not None:  # reduced already: this worker's slices of them
            whole = [g if type(g) is torch.Tensor else _first_tensor(g) for g in grads]
            return self._apply_sharded(strategy, shards, shards.slices(whole), divisor=divisor)
        self._build_for(variables)
        plain = all(type(g) is torch.Tensor for g in grads)  # one copy each (the default strategy)
        primaries = grads if plain else [_first_tensor(g) for g in grads]
        prepared = self._prepared(primaries, self._divisor(strategy, divisor))
        if prepared is None:  # a gradient stage skipped it (a loss scaler's infinities or NaNs): counted
            self._count()
            return self.iterations
        transformed = self._transform(prepared, variables)
        if transformed is not primaries:  # one value per variable now: each copy gets it below
            grads, plain = transformed, True
        # Gradients given once for a variable with several copies go to every copy.
        spread = not (plain and all(type(v) is ds.LocalVariable for v in variables))
        learning_rate = self._current_learning_rate()
        self._prepare_step(learning_rate)
        ema = self._ema_step()
        if self._takes_multi_tensor_path():
            if spread:
                grads = [_per_copy(strategy, g, v) for g, v in zip(grads, variables)]
            self._apply_multi_tensor(grads, variables, learning_rate, ema)
            strategy.extended.after_direct_update(variables)
        else:
            if spread and plain:
                grads = [_per_copy(strategy, g, v) for g, v in zip(grads, variables)]
            decay, no_decay = self.weight_decay, self._no_decay
            for grad, variable in zip(grads, variables):
                strategy.extended.update(
                    variable,
                    self._update_component,
                    args=(grad, learning_rate, None if id(variable) in no_decay else decay, ema),
                    group=False,
                )
        self._count()
        return self.iterations

    def _prepared(self, grads: list, divisor) -> list | None:
        """The aggregated gradients divided by ``divisor`` (an accumulation window's weight, or the gradient
        denominator's total: a tensor), then through each gradient stage (a ``LossScaleOptimizer``'s
        unscaling); ``None`` when a stage skips the step (non-finite values)."""
        if isinstance(divisor, torch.Tensor):  # one factor for every gradient, one kernel per device
            with _no_grad():
                factor = divisor.reciprocal().to(torch.float32)
                by_device: dict = {}
                for index, grad in enumerate(grads):
                    by_device.setdefault(grad.device, []).append(index)
                scaled = list(grads)
                for device, indices in by_device.items():
                    on_device = factor.to(device)
                    for index, value in zip(indices, foreach.mul([grads[i] for i in indices], on_device)):
                        scaled[index] = value
                grads = scaled
        elif divisor is not None and divisor != 1:
            with _no_grad():
                grads = foreach.div(grads, float(divisor))
        for stage in self._gradient_stages.values():
            if (grads := stage(grads)) is None:
                return None
        return grads

    # Step 3, on the aggregated gradient (computed once, whatever the number of copies).
    def _transform(self, grads: list, variables: list) -> list:
        if self.clipvalue is not None:
            return [g.clamp(-self.clipvalue, self.clipvalue) for g in grads]
        if self.clipnorm is not None:
            return [g * (self.clipnorm / torch.clamp(torch.linalg.vector_norm(g), min=self.clipnorm)) for g in grads]
        if self.global_clipnorm is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            scale = self.global_clipnorm / torch.clamp(norm, min=self.global_clipnorm)
            return [g * scale for g in grads]
        return grads

    def _prepare_step(self, learning_rate: float) -> None:
        """Computes per-apply constants once (before any variable is updated)."""

    def update_step(self, gradient, variable, learning_rate) -> None:
        """Updates one copy of ``variable`` (a ``LocalVariable``) from its aggregated ``gradient``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement update_step(gradient, variable, learning_rate)."
        )

    def _update_component(self, variable, gradient, learning_rate, decay=None, ema=None):
        """One copy's update: decay, ``update_step``, then its moving average (the per-variable path)."""
        with torch.no_grad():
            if decay:
                variable.assign_sub(variable.value() * (decay * learning_rate))
            self.update_step(gradient, variable, learning_rate)
            if ema is not None:  # lists of one: the rule is written once (ema.move_averages)
                move_averages([self.get_slot(variable, "average").value()], [variable.value()], ema)

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
        tensors = [v.value() if isinstance(v, ds.Variable) else v for v in var_list]
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        return self.apply_gradients(zip(grads, var_list))

    def _strategy_of(self, variables):
        owner = getattr(variables[0], "_distribute_strategy", None)
        return owner if owner is not None else context.get_strategy()

    def _as_variable(self, variable, position: int):
        entry = self._wrapped.get(id(variable))
        if entry is not None and entry[0] is variable:
            return entry[1]
        if isinstance(variable, ds.Variable):
            return value_container(variable)
        if not isinstance(variable, torch.Tensor):
            raise TypeError(f"apply_gradients() needs variables or tensors, got {type(variable).__name__}.")
        container = value_container(variable)
        if container is not variable:
            return container
        if entry is None or entry[0] is not variable:
            name = f"variable_{len(self._wrapped)}"
            entry = (
                variable,
                ds.LocalVariable(variable, name=name, device=canonicalize(variable.device), trainable=True),
            )
            self._wrapped[id(variable)] = entry
        return entry[1]

    def _sharded_build(self, strategy, variables):
        """The ``StateShards`` of ``variables`` when the strategy shards optimizer states (the optimizer built
        for their pieces, a loaded state restored), else ``None``."""
        if self._shards is None and getattr(strategy.extended, "shard_optimizer_states", False) is False:
            return None
        shards = self._shards_for(strategy, variables)
        if shards is not None:
            self._build_for(variables)
        return shards

    def _build_for(self, variables) -> None:
        """Builds for the variables not built for yet (``_build_missing``), then restores what a loaded state
        holds for them."""
        self._build_missing(variables)
        # A loaded state waits for its variables (built here, or by a direct build() call).
        if self._pending is not None and self._pending.checked != len(self._variables):
            self._restore_pending()

    def _build_missing(self, variables) -> None:
        """Builds for the variables not built for yet: for their pieces where the strategy shards the optimizer
        state (``Trainer`` calls it before it loads a state, which is then checked against them)."""
        if self._slots_outdated:
            self._refresh_slots()
        missing = [v for v in variables if id(v) not in self._built_ids]
        if missing:
            strategy = self._strategy_of(missing)
            shards = self._shards_for(strategy, variables) if len(missing) == len(variables) else None
            if shards is not None:
                self._build_sharded(strategy, shards)
            else:
                with context.enter_or_assert_strategy(strategy):
                    self.build(missing)

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
        return {
            "name": self.name,
            "learning_rate": rate,
            "weight_decay": self.weight_decay,
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

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
        aggregated copies (a snapshot), the same under every strategy. Entries loaded by
        ``load_state_dict`` for variables not built yet are included as they were loaded.

        Example::

            state = optimizer.state_dict()
            state["slots"][0]["momentum"]          # the first variable's momentum
        """
        if self._slots_outdated:
            self._refresh_slots()
        if self._pending is not None and self._pending.checked != len(self._variables):
            self._restore_pending()  # variables built by a direct build() call since the load
        if self._window is not None:  # a first window opens before the first update builds
            self._build_for(self._window.variables)
        records = state_format.describe(self._variables)
        slots: dict = {}
        if self._shards is not None:  # gathered from every worker's pieces
            slots = self._whole_slots()
        for position, variable in enumerate(self._variables if self._shards is None else ()):
            slots[position] = {
                name: local_results(self._slots[(id(variable), name)])[0].value().detach().clone()
                for name in self._slot_names.get(id(variable), [])
            }
        pending = self._pending
        if pending is not None and pending.records is None and not self._variables:
            slots = {name: dict(entry) for name, entry in pending.entries.items()}  # name-keyed, as loaded
            records = None
        elif pending is not None and pending.records:
            for position in range(len(records), len(pending.records)):
                records.append(dict(pending.records[position]))
                if position in pending.entries:
                    slots[position] = dict(pending.entries[position])
        state = {"iterations": int(self.iterations), "slots": slots}
        if records is not None:
            state["variables"] = records
        self._add_window_state(state)
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
        taken, assignments = self._plan_restore(pending)  # every check before any change
        window = self._checked_window_state(state)
        self.iterations.assign(iterations)
        self._load_window_state(window)
        if learning_rate is not None:
            self.learning_rate = learning_rate
        _assign_all(assignments)
        pending.discard(taken, self._variables)
        self._pending = None if pending.done(len(self._variables)) else pending

    def _restore_pending(self) -> None:
        """Restores the loaded entries of variables built since ``load_state_dict``."""
        if not self._variables:
            return
        taken, assignments = self._plan_restore(self._pending)
        _assign_all(assignments)
        self._pending.discard(taken, self._variables)
        if self._pending.done(len(self._variables)):
            self._pending = None

    def _plan_restore(self, pending) -> tuple:
        """``(entries taken, [(slot, value)])`` for the built variables; ``ValueError`` if they do not fit."""
        if not self._variables:
            return {}, []
        taken = pending.match(self._variables)
        assignments = []
        for position, entry in taken.items():
            variable = self._variables[position]
            names = self._slot_names.get(id(variable), []) if self._shards is None else self._piece_names(position)
            if names is None:  # sharded, and this worker owns no piece at all: nothing here to check or keep
                continue
            entry = _with_average(entry, names, variable)
            if (set(entry) ^ set(names)) - set(self._optional_slots):
                raise ValueError(
                    f"The optimizer state's variable {position} ({variable.name!r}) has slots {sorted(entry)}, but "
                    f"{type(self).__name__} {self.name!r} keeps {sorted(names)} for it: the state was saved by "
                    "another optimizer or with other options."
                )
            expected = list(local_results(variable)[0].shape)
            for name in [*names, *(n for n in entry if n not in names)]:
                key = (id(variable), name)
                if self._shards is not None:  # this worker's pieces of the whole value
                    slot = ShardedSlot(self, position, name)
                else:
                    slot = self._slots[key] if key in self._slots else _NewSlot(self, variable, name)
                if name not in entry:  # an optional slot the state lacks starts again
                    assignments.append((slot, torch.zeros(expected, dtype=local_results(variable)[0].dtype)))
                    continue
                value = entry[name]
                if not isinstance(value, torch.Tensor) or list(value.shape) != expected:
                    found = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"The optimizer state's slot {name!r} of variable {position} ({variable.name!r}) must be a "
                        f"tensor of shape {expected}, got {found}."
                    )
                assignments.append((slot, value))
        return taken, assignments

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, learning_rate={self._learning_rate!r})"


class _NewSlot:
    """An optional slot a loaded state holds and the optimizer has not made yet: made only once every check
    has passed (``_assign_all``)."""

    def __init__(self, optimizer, variable, name: str):
        self.optimizer, self.variable, self.name = optimizer, variable, name

    def make(self):
        self.optimizer._plans.clear()  # the multi-tensor groups follow each variable's slot names
        return self.optimizer.add_variable_from_reference(self.variable, self.name)


def _assign_all(assignments) -> None:
    """Writes loaded values into slot variables (every copy of each), making the optional ones a state brings."""
    for slot, value in assignments:
        if isinstance(slot, _NewSlot):
            slot = slot.make()
        strategy = getattr(slot, "_distribute_strategy", None) or context.get_strategy()
        with context.enter_or_assert_strategy(strategy):
            slot.assign(value)


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


def _per_copy(strategy, grad, variable):
    if (
        type(variable) is ds.LocalVariable
        or isinstance(grad, ds.DistributedValues)
        or len(local_results(variable)) == 1
    ):
        return grad
    return strategy.extended.broadcast_to(grad, variable)


def _merge_apply(strategy, optimizer, grads, variables):
    """merge_fn of a replica-context apply: the optimizer's ``_reduce_and_apply``, once."""
    return optimizer._reduce_and_apply(strategy, grads, variables)
