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

import torch

from replicafit.strategies.values import local_results

from .base import Optimizer

__all__ = ["TorchOptimizer", "from_torch"]


class TorchOptimizer(Optimizer):
    """Wraps a ``torch.optim.Optimizer`` class (see ``from_torch``).

    ``learning_rate`` reads and sets the torch optimizer's ``lr``; ``state_dict()``
    keys torch's per-parameter state by variable name, so it loads under any strategy.
    """

    def __init__(
        self, optimizer_class, *, clipnorm=None, clipvalue=None, global_clipnorm=None, name=None, **torch_kwargs
    ):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"from_torch() needs a torch.optim.Optimizer subclass, got {optimizer_class!r}.")
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **torch_kwargs)  # validates the kwargs
        super().__init__(
            probe.param_groups[0].get("lr", 1e-3),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            name=name or f"torch_{optimizer_class.__name__.lower()}",
        )
        self._torch_class = optimizer_class
        self._torch_kwargs = dict(torch_kwargs)
        self._torch_optimizers: list = []
        self._pending_torch_state = None

    def build(self, variables) -> None:
        super().build(variables)
        copies = len(local_results(self._variables[0]))
        previous = self._torch_optimizers
        self._torch_optimizers = []
        for copy in range(copies):
            params = [self._copy_tensor(v, copy) for v in self._variables]
            optimizer = self._torch_class(params, **self._torch_kwargs)
            if copy < len(previous):  # keep the state of variables built before
                optimizer.state.update(previous[copy].state)
            self._torch_optimizers.append(optimizer)
        if self._pending_torch_state is not None:
            self._load_torch_state(self._pending_torch_state)

    @staticmethod
    def _copy_tensor(variable, copy: int) -> torch.Tensor:
        return local_results(variable)[copy]._read()

    def _current_learning_rate(self) -> float:
        rate = self._learning_rate
        return float(rate(int(self.iterations))) if callable(rate) else rate

    def _apply_aggregated(self, strategy, grads, variables):
        self._build_for(variables)
        primaries = [local_results(g)[0] for g in grads]
        transformed = self._transform(primaries, variables)
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
        strategy.extended._after_direct_update(variables)
        self.iterations.assign_add(1)
        return self.iterations

    def get_config(self) -> dict:
        config = super().get_config()
        return {
            "optimizer_class": f"{self._torch_class.__module__}.{self._torch_class.__qualname__}",
            "name": config["name"],
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
        } | self._torch_kwargs

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        module, _, name = config.pop("optimizer_class").rpartition(".")
        optimizer_class = getattr(torch.optim, name) if module.startswith("torch.optim") else None
        if optimizer_class is None:
            raise ValueError(f"Cannot rebuild a TorchOptimizer for {module}.{name}: only torch.optim classes.")
        return cls(optimizer_class, **config)

    def state_dict(self) -> dict:
        """``{"iterations", "torch_state": {variable name: torch state}, "param_groups": [...]}``."""
        names = [v.name for v in self._variables]
        if not self._torch_optimizers:
            pending = self._pending_torch_state or {"torch_state": {}, "param_groups": []}
            return {
                "iterations": int(self.iterations),
                "torch_state": dict(pending["torch_state"]),
                "param_groups": list(pending["param_groups"]),
            }
        state = self._torch_optimizers[0].state_dict()
        per_name = {
            names[index]: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for index, entry in state["state"].items()
        }
        groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
        return {"iterations": int(self.iterations), "torch_state": per_name, "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "torch_state" not in state:
            raise ValueError("load_state_dict() needs the dict returned by TorchOptimizer.state_dict().")
        self.iterations.assign(int(state["iterations"]))
        if state.get("param_groups") and "lr" in state["param_groups"][0] and not callable(self._learning_rate):
            self.learning_rate = float(state["param_groups"][0]["lr"])
        if self._torch_optimizers:
            self._load_torch_state(state)
        else:
            self._pending_torch_state = state

    def _load_torch_state(self, state: dict) -> None:
        names = [v.name for v in self._variables]
        missing = [n for n in state["torch_state"] if n not in names]
        if missing:
            raise ValueError(f"The optimizer state has entries for unknown variables {missing}; known: {names}.")
        for optimizer in self._torch_optimizers:
            current = optimizer.state_dict()
            groups = current["param_groups"]
            for group, saved in zip(groups, state["param_groups"]):
                group.update(saved)
            entries = {names.index(n): dict(v) for n, v in state["torch_state"].items()}
            optimizer.load_state_dict({"state": entries, "param_groups": groups})
        self._pending_torch_state = None


def from_torch(optimizer_class, **kwargs) -> TorchOptimizer:
    """Makes ``torch.optim`` optimizer ``optimizer_class`` distribution-aware.

    ``kwargs`` go to the torch class, except ``clipnorm``/``clipvalue``/``global_clipnorm``
    /``name``, which are this package's (applied to the aggregated gradient).

    Example::

        optimizer = from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    """
    return TorchOptimizer(optimizer_class, **kwargs)
