"""Variables: creation under every strategy, TensorFlow's assignment rules, tensor behaviour.

Reference: TensorFlow 2.21's observed behaviour for distributed variables, and the rows of
docs/porting/tensorflow.md where we deliberately differ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit.strategies import VariableAggregation as Agg
from replicafit.strategies import VariableSynchronization as Sync
from replicafit.strategies.variables import aggregated_reads

pytestmark = pytest.mark.timeout(60)


# --- helpers ---------------------------------------------------------------------------
def rid() -> int:
    return ds.get_replica_context().replica_id_in_sync_group


def replica_reads(strategy, variable) -> list:
    """What each replica reads from ``variable`` (as Python values)."""
    out = strategy.run(lambda: variable.read_value().detach().clone())
    return [t.tolist() for t in strategy.experimental_local_results(out)]


def component_values(variable) -> list:
    return [c.numpy().tolist() for c in variable.values]


def per_replica_value(strategy, fn):
    """``fn(replica_id)`` on every replica (a plain value with one replica)."""
    return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))


def is_multi(strategy) -> bool:
    return strategy.num_replicas_in_sync > 1


def expected_kind(strategy, synchronization=Sync.AUTO):
    if not is_multi(strategy):
        return ds.LocalVariable
    if synchronization is Sync.ON_READ:
        return ds.SyncOnReadVariable
    if isinstance(strategy, ds.CentralStorageStrategy):
        return ds.CentralStorageVariable
    return ds.MirroredVariable


def mirrored2():
    return make_strategy("mirrored2")


def central2():
    return make_strategy("central_storage2")


# --- creation ---------------------------------------------------------------------------
@pytest.mark.parametrize("synchronization", [Sync.AUTO, Sync.ON_WRITE, Sync.ON_READ])
def test_variable_kind_under_each_strategy(strategy, synchronization):
    with strategy.scope():
        v = ds.Variable(torch.tensor([1.0, 2.0]), name="v", synchronization=synchronization, aggregation="MEAN")
    assert type(v) is expected_kind(strategy, synchronization)
    assert isinstance(v, ds.Variable)
    assert v.name == "v"
    assert v.shape == torch.Size([2])
    assert v.dtype == torch.float32
    assert v.aggregation is Agg.MEAN
    assert v.distribute_strategy is (None if strategy is ds.get_strategy() else strategy)
    for component in strategy.experimental_local_results(v):
        assert isinstance(component, ds.LocalVariable)
        assert isinstance(component, ds.Variable)
        assert component.numpy().tolist() == [1.0, 2.0]


def test_every_kind_is_a_variable():
    kinds = set()
    for name in ("default", "one_device", "mirrored2", "central_storage2"):
        strategy = make_strategy(name)
        with strategy.scope():
            for sync in ("ON_WRITE", "ON_READ"):
                v = ds.Variable(1.0, synchronization=sync, aggregation="SUM")
                assert isinstance(v, ds.Variable), (name, sync, type(v))
                kinds.add(type(v))
    assert kinds == {ds.LocalVariable, ds.MirroredVariable, ds.SyncOnReadVariable, ds.CentralStorageVariable}
    assert issubclass(ds.MirroredVariable, ds.DistributedVariable)
    assert issubclass(ds.SyncOnReadVariable, ds.DistributedVariable)


def test_mirrored_components_devices_and_names():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(3.0, name="w")
        s = ds.Variable(3.0, name="m", synchronization="ON_READ", aggregation="SUM")
    for var, name in ((v, "w"), (s, "m")):
        assert var.devices == ("cpu:0", "cpu:1")
        assert [c.device for c in var.values] == ["cpu:0", "cpu:1"]
        assert [c.name for c in var.values] == [name, f"{name}/replica_1"]
        assert component_values(var) == [3.0, 3.0]
        assert var.device == "cpu:0"  # cross-replica: the primary copy
    assert v.synchronization is Sync.ON_WRITE  # AUTO resolves to ON_WRITE (TF 5.1)
    assert s.synchronization is Sync.ON_READ
    out = strategy.run(lambda: v.device)
    assert strategy.experimental_local_results(out) == ("cpu:0", "cpu:1")


def test_mirrored_components_are_independent_storage():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(lambda: torch.zeros(2))
    # A PerReplica argument to update writes each copy its own value (TF 3.6 [obs]).
    strategy.extended.update(v, lambda c, x: c.assign(x), args=(ds.PerReplica((torch.ones(2), 2 * torch.ones(2))),))
    assert component_values(v) == [[1.0, 1.0], [2.0, 2.0]]


def test_central_storage_variable_lives_on_parameter_device():
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu:2")
    with strategy.scope():
        v = ds.Variable(torch.tensor([1.0, 2.0]), name="c")
    assert type(v) is ds.CentralStorageVariable
    assert len(v.values) == 1
    assert v.values[0].device == "cpu:2"
    assert v.device == "cpu:2"
    assert strategy.experimental_local_results(v) == (v.values[0],)
    assert v.values[0].name == "c"
    out = strategy.run(lambda: v.device)
    assert strategy.experimental_local_results(out) == ("cpu:0", "cpu:1")
    assert replica_reads(strategy, v) == [[1.0, 2.0], [1.0, 2.0]]


def test_single_replica_variable_device(strategy):
    if is_multi(strategy):
        pytest.skip("single-replica strategies only")
    with strategy.scope():
        v = ds.Variable(1.0)
    assert v.device == "cpu:0"
    assert strategy.experimental_local_results(v) == (v,)


@pytest.mark.parametrize(
    ("synchronization", "trainable", "expected"),
    [
        (Sync.AUTO, None, True),
        (Sync.ON_WRITE, None, True),
        (Sync.ON_READ, None, False),
        (Sync.ON_READ, True, True),
        (Sync.ON_READ, False, False),
        (Sync.AUTO, False, False),
    ],
)
def test_trainable_defaults(strategy, synchronization, trainable, expected):
    # reference case 11: ON_READ variables are not trainable unless asked
    with strategy.scope():
        v = ds.Variable(1.0, trainable=trainable, synchronization=synchronization, aggregation="SUM")
    assert v.trainable is expected
    for component in strategy.experimental_local_results(v):
        assert component.trainable is expected


def test_none_synchronization_rejected_by_distributed_strategies(multi_strategy):
    # reference case 30
    with multi_strategy.scope():
        with pytest.raises(ValueError, match="`NONE` variable synchronization mode is not supported"):
            ds.Variable(1.0, name="bad", synchronization=Sync.NONE)
        with pytest.raises(ValueError, match="for variable: bad2"):
            ds.Variable(1.0, name="bad2", synchronization="NONE")


def test_none_synchronization_allowed_with_one_replica():
    for name in ("default", "one_device"):
        strategy = make_strategy(name)
        with strategy.scope():
            v = ds.Variable(1.0, synchronization="NONE")
        assert type(v) is ds.LocalVariable
        assert v.synchronization is Sync.NONE
        assert float(v) == 1.0


def test_invalid_synchronization_and_aggregation(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match="Invalid variable synchronization mode: .*BOGUS.* for variable: x"):
            ds.Variable(1.0, name="x", synchronization="BOGUS")
        with pytest.raises(ValueError, match="Invalid variable aggregation mode: .*BOGUS.* for variable: y"):
            ds.Variable(1.0, name="y", aggregation="BOGUS")
        with pytest.raises(ValueError, match="Invalid variable aggregation mode"):
            ds.Variable(1.0, aggregation=3)


def test_string_spellings_accepted(strategy):
    with strategy.scope():
        v = ds.Variable(1.0, synchronization="on_read", aggregation="only_first_replica")
    assert v.synchronization is Sync.ON_READ
    assert v.aggregation is Agg.ONLY_FIRST_REPLICA


@pytest.mark.parametrize("synchronization", ["ON_WRITE", "ON_READ"])
def test_mean_with_integer_dtype_rejected(multi_strategy, synchronization):
    with multi_strategy.scope():
        with pytest.raises(ValueError, match="aggregation=MEAN and a non-floating dtype is not supported"):
            ds.Variable(1, synchronization=synchronization, aggregation="MEAN")
        with pytest.raises(ValueError, match="non-floating dtype"):
            ds.Variable(1.0, dtype=torch.int32, synchronization=synchronization, aggregation=Agg.MEAN)
        # a floating MEAN variable and an integer SUM one are fine
        assert float(ds.Variable(1.0, synchronization=synchronization, aggregation="MEAN")) == 1.0
        counter = ds.Variable(1, synchronization=synchronization, aggregation="SUM")
        assert counter.dtype == torch.int64
        assert int(counter) == (2 if synchronization == "ON_READ" else 1)


def test_dtype_argument(strategy):
    with strategy.scope():
        a = ds.Variable(1, dtype=torch.float64)
        b = ds.Variable(torch.ones(2, dtype=torch.float16), dtype=torch.float32)
        c = ds.Variable([1, 2])
        d = ds.Variable(1.5)
        e = ds.Variable(np.array([1.0, 2.0]))
        f = ds.Variable(3, dtype=torch.int64, aggregation="ONLY_FIRST_REPLICA")
    assert a.dtype == torch.float64 and float(a) == 1.0
    assert b.dtype == torch.float32 and b.numpy().tolist() == [1.0, 1.0]
    assert c.dtype == torch.int64 and c.numpy().tolist() == [1, 2]
    assert d.dtype == torch.float32 and float(d) == 1.5
    assert e.dtype == torch.float64
    assert f.dtype == torch.int64 and int(f) == 3
    for var, dtype in ((a, torch.float64), (b, torch.float32), (c, torch.int64), (f, torch.int64)):
        for component in strategy.experimental_local_results(var):
            assert component.dtype == dtype


def test_callable_initial_value(strategy):
    calls = []

    def init():
        calls.append(1)
        return torch.arange(3.0)

    with strategy.scope():
        v = ds.Variable(init, name="ranged")
    assert len(calls) == 1  # called once; copies are initialised from that value (TF 5.1)
    assert [c.numpy().tolist() for c in strategy.experimental_local_results(v)] == [[0.0, 1.0, 2.0]] * len(
        strategy.experimental_local_results(v)
    )
    assert replica_reads(strategy, v) == [[0.0, 1.0, 2.0]] * strategy.num_replicas_in_sync


def test_initial_value_is_copied(strategy):
    source = torch.tensor([1.0, 2.0])
    with strategy.scope():
        v = ds.Variable(source)
        v.assign_add(torch.ones(2))
    assert source.tolist() == [1.0, 2.0]
    assert v.numpy().tolist() == [2.0, 3.0]


# --- MirroredVariable / CentralStorageVariable in replica context ---------------------------
ON_WRITE_TABLE = [
    # (aggregation, op, expected) for var=10, replica r writes r+1 (reference 5.3)
    ("SUM", "assign", 3.0),
    ("SUM", "assign_add", 13.0),
    ("SUM", "assign_sub", 7.0),
    ("MEAN", "assign", 1.5),
    ("MEAN", "assign_add", 11.5),
    ("MEAN", "assign_sub", 8.5),
    ("ONLY_FIRST_REPLICA", "assign", 1.0),
    ("ONLY_FIRST_REPLICA", "assign_add", 11.0),
    ("ONLY_FIRST_REPLICA", "assign_sub", 9.0),
]


@pytest.mark.parametrize(("aggregation", "op", "expected"), ON_WRITE_TABLE)
def test_mirrored_replica_context_assignment(aggregation, op, expected):
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(10.0, aggregation=aggregation)
    strategy.run(lambda: getattr(v, op)(torch.tensor(rid() + 1.0)))
    assert component_values(v) == [expected, expected]
    assert replica_reads(strategy, v) == [expected, expected]


@pytest.mark.parametrize(("aggregation", "op", "expected"), ON_WRITE_TABLE)
def test_central_storage_replica_context_assignment(aggregation, op, expected):
    # reference 5.6: SUM 13, MEAN 11.5, ONLY_FIRST 11 for assign_add; SUM assign -> 3
    strategy = central2()
    with strategy.scope():
        v = ds.Variable(10.0, aggregation=aggregation)
    strategy.run(lambda: getattr(v, op)(torch.tensor(rid() + 1.0)))
    assert component_values(v) == [expected]
    assert float(v) == expected
    assert replica_reads(strategy, v) == [expected, expected]


def test_replica_context_assignment_with_python_floats_per_replica():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(10.0, aggregation="SUM")
    strategy.run(lambda: v.assign_add(float(rid() + 1)))
    assert component_values(v) == [13.0, 13.0]


def test_replica_assignment_returns_variable_and_reads_back_inside_replica():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(10.0, aggregation="MEAN")

    def step():
        v.assign_add(torch.tensor(rid() + 1.0))
        return v.read_value()

    out = strategy.run(step)
    assert [t.item() for t in strategy.experimental_local_results(out)] == [11.5, 11.5]


@pytest.mark.parametrize("op", ["assign", "assign_add", "assign_sub"])
def test_aggregation_none_in_replica_context_raises(multi_strategy, op):
    # docs/porting/tensorflow.md: a deliberate difference from TF 2.21 (which lets the copies diverge)
    with multi_strategy.scope():
        v = ds.Variable(10.0)
    assert v.aggregation is Agg.NONE
    with pytest.raises(ValueError, match="aggregation"):
        multi_strategy.run(lambda: getattr(v, op)(torch.tensor(rid() + 1.0)))
    assert replica_reads(multi_strategy, v) == [10.0, 10.0]
    # also with the same value on every replica (TF 2.21 would add locally, 11/11)
    with pytest.raises(ValueError, match="aggregation"):
        multi_strategy.run(lambda: v.assign_add(1.0))
    assert replica_reads(multi_strategy, v) == [10.0, 10.0]
    assert [float(c) for c in v.values] == [10.0] * len(v.values)


def test_aggregation_none_mirrored_error_names_the_variable():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(1.0, name="weights")
    with pytest.raises(ValueError, match="MirroredVariable") as info:
        strategy.run(lambda: v.assign(5.0))
    assert "weights" in str(info.value)
    assert component_values(v) == [1.0, 1.0]


@pytest.mark.parametrize("op", ["assign", "assign_add"])
def test_sum_with_non_distributed_value_raises(multi_strategy, op):
    # reference case 18: the same Python constant on every replica cannot be SUMmed
    with multi_strategy.scope():
        v = ds.Variable(1.0, aggregation="SUM")
    with pytest.raises(ValueError, match="non-DistributedValues value 5.0 cannot be reduced"):
        multi_strategy.run(lambda: getattr(v, op)(5.0))
    same = torch.tensor(5.0)
    with pytest.raises(ValueError, match="non-DistributedValues"):
        multi_strategy.run(lambda: getattr(v, op)(same))
    assert replica_reads(multi_strategy, v) == [1.0, 1.0]


@pytest.mark.parametrize("aggregation", ["MEAN", "ONLY_FIRST_REPLICA"])
def test_same_constant_with_mean_or_only_first(multi_strategy, aggregation):
    # reference 5.3: identical values collapse; MEAN / ONLY_FIRST of 1.0 add 1.0 once
    with multi_strategy.scope():
        v = ds.Variable(10.0, aggregation=aggregation)
    multi_strategy.run(lambda: v.assign_add(1.0))
    assert replica_reads(multi_strategy, v) == [11.0, 11.0]


def test_mean_replica_assignments_reference_cases_19_and_21():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(1.0, aggregation="MEAN")
    strategy.run(lambda: v.assign(float(rid())))
    assert component_values(v) == [0.5, 0.5]
    strategy.run(lambda: v.assign(5.0))
    assert component_values(v) == [5.0, 5.0]
    with strategy.scope():
        w = ds.Variable(1.0, aggregation="MEAN")
    strategy.run(lambda: w.assign_add(float(rid())))
    assert component_values(w) == [1.5, 1.5]
    with strategy.scope():
        u = ds.Variable(5.0, aggregation="MEAN")
    strategy.run(lambda: u.assign_sub(float(rid())))
    assert component_values(u) == [4.5, 4.5]
    strategy.run(lambda: u.assign_sub(1.0))
    assert component_values(u) == [3.5, 3.5]


@pytest.mark.parametrize("aggregation", ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"])
def test_cross_replica_assignment_writes_every_copy(strategy, aggregation):
    # reference 5.2 and case 20: the same value on every copy, whatever the aggregation
    with strategy.scope():
        v = ds.Variable(10.0, aggregation=aggregation)
        result = v.assign_add(5.0)
        assert result is not None
        count = strategy.num_replicas_in_sync
        assert replica_reads(strategy, v) == [15.0] * count
        assert v.assign_sub(2.0, read_value=False) is None
        assert replica_reads(strategy, v) == [13.0] * count
        v.assign(torch.tensor(1.0))
    assert replica_reads(strategy, v) == [1.0] * count
    assert all(c.numpy().item() == 1.0 for c in strategy.experimental_local_results(v))


def test_cross_replica_assignment_reference_case_20():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(1.0)
        v.assign_add(6.0)
        assert component_values(v) == [7.0, 7.0]
        assert [c.device for c in v.values] == ["cpu:0", "cpu:1"]
        v.assign_add(2.0, read_value=False)
        assert component_values(v) == [9.0, 9.0]
        v.assign(5.0)
        v.assign_sub(2.0)
        assert component_values(v) == [3.0, 3.0]


def test_assign_outside_scope_reference_case_23(strategy):
    with strategy.scope():
        v = ds.Variable(1.0, aggregation="SUM")
    v.assign(3.0)
    assert [c.numpy().item() for c in strategy.experimental_local_results(v)] == [3.0] * len(
        strategy.experimental_local_results(v)
    )
    v.assign_add(torch.tensor(2.0))
    assert replica_reads(strategy, v) == [5.0] * strategy.num_replicas_in_sync


def test_assign_shape_mismatch_raises(strategy):
    with strategy.scope():
        v = ds.Variable(torch.zeros(2))
        with pytest.raises(ValueError, match="shape"):
            v.assign(torch.zeros(3))
    assert replica_reads(strategy, v) == [[0.0, 0.0]] * strategy.num_replicas_in_sync


def test_only_first_replica_int64_counter_reference_case_10(strategy):
    with strategy.scope():
        step = ds.Variable(0, dtype=torch.int64, aggregation=ds.VariableAggregation.ONLY_FIRST_REPLICA)

    def train_step():
        step.assign_add(1)
        return step.read_value()

    for expected in (1, 2, 3):
        out = strategy.run(train_step)
        assert [int(t) for t in strategy.experimental_local_results(out)] == [expected] * (
            strategy.num_replicas_in_sync
        )
    assert step.dtype == torch.int64
    assert int(step) == 3


def test_minimize_loss_reference_case_12(strategy):
    with strategy.scope():
        kernel = ds.Variable(torch.tensor([[3.0]]), name="kernel")
    x = torch.tensor([[1.0]])

    def step():
        loss = ((x @ kernel) - 1.0).pow(2).sum()
        (grad,) = torch.autograd.grad(loss, [kernel])

        def merge_fn(strategy, g):
            reduced = strategy.extended.reduce_to("SUM", g, kernel)
            strategy.extended.update(kernel, lambda v, d: v.assign_sub(0.2 * d), args=(reduced,), group=False)

        ds.get_replica_context().merge_call(merge_fn, args=(grad,))

    before = abs(float(kernel) - 1.0)
    for _ in range(10):
        strategy.run(step)
    after = abs(float(kernel) - 1.0)
    assert after < before
    # the exact trajectory: k <- k - 0.2 * R * 2 (k - 1)
    k = 3.0
    for _ in range(10):
        k -= 0.2 * strategy.num_replicas_in_sync * 2 * (k - 1.0)
    assert float(kernel) == pytest.approx(k, rel=1e-5)
    assert replica_reads(strategy, kernel) == [[[pytest.approx(k, rel=1e-5)]]] * strategy.num_replicas_in_sync


# --- SyncOnReadVariable ----------------------------------------------------------------------
def make_sync_on_read(strategy, aggregation, init=10.0, **kwargs):
    with strategy.scope():
        return ds.Variable(init, synchronization="ON_READ", aggregation=aggregation, **kwargs)


@pytest.mark.parametrize("aggregation", ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"])
def test_sync_on_read_replica_writes_are_local(multi_strategy, aggregation):
    v = make_sync_on_read(multi_strategy, aggregation)
    assert type(v) is ds.SyncOnReadVariable
    multi_strategy.run(lambda: v.assign_add(torch.tensor(rid() + 1.0)))
    assert component_values(v) == [11.0, 12.0]
    # replica-context reads are local (reference table 5.4)
    assert replica_reads(multi_strategy, v) == [11.0, 12.0]
    out = multi_strategy.run(lambda: v + 0)
    assert [t.item() for t in multi_strategy.experimental_local_results(out)] == [11.0, 12.0]
    multi_strategy.run(lambda: v.assign(torch.tensor(float(rid()))))
    assert component_values(v) == [0.0, 1.0]
    multi_strategy.run(lambda: v.assign_sub(1.0))
    assert component_values(v) == [-1.0, 0.0]


@pytest.mark.parametrize(("aggregation", "expected"), [("SUM", 23.0), ("MEAN", 11.5), ("ONLY_FIRST_REPLICA", 11.0)])
def test_sync_on_read_cross_replica_read_aggregates(multi_strategy, aggregation, expected):
    v = make_sync_on_read(multi_strategy, aggregation)
    multi_strategy.run(lambda: v.assign_add(torch.tensor(rid() + 1.0)))
    assert v.read_value().item() == expected
    assert v.value().item() == expected
    assert v.numpy().item() == expected
    assert float(v) == expected
    assert (v + 0).item() == expected
    assert torch.add(v, 0).item() == expected
    with multi_strategy.scope():
        assert v.read_value().item() == expected
        assert float(v) == expected
    # strategy.reduce works for any aggregation
    assert multi_strategy.reduce("SUM", v, axis=None).item() == 23.0


def test_sync_on_read_none_cannot_be_read_cross_replica(multi_strategy):
    v = make_sync_on_read(multi_strategy, "NONE")
    multi_strategy.run(lambda: v.assign_add(torch.tensor(rid() + 1.0)))
    with pytest.raises(ValueError, match="Could not convert from `VariableAggregation`"):
        v.read_value()
    with pytest.raises(ValueError, match="Could not convert"):
        float(v)
    with multi_strategy.scope(), pytest.raises(ValueError, match="Could not convert"):
        v.numpy()
    assert multi_strategy.reduce("SUM", v, axis=None).item() == 23.0
    assert component_values(v) == [11.0, 12.0]


@pytest.mark.parametrize("aggregation", ["SUM", "MEAN"])
def test_sync_on_read_initial_read_reference_case_22(multi_strategy, aggregation):
    v = make_sync_on_read(multi_strategy, aggregation, init=1.0)
    assert float(v) == (2.0 if aggregation == "SUM" else 1.0)
    with multi_strategy.scope():
        v.assign(6.0)
    assert float(v) == 6.0
    assert component_values(v) == ([3.0, 3.0] if aggregation == "SUM" else [6.0, 6.0])


def test_sync_on_read_sum_cross_replica_assign_divides(multi_strategy):
    v = make_sync_on_read(multi_strategy, "SUM")
    v.assign(4.0)
    assert component_values(v) == [2.0, 2.0]
    assert v.read_value().item() == 4.0
    # assign returns something that reads back the value
    result = v.assign(torch.tensor(8.0))
    assert float(result) == 8.0
    assert component_values(v) == [4.0, 4.0]


@pytest.mark.parametrize("op", ["assign_add", "assign_sub"])
def test_sync_on_read_sum_cross_replica_add_raises(multi_strategy, op):
    v = make_sync_on_read(multi_strategy, "SUM")
    with pytest.raises(ValueError, match=f"does not support `{op}` in cross-replica context"):
        getattr(v, op)(1.0)
    with multi_strategy.scope(), pytest.raises(ValueError, match="SUM"):
        getattr(v, op)(1.0)
    assert component_values(v) == [10.0, 10.0]


@pytest.mark.parametrize("aggregation", ["MEAN", "ONLY_FIRST_REPLICA"])
def test_sync_on_read_cross_replica_writes_every_component(multi_strategy, aggregation):
    v = make_sync_on_read(multi_strategy, aggregation)
    v.assign(4.0)
    assert component_values(v) == [4.0, 4.0]
    v.assign_add(1.0)
    assert component_values(v) == [5.0, 5.0]
    with multi_strategy.scope():
        v.assign_sub(1.0)
    assert component_values(v) == [4.0, 4.0]
    assert float(v) == 4.0


def test_sync_on_read_none_cross_replica_assign_writes_components(multi_strategy):
    v = make_sync_on_read(multi_strategy, "NONE")
    v.assign(4.0, read_value=False)
    assert component_values(v) == [4.0, 4.0]


def test_assign_component_writes_one_replicas_copy_alone(multi_strategy):
    v = make_sync_on_read(multi_strategy, "SUM", init=1.0)
    v.assign_component(1, torch.tensor(5.0))
    assert component_values(v) == [1.0, 5.0]
    assert float(v) == 6.0  # no share of a SUM: the copy holds the value given
    with pytest.raises(ValueError, match="the shapes must match"):
        v.assign_component(0, torch.zeros(2))
    assert component_values(v) == [1.0, 5.0]


def test_assign_component_of_a_local_variable_and_after_an_aggregated_read(strategy):
    with strategy.scope():
        v = ds.Variable(torch.zeros(2), synchronization="ON_READ", aggregation="SUM")
    last = len(strategy.experimental_local_results(v)) - 1
    with aggregated_reads([v]):
        float(v.read_value().sum())
        v.assign_component(last, torch.ones(2))
        assert v.read_value().tolist() == [1.0, 1.0]  # the aggregate read before the write is not reused
    assert strategy.experimental_local_results(v)[last].numpy().tolist() == [1.0, 1.0]


def test_extended_update_bypasses_division_reference_case_29(multi_strategy):
    v = make_sync_on_read(multi_strategy, "SUM", init=1.0)
    assert float(v) == 2.0
    result = multi_strategy.extended.update(v, lambda c, x: c.assign(x), args=(5.0,), group=False)
    assert isinstance(result, tuple) and len(result) == 2
    assert component_values(v) == [5.0, 5.0]
    assert float(v) == 10.0


def test_only_first_replica_sync_on_read_and_on_write_reference_case_28(multi_strategy):
    strategy = multi_strategy
    with strategy.scope():
        v0 = ds.Variable(2.0, synchronization="ON_READ", aggregation="ONLY_FIRST_REPLICA")
        v1 = ds.Variable(3.0, synchronization="ON_WRITE", aggregation="ONLY_FIRST_REPLICA")

    def step(a, b):
        v0.assign_add(a * (rid() + 1))
        v1.assign_add(b * (rid() + 1))

    strategy.run(step, args=(5.0, 7.0))
    assert component_values(v0) == [7.0, 12.0]
    assert float(v0) == 7.0
    assert replica_reads(strategy, v1) == [10.0, 10.0]
    strategy.run(step, args=(11.0, 13.0))
    assert component_values(v0) == [18.0, 34.0]
    assert float(v0) == 18.0
    assert replica_reads(strategy, v1) == [23.0, 23.0]


def test_sync_on_read_single_replica_is_local(strategy):
    if is_multi(strategy):
        pytest.skip("single-replica strategies only")
    v = make_sync_on_read(strategy, "SUM")
    assert type(v) is ds.LocalVariable
    assert v.synchronization is Sync.ON_READ
    strategy.run(lambda: v.assign_add(1.0))
    assert float(v) == 11.0
    v.assign_add(1.0)  # one replica: no SUM ambiguity
    assert float(v) == 12.0


# --- variables as tensors ----------------------------------------------------------------------
MATRIX = [[1.0, 2.0], [3.0, 4.0]]


def test_torch_operations_take_variables(strategy):
    with strategy.scope():
        v = ds.Variable(torch.tensor(MATRIX))
    m = torch.tensor(MATRIX)

    def check():
        assert torch.matmul(v, v).tolist() == [[7.0, 10.0], [15.0, 22.0]]
        assert torch.cat([v, v]).tolist() == MATRIX + MATRIX
        assert torch.stack((v, m)).shape == (2, 2, 2)
        x = torch.tensor([[1.0, 1.0]])
        assert F.linear(x, v).tolist() == [[3.0, 7.0]]
        assert F.linear(x, v, torch.ones(2)).tolist() == [[4.0, 8.0]]
        assert torch.sum(v).item() == 10.0
        assert v.sum().item() == 10.0
        assert v.t().tolist() == [[1.0, 3.0], [2.0, 4.0]]
        assert torch.nn.functional.relu(-v).tolist() == [[0.0, 0.0], [0.0, 0.0]]
        assert (m @ v).tolist() == [[7.0, 10.0], [15.0, 22.0]]
        assert (v @ m).tolist() == [[7.0, 10.0], [15.0, 22.0]]
        assert (m + v).tolist() == [[2.0, 4.0], [6.0, 8.0]]
        assert (m * v).tolist() == [[1.0, 4.0], [9.0, 16.0]]
        return True

    assert check()
    out = strategy.run(check)
    assert all(strategy.experimental_local_results(out))


def test_python_arithmetic_both_sides(strategy):
    with strategy.scope():
        v = ds.Variable(torch.tensor([2.0, 4.0]))
        i = ds.Variable(torch.tensor([6, 3]), aggregation="ONLY_FIRST_REPLICA")
    assert (v + 1).tolist() == [3.0, 5.0]
    assert (1 + v).tolist() == [3.0, 5.0]
    assert (v - 1).tolist() == [1.0, 3.0]
    assert (1 - v).tolist() == [-1.0, -3.0]
    assert (v * 3).tolist() == [6.0, 12.0]
    assert (3 * v).tolist() == [6.0, 12.0]
    assert (v / 2).tolist() == [1.0, 2.0]
    assert (8 / v).tolist() == [4.0, 2.0]
    assert (v**2).tolist() == [4.0, 16.0]
    assert (2**v).tolist() == [4.0, 16.0]
    assert (v // 3).tolist() == [0.0, 1.0]
    assert (9 // v).tolist() == [4.0, 2.0]
    assert (v % 3).tolist() == [2.0, 1.0]
    assert (-v).tolist() == [-2.0, -4.0]
    assert (+v).tolist() == [2.0, 4.0]
    assert abs(-v).tolist() == [2.0, 4.0]
    assert (v + v).tolist() == [4.0, 8.0]
    assert (v * i).tolist() == [12.0, 12.0]
    assert (i & 2).tolist() == [2, 2]
    assert (i | 1).tolist() == [7, 3]
    assert (i ^ 1).tolist() == [7, 2]
    assert (~i).tolist() == [-7, -4]


def test_comparisons_and_indexing(strategy):
    with strategy.scope():
        v = ds.Variable(torch.tensor(MATRIX))
        s = ds.Variable(3.0)
    assert (v > 2).tolist() == [[False, False], [True, True]]
    assert (v >= 2).tolist() == [[False, True], [True, True]]
    assert (v < 2).tolist() == [[True, False], [False, False]]
    assert (v <= 2).tolist() == [[True, True], [False, False]]
    assert (v == 4).tolist() == [[False, False], [False, True]]
    assert (v != 4).tolist() == [[True, True], [True, False]]
    assert (2 < v).tolist() == [[False, False], [True, True]]
    assert (v == v).all().item() is True
    assert s > 2 and not s < 2
    assert v[0].tolist() == [1.0, 2.0]
    assert v[1, 0].item() == 3.0
    assert v[:, 1].tolist() == [2.0, 4.0]
    assert v[torch.tensor([1, 0])].tolist() == [[3.0, 4.0], [1.0, 2.0]]
    assert len(v) == 2
    assert [row.tolist() for row in v] == MATRIX
    # variables stay hashable (optimizers key slots by variable) despite __eq__
    table = {v: "v", s: "s"}
    assert table[v] == "v" and table[s] == "s"


def test_python_conversions(strategy):
    with strategy.scope():
        s = ds.Variable(3.5)
        n = ds.Variable(7, aggregation="ONLY_FIRST_REPLICA")
        v = ds.Variable(torch.tensor([1.0, 2.0]))
    assert float(s) == 3.5
    assert int(s) == 3
    assert int(n) == 7
    assert [10, 20, 30, 40, 50, 60, 70, 80][n] == 80  # __index__
    assert bool(s) is True
    assert f"{s:.2f}" == "3.50"
    array = v.numpy()
    assert isinstance(array, np.ndarray)
    assert array.dtype == np.float32
    assert array.tolist() == [1.0, 2.0]
    array[0] = 99.0  # a copy
    assert v.numpy().tolist() == [1.0, 2.0]
    assert np.asarray(v).tolist() == [1.0, 2.0]
    assert np.asarray(v, dtype=np.float64).dtype == np.float64
    assert np.array_equal(np.asarray(v) * 2, np.array([2.0, 4.0], dtype=np.float32))
    assert s.numpy().shape == ()


def test_read_value_is_a_snapshot_value_is_live(strategy):
    with strategy.scope():
        v = ds.Variable(torch.tensor([1.0, 2.0]), aggregation="MEAN")
    snapshot = v.read_value()
    live = v.value()
    v.assign(torch.tensor([5.0, 6.0]))
    assert snapshot.tolist() == [1.0, 2.0]
    assert live.tolist() == [5.0, 6.0]
    assert v.read_value().tolist() == [5.0, 6.0]

    def in_replica():
        snap = v.read_value()
        now = v.value()
        v.assign_add(torch.tensor([1.0, 1.0]))
        return snap.detach().clone(), now.detach().clone()

    out = strategy.run(in_replica)
    snaps, nows = out
    assert [t.tolist() for t in strategy.experimental_local_results(snaps)] == [[5.0, 6.0]] * (
        strategy.num_replicas_in_sync
    )
    assert [t.tolist() for t in strategy.experimental_local_results(nows)] == [[6.0, 7.0]] * (
        strategy.num_replicas_in_sync
    )


def test_autograd_through_trainable_variable_in_run(strategy):
    with strategy.scope():
        w = ds.Variable(torch.tensor([1.0, 2.0, 3.0]), name="w")
        frozen = ds.Variable(torch.tensor([1.0, 1.0, 1.0]), trainable=False)
    assert w.requires_grad is True
    assert frozen.requires_grad is False
    x = per_replica_value(strategy, lambda r: torch.tensor([1.0, 2.0, 3.0]) * (r + 1))

    def step(x):
        loss = (w * x * frozen).sum() + (w**2).sum()
        (grad,) = torch.autograd.grad(loss, [w])
        return grad

    out = strategy.run(step, args=(x,))
    grads = strategy.experimental_local_results(out)
    assert len(grads) == strategy.num_replicas_in_sync
    for r, g in enumerate(grads):
        expected = torch.tensor([1.0, 2.0, 3.0]) * (r + 1) + 2 * torch.tensor([1.0, 2.0, 3.0])
        assert torch.equal(g, expected)
    # gradients flow through read_value() too
    out = strategy.run(lambda: torch.autograd.grad((w.read_value() * 3).sum(), [w])[0])
    for g in strategy.experimental_local_results(out):
        assert g.tolist() == [3.0, 3.0, 3.0]
    # the grad is w.r.t. the replica's own copy: nothing accumulates in .grad
    for component in strategy.experimental_local_results(w):
        assert component.grad is None


def test_variable_stands_for_its_local_value_in_run():
    strategy = mirrored2()
    s = make_sync_on_read(strategy, "SUM", init=0.0)
    strategy.run(lambda: s.assign(torch.tensor(rid() + 11.0)))
    out = strategy.run(lambda: s * 2)
    assert [t.item() for t in strategy.experimental_local_results(out)] == [22.0, 24.0]
    out = strategy.run(lambda: torch.mul(s, 2))
    assert [t.item() for t in strategy.experimental_local_results(out)] == [22.0, 24.0]
    out = strategy.run(lambda: s.device)
    assert strategy.experimental_local_results(out) == ("cpu:0", "cpu:1")


def test_per_replica_times_variable_reference_case_16():
    strategy = mirrored2()
    with strategy.scope():
        factor = ds.Variable(1.25)
    out = strategy.run(lambda x: x * factor, args=(ds.PerReplica((torch.tensor(5.0), torch.tensor(3.0))),))
    assert isinstance(out, ds.PerReplica)
    assert [t.item() for t in out.values] == [6.25, 3.75]


def test_repr_tensorflow_style():
    strategy = mirrored2()
    with strategy.scope():
        v = ds.Variable(10.0, name="v")
        s = ds.Variable(torch.tensor([1.0, 2.0]), name="s", synchronization="ON_READ", aggregation="SUM")
    assert repr(v) == (
        "MirroredVariable:{\n"
        "  0: <replicafit.Variable 'v' shape=() dtype=float32, device='cpu:0', numpy=10.0>,\n"
        "  1: <replicafit.Variable 'v/replica_1' shape=() dtype=float32, device='cpu:1', numpy=10.0>\n"
        "}"
    )
    assert repr(s).startswith("SyncOnReadVariable:{\n  0: <replicafit.Variable 's' shape=(2,) dtype=float32, ")
    assert "  1: <replicafit.Variable 's/replica_1' shape=(2,) dtype=float32, device='cpu:1'" in repr(s)
    assert repr(s).endswith(">\n}")
    with make_strategy("one_device").scope():
        local = ds.Variable(2, name="n", dtype=torch.int64)
    assert repr(local) == "<replicafit.Variable 'n' shape=() dtype=int64, device='cpu:0', numpy=2>"
    cs = central2()
    with cs.scope():
        c = ds.Variable(1.0, name="c")
    assert repr(c).startswith("CentralStorageVariable:{")
    assert "<replicafit.Variable 'c' shape=() dtype=float32, device='cpu:0', numpy=1.0>" in repr(c)


# --- variables created inside run -----------------------------------------------------------------
def test_variable_created_in_run_is_shared_reference_case_24(multi_strategy):
    strategy = multi_strategy
    created = []

    def step():
        v = ds.Variable(5.0 + rid(), name="foo", aggregation="SUM")
        u = ds.Variable(1.0)
        created.append((v, u))
        return v

    out = strategy.run(step)
    assert len(created) == 2
    (v0, u0), (v1, u1) = created
    assert v0 is v1 and u0 is u1
    assert out is v0
    assert type(v0) is expected_kind(strategy)
    assert v0.name == "foo"
    assert u0.name == "Variable"
    assert v0.distribute_strategy is strategy
    assert strategy.extended.variable_created_in_scope(v0)
    # initialised from replica 0's value
    assert replica_reads(strategy, v0) == [5.0, 5.0]
    if isinstance(strategy, ds.MirroredStrategy):
        assert [c.device for c in v0.values] == list(strategy.extended.worker_devices)
    else:
        assert [c.device for c in v0.values] == list(strategy.extended.parameter_devices)


def test_variable_created_in_run_mismatching_names_reference_case_26():
    strategy = mirrored2()
    with pytest.raises(RuntimeError, match="Tried to create variable bar with mismatching name on device 1"):
        strategy.run(lambda: ds.Variable(1.0, name="foo" if rid() == 0 else "bar"))


def test_variable_created_in_run_canonical_names_reference_case_25():
    # TF canonicalises foo_0 / foo_1 to one variable (named after replica 0's)
    strategy = mirrored2()
    out = strategy.run(lambda: ds.Variable(1.0, name=f"foo_{rid()}"))
    assert isinstance(out, ds.MirroredVariable)
    assert out.name == "foo_0"


def test_variable_created_in_merge_fn_is_distributed(multi_strategy):
    strategy = multi_strategy

    def merge_fn(strategy):
        return ds.Variable(4.0, name="merged")

    out = strategy.run(lambda: ds.get_replica_context().merge_call(merge_fn))
    assert type(out) is expected_kind(strategy)
    assert out.name == "merged"
    assert replica_reads(strategy, out) == [4.0, 4.0]


def test_variable_created_in_run_single_replica(strategy):
    if is_multi(strategy):
        pytest.skip("single-replica strategies only")
    out = strategy.run(lambda: ds.Variable(2.0, name="one"))
    assert type(out) is ds.LocalVariable
    assert float(out) == 2.0


# --- colocation, scope membership, value_container -------------------------------------------------
def test_colocate_vars_with(strategy):
    with strategy.scope():
        v = ds.Variable(torch.ones(3), name="v")
        with strategy.extended.colocate_vars_with(v):
            slot = ds.Variable(torch.zeros(3), name="v/momentum", trainable=False)
    assert type(slot) is type(v)
    var_devices = [c.device for c in strategy.experimental_local_results(v)]
    slot_devices = [c.device for c in strategy.experimental_local_results(slot)]
    assert slot_devices == var_devices
    assert slot.device == v.device
    assert strategy.extended.variable_created_in_scope(slot)


def test_colocate_vars_with_parameter_device():
    strategy = ds.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu:3")
    with strategy.scope():
        v = ds.Variable(1.0)
        with strategy.extended.colocate_vars_with(v):
            slot = ds.Variable(0.0)
    assert [c.device for c in slot.values] == ["cpu:3"]


def test_colocate_vars_with_foreign_variable_raises(multi_strategy):
    other = make_strategy("one_device")
    with other.scope():
        foreign = ds.Variable(1.0)
    plain = ds.Variable(1.0)
    with multi_strategy.scope():
        for bad in (foreign, plain):
            with pytest.raises(ValueError, match="`colocate_vars_with` must only be passed a variable created in"):
                with multi_strategy.extended.colocate_vars_with(bad):
                    pass


def test_variable_created_in_scope(strategy):
    with strategy.scope():
        mine = ds.Variable(1.0)
    plain = ds.Variable(1.0)  # default strategy, outside any scope
    with make_strategy("mirrored2").scope() as other_strategy:
        other = ds.Variable(1.0)
    assert other_strategy is not strategy
    assert strategy.extended.variable_created_in_scope(mine) is True
    assert strategy.extended.variable_created_in_scope(other) is False
    default = ds.get_strategy()
    if strategy is default:
        assert strategy.extended.variable_created_in_scope(plain) is True
    else:
        assert strategy.extended.variable_created_in_scope(plain) is False
    # reference 3.7: (True, False, True) for mirrored / plain / plain-vs-default
    assert default.extended.variable_created_in_scope(plain) is True
    assert default.extended.variable_created_in_scope(other) is False


def test_value_container(strategy):
    with strategy.scope():
        v = ds.Variable(torch.ones(2))
        s = ds.Variable(1.0, synchronization="ON_READ", aggregation="SUM")
    extended = strategy.extended
    for var in (v, s):
        for component in strategy.experimental_local_results(var):
            assert extended.value_container(component) is var
        assert extended.value_container(var) is var
    assert extended.value_container(5) == 5
    t = torch.ones(1)
    assert extended.value_container(t) is t


def test_value_container_mirrored_component_1():
    strategy = mirrored2()
    with strategy.scope():
        m = ds.Variable(1.0)
    assert strategy.extended.value_container(m.values[1]) is m
    assert strategy.extended.value_container(m.values[0]) is m


# --- robustness (review findings) ----------------------------------------------------------


def test_central_storage_replicas_have_their_own_autograd_leaves():
    strategy = make_strategy("central_storage2")
    with strategy.scope():
        w = ds.Variable(torch.ones(2))
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((2,), 1.0 if ctx.replica_id_in_sync_group == 0 else 10.0)
    )

    def step(x):
        (w * x).sum().backward()
        return torch.autograd.grad((w * x).sum(), w)[0]

    grads = strategy.experimental_local_results(strategy.run(step, args=(xs,)))
    assert [g.tolist() for g in grads] == [[1.0, 1.0], [10.0, 10.0]]
    assert strategy.reduce("SUM", strategy.run(lambda: w.grad), axis=None).tolist() == [11.0, 11.0]


@pytest.mark.parametrize("write", ["clamp_", "out", "method"])
def test_in_place_torch_functions_cannot_split_a_mirrored_variable(write):
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(torch.ones(3), trainable=False)
    with pytest.raises((TypeError, AttributeError), match="one copy only"):
        if write == "clamp_":
            torch.clamp_(v, max=0.5)
        elif write == "out":
            torch.mul(torch.ones(3), 2, out=v)
        else:
            v.add_(1)
    assert [c.numpy().tolist() for c in v.values] == [[1.0] * 3, [1.0] * 3]


def test_mirrored_variable_refuses_per_replica_in_cross_replica_assign():
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = ds.Variable(0.0)
    with pytest.raises(ValueError, match="one value for every copy"):
        v.assign(ds.PerReplica((torch.tensor(0.0), torch.tensor(1.0))))
    assert [float(c) for c in v.values] == [0.0, 0.0]


def test_setting_grad_reaches_every_copy(multi_strategy):
    with multi_strategy.scope():
        v = ds.Variable(torch.ones(2))
    multi_strategy.run(lambda: (v * 2).sum().backward())
    assert all(t.grad is not None for t in v.copy_tensors())
    v.grad = None
    assert all(t.grad is None for t in v.copy_tensors())


def test_distributed_module_zero_grad_clears_every_replica():
    strategy = make_strategy("mirrored2")
    dm = strategy.distribute_module(torch.nn.Linear(2, 1))
    strategy.run(lambda: dm(torch.ones(1, 2)).sum().backward())
    assert all(r.weight.grad is not None for r in dm.replicas)
    dm.zero_grad()
    assert all(r.weight.grad is None for r in dm.replicas)
