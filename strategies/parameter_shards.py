"""Sharded parameters (``FullyShardedStrategy``): their variables, the optimizer's layout over their shards, and
the switch that keeps a state dict sharded.

Under ``FullyShardedStrategy`` a module's parameters are torch ``DTensor`` s, sharded along their first dimension
across the workers by torch's ``fully_shard`` (each worker holds ``torch.chunk(whole, num_workers)[rank]``, an
empty chunk where there are fewer rows than workers). Three things sit on them:

* ``ShardedVariable``: the variable of such a parameter. Its ``value()`` is the parameter itself (a ``DTensor``);
  ``shape`` is the whole shape; ``read_value()`` the whole value (a collective: every worker calls it);
  ``assign`` takes a whole value (each worker keeps its chunk) or a ``DTensor`` (resharded where its layout
  differs); ``local_shard`` is this worker's chunk, in place.
* ``ParameterShards``: the ``StateLayout`` the strategy gives an optimizer of such variables. Its targets are
  the local shards (so the optimizer's slots are sharded as the parameters are); the gradients arrive summed
  over the workers already (``fully_shard`` reduce-scatters them during backward), so ``reduce`` has only the
  step values to sum (one small all-reduce, where there are any: an element-level loss's count of real
  elements); clipping norms and a loss scaler's finite check add up the workers' partial results.
* ``sharded_state_dict()``: inside it, ``DistributedModule.state_dict()`` and ``Optimizer.state_dict()`` hold a
  sharded variable's value and slots as ``DTensor`` s of this worker's chunks (no communication), which is what a
  sharded checkpoint writes (``torch.distributed.checkpoint``: every worker its chunks). Outside it they hold
  whole tensors, gathered from every worker (the strategy-independent state).

Example (in every worker of a ``FullyShardedStrategy``)::

    dm = strategy.distribute_module(model)
    dm.state_dict()["0.weight"].shape          # the whole weight: gathered from every worker
    with ds.sharded_state_dict():
        dm.state_dict()["0.weight"]            # a DTensor: this worker's rows, nothing gathered
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .distributed_checkpoint import PiecedValue
from .reduce_util import VariableAggregation, VariableSynchronization
from .state_layout import ReducedGradients, StateLayout
from .values import local_results
from .variables import _ASSIGN_OPS, LocalVariable, Variable, as_assign_value

__all__ = [
    "ParameterShards",
    "ShardedVariable",
    "consolidate",
    "is_sharded",
    "keeps_shards",
    "load_target",
    "shard_of",
    "sharded_state_dict",
    "whole_from_shard",
    "workers_mesh",
]

_mode = threading.local()


@contextlib.contextmanager
def sharded_state_dict(snapshot: bool = True):
    """Inside it (on this thread), state dicts keep sharded parameters and their optimizer slots as ``DTensor`` s
    of this worker's chunks instead of gathering whole tensors: what a sharded checkpoint writes and reads.
    ``snapshot=False``: the ``DTensor`` s view the live shards instead of copies (for a state written at once,
    before the next update: no memory beyond the state itself).

    Example::

        with ds.sharded_state_dict():
            state = {"model": dm.state_dict(), "optimizer": optimizer.state_dict()}
            torch.distributed.checkpoint.save(state, checkpoint_id="ckpt")
    """
    outer = getattr(_mode, "sharded", None)
    _mode.sharded = "snapshot" if snapshot else "live"
    try:
        yield
    finally:
        _mode.sharded = outer


def keeps_shards() -> bool:
    """Whether ``sharded_state_dict()`` is in force on this thread."""
    return getattr(_mode, "sharded", None) is not None


def reads_live() -> bool:
    """Whether ``sharded_state_dict(snapshot=False)`` is in force on this thread: a state written at once reads the
    variables' live tensors, copying none (``DistributedModule.state_dict`` reads whole variables so too)."""
    return getattr(_mode, "sharded", None) == "live"


def _copied(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, copied unless ``sharded_state_dict(snapshot=False)`` is in force."""
    return tensor.detach() if getattr(_mode, "sharded", None) == "live" else tensor.detach().clone()


def is_sharded(value) -> bool:
    """Whether ``value`` is a ``DTensor`` (a sharded value of a sharded state dict)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_part(value: torch.Tensor, like) -> torch.Tensor:
    """This worker's chunk of ``value`` laid out as the ``DTensor`` ``like`` is: ``value`` whole (every worker has
    it) or a ``DTensor`` of any layout (resharded: a collective where its layout differs from ``like``'s)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(value, DTensor):
        if value.device_mesh == like.device_mesh and value.placements == like.placements:
            return value.to_local()
        return value.redistribute(like.device_mesh, like.placements).to_local()
    # Every worker holds the whole value: no communication, each takes its chunk as fully_shard cuts it.
    whole = value.to(device=like.device)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()


def as_sharded(local: torch.Tensor, like) -> torch.Tensor:
    """A ``DTensor`` of the whole shape of ``like`` whose chunk on this worker is ``local`` (no communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


class ShardedVariable(Variable):
    """The variable of a parameter that ``fully_shard`` shards across the workers (``FullyShardedStrategy``).

    ``value()`` is the parameter (a ``DTensor``: torch operations on it run on the shards); ``shape`` and ``dtype``
    are the whole parameter's; ``read_value()``/``numpy()`` the whole value, gathered from every worker (a
    collective: call it on every worker, in the same order); ``assign(whole)`` keeps this worker's chunk of a
    whole value (every worker passes the same), ``assign(dtensor)`` reshards where the layout differs.
    ``local_shard`` is this worker's chunk of the parameter itself (in place: writing it writes the parameter).
    Under ``sharded_state_dict()`` ``read_value()`` is a ``DTensor`` copy of the shards (nothing gathered).

    Example::

        v = dm.trainable_variables[0]
        v.shape, v.local_shard.shape      # torch.Size([7, 5]), torch.Size([4, 5]) on worker 0 of 2
    """

    def __init__(self, parameter, *, name: str, device: str, trainable: bool = True, strategy=None):
        self._tensor = parameter
        self._name = name
        self._device = device
        self._trainable = bool(trainable)
        self._aggregation = VariableAggregation.NONE
        self._synchronization = VariableSynchronization.ON_WRITE
        self._distribute_strategy = strategy
        self._replica_id = 0

    @property
    def local_shard(self) -> torch.Tensor:
        """This worker's chunk of the parameter (a plain tensor sharing its memory; possibly empty)."""
        return self._tensor.to_local().detach()

    def _read(self) -> torch.Tensor:
        return self._tensor

    def read_value(self) -> torch.Tensor:
        """The whole value, gathered from every worker (a collective); a ``DTensor`` copy of the shards under
        ``sharded_state_dict()``."""
        if keeps_shards():
            return as_sharded(_copied(self.local_shard), self._tensor)
        return self._tensor.detach().full_tensor()

    def numpy(self):
        """The whole value as a NumPy array (a collective: it is gathered from every worker)."""
        return self.read_value().cpu().numpy().copy()

    def copy_tensors(self) -> tuple:
        return (self._tensor,)

    def _primary_tensor(self) -> torch.Tensor:
        return self._tensor

    def _device_name(self) -> str:
        return self._device

    def _assign(self, op: str, value):
        local = self.local_shard
        if isinstance(value, Variable):
            value = value.value()
        if isinstance(value, (int, float)) and op != "assign":
            part = value
        else:
            whole = value if is_sharded(value) else as_assign_value(value, self._tensor, self._name)
            part = local_part(whole, self._tensor)
        with torch.no_grad():
            _ASSIGN_OPS[op](local, part)
        return self

    def _local_results(self) -> tuple:
        return (self,)

    def __repr__(self) -> str:
        return (
            f"<ShardedVariable '{self._name}' shape={list(self.shape)} dtype={self.dtype} "
            f"local_shard={list(self.local_shard.shape)}>"
        )


def _where(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype


class ParameterShards(StateLayout):
    """The ``StateLayout`` of sharded parameters (``FullyShardedStrategy``; see the module docstring).

    Each target is a ``LocalVariable`` viewing one parameter's local shard, so the update rule, the slots and the
    moving averages are this worker's chunks (``slices_variables``: only element-wise rules are right, as under
    sharded optimizer states). The gradients reach ``reduce`` as local shards summed over the workers already.

    Example::

        layout = strategy.extended.state_layout(dm.trainable_variables)
        [t.shape for t in layout.extend(dm.trainable_variables)]   # the local shards' shapes
    """

    slices_variables = True

    def __init__(self, extended):
        super().__init__(extended._strategy)
        self._extended = extended
        self._collective = extended._collective
        self._targets: list = []
        self._positions: dict = {}  # id(variable) or id(target) -> position
        self._storage: list = []

    # --- the variables and their targets -------------------------------------------------------------------
    def extend(self, variables) -> list:
        new = []
        for variable in variables:
            if id(variable) in self._positions:
                continue
            if not isinstance(variable, ShardedVariable):
                raise ValueError(
                    f"The variable {variable.name!r} is not a parameter of the sharded model, and an optimizer under "
                    "FullyShardedStrategy updates the sharded parameters only: train other variables with an "
                    "optimizer of their own."
                )
            position = len(self.variables)
            tensor = variable.local_shard
            target = LocalVariable(tensor, name=f"{variable.name}[shard]", device=variable.device, trainable=False)
            self.variables.append(variable)
            self._targets.append(target)
            self._storage.append(_where(tensor))
            self._positions[id(variable)] = position
            self._positions[id(target)] = position
            new.append(target)
        return new

    def targets_of(self, variables) -> list:
        return [self._targets[self._positions[id(v)]] for v in variables]

    @property
    def targets(self) -> list:
        return list(self._targets)

    def position_of(self, target) -> int:
        return self._positions[id(target)]

    def refresh(self) -> bool:
        changed = False
        for position, variable in enumerate(self.variables):
            tensor = variable.local_shard
            if _where(tensor) != self._storage[position]:
                self._targets[position]._tensor = tensor
                self._storage[position] = _where(tensor)
                changed = True
        return changed

    # --- a step ------------------------------------------------------------------------------------------------
    def reduce(self, grads: list, variables: list) -> ReducedGradients:
        # fully_shard summed the gradients over the workers during backward; what is left to sum is the step's
        # values (an element-level loss's real elements), in one small all-reduce of their own.
        values = self._extended._step_values
        if values.pending:
            payload = values.take()
            values.finish(payload, self._extended._reduce_step_values_alone(payload))
        return self.take(grads, variables)

    def take(self, grads: list, variables: list) -> ReducedGradients:
        parts = []
        for grad, variable in zip(grads, variables):
            grad = grad if type(grad) is torch.Tensor else local_results(grad)[0]
            shard = variable.local_shard
            if grad.shape != shard.shape:  # a whole gradient (every worker the same): this worker's chunk of it
                grad = local_part(grad, variable.value())
            parts.append(grad)
        return ReducedGradients(parts, parts)

    def sum_over_workers(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if self._collective is None:
            return tensor
        buffer = tensor.detach().to(self._collective.device).clone().reshape(-1)
        self._collective.all_reduce_flat([buffer], what)
        return buffer.view(tensor.shape).to(tensor.device)

    def all_agree(self, flag: bool, what: str) -> bool:
        if self._collective is None:
            return flag
        return self._collective.sum_ints([0 if flag else 1], what)[0] == 0

    @property
    def device(self) -> torch.device:
        return self._collective.device if self._collective is not None else torch.device("cpu")

    def make_slot(self, target, name: str, value: torch.Tensor) -> LocalVariable:
        tensor = value.to(target.value().device)
        return LocalVariable(tensor, name=f"{target.name}/{name}", device=target.device, trainable=False)

    def update(self, target, fn, args: tuple) -> None:
        fn(target, *args)

    # --- the state in the unsharded layout ---------------------------------------------------------------------
    def whole(self, per_target: list, what: str) -> list:
        out = []
        for tensor, variable in zip(per_target, self.variables):
            local = variable.local_shard
            local = torch.zeros_like(local) if tensor is None else _copied(tensor)
            sharded = as_sharded(local, variable.value())
            out.append(sharded if keeps_shards() else sharded.full_tensor())
        return out

    def cut(self, position: int, value: torch.Tensor) -> list:
        variable = self.variables[position]
        return [(self._targets[position], local_part(value, variable.value()))]

    def copy_from_slots(self, variables: list, slot_of) -> None:
        with torch.no_grad():
            for variable in variables:
                target = self._targets[self._positions[id(variable)]]
                target.value().copy_(slot_of(target).value())

    def gather_objects(self, obj, what: str) -> list:
        if self._collective is None:
            return [obj]
        return self._collective.all_gather_object(obj, what)

    def __repr__(self) -> str:
        return f"ParameterShards({len(self.variables)} sharded variables)"


def load_target(variable, shape, dtype) -> torch.Tensor:
    """An empty tensor to read a saved value of ``variable`` into (``distributed_checkpoint.read_shards``): laid out
    as its shards where ``variable`` is a ``ShardedVariable`` of that shape (each worker reads its chunk), else a
    whole tensor of ``shape`` and ``dtype``.

    Example::

        target = load_target(dm.named_variables()["0.weight"], [7, 5], torch.float32)
    """
    if isinstance(variable, ShardedVariable) and list(variable.shape) == list(shape):
        like = variable.value()
        return as_sharded(torch.empty(like.to_local().shape, dtype=dtype, device=like.device), like)
    return torch.empty(list(shape), dtype=dtype)


def consolidate(state, keep: bool):
    """``state`` with each ``DTensor`` in it gathered whole, one at a time in the order of the nest (a collective
    per tensor: every worker calls it with a state of the same structure). Where ``keep`` (the worker that writes
    the file) the whole tensors are kept, moved to host memory; elsewhere each is dropped at once (``None``), so
    no other worker ever holds more than one whole tensor. First the heap's free memory is handed back to the
    system (glibc's ``malloc_trim``: training's freed gather and gradient buffers stay in the process's resident
    memory otherwise, some 40-60 MB on the benchmark's model), so the chief's peak is its live state and one copy.

    Example::

        with ds.sharded_state_dict():
            state = {"model": dm.state_dict()}
        state = consolidate(state, keep=strategy.cluster.is_chief)
    """

    _return_free_heap()
    gathered: dict = {}  # id(tensor) -> the whole tensor, for parts shared by several pieced values

    def whole_of(tensor):
        if id(tensor) not in gathered:
            gathered[id(tensor)] = _gathered(tensor) if is_sharded(tensor) else tensor
        return gathered[id(tensor)]

    kept: dict = {}  # id(DTensor) -> what it became: a tensor met twice (tied weights) is gathered once, shared

    def walk(value):
        if is_sharded(value):
            if id(value) not in kept:
                whole = _gathered(value)  # (waited for on every worker, whether it keeps it or not)
                kept[id(value)] = whole if keep else None
            return kept[id(value)]
        if isinstance(value, PiecedValue):
            whole = value.assemble(whole_of)
            return whole if keep else None
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v) for v in value)
        return value

    return walk(state)


def whole_from_shard(variable, local: torch.Tensor) -> torch.Tensor:
    """A value of ``variable``'s shape from this worker's shard ``local`` of it where ``variable`` is a
    ``ShardedVariable`` (a ``DTensor`` under ``sharded_state_dict()``, else gathered whole: a collective); ``local``
    itself for any other variable. What an optimizer's state keeps of per-shard sums (an open accumulation window).

    Example::

        whole = whole_from_shard(variable, window_sum)   # every worker calls it, in the same order
    """
    if not isinstance(variable, ShardedVariable):
        return local
    sharded = as_sharded(local.detach().clone(), variable.value())
    return sharded if keeps_shards() else sharded.full_tensor()


def shard_of(variable, whole: torch.Tensor) -> torch.Tensor:
    """This worker's shard of a value of ``variable``'s shape where ``variable`` is a ``ShardedVariable`` (``whole``
    whole, or a ``DTensor``); ``whole`` itself for any other variable."""
    if not isinstance(variable, ShardedVariable):
        return whole
    return local_part(whole, variable.value())


def _gathered(value) -> torch.Tensor:
    """``value`` (a ``DTensor``) gathered whole into host memory, the gather waited for: ``full_tensor`` may return a
    tensor whose collective completes only when it is used, and a worker that drops it unused must not go on to
    its next collective before this one is done (the others would wait for it in vain)."""
    from torch.distributed._functional_collectives import wait_tensor  # private: the gather's completion

    return wait_tensor(value.full_tensor()).cpu()


def _return_free_heap() -> None:
    """glibc's ``malloc_trim(0)``: free heap memory back to the system (nothing where there is no glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def workers_mesh(collective):
    """The one-dimensional ``DeviceMesh`` of every worker over the collective's default group itself (the process
    group ``init_process_group`` made, with the strategy's communication timeout): ``init_device_mesh`` would make a
    group of its own, without that timeout, where CUDA is present and the default group is gloo. Passed to
    ``fully_shard`` explicitly: with a gloo default group its own choice of device can move the parameters to a
    GPU (torch issue 132471)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, collective.device.type)
