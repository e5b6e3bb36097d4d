"""Optimizers under distribution strategies: the same training on every strategy.

Reference: the pipeline in optimizers/base.py's docstring and TensorFlow 2.21's observed
behaviour of apply_gradients under a strategy. The pipeline under test: in a replica
context ``apply_gradients`` merges, SUMs the replicas' gradients once, clips the
aggregate, and updates every copy of every variable (slots colocated), so that a
training loop whose loss is "per-example sum / global batch size" takes the same steps
under every strategy as on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from conftest import Lion, make_strategy
from torch import nn

import replicafit.strategies as ds
from replicafit import optimizers

pytestmark = pytest.mark.timeout(60)

STRATEGY_NAMES = ["default", "one_device", "mirrored2", "mirrored4", "central_storage2"]
BATCH_SIZES = (6, 6, 5, 1)  # a partial batch of 5 and a batch of 1: empty replicas under Mirrored(2)/(4)
ATOL = 1e-5
CLIP = 1.0  # the global gradient norm of every step below is between 2 and 7, so this clips


OPTIMIZERS = {
    "sgd": lambda **kw: optimizers.SGD(0.1, **kw),
    "sgd_momentum": lambda **kw: optimizers.SGD(0.1, momentum=0.9, **kw),
    "sgd_nesterov": lambda **kw: optimizers.SGD(0.1, momentum=0.9, nesterov=True, **kw),
    "adam": lambda **kw: optimizers.Adam(0.01, **kw),
    "adam_amsgrad": lambda **kw: optimizers.Adam(0.01, amsgrad=True, **kw),
    "adamw": lambda **kw: optimizers.AdamW(0.01, weight_decay=0.1, **kw),
    "rmsprop_centered_momentum": lambda **kw: optimizers.RMSprop(0.01, momentum=0.5, centered=True, **kw),
    "adagrad": lambda **kw: optimizers.Adagrad(0.1, **kw),
    "torch_sgd": lambda **kw: optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, **kw),
    "torch_adam": lambda **kw: optimizers.from_torch(torch.optim.Adam, lr=0.01, **kw),
    "torch_adamw": lambda **kw: optimizers.from_torch(torch.optim.AdamW, lr=0.01, weight_decay=0.1, **kw),
    "lion_user_subclass": lambda **kw: Lion(0.01, **kw),
}
BUILTINS = [
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
    "adam",
    "adam_amsgrad",
    "adamw",
    "rmsprop_centered_momentum",
    "adagrad",
]
CONFIGS = [(name, clip) for name in OPTIMIZERS for clip in (False, True)]
CONFIG_IDS = [f"{name}-{'global_clipnorm' if clip else 'noclip'}" for name, clip in CONFIGS]


def make_optimizer(name: str, clip: bool):
    return OPTIMIZERS[name](**({"global_clipnorm": CLIP} if clip else {}))


# --- the training helper ---------------------------------------------------------------------
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def make_batches(sizes=BATCH_SIZES, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator)) for n in sizes]


def expected_empty_replica_steps(sizes, replicas: int) -> int:
    """Replica batches that are empty under the split rule (data/input_lib.py)."""
    count = 0
    for size in sizes:
        k = math.ceil(size / replicas)
        count += sum(1 for i in range(replicas) if i * k >= size)
    return count


@dataclass
class Run:
    strategy: object
    dm: object
    optimizer: object
    empty_replica_steps: int = 0
    replica_rows: list = field(default_factory=list)


def train(
    strategy,
    make_opt,
    batches,
    *,
    model_state=None,
    optimizer_state=None,
    model_seed: int = 0,
    use_minimize: bool = False,
    after_step=None,
) -> Run:
    """Trains a fresh model on ``batches`` (global batches) under ``strategy``."""
    if isinstance(strategy, str):
        strategy = make_strategy(strategy)
    dm = strategy.distribute_module(make_model(model_seed))
    if model_state is not None:
        dm.load_state_dict(model_state)
    with strategy.scope():
        optimizer = make_opt()
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    run = Run(strategy, dm, optimizer)
    variables = dm.trainable_variables
    empties = []

    for (x, y), (global_x, _) in zip(strategy.experimental_distribute_dataset(batches), batches):
        global_batch_size = global_x.shape[0]

        def step(x, y, global_batch_size):
            def loss_fn():
                return ((dm(x) - y) ** 2).sum(dim=1).sum() / global_batch_size

            run.replica_rows.append(x.shape[0])
            if use_minimize:
                optimizer.minimize(loss_fn, variables)
                return
            grads = torch.autograd.grad(loss_fn(), [v.value() for v in variables])
            if x.shape[0] == 0:
                empties.append(all(g.shape == v.shape and not g.any() for g, v in zip(grads, variables)))
            optimizer.apply_gradients(zip(grads, variables))

        strategy.run(step, args=(x, y, global_batch_size))
        if after_step is not None:
            after_step(run)
    assert all(empties), "an empty replica's gradients must be zeros of the variables' shapes"
    run.empty_replica_steps = len(empties)
    return run


_REFERENCE_CACHE: dict = {}


def reference(name: str, clip: bool):
    """(model state, optimizer state) of the default-strategy run, computed once per config."""
    key = (name, clip)
    if key not in _REFERENCE_CACHE:
        run = train("default", lambda: make_optimizer(name, clip), make_batches())
        _REFERENCE_CACHE[key] = (clone_state(run.dm.state_dict()), run.optimizer.state_dict())
    return _REFERENCE_CACHE[key]


def clone_state(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def assert_state_close(actual, expected, atol=ATOL, path="state"):
    """Recursively compares nests of dicts/lists/tensors/scalars."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        assert sorted(map(str, actual)) == sorted(map(str, expected)), path
        for key in expected:
            assert_state_close(actual[key], expected[key], atol, f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_close(a, e, atol, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        actual = torch.as_tensor(actual)
        assert actual.shape == expected.shape, path
        torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=0, msg=path)
    else:
        assert actual == expected, path


def assert_replicas_identical(run: Run) -> None:
    """Every replica module equals replica 0 exactly; every optimizer variable's copies are equal."""
    first = dict(run.dm.replicas[0].named_parameters())
    for index, replica in enumerate(run.dm.replicas[1:], start=1):
        for name, param in replica.named_parameters():
            assert torch.equal(param, first[name]), f"replica {index} {name} differs from replica 0"
    for variable in run.optimizer.variables:
        copies = [c.numpy() for c in run.strategy.experimental_local_results(variable)]
        for index, copy in enumerate(copies[1:], start=1):
            assert (copy == copies[0]).all(), f"copy {index} of {variable.name} differs from copy 0"


def set_per_variable_path(optimizer) -> None:
    optimizer._multi_tensor = (
        False  # private switch: the fast path is chosen automatically, never through a public flag
    )


# --- same weights under every strategy --------------------------------------------------------
@pytest.mark.parametrize("strategy_name", STRATEGY_NAMES)
@pytest.mark.parametrize(("name", "clip"), CONFIGS, ids=CONFIG_IDS)
def test_training_matches_the_default_strategy(name, clip, strategy_name):
    expected_model, expected_optimizer = reference(name, clip)
    run = train(strategy_name, lambda: make_optimizer(name, clip), make_batches())

    assert_state_close(run.dm.state_dict(), expected_model, path="model")
    assert_state_close(run.optimizer.state_dict(), expected_optimizer, path="optimizer")
    assert_replicas_identical(run)
    assert int(run.optimizer.iterations) == len(BATCH_SIZES)
    replicas = run.strategy.num_replicas_in_sync
    assert run.empty_replica_steps == expected_empty_replica_steps(BATCH_SIZES, replicas)
    assert sum(run.replica_rows) == sum(BATCH_SIZES)


def test_the_matrix_has_teeth():
    """The matrix above compares different things: clipping binds, training moves the weights."""
    initial = clone_state(make_model().state_dict())
    plain, _ = reference("sgd", False)
    clipped, _ = reference("sgd", True)
    for key in initial:
        assert not torch.allclose(plain[key], initial[key], atol=1e-3), key
        assert not torch.allclose(plain[key], clipped[key], atol=1e-3), key
    assert expected_empty_replica_steps(BATCH_SIZES, 4) == 6
    assert expected_empty_replica_steps(BATCH_SIZES, 2) == 1


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "global_clipnorm"])
@pytest.mark.parametrize("name", ["torch_sgd", "torch_adam", "torch_adamw", "sgd_momentum", "lion_user_subclass"])
def test_default_strategy_run_matches_a_plain_torch_loop(name, clip):
    """The reference of the matrix is itself right: a plain single-device torch loop."""
    model = make_model()
    params = list(model.parameters())
    lion_momentum = [torch.zeros_like(p) for p in params]
    torch_class, kwargs = {
        "torch_sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "torch_adam": (torch.optim.Adam, {"lr": 0.01}),
        "torch_adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),  # Keras' momentum form is the same rule
        "lion_user_subclass": (None, {}),
    }[name]
    torch_optimizer = torch_class(params, **kwargs) if torch_class else None
    for x, y in make_batches():
        loss = ((model(x) - y) ** 2).sum(dim=1).sum() / x.shape[0]
        grads = torch.autograd.grad(loss, params)
        if clip:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            grads = [g * (CLIP / max(norm.item(), CLIP)) for g in grads]
        with torch.no_grad():
            if torch_optimizer is not None:
                for p, g in zip(params, grads):
                    p.grad = g
                torch_optimizer.step()
            else:
                for p, g, m in zip(params, grads, lion_momentum):
                    p.sub_(0.01 * torch.sign(m * 0.9 + g * 0.1))
                    m.mul_(0.99).add_(g * 0.01)
    expected_model, _ = reference(name, clip)
    assert_state_close(expected_model, model.state_dict(), path="model")


# --- the seed's pattern: the SUM of the replicas' gradients, clipped after summing -------------
@pytest.mark.parametrize("per_variable", [False, True], ids=["multi_tensor", "per_variable"])
@pytest.mark.parametrize(
    ("clip", "expected"),
    [
        ({}, [-3.0, -6.0]),
        ({"clipnorm": 1.0}, [-1 / math.sqrt(5), -2 / math.sqrt(5)]),
        ({"global_clipnorm": 1.0}, [-1 / math.sqrt(5), -2 / math.sqrt(5)]),
    ],
    ids=["sum", "clipnorm", "global_clipnorm"],
)
@pytest.mark.parametrize("strategy_name", ["mirrored2", "central_storage2"])
def test_seed_pattern_sum_then_clip(strategy_name, clip, expected, per_variable):
    """reference 7.1: local grads [1,2] and [2,4], SGD lr=1 -> [-3,-6]; Keras 3 clips before
    summing ([-0.894, -1.789]); we clip the sum ([-0.447, -0.894]), as docs/porting/tensorflow.md says."""
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(learning_rate=1.0, **clip)
    if per_variable:
        set_per_variable_path(optimizer)

    def step():
        replica = ds.get_replica_context().replica_id_in_sync_group
        gradient = torch.tensor([1.0, 2.0]) * (replica + 1)
        optimizer.apply_gradients([(gradient, variable)])

    strategy.run(step)
    expected = torch.tensor(expected)
    for copy in strategy.experimental_local_results(variable):
        torch.testing.assert_close(torch.as_tensor(copy.numpy()), expected, atol=1e-6, rtol=0)
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("strategy_name", ["mirrored2", "central_storage2"])
def test_seed_pattern_for_the_user_subclass_and_from_torch(strategy_name):
    """The same SUM reaches an update_step written by a user and torch's own step()."""
    strategy = make_strategy(strategy_name)

    class PlainSGD(optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_sub(gradient * learning_rate)

    with strategy.scope():
        variables = [ds.Variable(torch.zeros(2)), ds.Variable(torch.zeros(2))]
        opts = [PlainSGD(learning_rate=1.0), optimizers.from_torch(torch.optim.SGD, lr=1.0)]

    def step():
        replica = ds.get_replica_context().replica_id_in_sync_group
        gradient = torch.tensor([1.0, 2.0]) * (replica + 1)
        for optimizer, variable in zip(opts, variables):
            optimizer.apply_gradients([(gradient, variable)])

    strategy.run(step)
    for variable in variables:
        for copy in strategy.experimental_local_results(variable):
            assert copy.numpy().tolist() == [-3.0, -6.0]


# --- slots ------------------------------------------------------------------------------------
def built_optimizer(strategy, make_opt):
    dm = strategy.distribute_module(make_model())
    with strategy.scope():
        optimizer = make_opt()
    variables = dm.trainable_variables

    def step(x):
        loss = dm(x).sum()
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        optimizer.apply_gradients(zip(grads, variables))

    strategy.run(step, args=(strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(1, 4)),))
    return dm, optimizer


SLOT_OPTIMIZERS = {
    "sgd_momentum": (lambda: optimizers.SGD(0.1, momentum=0.9), ["momentum"]),
    "adam_amsgrad": (lambda: optimizers.Adam(amsgrad=True), ["momentum", "velocity", "velocity_hat"]),
    "rmsprop": (lambda: optimizers.RMSprop(momentum=0.5, centered=True), ["velocity", "momentum", "average_gradient"]),
    "adagrad": (lambda: optimizers.Adagrad(), ["accumulator"]),
    "lion_user_subclass": (lambda: Lion(0.01), ["momentum"]),
}


@pytest.mark.parametrize("opt_name", list(SLOT_OPTIMIZERS))
@pytest.mark.parametrize("strategy_name", STRATEGY_NAMES)
def test_slot_variables_live_where_their_variable_lives(strategy_name, opt_name):
    strategy = make_strategy(strategy_name)
    make_opt, slot_names = SLOT_OPTIMIZERS[opt_name]
    dm, optimizer = built_optimizer(strategy, make_opt)
    slots = []
    for variable in dm.trainable_variables:
        for slot_name in slot_names:
            slot = optimizer.get_slot(variable, slot_name)
            slots.append(slot)
            assert slot.shape == variable.shape
            assert slot.trainable is False
            if strategy_name.startswith("mirrored"):
                assert isinstance(slot, ds.MirroredVariable)
                assert [c.device for c in slot.values] == list(strategy.extended.worker_devices)
                assert [c.device for c in slot.values] == [c.device for c in variable.values]
            elif strategy_name.startswith("central_storage"):
                assert isinstance(slot, ds.CentralStorageVariable)
                assert [c.device for c in slot.values] == list(strategy.extended.parameter_devices)
                assert len(strategy.experimental_local_results(slot)) == 1
            else:
                assert type(slot) is ds.LocalVariable
                assert slot.device == variable.device
            assert strategy.extended.variable_created_in_scope(slot)
    assert len({id(s) for s in slots}) == len(slots)
    for slot in slots:
        assert any(slot is v for v in optimizer.variables)


def test_central_storage_slots_follow_a_non_default_parameter_device():
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu:1")
    dm, optimizer = built_optimizer(strategy, lambda: optimizers.Adam())
    for variable in dm.trainable_variables:
        assert [c.device for c in variable.values] == ["cpu:1"]
        for slot_name in ("momentum", "velocity"):
            slot = optimizer.get_slot(variable, slot_name)
            assert isinstance(slot, ds.CentralStorageVariable)
            assert [c.device for c in slot.values] == ["cpu:1"]


class RecordingOptimizer(optimizers.Optimizer):
    """Heavy-ball SGD that records which slot copy ``get_slot`` gives inside ``update_step``."""

    def __init__(self, learning_rate=0.1, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.seen = []

    def build(self, variables):
        super().build(variables)
        for v in variables:
            self.add_variable_from_reference(v, "m")

    def update_step(self, gradient, variable, learning_rate):
        m = self.get_slot(variable, "m")
        self.seen.append((variable, m))
        m.assign(m * 0.5 + gradient)
        variable.assign_sub(m * learning_rate)


@pytest.mark.parametrize("strategy_name", STRATEGY_NAMES)
def test_get_slot_inside_update_step_gives_the_matching_copy(strategy_name):
    strategy = make_strategy(strategy_name)
    run = train(strategy, lambda: RecordingOptimizer(0.1), make_batches())
    optimizer = run.optimizer
    containers = {id(v): v for v in run.dm.trainable_variables}
    expected_indices = range(len(strategy.experimental_local_results(run.dm.trainable_variables[0])))
    indices_seen: dict = {}
    for component, slot in optimizer.seen:
        container = strategy.extended.value_container(component)
        assert id(container) in containers, "update_step got something that is not a copy of a model variable"
        copies = strategy.experimental_local_results(container)
        index = next(i for i, c in enumerate(copies) if c is component)
        slot_copies = strategy.experimental_local_results(optimizer.get_slot(container, "m"))
        assert slot is slot_copies[index], f"get_slot gave the wrong copy for copy {index} of {container.name}"
        assert slot.device == component.device
        indices_seen.setdefault(id(container), []).append(index)
    assert set(indices_seen) == set(containers)
    for indices in indices_seen.values():
        assert sorted(indices) == sorted(list(expected_indices) * len(BATCH_SIZES))
    if strategy_name.startswith("mirrored"):
        assert list(expected_indices) == list(range(strategy.num_replicas_in_sync))
    # and the math with the resolved slots trains like the default strategy
    expected = train("default", lambda: RecordingOptimizer(0.1), make_batches())
    assert_state_close(run.dm.state_dict(), clone_state(expected.dm.state_dict()), path="model")
    assert_replicas_identical(run)


# --- multi-tensor path == per-variable path, bit for bit ---------------------------------------
def count_calls(optimizer) -> dict:
    counts = {"update_step": 0, "_update_many": 0}
    for method in counts:
        original = getattr(optimizer, method)

        def wrapper(*args, _original=original, _method=method, **kwargs):
            counts[_method] += 1
            return _original(*args, **kwargs)

        setattr(optimizer, method, wrapper)
    return counts


@pytest.mark.parametrize(
    ("name", "clip"),
    [(name, False) for name in BUILTINS] + [("adam", True), ("sgd_nesterov", True)],
    ids=[*BUILTINS, "adam-global_clipnorm", "sgd_nesterov-global_clipnorm"],
)
@pytest.mark.parametrize("strategy_name", ["mirrored2", "central_storage2"])
def test_multi_tensor_path_equals_per_variable_path(strategy_name, name, clip):
    counters = {}

    def make(per_variable):
        def factory():
            optimizer = make_optimizer(name, clip)
            if per_variable:
                set_per_variable_path(optimizer)
            counters[per_variable] = count_calls(optimizer)
            return optimizer

        return factory

    fast = train(strategy_name, make(False), make_batches())
    slow = train(strategy_name, make(True), make_batches())
    assert counters[False]["_update_many"] > 0 and counters[False]["update_step"] == 0
    assert counters[True]["update_step"] > 0 and counters[True]["_update_many"] == 0
    fast_state, slow_state = fast.dm.state_dict(), slow.dm.state_dict()
    for key in fast_state:
        assert torch.equal(fast_state[key], slow_state[key]), key
    for variable in fast.dm.trainable_variables:
        for slot_name in fast.optimizer._slots.names_of(variable):
            other = next(v for v in slow.dm.trainable_variables if v.name == variable.name)
            a = fast.optimizer.get_slot(variable, slot_name).numpy()
            b = slow.optimizer.get_slot(other, slot_name).numpy()
            assert (a == b).all(), (variable.name, slot_name)
    assert_replicas_identical(fast)
    assert_replicas_identical(slow)


# --- CentralStorage: the replicas' copies follow the stored value after every step ---------------
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "torch_adam", "lion_user_subclass"])
def test_central_storage_replica_copies_refresh_after_every_step(name):
    checked = []

    def after_step(run):
        stored = {v.name: run.strategy.experimental_local_results(v)[0].numpy() for v in run.dm.trainable_variables}
        for param_name, param in run.dm.replicas[1].named_parameters():
            assert (param.detach().numpy() == stored[param_name]).all(), (len(checked), param_name)
        for param_name, param in run.dm.replicas[0].named_parameters():
            assert (param.detach().numpy() == stored[param_name]).all(), (len(checked), param_name)
        checked.append(int(run.optimizer.iterations))

    train("central_storage2", lambda: make_optimizer(name, False), make_batches(), after_step=after_step)
    assert checked == [1, 2, 3, 4]


# --- apply_gradients in cross-replica context ---------------------------------------------------
@pytest.mark.parametrize("opt_name", ["sgd", "sgd_per_variable", "torch_sgd", "lion_user_subclass"])
@pytest.mark.parametrize("strategy_name", STRATEGY_NAMES)
def test_cross_replica_apply_gradients_applies_the_given_gradient_to_every_copy(strategy_name, opt_name):
    strategy = make_strategy(strategy_name)
    dm = strategy.distribute_module(make_model())
    before = clone_state(dm.state_dict())
    variables = dm.trainable_variables
    grads = [torch.arange(v.shape.numel(), dtype=torch.float32).reshape(v.shape) * 0.01 + 0.5 for v in variables]
    with strategy.scope():
        if opt_name == "lion_user_subclass":
            optimizer = Lion(0.1, beta_1=0.0)  # sign(gradient) steps
        elif opt_name == "torch_sgd":
            optimizer = optimizers.from_torch(torch.optim.SGD, lr=0.1)
        else:
            optimizer = optimizers.SGD(0.1)
            if opt_name == "sgd_per_variable":
                set_per_variable_path(optimizer)
        if strategy_name != "default":  # TF: the default strategy's scope keeps its replica context
            assert ds.get_replica_context() is None
        optimizer.apply_gradients(zip(grads, variables))
    for v, g in zip(variables, grads):
        step = torch.sign(g) if opt_name == "lion_user_subclass" else g
        expected = before[v.name] - 0.1 * step
        for copy in strategy.experimental_local_results(v):
            torch.testing.assert_close(torch.as_tensor(copy.numpy()), expected, atol=1e-6, rtol=0)
        for index, replica in enumerate(dm.replicas):
            torch.testing.assert_close(
                replica.get_parameter(v.name).detach(), expected, atol=1e-6, rtol=0, msg=f"replica {index}"
            )
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored4", "central_storage2"])
def test_apply_gradients_on_some_replicas_only_raises_and_the_strategy_stays_usable(strategy_name):
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(learning_rate=1.0)
    replicas = strategy.num_replicas_in_sync

    def partial_step():
        replica = ds.get_replica_context().replica_id_in_sync_group
        if replica < replicas // 2:
            optimizer.apply_gradients([(torch.ones(2), variable)])

    with pytest.raises(RuntimeError, match="different number of replica_context\\(\\).merge_call\\(\\) calls"):
        strategy.run(partial_step)
    assert int(optimizer.iterations) == 0
    for copy in strategy.experimental_local_results(variable):
        assert copy.numpy().tolist() == [0.0, 0.0]

    def full_step():
        replica = ds.get_replica_context().replica_id_in_sync_group
        optimizer.apply_gradients([(torch.tensor([1.0, 2.0]) * (replica + 1), variable)])

    strategy.run(full_step)
    total = replicas * (replicas + 1) / 2
    for copy in strategy.experimental_local_results(variable):
        assert copy.numpy().tolist() == [-total, -2 * total]
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("name", ["adam", "torch_adam", "lion_user_subclass"])
@pytest.mark.parametrize("strategy_name", STRATEGY_NAMES)
def test_minimize_inside_run_equals_apply_gradients(strategy_name, name):
    by_apply = train(strategy_name, lambda: make_optimizer(name, True), make_batches())
    by_minimize = train(strategy_name, lambda: make_optimizer(name, True), make_batches(), use_minimize=True)
    a, b = by_apply.dm.state_dict(), by_minimize.dm.state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert int(by_minimize.optimizer.iterations) == len(BATCH_SIZES)
    assert_replicas_identical(by_minimize)


def test_minimize_with_a_loss_tensor_inside_run():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        variable = ds.Variable(torch.zeros(2))
        optimizer = optimizers.SGD(learning_rate=1.0)

    def step():
        replica = ds.get_replica_context().replica_id_in_sync_group
        loss = (variable * torch.tensor([1.0, 2.0]) * (replica + 1)).sum()
        optimizer.minimize(loss, [variable])

    strategy.run(step)
    for copy in strategy.experimental_local_results(variable):
        assert copy.numpy().tolist() == [-3.0, -6.0]


# --- state dicts move between strategies --------------------------------------------------------
@pytest.mark.parametrize("restore_under", ["central_storage2", "default"])
@pytest.mark.parametrize("name", ["adam_amsgrad", "sgd_momentum", "rmsprop_centered_momentum", "torch_adam", "lion"])
def test_state_dict_round_trip_across_strategies(name, restore_under):
    opt_name = "lion_user_subclass" if name == "lion" else name
    batches = make_batches(sizes=(6, 6, 5, 1, 6))

    def make():
        return make_optimizer(opt_name, True)

    uninterrupted = train("default", make, batches)
    first = train("mirrored2", make, batches[:3])
    model_state = clone_state(first.dm.state_dict())
    optimizer_state = first.optimizer.state_dict()
    assert optimizer_state["iterations"] == 3
    resumed = train(
        restore_under,
        make,
        batches[3:],
        model_state=model_state,
        optimizer_state=optimizer_state,
        model_seed=123,  # a fresh model whose own weights differ
    )
    assert int(resumed.optimizer.iterations) == 5
    assert_state_close(resumed.dm.state_dict(), clone_state(uninterrupted.dm.state_dict()), path="model")
    assert_state_close(resumed.optimizer.state_dict(), uninterrupted.optimizer.state_dict(), path="optimizer")
    assert_replicas_identical(resumed)
