"""Gradient accumulation: the window of ``Optimizer(gradient_accumulation_steps=N)``, its sums and its logic.

Each replica adds its own local gradients of a step into its own sums, weighted by the
step's weight, with no communication; the N-th step of the window hands the sums to the
optimizer's pipeline (one batched reduction across replicas and workers, divided by the
window's total weight, then clipping and the update). The trainer gives each step the
weight of its global batch size (the number of examples), so a window equals one step on
its batches together, whatever their sizes: the per-step loss ``sum / B_k`` times ``B_k``
summed over the window, divided by ``sum(B_k)``, is the mean over every example of the
window. A step of one's own (a custom loop) weighs 1, which gives Keras 3's rule, the mean
of the N gradients.

``GradientWindow`` holds one window's sums; ``GradientAccumulation``, the optimizer's accumulation
stage, opens and fills windows, hands a full one on, and keeps an open one in the optimizer's
state (saved, loaded, and restored once its variables are built). ``GradientDenominator`` says where
an update's divisor comes from when it is known only after the reduction (an element-level loss).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from replicafit.strategies import context, foreach
from replicafit.strategies.devices import torch_device
from replicafit.strategies.parameter_shards import shard_of, whole_from_shard
from replicafit.strategies.variables import first_tensor

from .tensors import _no_grad

__all__ = [
    "GradientAccumulation",
    "GradientDenominator",
    "GradientWindow",
    "check_accumulation_steps",
    "checked_window_state",
    "window_state",
]


@dataclasses.dataclass(frozen=True)
class GradientDenominator:
    """An update's divisor, known only after the gradients are reduced: the global total of the step value
    ``step_value`` since the previous update, divided by ``prescale`` (the constant each replica already
    divided its loss by before backward, which keeps float16 gradients in the mean's range).

    Example::

        optimizer.gradient_denominator = GradientDenominator("tokens", prescale=512.0)
    """

    step_value: str
    prescale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.step_value, str):
            raise TypeError(f"GradientDenominator's step_value must be a step value's name, got {self.step_value!r}.")
        if not (isinstance(self.prescale, (int, float)) and self.prescale > 0):
            raise ValueError(f"GradientDenominator's prescale must be a positive number, got {self.prescale!r}.")


class GradientWindow:
    """The sums of one open accumulation window, per local replica.

    ``sums[r]`` is local replica ``r``'s list of weighted gradient sums (one tensor per
    variable, in the window's variable order); ``counts[r]`` and ``weights[r]`` its steps and
    total weight so far (equal on every replica: each adds once per step). ``aggregated`` is
    true when the steps were applied in cross-replica context with gradients already reduced:
    those sums are applied as they are, never reduced again.
    """

    def __init__(self, variables: list, aggregated: bool):
        self.variables = variables
        self.aggregated = aggregated
        self.sums: dict = {}
        self.counts: dict = {}
        self.weights: dict = {}

    def add(self, replica: int, grads: list, weight: float) -> int:
        """Adds ``weight * grads`` to replica ``replica``'s sums; returns its step count."""
        grads = [g.detach() for g in grads]
        with torch.no_grad():
            sums = self.sums.get(replica)
            if sums is None:  # a new list: the window's sums are never the caller's tensors
                self.sums[replica] = foreach.mul(grads, weight)
            else:
                foreach.add_(sums, grads, alpha=weight)
        self.counts[replica] = self.counts.get(replica, 0) + 1
        self.weights[replica] = self.weights.get(replica, 0.0) + weight
        return self.counts[replica]

    @property
    def count(self) -> int:
        """Steps in the window (the first replica's count; every replica's is the same)."""
        return self.counts[min(self.counts)] if self.counts else 0

    @property
    def weight(self) -> float:
        return self.weights[min(self.weights)] if self.weights else 0.0

    def matches(self, variables: list) -> bool:
        return len(variables) == len(self.variables) and all(map(lambda a, b: a is b, variables, self.variables))


class GradientAccumulation:
    """The accumulation stage of the pipeline (optax's ``MultiSteps``): a step's gradients into the open window,
    the window handed on when its last step arrives, and an open window in the optimizer's state.

    Args:
      steps: ``gradient_accumulation_steps`` (an int >= 2).
      owner: the optimizer, as errors name it (``"SGD 'sgd'"``).

    Holds the open window, a loaded one waiting for its variables (``pending``), and ``step_weight``, the
    weight of the next step.

    Example::

        accumulation = GradientAccumulation(4, "SGD 'sgd'")
        window = accumulation.add(None, grads, variables)   # None until the 4th step: then the full window
    """

    def __init__(self, steps: int, owner: str):
        self.steps = steps
        self.owner = owner
        self.window: GradientWindow | None = None  # the open window
        self._lock = threading.Lock()  # replicas on threads open a window once
        self.pending: dict | None = None  # a loaded window, for variables not built yet
        self.step_weight = 1.0  # the weight of the next accumulated step (the trainer's: its examples)

    @property
    def count(self) -> int:
        """Steps in the open window (or in a loaded one not stepped since), not applied yet."""
        window = self.window
        if window is None and self.pending is not None:
            return int(self.pending["count"])
        return window.count if window is not None else 0

    def add(self, ctx, grads, variables, strategy_of, positions_of):
        """Adds this step's gradients (``ctx``: the replica context; ``None`` in cross-replica context, where the
        gradients are reduced already) to the open window, opening one if needed. Returns ``(window, this
        replica's sums)`` when the step is the window's last, else ``None``."""
        window = self.open(variables, ctx is None, strategy_of, positions_of)
        if ctx is None:  # cross-replica context: the gradients are reduced already, one value each
            grads, replica = [first_tensor(g) for g in grads], 0
        else:
            replica = ctx.replica_id_in_sync_group - ctx.strategy.cluster.first_replica_id  # this worker's
        if window.add(replica, grads, self.step_weight) < self.steps:
            return None
        return window, window.sums[replica]

    def open(self, variables, aggregated: bool, strategy_of, positions_of) -> GradientWindow:
        """The open window for ``variables`` (opened now, from a loaded one where there is one: ``positions_of()``
        gives ``{id(variable): position}`` to find its sums)."""
        with self._lock:
            window = self.window
            if window is None:
                window = self.window = GradientWindow(variables, aggregated)
                if self.pending is not None:
                    self._restore(window, strategy_of(variables), positions_of())
        if not window.matches(variables):
            raise ValueError(
                f"{self.owner} accumulates gradients over {self.steps} steps, but this step gave gradients for other "
                f"variables ({len(variables)}) than the window's first step ({len(window.variables)}): every step of "
                "a window must apply gradients to the same variables, in the same order."
            )
        if window.aggregated != aggregated:
            raise ValueError(
                "Gradient accumulation cannot mix steps applied inside strategy.run() (per-replica gradients) and "
                "outside it (reduced gradients) in one window; apply every step of a window the same way."
            )
        return window

    def close(self) -> GradientWindow | None:
        """The open window, closed (its sums are applied now)."""
        window, self.window = self.window, None
        return window

    def ready_to_apply(self, strategy_of, positions_of) -> GradientWindow | None:
        """The window ``apply_accumulated_gradients`` applies now (an open one with steps, or a loaded one not
        stepped since), or ``None``."""
        window, pending = self.window, self.pending
        if window is None and pending is not None and pending["variables"] is not None:
            window = self.open(pending["variables"], pending["aggregated"], strategy_of, positions_of)
        if window is None or not window.count:
            return None
        return window

    # --- the open window in the optimizer's state ----------------------------------------------------
    def state(self, positions: dict, strategy) -> dict | None:
        """``state["accumulation"]`` while a window is open: ``{"count", "weight", "aggregated",
        "gradients": {position: [sum of each local replica]}, "first_replica", "replicas_in_sync"}``
        (this process's replicas: the sums of global replicas ``first_replica`` on, of the
        ``replicas_in_sync`` the window was filled by; ``Trainer`` checkpoints gather every worker's
        and set ``first_replica`` to 0). ``positions``: ``{id(variable): position}``."""
        window = self.window
        if window is None or not window.count:
            return dict(self.pending["state"]) if self.pending is not None else None
        replicas = sorted(window.sums)
        if strategy.extended.capabilities.shards_parameters and not window.aggregated:
            # Each worker's sums are its shards of the sums over every worker (sharded parameters' gradients are
            # reduced in backward): kept as global replica 0's whole sums, which any strategy restores.
            (replica,) = replicas
            return {
                "count": window.count,
                "weight": float(window.weight),
                "aggregated": False,
                "gradients": {
                    positions[id(v)]: [whole_from_shard(v, window.sums[replica][i])]
                    for i, v in enumerate(window.variables)
                },
                "first_replica": 0,
                "replicas_in_sync": 1,
            }
        return {
            "count": window.count,
            "weight": float(window.weight),
            "aggregated": window.aggregated,
            "gradients": {
                positions[id(v)]: [window.sums[r][i].detach().clone() for r in replicas]
                for i, v in enumerate(window.variables)
            },
            "first_replica": 0 if window.aggregated else strategy.cluster.first_replica_id,
            "replicas_in_sync": 1 if window.aggregated else strategy.num_replicas_in_sync,
        }

    def checked(self, window) -> dict | None:
        """A loaded ``state["accumulation"]`` checked (``ValueError`` when it does not fit), or ``None``."""
        if window is None:
            return None
        try:
            count, weight = int(window["count"]), float(window["weight"])
            aggregated, gradients = bool(window["aggregated"]), dict(window["gradients"])
            lists = [list(v) for v in gradients.values()]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"The optimizer state's 'accumulation' entry is malformed ({error!r}).") from None
        if not 0 < count < self.steps or not all(isinstance(t, torch.Tensor) for part in lists for t in part):
            raise ValueError(
                f"The optimizer state's accumulation window ({count} steps) does not fit "
                f"gradient_accumulation_steps={self.steps}, or holds other values than tensors."
            )
        return {"count": count, "weight": weight, "aggregated": aggregated, "gradients": gradients, "state": window}

    def load(self, window: dict | None, variables: list) -> None:
        """Keeps a checked window (``checked``) until its variables are built (``variables``: those built now)."""
        self.window = None
        self.pending = None
        if window is None:
            return
        positions = sorted(window["gradients"])
        if variables and positions and positions[-1] < len(variables):
            window["variables"] = [variables[p] for p in positions]
        else:
            window["variables"] = None  # resolved when the variables are built
        self.pending = window

    def _restore(self, window: GradientWindow, strategy, positions: dict) -> None:
        """Fills a new window from a loaded one (``_window_sums``): each local replica's own sums where the
        replica count is the saver's, else every replica's sums added together onto global replica 0 (zeros
        on the others), which the window's reduction adds up to the same total."""
        pending, self.pending = self.pending, None
        cluster = strategy.cluster
        replicas = 1 if window.aggregated else cluster.num_local_replicas
        devices = [torch_device(d) for d in strategy.extended.worker_devices] or [None]
        with _no_grad():
            for r in range(replicas):
                sums = []
                for variable in window.variables:
                    saved = pending["gradients"].get(positions[id(variable)])
                    if saved is None:
                        raise ValueError(
                            f"The loaded accumulation window has no sums for variable {variable.name!r}: it was "
                            "saved for other variables."
                        )
                    device = devices[min(r, len(devices) - 1)]
                    if strategy.extended.capabilities.shards_parameters and not window.aggregated:
                        # Every worker's window holds its shard of the whole sums (no reduction at the window's end)
                        value = shard_of(variable, _window_sums(pending, saved, True, strategy, r, device))
                    else:
                        value = _window_sums(pending, saved, window.aggregated, strategy, r, device)
                    sums.append(value.detach().to(device).clone())
                window.sums[r] = sums
                window.counts[r] = pending["count"]
                window.weights[r] = pending["weight"]


def _window_sums(pending: dict, saved: list, aggregated: bool, strategy, r: int, device) -> torch.Tensor:
    """Local replica ``r``'s share of a loaded window's sums of one variable, ``saved`` (a list of per-replica
    sums: those of global replicas ``first_replica`` on, of ``replicas_in_sync``; a state without these
    entries holds every replica's, as ``Trainer`` checkpoints do).

    Steps applied with reduced gradients (``aggregated``) take the whole sum on every worker (each applies
    its own copy). Per-replica steps take the replica's own sums where the replica count is the saver's;
    on another count (another number of workers or replicas, the same global batches) global replica 0
    takes every saved replica's sums added together and the others zeros: the window's reduction sums the
    replicas, so the total is the saver's (up to float rounding)."""
    cluster = strategy.cluster
    total, global_id = strategy.num_replicas_in_sync, cluster.first_replica_id + r
    state = pending["state"]
    first, saver = int(state.get("first_replica", 0)), int(state.get("replicas_in_sync", len(saved)))
    complete = first == 0 and len(saved) == saver
    if aggregated or (complete and saver != total):
        if not complete:
            raise ValueError(_PARTIAL_WINDOW.format(first=first, last=first + len(saved) - 1, saver=saver))
        if not aggregated and global_id != 0:
            return torch.zeros_like(saved[0])
        return torch.stack([t.to(device) for t in saved]).sum(0)
    if saver == total and first <= global_id < first + len(saved):
        return saved[global_id - first]
    raise ValueError(_PARTIAL_WINDOW.format(first=first, last=first + len(saved) - 1, saver=saver))


_PARTIAL_WINDOW = (
    "The loaded accumulation window holds the sums of replicas {first}-{last} of {saver} only (one worker's "
    "optimizer.state_dict()), and this strategy needs others: load it on the same worker with the same "
    "replicas, or save a state with every worker's sums (Trainer.save_checkpoint, BackupAndRestore)."
)


def check_accumulation_steps(steps):
    """``gradient_accumulation_steps`` checked: ``None`` or an int >= 2 (as Keras 3 asks)."""
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"`gradient_accumulation_steps` must be None (no accumulation) or an integer >= 2, got {steps!r}."
        )
    return steps


def window_state(optimizer, state: dict) -> None:
    """Adds ``state["accumulation"]`` while a window is open (``GradientAccumulation.state``)."""
    accumulation = optimizer._accumulation
    if accumulation is None:
        return
    window = accumulation.window
    strategy = optimizer._strategy_of(window.variables) if window is not None else context.get_strategy()
    entry = accumulation.state(optimizer._positions(), strategy)
    if entry is not None:
        state["accumulation"] = entry


def checked_window_state(optimizer, state: dict):
    """A loaded state's open window, checked against the optimizer (``ValueError`` when it does not fit)."""
    window = state.get("accumulation")
    if window is None:
        return None
    if optimizer._accumulation is None:
        raise ValueError(
            "The optimizer state holds an open gradient accumulation window, but this optimizer does not "
            "accumulate: pass the same gradient_accumulation_steps as the run that saved it."
        )
    return optimizer._accumulation.checked(window)
