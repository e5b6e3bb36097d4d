"""``FullyShardedStrategy``: parameters, gradients and optimizer state sharded across workers, on torch's
``fully_shard`` (FSDP2).

One replica per worker process; the cluster is joined as under ``MultiWorkerMirroredStrategy`` (the launcher,
``torchrun``, SLURM, ``TF_CONFIG``; gloo on CPUs, NCCL on GPUs), and the rest of the tf.distribute surface is that
strategy's: ``run``, ``reduce``, ``gather``, ``experimental_distribute_dataset`` (each worker reads its rows), the
cluster contract, ``scope()``. What differs is the model:

* ``distribute_module`` (the ``Trainer`` calls it) applies ``torch.distributed.fsdp.fully_shard`` to each **unit**
  of the model and then to the model itself, over a one-dimensional device mesh of the workers: every parameter
  becomes a ``DTensor`` of which each worker holds ``1/num_workers`` of the rows. A unit's parameters are gathered
  (all-gather) for its forward and again for its backward, and freed after; its gradients are reduce-scattered
  during backward, so each worker ends with its shard of the **sum** over the workers (``fully_shard`` averages
  by default; here every unit sums, so the global-batch loss rule holds as under every strategy).
* the optimizer updates the local shards (``parameter_shards.ParameterShards``): every element-wise rule, clipping
  by the global norm (partial sums added up), weight decay, moving averages, loss scaling and gradient
  accumulation work unchanged; a rule that needs whole tensors is refused.
* checkpoints are sharded (every worker writes its shards with ``torch.distributed.checkpoint``) and load on any
  worker count (``trainer.sharded_checkpoint``).

With one worker nothing is sharded: the strategy is a one-worker ``MultiWorkerMirroredStrategy``, equal to the
default strategy.

Example (on every worker: ``replicafit fit RECIPE --workers 2`` with ``strategy: {type: fully_sharded}``, or
``torchrun --nproc-per-node 2 train.py``)::

    strategy = ds.FullyShardedStrategy(shard_units=["GPT2Block"])
    trainer = Trainer(strategy=strategy, optimizer=optimizers.AdamW(1e-4), loss=None)
    trainer.fit(model, dataset, batch_size=32)
"""

from __future__ import annotations

import torch

from .capabilities import StrategyCapabilities
from .cluster_resolver import ClusterResolver
from .distribute_lib import Strategy
from .multi_worker_mirrored import MultiWorkerMirroredExtended, check_cluster_spec, checked_cluster
from .parameter_shards import ParameterShards, ShardedVariable, workers_mesh
from .reduce_util import CommunicationOptions
from .state_layout import StateLayout

__all__ = ["FullyShardedStrategy", "select_units"]

#: The ``MixedPrecisionPolicy`` of each of the trainer's precisions: parameters gathered in the compute dtype,
#: gradients reduced in float32 (the sharded parameters, their gradients and the optimizer state stay float32).
_PARAM_DTYPES = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def select_units(module: torch.nn.Module, shard_units=None, min_parameters: int = 100_000) -> list:
    """The submodules of ``module`` that ``fully_shard`` makes units, innermost first.

    ``shard_units``: ``None`` — the model's own declaration where it has one (Hugging Face's
    ``_no_split_modules``, class names), else by size: bottom-up, each submodule whose parameters not yet in a
    unit number at least ``min_parameters`` (torch's size-based wrapping rule; ``ModuleList``/``ModuleDict`` are
    never units, having no forward); a list of classes or class names; or a function ``module -> bool``. The model
    itself is not in the list (it is always sharded last, as the root).

    Example::

        >>> import torch
        >>> blocks = torch.nn.Sequential(*[torch.nn.Linear(400, 400) for _ in range(3)])
        >>> [type(m).__name__ for m in select_units(blocks)]
        ['Linear', 'Linear', 'Linear']
    """
    if shard_units is None:
        declared = getattr(module, "_no_split_modules", None)  # private: Hugging Face's declared unit classes
        if declared:
            shard_units = list(declared)
        else:
            return _by_size(module, min_parameters)
    if callable(shard_units) and not isinstance(shard_units, (list, tuple, type)):
        predicate = shard_units
    else:
        wanted = [shard_units] if isinstance(shard_units, (str, type)) else list(shard_units)
        bad = [w for w in wanted if not isinstance(w, (str, type))]
        if bad:
            raise TypeError(f"shard_units must name module classes (classes or class names), got {bad!r}.")
        names = {w if isinstance(w, str) else w.__name__ for w in wanted}
        classes = tuple(w for w in wanted if isinstance(w, type))

        def predicate(m):
            return isinstance(m, classes) or type(m).__name__ in names

    units = [m for m in module.modules() if m is not module and predicate(m)]
    if shard_units is not None and not units and not callable(shard_units):
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(
            f"shard_units={shard_units!r} names no submodule of {type(module).__name__} (its module classes: "
            f"{', '.join(present)}). Name the classes of its repeated blocks, or pass None to choose by size."
        )
    return list(reversed(units))  # innermost first: a unit inside another is sharded before it


def _by_size(module: torch.nn.Module, min_parameters: int) -> list:
    units: list = []

    def visit(m) -> int:
        count = sum(p.numel() for p in m.parameters(recurse=False))
        for child in m.children():
            count += visit(child)
        containers = (torch.nn.ModuleList, torch.nn.ModuleDict)  # no forward of their own
        if m is not module and count >= min_parameters and not isinstance(m, containers):
            units.append(m)
            return 0
        return count

    visit(module)
    return units


class FullyShardedExtended(MultiWorkerMirroredExtended):
    """The workers of ``MultiWorkerMirroredStrategy`` (one replica each) with the module sharded by ``fully_shard``.

    It reuses that strategy's cluster, collectives, input distribution and variables, and overrides the hooks
    where sharded parameters differ: ``_prepare_module`` (the sharding), ``_module_variable`` (a
    ``ShardedVariable`` per parameter), ``gradients`` (backward, then the local shards of the summed gradients),
    ``state_layout`` (``ParameterShards``), ``gradient_step`` (``fully_shard`` reduces during backward: no buckets
    of ours) and ``capabilities``. (A deliberate second level of inheritance: everything across processes is that
    strategy's, one place for it.)
    """

    #: Submodules with at least this many parameters (not in a smaller unit) are units when neither
    #: ``shard_units`` nor the model names them: a unit's all-gather then moves at least ~400 KB of float32,
    #: where one collective's fixed cost (about a millisecond on gloo over loopback) is no longer most of it.
    min_unit_parameters: int = 100_000

    def __init__(self, strategy, devices, resolver, options, shard_units, reshard_after_forward, checkpointing):
        super().__init__(strategy, devices, resolver, options, shard_states=False)
        collective = self._collective
        if collective is not None and collective.device.type == "cuda" and collective.backend != "nccl":
            raise ValueError(
                f"FullyShardedStrategy shards parameters on {devices[0]} over {collective.backend}, and fully_shard "
                "gathers and reduces CUDA tensors with NCCL only (gloo's CUDA support stops short of its "
                "collectives). Give each worker its own GPU with CommunicationImplementation.AUTO or NCCL; workers "
                "that share a GPU over gloo can train with MultiWorkerMirroredStrategy."
            )
        self.shard_units = shard_units
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = checkpointing
        self._mesh = None
        #: The units of the last module sharded (innermost first), for inspection.
        self.units: list = []

    @property
    def sharded(self) -> bool:
        """Whether parameters are sharded, which they are across more than one worker."""
        return self._collective is not None

    @property
    def capabilities(self) -> StrategyCapabilities:
        """What the strategy declares (``StrategyCapabilities``).

        Across workers the parameters, gradients and optimizer state are sharded, and no worker holds the whole
        state; with one worker nothing is."""
        sharded = self.sharded
        return StrategyCapabilities(
            whole_state_on_every_worker=not sharded,
            shards_optimizer_states=sharded,
            shards_parameters=sharded,
            sharded_checkpoints=sharded,
        )

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` of the workers the parameters are sharded over (``None`` before any module is, or
        with one worker)."""
        return self._mesh

    def _prepare_module(self, module: torch.nn.Module, precision: str = "32") -> bool:
        units = select_units(module, self.shard_units, self.min_unit_parameters)  # (a misnamed unit: said here)
        if not self.sharded:
            return False
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if isinstance(module, FSDPModule):
            raise ValueError(
                f"The module {type(module).__name__} is sharded already (fully_shard was applied to it): "
                "FullyShardedStrategy shards the plain module itself; pass the model before fully_shard."
            )
        if self._mesh is None:
            self._mesh = workers_mesh(self._collective)
        param_dtype = _PARAM_DTYPES.get(precision)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        if self.activation_checkpointing:
            from torch.distributed._composable import checkpoint  # private: torch's composable activation checkpointing

            for unit in units or [module]:
                checkpoint(unit)
        for unit in units:
            fully_shard(unit, mesh=self._mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        # The root keeps its parameters gathered from forward to backward, which starts with them (torch's advice).
        fully_shard(module, mesh=self._mesh, reshard_after_forward=False, mp_policy=policy)
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                # A plain SUM in every reduction: fully_shard divides by the workers by default (and a divide
                # factor of its own alone is a PREMUL_SUM, which gloo lacks); the loss is divided by the global
                # batch already.
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)
        self.units = units
        return True

    def _module_variable(self, name, tensors, trainable, synchronization, aggregation):
        from torch.distributed.tensor import DTensor

        if isinstance(tensors[0], DTensor):
            return ShardedVariable(
                tensors[0], name=name, device=self._worker_devices[0], trainable=trainable, strategy=self._strategy
            )
        return self._replicated_module_variable(name, tensors, trainable, synchronization, aggregation)

    def state_layout(self, variables) -> StateLayout:
        """``ParameterShards`` for the sharded parameters (the optimizer updates this worker's shards)."""
        if any(isinstance(v, ShardedVariable) for v in variables):
            return ParameterShards(self)
        return super().state_layout(variables)

    def gradient_step(self, variables):
        if any(isinstance(v, ShardedVariable) for v in variables):
            import contextlib

            return contextlib.nullcontext()  # fully_shard reduces the gradients during backward
        return super().gradient_step(variables)

    def gradients(self, loss: torch.Tensor, variables) -> list:
        """Backward through the sharded model; this worker's shards of the gradients, summed over the workers
        (``fully_shard`` reduce-scatters each unit's gradients as its backward ends). The parameters' ``grad``
        is left empty."""
        sharded = [isinstance(v, ShardedVariable) for v in variables]
        if not any(sharded):
            return super().gradients(loss, variables)
        if not all(sharded):
            other = next(v.name for v, s in zip(variables, sharded) if not s)
            raise ValueError(
                f"The variable {other!r} is not a parameter of the sharded model: under FullyShardedStrategy the "
                "gradients of a step are those of the sharded parameters (train other variables separately)."
            )
        parameters = [v.value() for v in variables]
        for parameter in parameters:
            parameter.grad = None
        loss.backward()
        grads = []
        for variable, parameter in zip(variables, parameters):
            grad = parameter.grad
            grads.append(torch.zeros_like(variable.local_shard) if grad is None else grad.to_local())
            parameter.grad = None
        return grads


class FullyShardedStrategy(Strategy):
    """Data parallelism with parameters, gradients and optimizer state sharded across workers (torch's FSDP2).

    Args:
      communication_options: a ``CommunicationOptions`` (``timeout_seconds`` bounds every wait; ``implementation``
        as for ``MultiWorkerMirroredStrategy``).
      cluster_resolver: a ``ClusterResolver``; ``None`` detects the environment (``resolve_cluster()``).
      shard_units: which submodules are units (gathered and freed together): ``None`` — the model's own
        declaration where it has one (Hugging Face's ``_no_split_modules``), else submodules of at least
        ``FullyShardedExtended.min_unit_parameters`` parameters (bottom-up); a list of classes or class names
        (what a recipe gives); or a function ``module -> bool``. The model itself is always the last unit.
      reshard_after_forward: free each unit's gathered parameters after its forward and gather them again for its
        backward (``True``: less memory), or keep them until its backward (``False``: one all-gather less per unit
        and step). The model's own parameters (those in no unit) stay gathered from its forward to its backward
        either way (torch's advice: its backward comes first).
      activation_checkpointing: recompute each unit's activations during backward instead of keeping them (any
        model: torch's composable ``checkpoint`` on every unit, or on the model where there is no unit).

    One replica per worker. Parameters become ``DTensor`` s (each worker keeps ``1/num_workers`` of every
    parameter's rows), and so do the gradients; the optimizer's slots are made for the local shards. Training
    equals one process on the same global batches: the loss is the global batch's (every unit's gradient
    reduction is a plain sum, not torch's default mean), clipping norms add up every worker's partial sums, and
    an element-level loss's count of real elements is summed over the workers in one small all-reduce per
    step. Every worker runs the forward and backward passes every step, an empty batch included (they are
    collectives). ``Trainer(precision="bf16-mixed")`` gathers parameters in bfloat16 and reduces gradients in
    float32 (``MixedPrecisionPolicy``; ``"16-mixed"`` likewise in float16, with its loss scaling); the sharded
    parameters, gradients and optimizer state stay float32 under every precision.

    After ``fit`` the user's ``model`` is the sharded module (its parameters are ``DTensor`` s; a forward pass is
    a collective). ``trainer.save_checkpoint(path)`` writes a consolidated file that ``torch.load`` reads;
    ``BackupAndRestore`` and ``ModelCheckpoint`` write sharded checkpoints. With one worker nothing is sharded:
    no unit is made (``extended.units`` stays empty) and ``activation_checkpointing`` is not applied.

    A custom ``train_step`` computes its gradients with ``strategy.extended.gradients(loss, variables)``:
    ``torch.autograd.grad`` cannot reach sharded parameters (``fully_shard`` gathers them into other tensors).

    Example::

        strategy = ds.FullyShardedStrategy(shard_units=[Block])
        trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-3), loss="cross_entropy")
        trainer.fit(model, (x, y), batch_size=64)       # the same call on every worker
    """

    def __init__(
        self,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver=None,
        *,
        shard_units=None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
    ):
        communication_options, cluster_resolver, devices = checked_cluster(
            communication_options, cluster_resolver, replicas=1
        )
        for name, value in (
            ("reshard_after_forward", reshard_after_forward),
            ("activation_checkpointing", activation_checkpointing),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}.")
        if shard_units is not None and not callable(shard_units):
            wanted = [shard_units] if isinstance(shard_units, (str, type)) else shard_units
            if not isinstance(wanted, (list, tuple)) or not all(isinstance(w, (str, type)) for w in wanted):
                raise TypeError(
                    "shard_units must be None, a list of module classes or class names, or a function module -> "
                    f"bool, got {shard_units!r}."
                )
        self._cluster_resolver = cluster_resolver
        extended = FullyShardedExtended(
            self,
            devices,
            cluster_resolver,
            communication_options,
            shard_units,
            reshard_after_forward,
            activation_checkpointing,
        )
        super().__init__(extended)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster this strategy belongs to (read-only)."""
        return self._cluster_resolver

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None) -> None:
        """Validated, as ``MultiWorkerMirroredStrategy.configure``: the cluster comes from ``cluster_resolver``, and a
        ``cluster_spec`` must name as many tasks as it has workers."""
        Strategy.configure(self, session_config, None, task_type, task_id)
        check_cluster_spec(cluster_spec, self._extended._num_workers)

    def __repr__(self) -> str:
        extended = self._extended
        return (
            f"FullyShardedStrategy(worker {extended._worker_index} of {extended._num_workers}, "
            f"device={extended.worker_devices[0]})"
        )
