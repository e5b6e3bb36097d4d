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
from .base import Optimizer, _assign_all
from .ema import move_averages

__all__ = ["TorchOptimizer", "from_torch"]


class TorchOptimizer(Optimizer):
    """Wraps a ``torch.optim.Optimizer`` class (see ``from_torch``).

    ``learning_rate`` reads and sets the torch optimizer's ``lr``; ``state_dict()``
    keys torch's per-parameter state by the variable's position (as torch does), with
    names and shapes as a check, and holds one copy, so it loads under any strategy.
    """

    def __init__(
        self,
        optimizer_class,
        *,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        gradient_accumulation_steps=None,
        name=None,
        **torch_kwargs,
    ):
        if isinstance(optimizer_class, torch.optim.Optimizer):  # the torch habit: an optimizer of parameters
            raise TypeError(
                "from_torch() takes a torch optimizer class and its arguments, not an optimizer already made from "
                f"parameters ({type(optimizer_class).__name__}): write optimizers.from_torch("
                f"{_call_of(optimizer_class)}). The parameters are given at the first update (every replica's copy "
                "gets its own torch optimizer)."
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"from_torch() needs a torch.optim.Optimizer subclass, got {brief(optimizer_class)}.")
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **torch_kwargs)  # validates the kwargs
        super().__init__(
            probe.param_groups[0].get("lr", 1e-3),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name or f"torch_{optimizer_class.__name__.lower()}",
        )
        self._torch_class = optimizer_class
        self._torch_kwargs = dict(torch_kwargs)
        # Sharded optimizer states give the update slices of variables: refused for rules that read whole ones.
        self.elementwise_update = optimizer_class.__name__ not in _WHOLE_TENSOR_RULES
        self._decays = "weight_decay" in probe.defaults  # the class has a weight_decay (exclusions apply)
        self._torch_optimizers: list = []
        self._torch_order: list = []  # the variable position of each of torch's parameter indices
        self._pending_groups: list = []  # loaded param_groups (without "params"), applied at build
        self._pending_slots = None  # loaded averages (use_ema), for variables not built yet

    def build(self, variables) -> None:
        super().build(variables)
        if self._shards is not None:  # sharded optimizer states: one torch optimizer over this worker's pieces
            self._build_pieces()
            return
        copies = len(local_results(self._variables[0]))
        previous = self._torch_optimizers
        self._torch_optimizers = []
        # Variables excluded from weight decay form a second param group with weight_decay=0;
        # torch numbers the parameters group by group, so its indices follow this order.
        excluded = [i for i, v in enumerate(self._variables) if id(v) in self._no_decay] if self._decays else []
        decayed = [i for i in range(len(self._variables)) if i not in set(excluded)]
        self._torch_order = decayed + excluded
        for copy in range(copies):
            tensors = [self._copy_tensor(v, copy) for v in self._variables]
            params = [{"params": [tensors[i] for i in decayed]}] if decayed else []
            if excluded:
                params.append({"params": [tensors[i] for i in excluded], "weight_decay": 0.0})
            optimizer = self._torch_class(params, **self._torch_kwargs)
            if copy < len(previous):  # keep the state of variables built before
                optimizer.state.update(previous[copy].state)
            self._torch_optimizers.append(optimizer)

    def _build_pieces(self) -> None:
        """One torch optimizer over this worker's piece variables (1-D views of its chunks), its param groups
        those of the whole variables (a group may be empty on this worker), so its state has their layout."""
        pieces = self._shards.piece_variables
        excluded = [i for i, v in enumerate(pieces) if id(v) in self._no_decay] if self._decays else []
        decayed = [i for i in range(len(pieces)) if i not in set(excluded)]
        self._torch_order = decayed + excluded  # torch's parameter index -> piece index
        whole_excluded = self._decays and any(id(v) in self._no_decay for v in self._variables)
        whole_decayed = not self._decays or any(id(v) not in self._no_decay for v in self._variables)
        tensors = [v._read() for v in pieces]
        params = [{"params": [tensors[i] for i in decayed]}] if whole_decayed else []
        if whole_excluded:
            params.append({"params": [tensors[i] for i in excluded], "weight_decay": 0.0})
        self._torch_optimizers = [self._torch_class(params, **self._torch_kwargs)]

    def _pieces_moved(self) -> None:
        """The torch optimizer's parameters (and its state, keyed by them) follow the pieces' new views."""
        optimizer = self._torch_optimizers[0]
        tensors = [v._read() for v in self._shards.piece_variables]
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

    def _update_pieces(self, shards, grads: list, learning_rate: float, ema) -> None:
        """torch's ``step()`` on this worker's pieces, then their moving averages."""
        optimizer = self._torch_optimizers[0]
        pieces = [v._read() for v in shards.piece_variables]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        try:
            for tensor, grad in zip(pieces, grads):
                tensor.grad = grad.detach()
            optimizer.step()
        finally:
            for tensor in pieces:
                tensor.grad = None
        if ema is not None and pieces:
            averages = [self._slots[(id(v), "average")]._read() for v in shards.piece_variables]
            move_averages(averages, pieces, ema)

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
    def _copy_tensor(variable, copy: int) -> torch.Tensor:
        return local_results(variable)[copy].value()

    def _apply_aggregated(self, strategy, grads, variables, divisor=None):
        shards = self._sharded_build(strategy, variables)
        if shards is not None:  # reduced already: this worker's slices of them
            whole = [g if type(g) is torch.Tensor else local_results(g)[0] for g in grads]
            return self._apply_sharded(strategy, shards, shards.slices(whole), divisor=divisor)
        self._build_for(variables)
        primaries = [g if type(g) is torch.Tensor else local_results(g)[0] for g in grads]
        prepared = self._prepared(primaries, self._divisor(strategy, divisor))
        if prepared is None:  # a gradient stage skipped it (a loss scaler's infinities or NaNs): counted
            self._count()
            return self.iterations
        transformed = self._transform(prepared, variables)
        grads = [strategy.extended.broadcast_to(g, v) for g, v in zip(transformed, variables)]
        learning_rate = self._current_learning_rate()
        with torch.no_grad():
            for copy, optimizer in enumerate(self._torch_optimizers):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate
                # torch steps every parameter that has a .grad: only this apply's gradients may be set.
                everything = [self._copy_tensor(v, copy) for v in self._variables]
                saved = [t.grad for t in everything]
                for tensor in everything:
                    tensor.grad = None
                for variable, grad in zip(variables, grads):
                    self._copy_tensor(variable, copy).grad = local_results(grad)[copy].detach()
                try:
                    optimizer.step()
                finally:
                    for tensor, grad in zip(everything, saved):
                        tensor.grad = grad
            ema = self._ema_step()
            if ema is not None:
                self._update_averages(variables, ema)
        strategy.extended.after_direct_update(variables)
        self._count()
        return self.iterations

    def _update_averages(self, variables, ema) -> None:
        """Every copy's moving average, from that copy (the operations of the built-ins' update)."""
        weights = [self._copy_tensor(v, c) for v in variables for c in range(len(local_results(v)))]
        averages = [
            local_results(self._slots[(id(v), "average")])[c].value()
            for v in variables
            for c in range(len(local_results(v)))
        ]
        move_averages(averages, weights, ema)

    def get_config(self) -> dict:
        """The torch class's dotted name as ``optimizer_class``, the wrapper's arguments, and ``torch_kwargs``.

        ``torch_kwargs`` are as they are now (after ``set_torch_hyperparameters``). The learning rate is
        there only as the ``lr`` given to ``from_torch``: unlike Keras', the config does not keep a rate
        set later through ``learning_rate``.
        """
        config = super().get_config()
        return {
            "optimizer_class": f"{self._torch_class.__module__}.{self._torch_class.__qualname__}",
            "name": config["name"],
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        } | self._torch_kwargs

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
        if self._window is not None:  # a first window opens before the first update builds
            self._build_for(self._window.variables)
        records = state_format.describe(self._variables)
        entries: dict = {}
        groups = [dict(group) for group in self._pending_groups]
        if self._torch_optimizers:
            state = self._torch_optimizers[0].state_dict()
            if self._shards is not None:  # every worker's pieces, gathered into whole entries
                entries = self._whole_torch_state(state["state"])
            else:
                entries = {self._torch_order[index]: _cloned(entry) for index, entry in state["state"].items()}
            groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
        pending = self._pending
        if pending is not None and pending.records is None and not self._variables:
            entries, records = {name: dict(entry) for name, entry in pending.entries.items()}, None  # as loaded
        elif pending is not None and pending.records:
            for position in range(len(records), len(pending.records)):
                records.append(dict(pending.records[position]))
                if position in pending.entries:
                    entries[position] = dict(pending.entries[position])
        if not callable(self._learning_rate):  # a rate set since the last step (e.g. by a callback) is the rate
            groups = [group | {"lr": float(self._learning_rate)} for group in groups or [{}]]
        state = {"iterations": int(self.iterations), "torch_state": entries, "param_groups": groups}
        if records is not None:
            state["variables"] = records
        if self.use_ema:
            state["slots"] = self._average_entries(records)
        self._add_window_state(state)
        return state

    def _piece_entries(self, taken: dict) -> dict:
        """``{piece number: torch entry}``: the whole entries ``taken`` (by position) cut into this worker's
        pieces; a value shaped like its variable is sliced, any other (``step``) kept as it is."""
        entries: dict = {}
        for number, piece in enumerate(self._shards.pieces):
            entry = taken.get(piece.variable)
            if entry is None:
                continue
            shape = tuple(local_results(self._variables[piece.variable])[0]._read().shape)
            entries[number] = {
                name: value.reshape(-1)[piece.start : piece.stop].clone()
                if name != "step" and isinstance(value, torch.Tensor) and tuple(value.shape) == shape
                else value
                for name, value in entry.items()
            }
        return entries

    def _whole_torch_state(self, state: dict) -> dict:
        """``{position: torch entry}`` of whole variables from this worker's piece entries (``state``, keyed by
        torch's index) and every other worker's: an entry's tensors shaped like the piece are gathered into the
        variable's shape, its other values (``step``) are the same on every piece and taken as they are."""
        shards = self._shards
        by_piece = {self._torch_order[index]: entry for index, entry in state.items()}
        mine: dict = {}  # position -> {name: None for a gathered tensor, else the value}
        for number, piece in enumerate(shards.pieces):
            entry = by_piece.get(number)
            if entry is not None and piece.variable not in mine:
                mine[piece.variable] = {
                    name: None if _is_piece_tensor(name, value, piece) else _cloned({name: value})[name]
                    for name, value in entry.items()
                }
        layout: dict = {}
        for part in shards.gather_objects(mine, "the torch optimizer's state layout"):
            for position, entry in part.items():
                layout.setdefault(position, entry)
        names = []
        for entry in layout.values():
            names += [name for name, value in entry.items() if value is None and name not in names]
        entries = {position: dict(entry) for position, entry in layout.items()}
        for name in names:
            per_piece = [
                by_piece[number][name].detach() if name in by_piece.get(number, {}) else None
                for number in range(len(shards.pieces))
            ]
            whole = shards.gather(per_piece, f"the torch optimizer's {name!r} state")
            for position, entry in entries.items():
                if name in entry:
                    shape = local_results(shards.variables[position])[0]._read().shape
                    entry[name] = whole[position].view(shape).clone()
        return dict(sorted(entries.items()))

    def _average_entries(self, records) -> dict:
        """``{position: {"average": tensor}}``: the moving averages (``use_ema``), as the built-ins keep them."""
        if self._shards is not None:
            return self._whole_slots()
        slots = {
            position: {"average": local_results(self._slots[(id(v), "average")])[0].value().detach().clone()}
            for position, v in enumerate(self._variables)
        }
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
                self._plan_restore(slots)
        window = self._checked_window_state(state)
        self.iterations.assign(iterations)
        self._load_window_state(window)
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
        loaded, index = taken, {position: i for i, position in enumerate(self._torch_order)}  # torch's numbering
        if self._shards is not None:  # each whole entry cut into this worker's pieces, keyed by their numbers
            loaded, index = self._piece_entries(taken), {number: i for i, number in enumerate(self._torch_order)}
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
            slot_taken, assignments = self._plan_restore(slots)
            _assign_all(assignments)
            slots.discard(slot_taken, self._variables)
            if slots.done(len(self._variables)):
                self._pending_slots = None


# torch.optim rules that read whole parameters (Adafactor's factored second moments and RMS scale, Muon's
# orthogonalised matrices, L-BFGS's closure over every parameter): not element-wise, so never sharded.
_WHOLE_TENSOR_RULES = frozenset({"Adafactor", "Muon", "LBFGS"})


def _is_piece_tensor(name: str, value, piece) -> bool:
    """Whether a torch state value holds one value per element of ``piece`` (``step`` never does)."""
    return name != "step" and isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.size


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
