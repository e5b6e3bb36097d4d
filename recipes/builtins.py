"""The names recipes can use out of the box (``replicafit list`` prints them)."""

from __future__ import annotations

import inspect

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.optimizers import schedules
from replicafit.trainer import callbacks, losses, metrics

from . import datasets, models
from .registry import REGISTRIES


def optimizer_arguments() -> str:
    """What every optimizer entry of a recipe takes besides its own arguments (``replicafit list optimizer``)."""
    parameters = inspect.signature(optimizers.Optimizer.__init__).parameters
    common = [name for name in parameters if name not in ("self", "learning_rate")]
    return (
        f"every optimizer also takes: {', '.join(common)}; "
        "and exclude_from_weight_decay: [name parts] (e.g. [bias, norm])"
    )


def _own_arguments(cls) -> str:
    """``Arguments: ...`` of an optimizer class, those shared by every optimizer left out."""
    common = set(inspect.signature(optimizers.Optimizer.__init__).parameters)
    own = [
        name
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name not in common and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return f"Arguments: learning_rate, {', '.join(own)}." if own else "Arguments: learning_rate."


def default() -> ds.Strategy:
    """The default strategy: one replica on torch's current device."""
    return ds.get_strategy()


def one_device(device: str = "cpu") -> ds.Strategy:
    """OneDeviceStrategy: every variable and computation on one device ("cpu", "cuda:0", ...)."""
    return ds.OneDeviceStrategy(device)


def mirrored(devices: list[str] | None = None) -> ds.Strategy:
    """MirroredStrategy: one replica per device, variables in sync (logical CPUs: ["cpu:0", "cpu:1"])."""
    return ds.MirroredStrategy(_some_devices("devices", devices))


def central_storage(compute_devices: list[str] | None = None, parameter_device: str | None = None) -> ds.Strategy:
    """CentralStorageStrategy: variables on one parameter device, compute on several."""
    return ds.CentralStorageStrategy(_some_devices("compute_devices", compute_devices), parameter_device)


def multi_worker_mirrored(
    timeout_seconds: float | None = None, bytes_per_pack: int = 0, shard_optimizer_states: bool = False
) -> ds.Strategy:
    """MultiWorkerMirroredStrategy: one process per worker (`replicafit fit --workers N`, torchrun).

    The cluster comes from the environment that the launcher or torchrun sets; ``timeout_seconds``
    bounds every wait for the other workers (a worker that dies or stops arriving fails the run
    after it; ``None``: torch's default, 30 minutes on gloo and 10 on NCCL), ``bytes_per_pack`` sizes the buffers that
    cross processes (``CommunicationOptions``) and ``shard_optimizer_states`` splits the optimizer's
    state across the workers. Example recipe entry::

        strategy: {type: multi_worker_mirrored, timeout_seconds: 300, shard_optimizer_states: true}
    """
    # Looked up when called, not when this module is imported: the registry does not depend on
    # the strategy class being importable.
    options = ds.CommunicationOptions(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)
    return ds.MultiWorkerMirroredStrategy(communication_options=options, shard_optimizer_states=shard_optimizer_states)


def fully_sharded(
    timeout_seconds: float | None = None,
    shard_units: list[str] | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> ds.Strategy:
    """FullyShardedStrategy: parameters, gradients and optimizer state sharded across the workers (torch's FSDP2).

    One process per worker, the cluster found as for ``multi_worker_mirrored`` (`replicafit fit --workers N`,
    torchrun); ``timeout_seconds`` bounds every wait for the other workers as there. ``shard_units`` names the
    classes of the model's submodules that are gathered and freed together (class names, e.g. its repeated
    blocks; ``None``: the model's own declaration, else submodules by size), ``reshard_after_forward`` frees each
    unit's gathered parameters after its forward (``false``: kept until its backward, one all-gather less) and
    ``activation_checkpointing`` recomputes each unit's activations during backward. Example recipe entry::

        strategy: {type: fully_sharded, timeout_seconds: 300, shard_units: [GPT2Block], reshard_after_forward: true}
    """
    options = ds.CommunicationOptions(timeout_seconds=timeout_seconds)
    return ds.FullyShardedStrategy(
        communication_options=options,
        shard_units=shard_units,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
    )


def _some_devices(name: str, devices):
    # The strategies read an empty list like None (every GPU, else the CPU); in a recipe `[]` is
    # more likely a list emptied by mistake than a request for the default, so it is refused.
    if devices is not None and len(devices) == 0:
        raise ValueError(
            f'{name} is an empty list: name at least one device (e.g. ["cpu:0", "cpu:1"]), '
            f"or leave {name} out to use every GPU (or the CPU when there is none)"
        )
    return devices


def _register_all() -> None:
    register = lambda kind, name, factory, description="": REGISTRIES[kind].register(name, factory, description)  # noqa: E731
    for name, factory in (
        ("default", default),
        ("one_device", one_device),
        ("mirrored", mirrored),
        ("central_storage", central_storage),
        ("multi_worker_mirrored", multi_worker_mirrored),
        ("fully_sharded", fully_sharded),
    ):
        register("strategy", name, factory)
    for name, factory in (("mlp", models.mlp), ("cnn", models.cnn), ("linear", models.linear)):
        register("model", name, factory)
    for name, factory, task in (
        ("digits", datasets.digits, "classification"),
        ("classification", datasets.classification, "classification"),
        ("regression", datasets.regression, "regression"),
        ("npz", datasets.npz, None),
        ("csv", datasets.csv, None),
    ):
        if task:
            factory.task = task
        register("dataset", name, factory)
    for name, cls in (
        ("sgd", optimizers.SGD),
        ("adam", optimizers.Adam),
        ("adamw", optimizers.AdamW),
        ("rmsprop", optimizers.RMSprop),
        ("adagrad", optimizers.Adagrad),
    ):
        register("optimizer", name, cls, f"{(cls.__doc__ or '').strip().splitlines()[0]} {_own_arguments(cls)}")
    for name, cls in (
        ("exponential_decay", schedules.ExponentialDecay),
        ("piecewise_constant_decay", schedules.PiecewiseConstantDecay),
        ("polynomial_decay", schedules.PolynomialDecay),
        ("inverse_time_decay", schedules.InverseTimeDecay),
        ("cosine_decay", schedules.CosineDecay),
    ):
        register("schedule", name, cls)
    for name, cls in losses.BY_NAME.items():
        register("loss", name, cls)
    for name, cls in metrics.BY_NAME.items():
        register("metric", name, cls)
    # The names the trainer resolves from the shapes of labels and predictions (metrics.get), as a name or
    # {type: ...}: the recipe hands the name itself to Trainer(metrics=[...]) (validation._check_metric).
    register(
        "metric",
        "accuracy",
        "accuracy",
        "accuracy resolved from the shapes of labels and predictions (binary, categorical or sparse "
        "categorical), as Trainer(metrics=['accuracy']); alias acc. exact_match compares them as they are",
    )
    register(
        "metric",
        "crossentropy",
        "crossentropy",
        "cross entropy resolved from the shapes of labels and predictions, as accuracy is; alias ce",
    )
    for name, cls in (
        ("early_stopping", callbacks.EarlyStopping),
        ("model_checkpoint", callbacks.ModelCheckpoint),
        ("reduce_lr_on_plateau", callbacks.ReduceLROnPlateau),
        ("csv_logger", callbacks.CSVLogger),
        ("terminate_on_nan", callbacks.TerminateOnNaN),
        ("backup_and_restore", callbacks.BackupAndRestore),
        ("swap_ema_weights", callbacks.SwapEMAWeights),
        ("torch_lr_scheduler", callbacks.TorchLRScheduler),
        ("tensorboard", callbacks.TensorBoard),
        ("mlflow_logger", callbacks.MLflowLogger),
        ("wandb_logger", callbacks.WandbLogger),
    ):
        register("callback", name, cls)


_register_all()

# replicafit's own factories by kind, as registered above (before any user package registers more):
# the only ones `replicafit validate` calls (see kinds.is_builtin).
BUILTINS = {kind: tuple(registry.get(name) for name in registry.names()) for kind, registry in REGISTRIES.items()}
