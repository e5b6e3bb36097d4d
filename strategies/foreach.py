"""torch's multi-tensor kernels (``torch._foreach_*``), under names of our own: every one the library runs.

Why torch's private functions: torch has no public multi-tensor operations, and these are the kernels that
``torch.optim``'s own ``foreach`` implementations run: one kernel per list of tensors instead of one per
tensor, which is what makes an update over hundreds of parameters cost a handful of launches (the reductions'
packing, the optimizers' fast path, the moving averages, the accumulation windows). Naming them here, once,
keeps every other module on public names; a torch release that renames one breaks this file alone.

Each function takes lists of tensors of one device and dtype, as torch's do: ``add_(xs, ys, alpha=a)`` is
``x.add_(y, alpha=a)`` for every pair, with the same bits.

Example::

    >>> import torch
    >>> from replicafit.strategies import foreach
    >>> xs = [torch.ones(2), torch.zeros(3)]
    >>> _ = foreach.mul_(xs, 2.0)   # in place (it returns the list too)
    >>> [x.tolist() for x in xs]
    [[2.0, 2.0], [0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import torch

__all__ = [
    "add",
    "add_",
    "addcdiv_",
    "copy_",
    "div",
    "div_",
    "lerp_",
    "maximum_",
    "mul",
    "mul_",
    "norm",
    "sqrt",
    "sub",
    "sub_",
]

add = torch._foreach_add  # private: torch's multi-tensor kernel (no public one; the docstring says why)
add_ = torch._foreach_add_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
addcdiv_ = torch._foreach_addcdiv_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
copy_ = torch._foreach_copy_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
div = torch._foreach_div  # private: torch's multi-tensor kernel (no public one; the docstring says why)
div_ = torch._foreach_div_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
lerp_ = torch._foreach_lerp_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
maximum_ = torch._foreach_maximum_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
mul = torch._foreach_mul  # private: torch's multi-tensor kernel (no public one; the docstring says why)
mul_ = torch._foreach_mul_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
norm = torch._foreach_norm  # private: torch's multi-tensor kernel (no public one; the docstring says why)
sqrt = torch._foreach_sqrt  # private: torch's multi-tensor kernel (no public one; the docstring says why)
sub = torch._foreach_sub  # private: torch's multi-tensor kernel (no public one; the docstring says why)
sub_ = torch._foreach_sub_  # private: torch's multi-tensor kernel (no public one; the docstring says why)
