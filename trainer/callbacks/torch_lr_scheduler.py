"""``TorchLRScheduler``: drives the learning rate with a ``torch.optim.lr_scheduler`` scheduler, through a torch
optimizer standing for ours.
"""

from __future__ import annotations

import inspect

import torch

from replicafit import optimizers

from .monitor_callback import MonitorCallback


def _updates(optimizer) -> int:
    """The optimizer's update count, from its host copy (no read from the device)."""
    return optimizer.updates_so_far()


class TorchLRScheduler(MonitorCallback):
    """Drives the learning rate with any ``torch.optim.lr_scheduler`` scheduler, per step or per epoch.

    Args:
      factory: a callable taking a ``torch.optim.Optimizer`` and returning a scheduler
        (``functools.partial(OneCycleLR, max_lr=0.01, total_steps=1000)``, a lambda building a
        ``SequentialLR`` warm-up chain, ...), or the name of a class in
        ``torch.optim.lr_scheduler`` (``"OneCycleLR"``), whose arguments then come as keyword
        arguments (the recipe form: ``{type: torch_lr_scheduler, factory: OneCycleLR, max_lr: 0.01}``;
        ``OneCycleLR``'s ``total_steps`` defaults to the run's number of updates there).
      interval: ``"step"`` (after every update, Lightning's ``interval: step``) or ``"epoch"``
        (after every epoch, the default).
      monitor: the log ``ReduceLROnPlateau`` reads (``"val_loss"`` by default; per step, a batch
        log such as ``"loss"``). Other schedulers ignore it. Missing from the logs, it is a
        ``UserWarning`` once per fit (as ``EarlyStopping``'s) and the rate is left alone.

    The optimizer the factory receives stands for the trainer's optimizer, ours or
    ``from_torch``'s: one param group whose ``lr`` (and ``momentum`` or ``betas``, which
    ``OneCycleLR`` cycles) is the optimizer's. As in torch, a momentum of 0 is cycled too:
    ``SGD()`` under ``OneCycleLR`` starts using momentum at its first update (its momentum slots
    are made then), as ``torch.optim.SGD(params, lr)`` does; ``cycle_momentum=False`` leaves it
    at 0. It is created at the start of ``fit``, so its
    first learning rate is the scheduler's, exactly as in a plain torch loop; after every
    scheduler step the values are written back, one learning rate for every replica and worker.
    ``learning_rate`` is logged at each epoch's end (the last step's). The scheduler's state is
    kept in checkpoints and ``BackupAndRestore`` backups (a resumed run continues the schedule
    exactly). With ``gradient_accumulation_steps`` the ``"step"`` interval counts updates.

    Example::

        from functools import partial
        from torch.optim.lr_scheduler import OneCycleLR
        trainer.fit(model, data, epochs=5, batch_size=64, callbacks=[
            TorchLRScheduler(partial(OneCycleLR, max_lr=0.01, total_steps=5 * steps), interval="step")])
    """

    leaves_variables_alone = True  # its batch hooks read the logs (and set rates), not variables

    _decides_from_logs = True
    logs_learning_rate = "after_step"
    _monitor_owner = "TorchLRScheduler(ReduceLROnPlateau)"
    _without_monitor = "The learning rate is left alone while it is missing."

    def __init__(self, factory, interval: str = "epoch", monitor: str = "val_loss", **scheduler_kwargs):
        super().__init__(monitor)
        if interval not in ("step", "epoch"):
            raise ValueError(f"`interval` must be 'step' or 'epoch', got {interval!r}.")
        if isinstance(factory, str):
            cls = getattr(torch.optim.lr_scheduler, factory.rsplit(".", 1)[-1], None)
            if not (isinstance(cls, type) and issubclass(cls, (_LRScheduler, _Plateau))):
                known = sorted(n for n, c in vars(torch.optim.lr_scheduler).items() if _is_scheduler_class(c))
                raise ValueError(f"{factory!r} is not a scheduler of torch.optim.lr_scheduler; known: {known}.")
            try:  # unknown or missing arguments now, not when fit starts
                inspect.signature(cls).bind(None, **scheduler_kwargs)
            except TypeError as error:
                raise TypeError(f"{cls.__name__}: {error}") from None
            factory = (cls, scheduler_kwargs)
        elif scheduler_kwargs:
            raise TypeError(
                f"TorchLRScheduler got scheduler arguments {sorted(scheduler_kwargs)} with a callable factory: bind "
                "them in the factory (functools.partial), or name the class as a string."
            )
        elif not callable(factory):
            raise TypeError(f"`factory` must be a callable (optimizer -> scheduler) or a class name, got {factory!r}.")
        self.factory, self.interval = factory, interval
        self.scheduler = None
        self._view = None
        self._pending = None  # a restored state that waits for the scheduler
        self._updates = None  # the optimizer's updates at the last step (with gradient accumulation)
        self._used = None  # the learning rate of the last step

    # --- the scheduler and the optimizer it stands for -------------------------------------------
    def _optimizer(self):
        optimizer = self.trainer.optimizer
        return optimizer.inner_optimizer if isinstance(optimizer, optimizers.LossScaleOptimizer) else optimizer

    def _make(self) -> None:
        optimizer = self._optimizer()
        if optimizer.learning_rate_schedule is not None:
            raise ValueError(
                "TorchLRScheduler sets the learning rate, but the optimizer's learning_rate is a schedule already: "
                "give the optimizer a number."
            )
        self._view = _OptimizerView(optimizer)
        if isinstance(self.factory, tuple):
            cls, kwargs = self.factory
            kwargs = dict(kwargs)
            if cls is torch.optim.lr_scheduler.OneCycleLR and not {"total_steps", "epochs"} & set(kwargs):
                kwargs["total_steps"] = self._total_updates()
            scheduler = cls(self._view, **kwargs)
        else:
            scheduler = self.factory(self._view)
        if not isinstance(scheduler, (_LRScheduler, _Plateau)):
            raise TypeError(
                f"The factory of TorchLRScheduler must return a torch.optim.lr_scheduler scheduler, got "
                f"{type(scheduler).__name__}."
            )
        self.scheduler = scheduler
        self._view.write_back(optimizer)

    def _total_updates(self) -> int:
        epochs, steps = self.params.get("epochs"), self.params.get("steps")
        if self.interval == "epoch":
            return int(epochs)
        if steps is None:
            raise ValueError(
                "OneCycleLR needs total_steps: the training data has no length, so pass total_steps yourself."
            )
        window = self._optimizer().gradient_accumulation_steps or 1
        return int(epochs) * -(-int(steps) // window)

    def _step(self, logs) -> None:
        optimizer = self._optimizer()
        self._view.read(optimizer)  # another callback may have set the rate
        self._view.step()  # torch checks that optimizer.step() came before scheduler.step()
        if isinstance(self.scheduler, _Plateau):
            current = self._monitor_value(logs, per_step="interval='epoch'" if self.interval == "step" else "")
            if current is None:
                return
            self.scheduler.step(float(current))
        else:
            self.scheduler.step()
        self._view.write_back(optimizer)

    # --- hooks -------------------------------------------------------------------------------
    _keeps_state = True
    forwards_kwargs = True  # the keyword arguments are the scheduler's (``{type: torch_lr_scheduler, max_lr: ...}``)

    def _wants_logs(self, hook: str) -> bool:
        # The batch-begin hook (whose logs are always empty: nothing is read) notes the update count under
        # gradient accumulation; the trainer calls it only where a callback asks.
        if hook == "on_train_batch_begin":
            return self.interval == "step"
        # Per-step logs (a read of every metric) only where a per-step ReduceLROnPlateau needs them; which
        # scheduler a callable factory makes is known once fit has started (then asked again).
        if hook != "on_train_batch_end" or self.interval != "step":
            return False
        if self.scheduler is not None:
            return isinstance(self.scheduler, _Plateau)
        return isinstance(self.factory, tuple) and issubclass(self.factory[0], _Plateau)

    def on_train_begin(self, logs=None):
        """Builds the scheduler on a torch optimizer standing for the trainer's (its first learning rate is
        written into the optimizer), resets the once-per-fit missing-monitor warning, and restores a state
        loaded before the scheduler existed. ``ValueError`` where the optimizer's ``learning_rate`` is a
        schedule already."""
        self._make()
        self._updates = None
        super().on_train_begin(logs)  # a missing monitor is said once per fit
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._load(state)

    def _accumulating(self) -> bool:
        return self.interval == "step" and bool(self._optimizer().gradient_accumulation_steps)

    def on_train_batch_begin(self, batch, logs=None):
        """With ``interval="step"`` and gradient accumulation, notes the optimizer's update count, to tell
        whether the step completes a window."""
        if self._accumulating():  # only a step that completes a window is an update
            self._updates = _updates(self._optimizer())

    def on_train_batch_end(self, batch, logs=None):
        """With ``interval="step"``, steps the scheduler after every update (with gradient accumulation, only
        after a step that applied one); a ``ReduceLROnPlateau`` reads ``logs[monitor]`` from the batch logs."""
        if self.interval != "step":
            return
        optimizer = self._optimizer()
        self._used = float(optimizer.learning_rate)
        if self._accumulating():
            updates = _updates(optimizer)
            if updates == self._updates:
                return
            self._updates = updates
        self._step(logs)

    def on_epoch_end(self, epoch, logs=None):
        """With ``interval="epoch"``, steps the scheduler (a ``ReduceLROnPlateau`` with the epoch's
        ``logs[monitor]``); with ``"step"`` and gradient accumulation, steps it once more where the epoch's
        partial window was applied at its end. Logs ``learning_rate``: the rate the epoch's last step used."""
        optimizer = self._optimizer()
        if self.interval == "epoch":
            self._used = float(optimizer.learning_rate)
            self._step(logs)
        elif self._accumulating() and self._updates is not None and _updates(optimizer) != self._updates:
            self._updates = _updates(optimizer)  # the epoch's partial window was one more update
            self._step(logs)
        if logs is not None and self._used is not None:
            logs["learning_rate"] = self._used

    # --- state (checkpoints and backups) -------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"scheduler": its state_dict(), "group": lr and momentum/betas, "used": the last step's rate}``."""
        if self.scheduler is None:
            return dict(self._pending) if self._pending is not None else {}
        return {"scheduler": self.scheduler.state_dict(), "group": self._view.hyper(), "used": self._used}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output now, or when ``fit`` creates the scheduler."""
        if not state:
            return
        if self.scheduler is None:
            self._pending = dict(state)
        else:
            self._load(state)

    def _load(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._view.param_groups[0].update(state["group"])
        self._used = state.get("used")  # the last step's rate, logged at the end of its epoch
        self._view.write_back(self._optimizer())


_LRScheduler = torch.optim.lr_scheduler.LRScheduler
_Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


def _is_scheduler_class(value) -> bool:
    return isinstance(value, type) and issubclass(value, (_LRScheduler, _Plateau)) and value is not _LRScheduler


class _OptimizerView(torch.optim.Optimizer):
    """A torch optimizer standing for one of ours: one param group holding its learning rate and, where it
    has them, its momentum (SGD, RMSprop) or betas (Adam), which schedulers read and change."""

    def __init__(self, optimizer):
        defaults = {"lr": float(optimizer.learning_rate)} | optimizer.torch_hyperparameters()
        super().__init__([torch.zeros((), requires_grad=True)], defaults)

    def step(self, closure=None):
        return None

    def hyper(self) -> dict:
        group = self.param_groups[0]
        return {k: group[k] for k in ("lr", "momentum", "betas") if k in group}

    def read(self, optimizer) -> None:
        self.param_groups[0]["lr"] = float(optimizer.learning_rate)

    def write_back(self, optimizer) -> None:
        group = self.param_groups[0]
        optimizer.learning_rate = float(group["lr"])
        optimizer.set_torch_hyperparameters(**{k: group[k] for k in optimizer.torch_hyperparameters() if k in group})
