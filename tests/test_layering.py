"""The packages keep their layers and their privacy (``layering.py`` has the rules and the checker).

The first test reads the whole library. The others give the checker lines the library once had (the
ones issue 40 listed, as they stood) and lines of the same kinds, and check that each is caught, so the
first test cannot pass by the checker going blind.
"""

from __future__ import annotations

import pytest
from layering import check

# (package the line lived in, the code, what the violation says)
ONCE_IN_THE_LIBRARY = [
    # the optimizers read the strategies' variables' privates
    ("optimizers", "def f(variable):\n    return local_results(variable)[0]._read().numel()\n", "reads _read"),
    ("optimizers", "def f(container):\n    return container._device_name()\n", "reads _device_name"),
    (
        "optimizers",
        "def f(variables):\n    return getattr(variables[0], '_distribute_strategy', None)\n",
        "getattr() of '_distribute_strategy'",
    ),
    # ... and a class faked a strategies private to pass their check (sharded.py:250)
    ("optimizers", "class ShardedSlot:\n    _distribute_strategy = None\n", "imitates another package's private"),
    # capabilities probed instead of declared
    (
        "optimizers",
        "def f(self, strategy):\n    return getattr(strategy.extended, 'shard_optimizer_states', False) is False\n",
        "probes 'shard_optimizer_states'",
    ),
    ("optimizers", "def f(strategy):\n    return getattr(strategy.extended, 'state_shards', None)\n", "probes"),
    ("trainer", "def f(self):\n    return getattr(self.optimizer, 'use_ema', False)\n", "probes 'use_ema'"),
    # the trainer called the optimizer's private build
    (
        "trainer",
        "def f(self, dm):\n    self.optimizer._build_missing(dm.trainable_variables)\n",
        "reads _build_missing",
    ),
    # DataLoader._iterator peeked from two packages (trainer/inputs.py, data/sharding.py)
    (
        "trainer",
        "def f(loaders):\n    return [getattr(loader, '_iterator', None) is not None for loader in loaders]\n",
        "'_iterator', a private attribute of torch's objects",
    ),
    (
        "data",
        "def f(loader):\n    iterator = getattr(loader, '_iterator', None)\n    iterator._shutdown_workers()\n",
        "'_iterator', a private attribute of torch's objects",
    ),
    # the strategies imported the data layer on use
    (
        "strategies",
        "def f(self, dataset, options):\n"
        "    from replicafit.data import DistributedDataset  # the data layer sits above; imported on use\n"
        "    return DistributedDataset(dataset, self, options)\n",
        "imports replicafit.data",
    ),
    # torch's privates without a reason
    ("optimizers", "import torch\nx = torch._foreach_mul([torch.ones(1)], 2.0)\n", "reads _foreach_mul"),
    ("strategies", "import torch\ndef f():\n    return torch._C._set_grad_enabled(False)\n", "reads _set_grad_enabled"),
]

OTHER_KINDS = [
    ("data", "import replicafit.trainer\n", "imports replicafit.trainer"),
    ("optimizers", "from replicafit import data\n", "imports replicafit.data"),  # siblings: neither on the other
    (
        "strategies",
        "import importlib\nimportlib.import_module('replicafit.optimizers')\n",
        "imports replicafit.optimizers",
    ),
    ("strategies", "import replicafit\nx = replicafit.data\n", "imports replicafit.data"),  # through the root
    ("trainer", "from replicafit.recipes import build\n", "imports replicafit.recipes"),
    ("recipes", "from replicafit.cli import main\n", "imports replicafit.cli"),
    ("trainer", "def f():\n    from .. import recipes\n", "imports replicafit.recipes"),  # lazy and relative
    ("trainer", "from replicafit.optimizers.base import _count_update\n", "imports private names"),
    ("trainer", "import torch\nx = torch.nn.modules.loss._Loss  # why\n", "reads _Loss"),  # a comment, no reason
    ("trainer", "import torch\nx = torch.nn.modules.loss._Loss  # private: says\n", "reads _Loss"),  # too short
]

ALLOWED = [
    ("trainer", "from replicafit.optimizers import SGD\nfrom replicafit.strategies import nest\n"),
    ("strategies", "import replicafit\nrole = replicafit.layer_provider('input layer')\n"),  # the root itself
    ("trainer", "import torch\nx = torch.nn.modules.loss._Loss  # private: torch's one base of its losses\n"),
    ("trainer", "def f(model):\n    return getattr(model, 'config', None)\n"),  # duck typing on a user's model
    ("optimizers", "class Mine:\n    def f(self):\n        return self._anything\n"),
]


def _found(package: str, code: str) -> list:
    module = f"replicafit.{package}.example"
    return [v for v in check([package], {(package, module): code}) if v.path == f"<{module}>"]


def test_the_packages_keep_their_layers_and_their_privacy():
    violations = check()
    assert not violations, "\n" + "\n".join(map(str, violations))


@pytest.mark.parametrize(
    "package,code,expected",
    ONCE_IN_THE_LIBRARY + OTHER_KINDS,
    ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(ONCE_IN_THE_LIBRARY + OTHER_KINDS)],
)
def test_the_checker_catches(package, code, expected):
    found = _found(package, code)
    assert any(expected in v.rule for v in found), found


@pytest.mark.parametrize("package,code", ALLOWED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(ALLOWED)])
def test_the_checker_lets_through(package, code):
    assert _found(package, code) == []
