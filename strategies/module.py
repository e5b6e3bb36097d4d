"""``DistributedModule``: a torch module replicated over a strategy's replicas.

torch has no variable creator, so a module built outside ``scope()`` is distributed
explicitly with ``strategy.distribute_module(module)`` (the ``Trainer`` does it for
you). Replica 0 **is** the user's module (moved to the first device if needed), so
after training the user's own object holds the trained weights.

Each parameter and buffer is mapped once to a distributed variable: parameters are
mirrored (central under ``CentralStorageStrategy``), floating buffers such as
batch-norm statistics are ``SyncOnRead``/``MEAN``, integer buffers
``SyncOnRead``/``ONLY_FIRST_REPLICA``. Per step nothing is rebuilt. Each ``nn.SyncBatchNorm``
becomes ``sync_batchnorm.SyncBatchNorm`` (statistics of the global batch); its running statistics
are the same on every replica, so they are read as the first replica's (``ONLY_FIRST_REPLICA``).

Example::

    >>> import torch, replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> model = torch.nn.Linear(3, 1)
    >>> dmodel = strategy.distribute_module(model)
    >>> dmodel.module is model
    True
    >>> out = strategy.run(lambda x: dmodel(x), args=(torch.ones(2, 3),))
    >>> len(strategy.experimental_local_results(out))
    2
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from . import context
from .parameter_shards import reads_live
from .reduce_util import VariableAggregation, VariableSynchronization
from .replica_context import prepare_backward_collective
from .sync_batchnorm import synchronize_batchnorm
from .variables import SyncOnReadVariable, aggregated_reads

__all__ = ["DistributedModule"]


def _buffer_aggregation(tensor: torch.Tensor, synchronized: bool) -> VariableAggregation:
    if (tensor.is_floating_point() or tensor.is_complex()) and not synchronized:
        return VariableAggregation.MEAN
    return VariableAggregation.ONLY_FIRST_REPLICA


class DistributedModule:
    """A module with one replica per device of its strategy.

    Inside ``strategy.run`` calling it calls the local replica; elsewhere replica 0
    (the user's module). ``trainable_variables``, ``non_trainable_variables`` and
    ``variables`` are the distributed variables; ``state_dict()`` is the aggregated,
    strategy-independent state and ``load_state_dict()`` writes every replica.
    """

    def __init__(self, strategy, module: torch.nn.Module, *, precision: str = "32"):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"distribute_module() needs a torch.nn.Module, got {type(module).__name__}.")
        self._strategy = strategy
        extended = strategy.extended
        devices = extended._torch_devices
        first = module.to(devices[0]) if _module_device(module) not in (None, devices[0]) else module
        extended._sync_module_state(first)  # across workers: every worker starts from worker 0's values
        self._collective_forward = bool(extended._prepare_module(first, precision))  # (sharded by FullyShardedStrategy)
        replicas = [first] + [copy.deepcopy(first).to(device) for device in devices[1:]]
        layers = synchronize_batchnorm(first)
        synchronized = {id(b) for layer in layers for b in layer.buffers(recurse=False)}
        self._synchronizes_batchnorm = bool(layers)
        if layers:  # while it trains, the replicas run on threads (runner.py)
            extended._synchronized_modules.add(self)
        for replica in replicas[1:]:
            synchronize_batchnorm(replica)
        self._replicas = tuple(replicas)
        self._variables: OrderedDict = OrderedDict()
        with strategy.scope():
            for name, param in first.named_parameters():
                tensors = [r.get_parameter(name) for r in replicas]
                self._variables[name] = extended._module_variable(
                    name, tensors, param.requires_grad, VariableSynchronization.ON_WRITE, VariableAggregation.NONE
                )
            for name, buffer in first.named_buffers():
                if buffer is None:
                    continue
                tensors = [r.get_buffer(name) for r in replicas]
                self._variables[name] = extended._module_variable(
                    name,
                    tensors,
                    False,
                    VariableSynchronization.ON_READ,
                    _buffer_aggregation(buffer, id(buffer) in synchronized),
                )

        # State-dict keys of tensors that have a variable under another name (tied weights: GPT-2's lm_head.weight
        # is its wte.weight), read and written through that variable.
        by_tensor = {id(t): n for n, t in list(first.named_parameters()) + list(first.named_buffers()) if t is not None}
        self._aliases = {
            key: self._variables[by_tensor[id(t)]]
            for key, t in first.state_dict(keep_vars=True).items()
            if key not in self._variables and id(t) in by_tensor and by_tensor[id(t)] in self._variables
        }

    # --- access ----------------------------------------------------------------------
    @property
    def strategy(self):
        """The strategy the module is replicated over."""
        return self._strategy

    @property
    def module(self) -> torch.nn.Module:
        """The user's own module, which is replica 0."""
        return self._replicas[0]

    @property
    def replicas(self) -> tuple:
        """One module per replica, in replica order."""
        return self._replicas

    @property
    def variables(self) -> list:
        """Every parameter and buffer as a distributed variable."""
        return list(self._variables.values())

    @property
    def trainable_variables(self) -> list:
        """The variables of the parameters that required gradients when the module was distributed."""
        return [v for v in self._variables.values() if v.trainable]

    @property
    def non_trainable_variables(self) -> list:
        """The buffers' variables and those of parameters that did not require gradients."""
        return [v for v in self._variables.values() if not v.trainable]

    def named_variables(self) -> OrderedDict:
        """``{parameter or buffer name: distributed variable}`` in module order."""
        return OrderedDict(self._variables)

    def local_module(self) -> torch.nn.Module:
        """The replica of the replica context running this code (replica 0 elsewhere)."""
        ctx = context.current_mode().replica_context
        if ctx is not None and not ctx._is_default and ctx.strategy is self._strategy:
            return self._replicas[ctx._replica_id]
        return self._replicas[0]

    @property
    def synchronizes_batchnorm(self) -> bool:
        """Whether the module has ``nn.SyncBatchNorm`` layers (statistics of the global batch).

        Example::

            >>> import torch, replicafit.strategies as ds
            >>> model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
            >>> ds.MirroredStrategy(["cpu:0", "cpu:1"]).distribute_module(model).synchronizes_batchnorm
            True
        """
        return self._synchronizes_batchnorm

    @property
    def forward_is_collective(self) -> bool:
        """Whether the forward and backward passes communicate across replicas or workers (``nn.SyncBatchNorm``
        layers, or parameters sharded by ``FullyShardedStrategy``, which are gathered for each unit's forward):
        then every replica runs them every step, with an empty batch too.

        Example::

            >>> import torch, replicafit.strategies as ds
            >>> ds.MirroredStrategy(["cpu:0", "cpu:1"]).distribute_module(torch.nn.Linear(2, 1)).forward_is_collective
            False
        """
        return self._synchronizes_batchnorm or self._collective_forward

    @property
    def gathers_parameters(self) -> bool:
        """Whether the strategy sharded the module's parameters, which every forward pass gathers (a collective on
        every worker, ``FullyShardedStrategy``); with ``nn.SyncBatchNorm`` alone ``forward_is_collective`` holds but
        this does not.

        Example::

            >>> import torch, replicafit.strategies as ds
            >>> ds.MirroredStrategy(["cpu:0", "cpu:1"]).distribute_module(torch.nn.Linear(2, 1)).gathers_parameters
            False
        """
        return self._collective_forward

    def __call__(self, *args, **kwargs):
        module = self.local_module()
        if self._synchronizes_batchnorm and module.training and torch.is_grad_enabled():
            ctx = context.current_mode().replica_context
            if ctx is not None and not ctx._is_default and ctx.strategy is self._strategy:
                # Its layers' backward passes are collectives: settle how the replicas run before any layer
                # has a side effect (a start again on threads would repeat it).
                prepare_backward_collective(
                    ctx, "A module with SyncBatchNorm layers (their backward passes are collectives)"
                )
        return module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients of every replica (the user's module alone holds only replica 0's)."""
        for replica in self._replicas:
            replica.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True) -> DistributedModule:
        """Sets every replica's training mode (``nn.Module.train``); returns ``self``."""
        for replica in self._replicas:
            replica.train(mode)
        return self

    def eval(self) -> DistributedModule:
        """Puts every replica in evaluation mode: ``train(False)``."""
        return self.train(False)

    @property
    def training(self) -> bool:
        """Replica 0's training mode, which is the user's module's; ``train``/``eval`` set every replica's."""
        return self._replicas[0].training

    # --- state -----------------------------------------------------------------------
    def state_dict(self) -> OrderedDict:
        """The aggregated state: parameters once, buffers as their cross-replica aggregate.

        The keys are those of ``module.state_dict()``; the result does not depend on the
        strategy, so it loads under any other one (or into the bare module).
        """
        state = self._replicas[0].state_dict()
        with context.enter_or_assert_strategy(self._strategy), aggregated_reads(self._variables.values()):
            read: dict = {}
            for name in state:
                variable = self._variables.get(name)
                variable = self._aliases.get(name) if variable is None else variable
                if variable is not None:
                    if id(variable) not in read:
                        live = reads_live() and not isinstance(variable, SyncOnReadVariable)  # (written at once)
                        read[id(variable)] = variable.value().detach() if live else variable.read_value().detach()
                    state[name] = read[id(variable)]
        return state

    def sync_buffers(self) -> None:
        """Writes each ``SyncOnRead`` buffer's aggregate (e.g. the replica mean of batch-norm
        statistics) into every replica, so every replica and the user's module hold it.

        Example::

            strategy.run(train_step, args=(batch,))   # replicas update their own statistics
            dmodel.sync_buffers()                      # now all hold the mean
        """
        with context.enter_or_assert_strategy(self._strategy), aggregated_reads(self._variables.values()):
            for variable in self._variables.values():
                # Across workers one local replica is no reason to skip: the mean is of every worker's.
                if isinstance(variable, SyncOnReadVariable) and self._strategy.num_replicas_in_sync > 1:
                    variable.assign(variable.read_value().detach())

    def load_state_dict(self, state_dict, strict: bool = True):
        """Loads ``state_dict`` into every replica; returns missing and unexpected keys like torch."""
        expected = self._replicas[0].state_dict()
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self._replicas[0]).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}. Pass strict=False to load the keys that match."
            )
        with context.enter_or_assert_strategy(self._strategy):
            for name, value in state_dict.items():
                variable = self._variables.get(name)
                if variable is not None:
                    variable.assign(value)
        extra = {
            k: v for k, v in state_dict.items() if k in expected and k not in self._variables and k not in self._aliases
        }
        if extra:
            for replica in self._replicas:
                replica.load_state_dict(extra, strict=False)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)  # private: what torch returns too

    def __repr__(self) -> str:
        return f"DistributedModule({type(self._replicas[0]).__name__}, strategy={self._strategy!r})"


def _module_device(module: torch.nn.Module):
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None
