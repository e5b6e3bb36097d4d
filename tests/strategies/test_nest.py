"""The nest walker: its fast path for flat tuples and lists equals the general walk."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from replicafit.strategies import nest

Point = collections.namedtuple("Point", "x y")


def structures():
    t = torch.ones(2)
    return [
        (1, 2, 3),
        [t, t * 2, "s"],
        (),
        [],
        (1, (2, 3)),
        [1, {"a": 2, "b": [3, 4]}],
        Point(1, 2),
        (Point(1, (2,)), [None]),
        {"x": (1, 2), "y": 3},
        5,
        None,
    ]


@pytest.fixture
def slow(monkeypatch):
    monkeypatch.setattr(nest, "_FAST", False)


def _walk_all():
    out = []
    for s in structures():
        flat = nest.flatten(s)
        mapped = nest.map_structure(lambda v: ("leaf", v) if not isinstance(v, torch.Tensor) else v + 1, s)
        packed = nest.pack_sequence_as(s, list(range(len(flat)))) if nest.is_nested(s) else None
        out.append((flat, mapped, packed, type(mapped), type(packed)))
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_the_fast_path_equals_the_general_walk(monkeypatch):
    fast = _walk_all()
    monkeypatch.setattr(nest, "_FAST", False)
    general = _walk_all()
    assert len(fast) == len(general)
    for f, g in zip(fast, general):
        assert _same(f, g), (f, g)


def test_pack_sequence_as_checks_the_count_on_both_paths(slow):
    with pytest.raises(nest.StructureMismatchError, match="needs 3 leaves"):
        nest.pack_sequence_as((1, 2, 3), [1, 2])


def test_pack_sequence_as_checks_the_count_on_the_fast_path():
    with pytest.raises(nest.StructureMismatchError, match="needs 3 leaves"):
        nest.pack_sequence_as((1, 2, 3), [1, 2])
    with pytest.raises(nest.StructureMismatchError, match="needs 2 leaves"):
        nest.pack_sequence_as([1, 2], [1, 2, 3])


def test_random_nests_agree():
    rng = random.Random(0)

    def make(depth):
        kind = rng.choice(["leaf", "tuple", "list", "dict", "point"] if depth < 3 else ["leaf"])
        if kind == "leaf":
            return rng.randint(0, 9)
        if kind == "dict":
            return {f"k{i}": make(depth + 1) for i in range(rng.randint(0, 3))}
        if kind == "point":
            return Point(make(depth + 1), make(depth + 1))
        items = [make(depth + 1) for _ in range(rng.randint(0, 4))]
        return tuple(items) if kind == "tuple" else items

    samples = [make(0) for _ in range(200)]
    fast = [(nest.flatten(s), nest.map_structure(lambda v: v * 2, s)) for s in samples]
    pairs = list(zip(samples, samples[1:] + samples[:1]))

    def combined(a, b):
        try:
            return nest.map_structure(lambda u, v: (u, v), a, b, names=lambda i: f"value {i}")
        except nest.StructureMismatchError as error:
            return ("mismatch", str(error))

    fast += [combined(a, b) for a, b in pairs] + [combined(s, s) for s in samples]
    original = nest._FAST
    try:
        nest._FAST = False
        general = [(nest.flatten(s), nest.map_structure(lambda v: v * 2, s)) for s in samples]
        general += [combined(a, b) for a, b in pairs] + [combined(s, s) for s in samples]
    finally:
        nest._FAST = original
    assert len(fast) == len(general)
    assert all(_same(f, g) for f, g in zip(fast, general))
