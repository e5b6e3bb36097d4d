"""``nn.SyncBatchNorm`` under every strategy: batch statistics of the whole global batch.

torch's ``nn.SyncBatchNorm`` synchronizes over a ``torch.distributed`` process group, on GPUs
only, and knows nothing of replicas that share one process. ``distribute_module`` (and so
``Trainer.fit``) turns every ``nn.SyncBatchNorm`` of the model into ``SyncBatchNorm`` below, a
subclass (``isinstance(m, nn.SyncBatchNorm)`` still holds, its ``repr`` and state dict are
torch's, and it pickles as torch's class) whose training forward, inside a replica of a strategy
with several replicas in sync, normalizes with the mean and variance of the global batch: across
the local replicas and across workers, weighted by each replica's number of rows, so that uneven
splits, a partial last batch and an empty replica are exact. Everywhere else it is torch's layer.

The statistics take one all-reduce per layer in the forward pass and one in the backward pass,
through the replica context's collective (the strategy's cross-device ops, bounded by its
communication timeout). Forward, each replica works out its slice's row count, mean and sum of
squared deviations about that mean (corrected for the rounding of the mean), in float64 (float32 on
Apple's MPS), and writes them into its own row of a table of zeros; the all-reduce of the table is a
gather (adding zeros is exact), and every replica merges the rows in replica order with Chan et al.'s
formula, without cancellation: the variance is as precise as one device's, however large the mean.
Backward, one all-reduce of every channel's sum of the output gradient and of its product with the
normalized input gives the global-batch BatchNorm's gradient; the gradients of ``weight`` and
``bias`` are the replica's own share (the optimizer sums them). Running statistics are updated from
the global statistics, so they are identical on every replica and worker (read as the first
replica's: one copy in a checkpoint). Evaluation normalizes with the running statistics, as torch's
layer does, and synchronizes nothing. Plain ``nn.BatchNorm*`` layers keep per-replica statistics
(TensorFlow's default).

While a module with these layers trains, its strategy runs the replicas on threads (their backward
passes meet at a collective, which replicas taking turns on one thread cannot); replicas on an
accelerator then run their backward passes on their own threads (``runner.py``).

Example::

    >>> import torch, replicafit.strategies as ds
    >>> strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    >>> dmodel = strategy.distribute_module(model)
    >>> x = torch.arange(12.0).reshape(4, 3)                  # replica 0 gets rows 0-1, replica 1 rows 2-3
    >>> out = strategy.run(lambda rows: dmodel(rows), args=(strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: x[2 * ctx.replica_id_in_sync_group:][:2]),))
    >>> torch.allclose(torch.cat(strategy.experimental_local_results(out)), torch.nn.functional.batch_norm(
    ...     x, None, None, training=True))
    True
"""

from __future__ import annotations

import copyreg

import torch
import torch.nn.functional as F
from torch import nn

from . import context
from .buckets import reading_back_waits
from .merge_fns import _batch_all_reduce
from .reduce_util import ReduceOp
from .replica_context import prepare_backward_collective
from .step_values import wide_float

# Autograd functions here run the math on plain tensors: a variable's __torch_function__ must not dispatch them.
_no_torch_function = torch._C.DisableTorchFunction  # private: torch has no public switch for __torch_function__

__all__ = ["SyncBatchNorm"]

_WHAT = "A SyncBatchNorm layer (its backward pass is a collective)"


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's ``nn.SyncBatchNorm``, synchronized through the replica context of a replicafit
    strategy (see the module docstring). ``distribute_module`` re-classes each ``nn.SyncBatchNorm``
    of a model to this class; nobody needs to build it by hand, and it behaves as torch's layer
    outside a replica of a strategy with several replicas in sync.

    Example::

        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)   # the torch way
        Trainer(strategy=ds.MirroredStrategy(["cpu:0", "cpu:1"]), ...).fit(model, data)
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        replica = _replica_context()
        if replica is None or not self.training:
            return super().forward(input)  # torch's own layer: eval mode, or outside our replicas
        synchronized = replica.num_replicas_in_sync > 1
        if synchronized and torch.is_grad_enabled() and input.requires_grad:
            prepare_backward_collective(replica, _WHAT)  # before any side effect: the call may start again on threads
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch's
                factor = 1.0 / self.num_batches_tracked.item()
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        if not synchronized:  # nobody to synchronize with: the slice is the global batch
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, factor, self.eps)
        return sync_batch_norm(replica, input, self.weight, self.bias, running_mean, running_var, factor, self.eps)

    def _get_name(self) -> str:
        return "SyncBatchNorm"

    def __reduce_ex__(self, protocol):
        # Pickles (torch.save(model), copy.deepcopy) as torch's class: a saved model needs no replicafit.
        # (copyreg's own reconstructor: pickle refuses ``__newobj__`` of another class than the object's.)
        reduced = super().__reduce_ex__(protocol)
        return (copyreg._reconstructor, (nn.SyncBatchNorm, object, None), *reduced[2:])  # private: what pickle uses


def synchronize_batchnorm(module: nn.Module) -> list:
    """Re-classes every ``nn.SyncBatchNorm`` in ``module`` to ``SyncBatchNorm`` (in place); returns them.
    ``distribute_module`` calls it on every replica.

    Example::

        >>> model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)))
        >>> (layer,) = synchronize_batchnorm(model)
        >>> type(layer) is nn.SyncBatchNorm, isinstance(layer, nn.SyncBatchNorm), layer is model[1]
        (False, True, True)
    """
    found = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    for layer in found:
        if type(layer) is nn.SyncBatchNorm:
            layer.__class__ = SyncBatchNorm
    return found


def _replica_context():
    """The replica context of a replicafit strategy running this code, else None."""
    replica = context.current_mode().replica_context
    return None if replica is None or replica._is_default else replica


def sync_batch_norm(replica, x, weight, bias, running_mean, running_var, factor: float, eps: float):
    """Batch normalization of ``x`` with the statistics of every replica's ``x`` in training mode
    (``F.batch_norm(..., training=True)`` over the global batch); updates the running statistics
    in place. Every replica of ``replica``'s strategy must call it, with the same layer.

    Example (what ``SyncBatchNorm.forward`` does in training)::

        replica = ds.get_replica_context()
        out = sync_batch_norm(replica, x, layer.weight, layer.bias, layer.running_mean, layer.running_var, 0.1, 1e-5)
    """
    if torch.is_grad_enabled() and x.requires_grad:
        prepare_backward_collective(replica, _WHAT)  # its backward pass is a collective too
    return _SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, replica, factor, eps)


def _all_reduce(replica, tensor: torch.Tensor) -> torch.Tensor:
    return replica._merge_call(_batch_all_reduce, (ReduceOp.SUM, [tensor], None), {})[0]


def _channels(x: torch.Tensor) -> tuple:
    """The dimensions BatchNorm reduces over (all but the channels, dimension 1), and the shape
    that broadcasts a per-channel vector against ``x``."""
    dims = [0, *range(2, x.dim())]
    return dims, (1, x.shape[1]) + (1,) * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    # Few, fused operations: on replica threads every torch call pays for the function mode that routes
    # random draws (rng.py), and the threads share the interpreter. None of these draws anything, so
    # torch-function handling is off inside (the collective's merge function runs with it on).

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, replica, factor, eps):
        channels = x.shape[1]
        dims, _ = _channels(x)
        rows = x.numel() // channels
        wide = wide_float(x.device)
        with _no_torch_function():
            compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
            # Every replica's (row count, mean, sum of squared deviations about that mean) in its own row of
            # a table of zeros, summed across replicas and workers: a gather by one all-reduce, exact.
            table = torch.zeros(replica.num_replicas_in_sync, 1 + 2 * channels, dtype=wide, device=x.device)
            if rows:
                pivot = compute.mean(dims, keepdim=True)  # rounded: the deviations from it say by how much
                centred = compute - pivot
                moments = torch.stack([centred.sum(dims), centred.square_().sum(dims)]).to(wide)
                shift = moments[0] / rows
                mine = table[replica.replica_id_in_sync_group]
                mine[0] = rows
                torch.add(pivot.view(channels).to(wide), shift, out=mine[1 : 1 + channels])
                torch.addcmul(moments[1], moments[0], shift, value=-1, out=mine[1 + channels :])
        table = _all_reduce(replica, table)
        with _no_torch_function():
            counts = table[:, :1]
            n = counts.sum()
            if not reading_back_waits(x.device) and n.item() <= 1:  # (on an accelerator the host would wait)
                raise ValueError(
                    f"Expected more than 1 value per channel when training, got {int(n.item())} in the global "
                    f"batch (input size of this replica {list(x.shape)}): a SyncBatchNorm layer normalizes over the "
                    "whole global batch, which needs at least two values per channel."
                )
            # Chan et al.'s merge, in replica order (the same on every replica): no cancellation
            means = table[:, 1 : 1 + channels]
            mean = (counts * means).sum(0) / n
            squares = table[:, 1 + channels :].sum(0) + (counts * (means - mean).square_()).sum(0)
            statistics = torch.stack([mean, squares / n]).to(compute.dtype)  # the mean, the biased variance
            mean, var = statistics[0], statistics[1]
            if running_mean is not None:
                with torch.no_grad():
                    running_mean.lerp_(mean.to(running_mean.dtype), factor)
                    unbiased = squares / (n - 1).clamp(min=1)
                    running_var.lerp_(unbiased.to(running_var.dtype), factor)
            # Parameters in a half type (model.half()) normalize in the statistics' type, as torch's kernels do.
            weight_c = None if weight is None else weight.to(compute.dtype)
            bias_c = None if bias is None else bias.to(compute.dtype)
            out = F.batch_norm(x, mean, var, weight_c, bias_c, False, 0.0, eps)
            invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight_c, mean, invstd, n)
        ctx.replica, ctx.eps = replica, eps
        ctx.dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd, n = ctx.saved_tensors
        channels = x.shape[1]
        _, shape = _channels(x)
        weight_dtype, bias_dtype = ctx.dtypes
        with _no_torch_function():
            if x.numel():
                # (ones without a weight: the kernel's gradient of the weight is sum(dy * xhat) either way)
                ones = torch.ones(channels, dtype=mean.dtype, device=x.device) if weight is None else weight
                _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                    grad, x, ones, None, None, mean, invstd, True, ctx.eps, [False, True, True]
                )
            else:  # (torch's kernel divides by the row count)
                sum_dy_xhat = sum_dy = torch.zeros(channels, dtype=mean.dtype, device=x.device)
        grad_x = None
        if ctx.needs_input_grad[0]:
            with _no_torch_function():
                packed = torch.cat([sum_dy, sum_dy_xhat]).to(n.dtype)
            total = _all_reduce(ctx.replica, packed)
            with _no_torch_function():
                means = (total / n).to(mean.dtype).view(2, channels)  # mean(dy), mean(dy * xhat), global
                scale = invstd if weight is None else invstd * weight
                # dx = weight * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * invstd
                centred = (x - mean.view(shape)).mul_((invstd * means[1]).view(shape))
                grad_x = (grad - means[0].view(shape)).sub_(centred).mul_(scale.view(shape)).to(x.dtype)
        grad_weight = sum_dy_xhat.to(weight_dtype) if weight_dtype is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
