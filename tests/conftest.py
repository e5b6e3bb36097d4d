"""Shared fixtures: one fixture parameterises over the four in-process strategies
(default, OneDevice, Mirrored, CentralStorage)."""

from __future__ import annotations

import signal

import pytest
import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Callback

STRATEGY_IDS = ["default", "one_device", "mirrored2", "central_storage2", "multi_worker1x2"]


def make_strategy(name: str):
    """A fresh strategy by id: default, one_device, mirrored<N>, central_storage<N>."""
    if name == "default":
        return ds.get_strategy()
    if name == "one_device":
        return ds.OneDeviceStrategy("cpu")
    if name.startswith("mirrored"):
        count = int(name[len("mirrored") :])
        return ds.MirroredStrategy([f"cpu:{i}" for i in range(count)])
    if name.startswith("central_storage"):
        count = int(name[len("central_storage") :])
        return ds.CentralStorageStrategy([f"cpu:{i}" for i in range(count)], parameter_device="cpu:0")
    if name == "multi_worker1x2":  # one worker (no process group) with two logical CPUs
        resolver = ds.SimpleClusterResolver(1, 0, devices=["cpu:0", "cpu:1"])
        return ds.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    raise ValueError(name)


class Lion(optimizers.Optimizer):
    """A user's optimizer (Chen et al. 2023) written as the base class's docstring shows: only
    ``__init__``, ``build`` and ``update_step`` (correct under every strategy without seeing one)."""

    def __init__(self, learning_rate=1e-4, beta_1=0.9, beta_2=0.99, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.beta_1, self.beta_2 = beta_1, beta_2

    def build(self, variables):
        super().build(variables)
        for v in variables:
            self.add_variable_from_reference(v, "momentum")

    def update_step(self, gradient, variable, learning_rate):
        m = self.get_slot(variable, "momentum")
        update = torch.sign(m * self.beta_1 + gradient * (1 - self.beta_1))
        variable.assign_sub(learning_rate * update)
        m.assign(m * self.beta_2 + gradient * (1 - self.beta_2))


class InterruptAt(Callback):
    """Raises ``KeyboardInterrupt`` at the beginning of global step ``step`` (0-based), as Ctrl-C
    would: ``step`` steps are done (for resume tests)."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.step:
            raise KeyboardInterrupt(f"interrupted at global step {self.step}")
        self.seen += 1


@pytest.fixture(params=STRATEGY_IDS)
def strategy(request):
    """default / OneDevice("cpu") / Mirrored(["cpu:0","cpu:1"]) / CentralStorage(["cpu:0","cpu:1"])."""
    return make_strategy(request.param)


@pytest.fixture(params=["mirrored2", "central_storage2"])
def multi_strategy(request):
    """The two-replica strategies."""
    return make_strategy(request.param)


@pytest.fixture(autouse=True)
def _clean_context():
    """Every test starts and ends in the default context with torch's default modes."""
    from replicafit.strategies import context

    assert context.stack_depth() == 0
    yield
    depth = context.stack_depth()
    ds.experimental_set_strategy(None) if depth else None
    assert context.stack_depth() == 0, "a test left a strategy scope entered"
    assert torch.is_grad_enabled()


@pytest.fixture(autouse=True)
def _signal_handlers():
    """The process's handlers of the signals a fit or the CLI may take over (``replicafit fit`` run in-process
    ignores them once its run is over) are put back after each test: an ignored SIGTERM would be inherited
    by every process a later test starts."""
    names = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
    saved = {getattr(signal, n): signal.getsignal(getattr(signal, n)) for n in names if hasattr(signal, n)}
    yield
    for signum, handler in saved.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture
def replica_threads():
    """Every replica on a thread of its own for the test (replicas that share a device take turns on
    one thread by default): for tests of the threaded runner and of code that needs concurrency."""
    previous = ds.get_replica_execution()
    ds.set_replica_execution("threads")
    yield
    ds.set_replica_execution(previous)


gpu = pytest.mark.gpu


def requires_gpus(count: int):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"needs {count} CUDA GPU(s), this machine has {have}")
