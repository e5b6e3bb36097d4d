"""``from_torch``: any ``torch.optim`` optimizer, distribution-aware.

The gradients go through the same pipeline as the built-ins (one batched SUM across
replicas, clipping); the update itself is torch's own ``step()``, run by one torch
optimizer per set of variable copies (one per replica under ``MirroredStrategy``, one on
the parameter device under ``CentralStorageStrategy``). Every copy receives the same
gradient and starts from the same state, so the copies stay identical and the numerics
are exactly torch's.

Example::

    optimizer = optimizers.from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    strategy.run(step)          # step calls optimizer.apply_gradients(...)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replicafit.strategies.describe import brief
from replicafit.strategies.values import local_results

from . import state as state_format
from .accumulation import checked_window_state, window_state
from .base import SHARED_ARGUMENTS, Optimizer
from .ema import move_averages

__all__ = ["TorchOptimizer", "from_torch"]


class TorchOptimizer(Optimizer):
    """Wraps a ``torch.optim.Optimizer`` class (see ``from_torch``).

    ``learning_rate`` reads and sets the torch optimizer's ``lr``; ``state_dict()``
    keys torch's per-parameter state by the variable's position (as torch does), with
    names and shapes as a check, and holds one copy, so it loads under any strategy.
    The update rule of the pipeline (step 7) is torch's ``step()``: one torch optimizer per copy
    index of the targets (each replica's copies under ``MirroredStrategy``, the stored copies under
    ``CentralStorageStrategy``, this worker's slices under sharded optimizer states).
    """

    def __init__(self, optimizer_class, *, name=None, **kwargs):
        if isinstance(optimizer_class, torch.optim.Optimizer):  # the torch habit: an optimizer of parameters
            raise TypeError(
                "from_torch() takes a torch optimizer class and its arguments, not an optimizer already made from "
                f"parameters ({type(optimizer_class).__name__}): write optimizers.from_torch("
                f"{_call_of(optimizer_class)}). The parameters are given at the first update (every replica's copy "
                "gets its own torch optimizer)."
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"from_torch() needs a torch.optim.Optimizer subclass, got {brief(optimizer_class)}.")
        ours = {k: kwargs.pop(k) for k in _OURS if k in kwargs}  # the pipeline's; the rest is torch's
        torch_kwargs = kwargs
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **torch_kwargs)  # validates the kwargs
        super().__init__(
            probe.param_groups[0].get("lr", 1e-3), name=name or f"torch_{optimizer_class.__name__.lower()}", **ours
        )
        self._torch_class = optimizer_class
        self._torch_kwargs = dict(torch_kwargs)
        # Sharded optimizer states give the update slices of variables: refused for rules that read whole ones.
        self.elementwise_update = optimizer_class.__name__ not in _WHOLE_TENSOR_RULES
        self._decays = "weight_decay" in probe.defaults  # the class has a weight_decay (exclusions apply)
        self._torch_optimizers: list = []
        self._torch_order: list = []  # the target index of each of torch's parameter indices
        self._pending_groups: list = []  # loaded param_groups (without "params"), applied at build
        self._pending_slots = None  # loaded averages (use_ema), for variables not built yet

    def build(self, variables) -> None:
        """Builds the moving averages (``use_ema``), then one torch optimizer per copy index over every target
        built so far, keeping the state of the targets built before."""
        super().build(variables)
        targets = self._targets
        copies = len(local_results(targets[0]))
        previous = self._torch_optimizers
        self._torch_optimizers = []
        # Variables excluded from weight decay form a second param group with weight_decay=0; torch numbers the
        # parameters group by group, so its indices follow this order. The groups are those of the whole
        # variables (under sharded states a group may be empty on this worker), so every worker's state has
        # their layout.
        decay = self._weight_decay
        excluded = [i for i, t in enumerate(targets) if decay.excludes(t)] if self._decays else []
        decayed = [i for i in range(len(targets)) if i not in set(excluded)]
        self._torch_order = decayed + excluded
        excludes = self._decays and any(decay.excludes(v) for v in self._variables)
        decays = not self._decays or any(not decay.excludes(v) for v in self._variables)
        for copy in range(copies):
            tensors = [self._copy_tensor(t, copy) for t in targets]
            params = [{"params": [tensors[i] for i in decayed]}] if decays else []
            if excludes:
                params.append({"params": [tensors[i] for i in excluded], "weight_decay": 0.0})
            optimizer = self._torch_class(params, **self._torch_kwargs)
            if copy < len(previous):  # keep the state of the targets built before
                optimizer.state.update(previous[copy].state)
            self._torch_optimizers.append(optimizer)

    def _targets_moved(self, layout) -> None:
        """The torch optimizers' parameters (and their state, keyed by them) follow the targets' new memory."""
        for copy, optimizer in enumerate(self._torch_optimizers):
            tensors = [self._copy_tensor(t, copy) for t in self._targets]
            old = [p for group in optimizer.param_groups for p in group["params"]]
            state = {id(p): optimizer.state[p] for p in old if p in optimizer.state}
            start = 0
            for group in optimizer.param_groups:  # torch numbers the parameters group by group
                count = len(group["params"])
                group["params"] = [tensors[self._torch_order[i]] for i in range(start, start + count)]
                start += count
            optimizer.state.clear()
            for before, after in zip(old, (p for group in optimizer.param_groups for p in group["params"])):
                if id(before) in state:
                    optimizer.state[after] = state[id(before)]

    def _update_rule(self, layout, gradients, variables, learning_rate: float, ema) -> bool:
        """torch's ``step()`` for every copy index, with only this update's gradients set (torch steps every
        parameter that has a ``.grad``), then every copy's moving average."""
        targets = layout.targets_of(variables)
        per_copy = gradients.copies if gradients.copies is not None else layout.per_copy(gradients.values, variables)
        with torch.no_grad():
            for copy, optimizer in enumerate(self._torch_optimizers):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate
                everything = [self._copy_tensor(t, copy) for t in self._targets]
                saved = [t.grad for t in everything]
                for tensor in everything:
                    tensor.grad = None
                for target, grad in zip(targets, per_copy):
                    grad = grad if type(grad) is torch.Tensor else local_results(grad)[copy]
                    self._copy_tensor(target, copy).grad = grad.detach()
                try:
                    optimizer.step()
                finally:
                    for tensor, grad in zip(everything, saved):
                        tensor.grad = grad
            if ema is not None:
                self._update_averages(targets, ema)
        return True

    @property
    def torch_class(self) -> type:
        """The ``torch.optim.Optimizer`` class whose ``step()`` updates the variables.

        Example::

            optimizers.from_torch(torch.optim.SGD, lr=0.1).torch_class   # torch.optim.SGD
        """
        return self._torch_class

    @property
    def torch_kwargs(self) -> dict:
        """The keyword arguments the torch optimizers are made with.

        A copy: change them with ``set_torch_hyperparameters``.

        Example::

            optimizer = optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
            optimizer.torch_kwargs["momentum"]   # 0.9
            defaults = optimizer.torch_class([torch.zeros(1, requires_grad=True)], **optimizer.torch_kwargs).defaults
        """
        return dict(self._torch_kwargs)

    def torch_hyperparameters(self) -> dict:
        """The torch class's ``momentum`` or ``betas`` (a scheduler may cycle them), as the torch optimizers have
        them now."""
        defaults = self._torch_class([torch.zeros(1, requires_grad=True)], **self._torch_kwargs).defaults
        return {k: defaults[k] for k in ("momentum", "betas") if k in defaults}

    def set_torch_hyperparameters(self, **values) -> None:
        """Sets hyper-parameters of torch's param groups (``momentum``, ``betas``, ...) in every copy's torch
        optimizer, and in ``torch_kwargs`` for the copies built later. The learning rate is
        ``learning_rate``'s: set that instead.

        Example::

            optimizer.set_torch_hyperparameters(momentum=0.85)   # TorchLRScheduler cycling OneCycleLR's momentum
        """
        self._torch_kwargs.update(values)
        for copy in self._torch_optimizers:
            for group in copy.param_groups:
                group.update(values)

    @staticmethod
    def _copy_tensor(target, copy: int) -> torch.Tensor:
        return local_results(target)[copy].value()

    def _update_averages(self, targets, ema) -> None:
        """Every copy's moving average, from that copy (the operations of the built-ins' update)."""
        weights = [self._copy_tensor(t, c) for t in targets for c in range(len(local_results(t)))]
        averages = [
            local_results(self._slots.of(t, "average"))[c].value()
            for t in targets
            for c in range(len(local_results(t)))
        ]
        move_averages(averages, weights, ema)

    def get_config(self) -> dict:
        """The torch class's dotted name as ``optimizer_class``, the wrapper's arguments, and ``torch_kwargs``.

        ``torch_kwargs`` are as they are now (after ``set_torch_hyperparameters``). The learning rate is
        there only as the ``lr`` given to ``from_torch``: unlike Keras', the config does not keep a rate
        set later through ``learning_rate``.
        """
        return (
            {
                "optimizer_class": f"{self._torch_class.__module__}.{self._torch_class.__qualname__}",
                "name": self.name,
            }
            | {name: getattr(self, name) for name in _OURS}
            | self._torch_kwargs
        )

    @classmethod
    def from_config(cls, config: dict):
        """A ``TorchOptimizer`` from ``get_config()``'s output.

        Raises:
          ValueError: ``optimizer_class`` names a class from outside ``torch.optim`` (classes are found by name there).
        """
        config = dict(config)
        module, _, name = config.pop("optimizer_class").rpartition(".")
        inside = module == "torch.optim" or module.startswith("torch.optim.")
        optimizer_class = getattr(torch.optim, name, None) if inside else None
        if not isinstance(optimizer_class, type):
            raise ValueError(f"Cannot rebuild a TorchOptimizer for {module}.{name}: only torch.optim classes.")
        return cls(optimizer_class, **config)

    def state_dict(self) -> dict:
        """``{"iterations", "variables": [{"name", "shape"}], "torch_state": {position: torch state},
        "param_groups": [...]}``: torch's own per-parameter state, keyed by the variable's position."""
        if self._pending is not None and self._pending.checked != len(self._variables) and self._torch_optimizers:
            self._restore_pending()
        window = self._accumulation.window if self._accumulation is not None else None
        if window is not None:  # a first window opens before the first update builds
            self._build(self._strategy_of(window.variables), window.variables)
            if self._pending is not None and self._pending.checked != len(self._variables):
                self._restore_pending()
        records = state_format.describe(self._variables)
        entries: dict = {}
        groups = [dict(group) for group in self._pending_groups]
        if self._torch_optimizers:
            state = self._torch_optimizers[0].state_dict()
            entries = self._whole_torch_state(state["state"])
            groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
        records, entries = state_format.with_pending(self._pending, records, entries, bool(self._variables))
        if not callable(self._learning_rate):  # a rate set since the last step (e.g. by a callback) is the rate
            groups = [group | {"lr": float(self._learning_rate)} for group in groups or [{}]]
        state = {"iterations": int(self.iterations), "torch_state": entries, "param_groups": groups}
        if records is not None:
            state["variables"] = records
        if self.use_ema:
            state["slots"] = self._average_entries(records)
        window_state(self, state)
        return state

    def _target_entries(self, taken: dict) -> dict:
        """``{target index: torch entry}``: the whole entries ``taken`` (by position) as this worker's targets
        hold them; where targets are slices of variables, a value shaped like its variable is cut, any other
        (``step``) kept as it is."""
        layout = self._layout
        entries: dict = {}
        for number, target in enumerate(self._targets):
            position = layout.position_of(target)
            entry = taken.get(position)
            if entry is None:
                continue
            if not layout.slices_variables:
                entries[number] = entry
                continue
            shape = tuple(local_results(self._variables[position])[0].value().shape)
            entries[number] = {
                name: _part_of(layout, position, target, value)
                if name != "step" and isinstance(value, torch.Tensor) and tuple(value.shape) == shape
                else value
                for name, value in entry.items()
            }
        return entries

    def _whole_torch_state(self, state: dict) -> dict:
        """``{position: torch entry}`` of whole variables from torch's state (keyed by torch's index). Where the
        targets are slices, from this worker's slices and every other worker's: an entry's tensors shaped like
        the slice are gathered into the variable's shape, its other values (``step``) are the same on every
        slice and taken as they are."""
        layout = self._layout
        by_target = {self._torch_order[index]: entry for index, entry in state.items()}
        if not layout.slices_variables:
            return {layout.position_of(self._targets[n]): _cloned(entry) for n, entry in by_target.items()}
        mine: dict = {}  # position -> {name: None for a gathered tensor, else the value}
        for number, target in enumerate(self._targets):
            entry = by_target.get(number)
            position = layout.position_of(target)
            if entry is not None and position not in mine:
                mine[position] = {
                    name: None if _is_slice_tensor(name, value, target) else _cloned({name: value})[name]
                    for name, value in entry.items()
                }
        entries: dict = {}
        for part in layout.gather_objects(mine, "the torch optimizer's state layout"):
            for position, entry in part.items():
                entries.setdefault(position, dict(entry))
        names = []
        for entry in entries.values():
            names += [name for name, value in entry.items() if value is None and name not in names]
        for name in names:
            per_target = [
                by_target[n][name].detach() if name in by_target.get(n, {}) else None for n in range(len(self._targets))
            ]
            whole = layout.whole(per_target, f"the torch optimizer's {name!r} state")
            for position, entry in entries.items():
                if name in entry:
                    entry[name] = whole[position]
        return dict(sorted(entries.items()))

    def _average_entries(self, records) -> dict:
        """``{position: {"average": tensor}}``: the moving averages (``use_ema``), as the built-ins keep them."""
        slots = {position: {"average": value["average"]} for position, value in state_format.whole_slots(self).items()}
        pending = self._pending_slots
        if pending is not None and records is not None and pending.records:
            for position in range(len(self._variables), len(pending.records)):
                if position in pending.entries:
                    slots[position] = dict(pending.entries[position])
        return slots

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output (see ``Optimizer.load_state_dict`` for the checks).

        Torch's per-parameter entries are checked for their structure and for the
        variables they belong to (count, names, shapes); the shapes inside an entry are
        torch's business (they are not all the parameter's shape).
        """
        iterations, pending = state_format.parse(state, "torch_state", type(self).__name__)
        for key, entry in pending.entries.items():
            for name, value in entry.items():
                if not _is_state_value(value):
                    raise ValueError(
                        f"The optimizer state's torch entry {name!r} of variable {key!r} must be a tensor, a number "
                        f"or None, got {type(value).__name__}."
                    )
        groups = state.get("param_groups") or []
        if not isinstance(groups, (list, tuple)) or not all(isinstance(group, Mapping) for group in groups):
            raise ValueError(
                f"The optimizer state's 'param_groups' must be a list of dicts, got {type(groups).__name__}."
            )
        learning_rate = None
        if groups and "lr" in groups[0] and not callable(self._learning_rate):
            learning_rate = state_format.check_learning_rate(groups[0]["lr"], "lr (in the optimizer state)")
        slots = None
        if "slots" in state:  # moving averages (use_ema)
            _, slots = state_format.parse(
                {"iterations": 0, "slots": state["slots"], "variables": state.get("variables")},
                "slots",
                type(self).__name__,
            )
        if self._torch_optimizers:
            pending.match(self._variables)  # every check before any change
            if slots is not None:
                state_format.plan_restore(self, slots)
        window = checked_window_state(self, state)
        self.iterations.assign(iterations)
        if self._accumulation is not None:
            self._accumulation.load(window, self._variables)
        if learning_rate is not None:
            self.learning_rate = learning_rate
        self._pending_groups = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        self._pending = pending
        self._pending_slots = slots
        if self._torch_optimizers:
            self._restore_pending()

    def _restore_pending(self) -> None:
        """Loads the pending entries of built variables into every copy's torch optimizer."""
        if not self._torch_optimizers:
            return
        pending = self._pending
        taken = pending.match(self._variables)
        loaded = self._target_entries(taken)
        index = {number: i for i, number in enumerate(self._torch_order)}  # target index -> torch's
        for optimizer in self._torch_optimizers:
            current = optimizer.state_dict()
            groups = current["param_groups"]
            for group, saved in zip(groups, self._pending_groups):
                group.update(saved)
            # Each copy gets its own tensors: torch updates its state in place.
            entries = dict(current["state"]) | {index[key]: _cloned(entry) for key, entry in loaded.items()}
            optimizer.load_state_dict({"state": entries, "param_groups": groups})
        pending.discard(taken, self._variables)
        if pending.done(len(self._variables)):
            self._pending = None
        slots = self._pending_slots
        if slots is not None:
            slot_taken, assignments = state_format.plan_restore(self, slots)
            state_format.assign_all(assignments)
            slots.discard(slot_taken, self._variables)
            if slots.done(len(self._variables)):
                self._pending_slots = None


#: The pipeline's arguments a torch optimizer takes besides torch's own (weight decay is torch's: its class
#: decays the way it does, coupled or decoupled).
_OURS = tuple(name for name in SHARED_ARGUMENTS if name != "weight_decay")


# torch.optim rules that read whole parameters (Adafactor's factored second moments and RMS scale, Muon's
# orthogonalised matrices, L-BFGS's closure over every parameter): not element-wise, so never sharded.
_WHOLE_TENSOR_RULES = frozenset({"Adafactor", "Muon", "LBFGS"})


def _is_slice_tensor(name: str, value, target) -> bool:
    """Whether a torch state value holds one value per element of the slice ``target`` (``step`` never does)."""
    if name == "step" or not isinstance(value, torch.Tensor):
        return False
    return value.dim() == 1 and value.numel() == target.value().numel()


def _part_of(layout, position: int, target, value: torch.Tensor) -> torch.Tensor:
    """``target``'s part of a whole value of variable ``position`` (a copy)."""
    for owner, part in layout.cut(position, value):
        if owner is target:
            return part.clone()
    raise ValueError(f"{target.name!r} holds no part of variable {position}.")


def _call_of(optimizer: torch.optim.Optimizer) -> str:
    """``torch.optim.SGD, lr=0.1, momentum=0.9``: the class and the arguments that differ from its defaults."""
    cls = type(optimizer)
    try:
        defaults = cls([torch.zeros(1, requires_grad=True)]).defaults
    except TypeError:  # a required argument (lr for some classes): show every argument
        defaults = {}
    changed = [f"{k}={v!r}" for k, v in optimizer.defaults.items() if k not in defaults or defaults[k] != v]
    module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return ", ".join([f"{module}.{cls.__name__}", *changed])


def _cloned(entry: Mapping) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def _is_state_value(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(map(_is_state_value, value))
    return value is None or isinstance(value, (torch.Tensor, int, float))


def from_torch(optimizer_class, **kwargs) -> TorchOptimizer:
    """Makes ``torch.optim`` optimizer ``optimizer_class`` distribution-aware.

    ``kwargs`` go to the torch class, except ``clipnorm``/``clipvalue``/``global_clipnorm``
    /``gradient_accumulation_steps``/``name``, which are this package's (applied to the
    aggregated gradient; torch's ``step()`` runs once per accumulation window).

    Example::

        optimizer = from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    """
    return TorchOptimizer(optimizer_class, **kwargs)
