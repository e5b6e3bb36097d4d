"""The ``>>>`` examples in the docstrings of the modules below run and print what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "replicafit.strategies",
    "replicafit.strategies.cluster",
    "replicafit.strategies.step_values",
    "replicafit.strategies.describe",
    "replicafit.strategies.module",
    "replicafit.strategies.sync_batchnorm",
    "replicafit.strategies.slurm",
    "replicafit.data.sources",
    "replicafit.trainer.arguments",
    "replicafit.trainer.model_io",
    "replicafit.trainer.losses",
    "replicafit.trainer.metrics",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=False)
    assert tried > 0, f"{name} has no >>> examples"
    assert failures == 0, f"{failures} of {tried} examples in {name} failed (run: python -m doctest -v)"
