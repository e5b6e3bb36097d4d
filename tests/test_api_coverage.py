"""The site's check that every public name has an API reference entry (``docs/_ext/api_coverage.py``)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

import api_coverage  # noqa: E402


class _Domain:
    def __init__(self, objects):
        self.objects = objects


class _Env:
    def __init__(self, names):
        self._domain = _Domain(dict.fromkeys(names))

    def get_domain(self, name):
        assert name == "py"
        return self._domain


def everything_documented() -> set[str]:
    """What the reference documents when it is complete: every public name of the packages (the root's
    re-exports are documented there, not again) and its class's own members."""
    import inspect

    names = set()
    every = api_coverage.public_names()
    public = {id(value) for value in every.values()}
    for name, value in every.items():
        if name.count(".") == 1 and not inspect.ismodule(value):
            continue  # rf.Trainer is replicafit.trainer.Trainer
        names.add(name)
        if inspect.isclass(value) and value.__module__.startswith("replicafit."):
            names.update(f"{name}.{member}" for member in api_coverage.members_to_document(value, public))
    return names


def missing(monkeypatch, documented) -> list[str]:
    warned = []
    monkeypatch.setattr(api_coverage.logger, "warning", lambda message, *args, **kwargs: warned.append(message % args))
    monkeypatch.setattr(api_coverage.logger, "info", lambda *args, **kwargs: None)
    api_coverage.check(None, _Env(documented))
    return warned


def test_the_public_names_are_those_of_every_packages_all():
    names = api_coverage.public_names()
    for name in (
        "replicafit.Trainer",
        "replicafit.strategies.MirroredStrategy",
        "replicafit.strategies.resolve_cluster",
        "replicafit.data.AutoShardPolicy",
        "replicafit.optimizers.from_torch",
        "replicafit.optimizers.schedules.CosineDecay",
        "replicafit.trainer.losses.SparseCategoricalCrossentropy",
        "replicafit.trainer.BackupAndRestore",
    ):
        assert name in names
    assert "replicafit.__version__" not in names


def test_a_complete_reference_passes_and_each_gap_is_one_warning(monkeypatch):
    complete = everything_documented()
    assert missing(monkeypatch, complete) == []

    gaps = missing(monkeypatch, complete - {"replicafit.strategies.MirroredStrategy", "replicafit.trainer.Trainer.fit"})
    assert gaps == [
        "API reference: replicafit.MirroredStrategy (no reference entry)",  # rf.MirroredStrategy is that object
        "API reference: replicafit.strategies.MirroredStrategy (no reference entry)",
        "API reference: replicafit.trainer.Trainer.fit (a public member without a docstring, or not documented)",
    ]


def test_members_inherited_from_internal_classes_are_documented_under_the_public_class():
    import replicafit.optimizers as optimizers
    import replicafit.trainer as trainer

    every = api_coverage.public_names()
    public = {id(value) for value in every.values()}
    assert "fit" in api_coverage.members_to_document(trainer.Trainer, public)  # Trainer's own
    assert "averaged_weights" in api_coverage.members_to_document(optimizers.Optimizer, public)
    # a public base documents its own: SGD does not repeat Optimizer's (or its internal bases')
    assert "averaged_weights" not in api_coverage.members_to_document(optimizers.SGD, public)


def test_a_re_export_counts_where_its_object_is_documented(monkeypatch):
    # the root's rf.Trainer is replicafit.trainer.Trainer: documented once, under the package
    complete = everything_documented()
    assert "replicafit.Trainer" not in complete and missing(monkeypatch, complete) == []
    gaps = missing(monkeypatch, complete - {"replicafit.trainer.Trainer"})
    assert "API reference: replicafit.Trainer (no reference entry)" in gaps
    assert "API reference: replicafit.trainer.Trainer (no reference entry)" in gaps


def test_members_of_an_internal_base_are_documented_under_its_public_subclass():
    """The library's public classes no longer have internal bases (the optimizer's and the trainer's mixins
    became objects of their own); the rule still holds for one that would."""

    class _Internal:
        __module__ = "replicafit.example"  # (the rule is about replicafit's own classes)

        def shared(self):
            """Documented under the public class."""

    class Public(_Internal):
        __module__ = "replicafit.example"

        def own(self):
            """Its own."""

    members = api_coverage.members_to_document(Public, {id(Public)})
    assert "own" in members and "shared" in members
    assert "shared" not in api_coverage.members_to_document(Public, {id(Public), id(_Internal)})
