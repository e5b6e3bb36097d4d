"""Nested structures: tuples, lists, dicts and namedtuples of leaves.

The one nest walker of the project. A *structure* is a ``tuple``, ``list``,
``namedtuple`` or ``Mapping`` (dict subclasses keep their type); everything else,
including tensors and distributed values, is a leaf. Dict entries are visited in
the first structure's key order.

Example::

    >>> map_structure(lambda a, b: a + b, {"x": (1, 2)}, {"x": (10, 20)})
    {'x': (11, 22)}
    >>> flatten([1, {"a": 2, "b": (3,)}])
    [1, 2, 3]
"""

from __future__ import annotations

from collections.abc import Mapping

from .describe import describe_structure

__all__ = ["is_nested", "flatten", "map_structure", "pack_sequence_as"]


class StructureMismatchError(ValueError, AssertionError):
    """Two nests that had to have the same shape do not.

    Also an ``AssertionError``, which is what TensorFlow raises in the same places.
    """


_nested_types: dict = {}  # type -> whether it is a structure (isinstance on an ABC is slow)


_leaf_types: set = set()  # the types is_nested found leaves: a whole sequence checked at C speed (_all_leaves)


def is_nested(value) -> bool:
    """Whether ``value`` is a structure (tuple, list, namedtuple, mapping), not a leaf."""
    kind = type(value)
    nested = _nested_types.get(kind)
    if nested is None:
        nested = _nested_types[kind] = isinstance(value, (tuple, list, Mapping))
        if not nested:
            _leaf_types.add(kind)
    return nested


def _all_leaves(sequence) -> bool:
    """Whether no item of ``sequence`` is a structure (the types seen before: one set check, no call per item)."""
    return _leaf_types.issuperset(map(type, sequence)) or not any(map(is_nested, sequence))


_FAST = True  # the fast paths for plain tuples and lists (tests compare them with the general walk)


def _flat_sequence(value) -> bool:
    """A tuple or list (not a namedtuple) whose items are all leaves: the common case, walked at once."""
    kind = type(value)
    return _FAST and (kind is tuple or kind is list) and _all_leaves(value)


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _children(value):
    if isinstance(value, Mapping):
        return list(value.values())
    return list(value)


def _rebuild(template, children):
    if isinstance(template, Mapping):
        items = zip(template.keys(), children)
        return dict(items) if type(template) is dict else type(template)(items)
    if _is_namedtuple(template):
        return type(template)(*children)
    return type(template)(children)


def flatten(structure) -> list:
    """The leaves of ``structure`` in order (a leaf gives ``[leaf]``)."""
    if not is_nested(structure):
        return [structure]
    if _flat_sequence(structure):
        return list(structure)
    out: list = []
    stack = [structure]
    # Iterative depth-first walk keeps deep nests off the recursion limit.
    while stack:
        item = stack.pop()
        if is_nested(item):
            stack.extend(reversed(_children(item)))
        else:
            out.append(item)
    return out


def _check_same(structures, names=None) -> None:
    first = structures[0]
    for index, other in enumerate(structures[1:], start=1):
        same = False
        if not is_nested(first):
            same = not is_nested(other)
        elif type(first) is type(other) or (isinstance(first, Mapping) and isinstance(other, Mapping)):
            if isinstance(first, Mapping):
                same = set(first.keys()) == set(other.keys())
            else:
                same = len(first) == len(other)
        if not same:
            label = names(index) if names else f"structure {index}"
            label0 = names(0) if names else "structure 0"
            raise StructureMismatchError(
                f"The nested structures do not match: {label0} is {describe_structure(first)} but "
                f"{label} is {describe_structure(other)}; they must have the same nesting."
            )


def map_structure(fn, *structures, names=None):
    """Applies ``fn`` to the corresponding leaves of ``structures``; keeps the shape.

    ``names(i)`` may describe structure ``i`` in the error raised when shapes differ.
    """
    first = structures[0]
    kind = type(first)
    if _FAST and (kind is tuple or kind is list):
        if len(structures) == 1:
            if _all_leaves(first):
                return kind([fn(leaf) for leaf in first])
            return kind([map_structure(fn, child, names=names) for child in first])
        length = len(first)
        others = structures[1:]
        if all(type(other) is kind and len(other) == length for other in others):
            if _all_leaves(first) and all(map(_all_leaves, others)):
                return kind([fn(*parts) for parts in zip(*structures)])
            return kind([map_structure(fn, *parts, names=names) for parts in zip(*structures)])
    elif _FAST and not is_nested(first) and _all_leaves(structures[1:]):
        return fn(*structures)  # leaves only
    if len(structures) > 1:
        _check_same(structures, names)
    if not is_nested(first):
        return fn(*structures)
    if isinstance(first, Mapping):
        keys = list(first.keys())
        children = [map_structure(fn, *(s[k] for s in structures), names=names) for k in keys]
    else:
        children = [map_structure(fn, *parts, names=names) for parts in zip(*structures)]
    return _rebuild(first, children)


def pack_sequence_as(structure, flat_sequence):
    """Rebuilds ``structure`` with its leaves taken in order from ``flat_sequence``."""
    flat = list(flat_sequence)
    if _flat_sequence(structure):
        if len(structure) != len(flat):
            raise StructureMismatchError(
                f"pack_sequence_as() needs {len(structure)} leaves for the structure, got {len(flat)}."
            )
        return type(structure)(flat)
    position = 0

    def take(_):
        nonlocal position
        position += 1
        return flat[position - 1]

    expected = len(flatten(structure))
    if expected != len(flat):
        raise StructureMismatchError(f"pack_sequence_as() needs {expected} leaves for the structure, got {len(flat)}.")
    return map_structure(take, structure)
