"""The Python operators of tensors, in one table: what variables forward to their value and what distributed
containers refuse with a helpful error.

A variable stands for its local value, so ``v * 2``, ``v < w``, ``-v`` and ``v == w`` are the tensor
operations on it (``variables.py``). A ``PerReplica`` or ``Mirrored`` holds one value per replica and is not a
tensor: every operator below raises a ``TypeError`` that says what to do instead (``values.py``). Both read
this table, so an operator added here is forwarded by the one and refused by the other.

Example::

    >>> from replicafit.strategies.operators import BINARY, UNARY
    >>> "__floordiv__" in BINARY and "__rfloordiv__" in BINARY and "__neg__" in UNARY
    True
"""

from __future__ import annotations

__all__ = ["BINARY", "CONVERSIONS", "EQUALITY", "UNARY"]

_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")

#: Binary operators, each with its reflected form (``__radd__`` for ``2 + v``), and the orderings.
BINARY = (
    *(f"__{name}__" for name in _ARITHMETIC),
    *(f"__r{name}__" for name in _ARITHMETIC),
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
)

#: ``==`` and ``!=``: element-wise for a variable (as for a tensor); a container keeps Python's identity, so it
#: can be found in a list or a dict.
EQUALITY = ("__eq__", "__ne__")

#: Unary operators.
UNARY = ("__neg__", "__pos__", "__abs__", "__invert__")

#: What makes a single value of a tensor (a number, a truth value, an element): refused by containers, whose
#: replicas each hold their own. A variable reads its value for these (``float(v)``, ``v[0]``).
CONVERSIONS = ("__float__", "__int__", "__bool__", "__getitem__")
