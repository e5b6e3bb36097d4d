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

``GradientWindow`` holds one window's sums; ``GradientAccumulation``, a mixin of ``Optimizer``,
opens and fills windows, hands a full one to the pipeline, and keeps an open one in the
optimizer's state (saved, loaded, and restored once its variables are built).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

import replicafit.strategies as ds
from replicafit.strategies import context, foreach
from replicafit.strategies.devices import torch_device
from replicafit.strategies.step_values import wide_float

from .tensors import _first_tensor, _no_grad

__all__ = ["GradientAccumulation", "GradientDenominator", "GradientWindow", "check_accumulation_steps"]


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
    """The accumulation windows of ``Optimizer`` (a mixin): a step's gradients into the open window, the
    window's last step into the optimizer's pipeline, and the open window in the optimizer's state.

    Uses the optimizer's ``gradient_accumulation_steps``, ``iterations``, built variables
    (``_variables``), ``_strategy_of`` and its pipeline past the window: ``_reduce_and_apply``
    (per-replica sums) and ``_apply_aggregated`` (sums reduced already). Keeps ``_window`` (the
    open window), ``_pending_window`` (a loaded one, for variables not built yet) and the weight
    of the next step.
    """

    def _init_accumulation(self) -> None:
        self._window: GradientWindow | None = None  # the open accumulation window
        self._window_lock = threading.Lock()  # replicas on threads open a window once
        self._pending_window: dict | None = None  # a loaded window, for variables not built yet
        self._step_weight = 1.0  # the weight of the next accumulated step (the trainer's: its examples)
        self._gradient_denominator: GradientDenominator | None = None

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
        return self._step_weight

    @step_weight.setter
    def step_weight(self, value: float) -> None:
        self._step_weight = value

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
        window = self._window
        if window is None and self._pending_window is not None:
            return int(self._pending_window["count"])
        return window.count if window is not None else 0

    def _divisor(self, strategy, window_weight):
        """What an update divides the reduced gradients by: the window's weight (None: a lone step), or
        ``total / prescale`` of the gradient denominator (a tensor: no read back to the host)."""
        denominator = self._gradient_denominator
        if denominator is None:
            return window_weight
        total = strategy.cluster.step_total(denominator.step_value)
        # Nothing real in the window: its gradients are zeros, which a finite divisor keeps at zero (not NaN).
        total = total.to(wide_float(total.device))
        return total.clamp_min(denominator.prescale * 1e-30) / denominator.prescale

    def _accumulate(self, ctx, grads, variables):
        """Adds this step's gradients to the window; its last step applies the window."""
        window = self._open_window(variables, aggregated=ctx is None)
        if ctx is None:  # cross-replica context: the gradients are reduced already, one value each
            grads, replica = [_first_tensor(g) for g in grads], 0
        else:
            replica = ctx.replica_id_in_sync_group - ctx.strategy.cluster.first_replica_id  # this worker's
        if window.add(replica, grads, self._step_weight) < self.gradient_accumulation_steps:
            return self.iterations
        if ctx is not None:
            return ctx.merge_call(_merge_apply_window, args=(self, window.sums[replica], variables))
        strategy = self._strategy_of(variables)
        with context.enter_or_assert_strategy(strategy):
            return self._apply_window(strategy, window)

    def _open_window(self, variables, aggregated: bool) -> GradientWindow:
        with self._window_lock:
            window = self._window
            if window is None:
                window = self._window = GradientWindow(variables, aggregated)
                if self._pending_window is not None:
                    self._restore_window(window)
        if not window.matches(variables):
            raise ValueError(
                f"{type(self).__name__} {self.name!r} accumulates gradients over {self.gradient_accumulation_steps} "
                f"steps, but this step gave gradients for other variables ({len(variables)}) than the window's "
                f"first step ({len(window.variables)}): every step of a window must apply gradients to the same "
                "variables, in the same order."
            )
        if window.aggregated != aggregated:
            raise ValueError(
                "Gradient accumulation cannot mix steps applied inside strategy.run() (per-replica gradients) and "
                "outside it (reduced gradients) in one window; apply every step of a window the same way."
            )
        return window

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
        window = self._window
        pending = self._pending_window
        if window is None and pending is not None and pending["variables"] is not None:
            window = self._open_window(pending["variables"], pending["aggregated"])  # loaded, not stepped since
        if window is None or not window.count:
            return self.iterations
        if context.in_replica_function():
            raise RuntimeError(
                "apply_accumulated_gradients() must be called in cross-replica context (outside strategy.run()): "
                "it reduces every replica's window at once."
            )
        strategy = self._strategy_of(window.variables)
        with context.enter_or_assert_strategy(strategy):
            return self._apply_window(strategy, window)

    def _apply_window(self, strategy, window: GradientWindow):
        """Reduces (unless reduced already) and applies ``window``'s sums; closes the window."""
        self._window = None
        variables, divisor = window.variables, window.weight
        if window.aggregated:
            return self._apply_aggregated(strategy, window.sums[0], variables, divisor=divisor)
        replicas = sorted(window.sums)
        grads = [ds.PerReplica([window.sums[r][i] for r in replicas]) for i in range(len(variables))]
        return self._reduce_and_apply(strategy, grads, variables, divisor=divisor)

    def _add_window_state(self, state: dict) -> None:
        """``state["accumulation"]`` while a window is open: ``{"count", "weight", "aggregated",
        "gradients": {position: [sum of each local replica]}, "first_replica", "replicas_in_sync"}``
        (this process's replicas: the sums of global replicas ``first_replica`` on, of the
        ``replicas_in_sync`` the window was filled by; ``Trainer`` checkpoints gather every worker's
        and set ``first_replica`` to 0)."""
        window = self._window
        if window is None or not window.count:
            if self._pending_window is not None:
                state["accumulation"] = dict(self._pending_window["state"])
            return
        positions = {id(v): i for i, v in enumerate(self._variables)}
        replicas = sorted(window.sums)
        strategy = self._strategy_of(window.variables)
        state["accumulation"] = {
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

    def _checked_window_state(self, state: dict) -> dict | None:
        window = state.get("accumulation")
        if window is None:
            return None
        if not self.gradient_accumulation_steps:
            raise ValueError(
                "The optimizer state holds an open gradient accumulation window, but this optimizer does not "
                "accumulate: pass the same gradient_accumulation_steps as the run that saved it."
            )
        try:
            count, weight = int(window["count"]), float(window["weight"])
            aggregated, gradients = bool(window["aggregated"]), dict(window["gradients"])
            lists = [list(v) for v in gradients.values()]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"The optimizer state's 'accumulation' entry is malformed ({error!r}).") from None
        if not 0 < count < self.gradient_accumulation_steps or not all(
            isinstance(t, torch.Tensor) for part in lists for t in part
        ):
            raise ValueError(
                f"The optimizer state's accumulation window ({count} steps) does not fit "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, or holds other values than tensors."
            )
        return {"count": count, "weight": weight, "aggregated": aggregated, "gradients": gradients, "state": window}

    def _load_window_state(self, window: dict | None) -> None:
        self._window = None
        self._pending_window = None
        if window is None:
            return
        positions = sorted(window["gradients"])
        if self._variables and positions and positions[-1] < len(self._variables):
            window["variables"] = [self._variables[p] for p in positions]
        else:
            window["variables"] = None  # resolved when the variables are built
        self._pending_window = window

    def _restore_window(self, window: GradientWindow) -> None:
        """Fills a new window from a loaded one (``_window_sums``): each local replica's own sums where the
        replica count is the saver's, else every replica's sums added together onto global replica 0 (zeros
        on the others), which the window's reduction adds up to the same total."""
        pending, self._pending_window = self._pending_window, None
        strategy = self._strategy_of(window.variables)
        cluster = strategy.cluster
        replicas = 1 if window.aggregated else cluster.num_local_replicas
        positions = {id(v): i for i, v in enumerate(self._variables)}
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


def _merge_apply_window(strategy, optimizer, sums, variables):
    """merge_fn of a window's last step: every replica's sums, reduced once and applied."""
    window = optimizer._window
    optimizer._window = None
    return optimizer._reduce_and_apply(strategy, sums, variables, divisor=window.weight)


def check_accumulation_steps(steps):
    """``gradient_accumulation_steps`` checked: ``None`` or an int >= 2 (as Keras 3 asks)."""
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"`gradient_accumulation_steps` must be None (no accumulation) or an integer >= 2, got {steps!r}."
        )
    return steps
