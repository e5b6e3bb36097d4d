"""Scenarios run by the multi-worker tests, in worker processes and (``ops``) in the test process.

``ops(strategy)`` makes the same calls under any strategy and returns global values only, so
a ``MultiWorkerMirroredStrategy`` of 2 workers × 1 replica can be compared bit for bit with
``MirroredStrategy(["cpu:0", "cpu:1"])`` run in the test process.
"""

from __future__ import annotations

import os
import time

import torch

import replicafit.strategies as ds


def strategy_for(rank, num_workers, port, devices=None, timeout=20.0, implementation="AUTO"):
    if devices and any(d != "cpu:0" for d in devices):
        ds.set_logical_cpu_count(max(8, len(devices)))
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=devices)
    options = ds.CommunicationOptions(timeout_seconds=timeout, implementation=implementation)
    return ds.MultiWorkerMirroredStrategy(options, resolver)


def _values(replica_id: int, rows: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + replica_id)
    return torch.randn(rows, 4, generator=generator)


def ops(strategy) -> dict:
    """Every cross-replica operation, with results that are the same on every worker."""
    out: dict = {}
    ctx_id = lambda: ds.get_replica_context().replica_id_in_sync_group  # noqa: E731

    per_replica = strategy.run(lambda: _values(ctx_id()))
    out["run_gathered"] = strategy.gather(per_replica, axis=0)
    out["reduce_sum"] = strategy.reduce("SUM", per_replica, axis=None)
    out["reduce_mean"] = strategy.reduce("MEAN", per_replica, axis=None)
    out["reduce_sum_axis0"] = strategy.reduce("SUM", per_replica, axis=0)
    # Uneven rows: replica r has r + 1 rows, so MEAN along axis 0 divides by the global row count.
    uneven = strategy.run(lambda: _values(ctx_id(), rows=ctx_id() % 3 + 1))
    out["reduce_mean_axis0_uneven"] = strategy.reduce("MEAN", uneven, axis=0)
    out["gather_uneven"] = strategy.gather(uneven, axis=0)
    out["plain_sum"] = strategy.reduce("SUM", torch.tensor([1.0, 2.0]), axis=None)
    out["ids"] = strategy.gather(strategy.run(lambda: torch.tensor([ctx_id()])), axis=0)
    values = strategy.experimental_distribute_values_from_function(
        lambda c: torch.tensor([float(c.replica_id_in_sync_group), float(c.num_replicas_in_sync)])
    )
    out["values_from_function"] = strategy.gather(strategy.run(lambda v: v.unsqueeze(0), args=(values,)), axis=0)

    # Variables: worker 0's initial value everywhere (each worker draws its own here).
    torch.manual_seed(_worker(strategy))
    with strategy.scope():
        w = ds.Variable(torch.randn(4, 2), name="w")
        total = ds.Variable(torch.zeros(2), synchronization="ON_READ", aggregation="SUM", name="total")
        mean = ds.Variable(torch.zeros(2), synchronization="ON_READ", aggregation="MEAN", name="mean")
        first = ds.Variable(torch.zeros(2), aggregation="ONLY_FIRST_REPLICA", name="first")
    out["w_initial"] = w.read_value().clone()

    def step():
        rid = ctx_id()
        x = _values(rid).requires_grad_(True)
        y = ds.get_replica_context().all_reduce("SUM", x @ w.read_value())
        y.pow(2).sum().backward()
        gathered = ds.get_replica_context().all_gather(x.detach() * (rid + 1), axis=0)
        total.assign_add(torch.full((2,), float(rid + 1)))
        mean.assign_add(torch.full((2,), float(rid + 1)))
        first.assign(torch.full((2,), float(rid + 7)))

        def merge_fn(s, grad):
            reduced = s.extended.batch_reduce_to("SUM", [(grad, w)])[0]
            return s.extended.update(w, lambda c, g: c.assign_sub(0.01 * g), args=(reduced,))

        grad = torch.ones(4, 2) * (rid + 1)
        ds.get_replica_context().merge_call(merge_fn, args=(grad,))
        return y.detach(), x.grad, gathered

    y, xgrad, gathered = strategy.run(step)
    out["all_reduce"] = strategy.gather(y, axis=0)
    out["all_reduce_grad"] = strategy.gather(xgrad, axis=0)
    out["all_gather"] = strategy.gather(gathered, axis=0)
    out["w_after"] = w.read_value().clone()
    out["sync_on_read_sum"] = total.read_value().clone()
    out["sync_on_read_mean"] = mean.read_value().clone()
    out["only_first"] = first.read_value().clone()
    with strategy.scope():
        total.assign(torch.tensor([6.0, 8.0]))  # each copy gets its share of all replicas
    out["sync_on_read_assigned"] = total.read_value().clone()
    out["num_replicas"] = strategy.num_replicas_in_sync
    return out


def _worker(strategy) -> int:
    return strategy.cluster.worker_index


def basics(rank, num_workers, port, devices=None, staged=False, implementation="AUTO"):
    strategy = strategy_for(rank, num_workers, port, devices, implementation=implementation)
    if staged:  # the path of CUDA tensors on gloo (RING), forced: gathers go through host memory
        strategy.extended._collective._staged = True
    result = ops(strategy)
    result["local_results"] = len(strategy.experimental_local_results(strategy.run(lambda: torch.tensor(1.0))))
    result["should_checkpoint"] = strategy.extended.should_checkpoint
    result["repr"] = repr(strategy)
    strategy.cluster.barrier("end")
    return result


def module_broadcast(rank, num_workers, port):
    strategy = strategy_for(rank, num_workers, port)
    torch.manual_seed(rank)  # different initial weights per worker
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    dm = strategy.distribute_module(model)
    state = {k: v.clone() for k, v in dm.state_dict().items()}
    strategy.cluster.barrier("end")
    return state


def first_replica_reads(rank, num_workers, port):
    """A state dict of a model with three (synchronized) BatchNorm layers: the worker-0 reads of their
    statistics and step counts, and how many broadcasts the read made."""
    strategy = strategy_for(rank, num_workers, port)
    layers = [torch.nn.BatchNorm1d(4) for _ in range(3)]
    dm = strategy.distribute_module(torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(*layers)))
    for replica in dm.replicas:  # each worker's own values: a read must give worker 0's
        for buffer in replica.buffers():
            buffer.fill_(rank + 1)
    collective, calls = strategy.extended._collective, []
    broadcast = collective.broadcast
    collective.broadcast = lambda tensor, what: (calls.append(what), broadcast(tensor, what))[1]
    state = {k: v.clone() for k, v in dm.state_dict().items()}
    collective.broadcast = broadcast
    strategy.cluster.barrier("end")
    return {"state": state, "broadcasts": len(calls)}


def module_mismatch(rank, num_workers, port):
    strategy = strategy_for(rank, num_workers, port)
    model = torch.nn.Linear(3, 4 + rank)
    strategy.distribute_module(model)
    return "built"


def stuck_or_killed(rank, num_workers, port, mode="sleep", timeout=2.0):
    strategy = strategy_for(rank, num_workers, port, timeout=timeout)
    with strategy.scope():
        v = ds.Variable(torch.zeros(3))
    for step in range(1000):
        if rank == 1 and step == 3:
            if mode == "sleep":
                time.sleep(60)
            else:
                os.kill(os.getpid(), 9)
        start = time.monotonic()
        try:
            out = strategy.run(lambda: torch.ones(3))
            with strategy.scope():
                v.assign(strategy.reduce("SUM", out, axis=None))
        except ds.WorkerFailedError as error:
            return {"step": step, "waited": time.monotonic() - start, "message": str(error)}
    return {"step": None}


def cluster_contract(rank, num_workers, port, stop_at=None):
    """Every call of the cluster contract, with answers that differ by worker; ``stop_at``: the
    worker with that index never reaches the barrier (the others must fail, naming it)."""
    strategy = strategy_for(rank, num_workers, port, timeout=5.0)
    cluster = strategy.cluster
    out = {
        "facts": (cluster.is_chief, cluster.num_workers, cluster.worker_index),
        "replicas": (cluster.num_local_replicas, cluster.first_replica_id),
        "broadcast": cluster.broadcast({"from": rank}),
        "all_gather": cluster.all_gather(("worker", rank)),
        "any_one": cluster.any(rank == num_workers - 1),
        "all_one": cluster.all(rank == num_workers - 1),
        "all_every": cluster.all(True),
        "any_none": cluster.any(False),
        "sum": cluster.sum(rank + 1),
        "sum_list": cluster.sum([1, rank]),
    }
    channel = cluster.input_channel()
    finish = channel.start_sum([rank, 10])  # in flight while the control channel is used
    out["broadcast_while_started"] = cluster.broadcast(rank)
    out["start_sum"] = finish()
    out["input_all_gather"] = channel.all_gather(rank)
    if stop_at == rank:
        time.sleep(30)  # never arrives: its peers' barrier times out
        return out
    cluster.barrier("end of the contract")
    return out


def step_values(rank, num_workers, port, buckets=False, dtype="float32"):
    """Step values carried by a gradient reduction across workers, on the packed path or (``buckets``)
    in the spare elements of the last gradient bucket; the collectives counted with and without."""
    strategy = strategy_for(rank, num_workers, port, devices=["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(getattr(torch, dtype))
    dm = strategy.distribute_module(model)
    variables = list(dm.trainable_variables)
    collective = strategy.extended._collective
    out = {"operations": [], "totals": [], "grads": []}

    def step(carry):
        ctx = ds.get_replica_context()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.replica_id_in_sync_group)).to(model[0].weight)
        loss = dm(x).float().pow(2).sum()
        grads = torch.autograd.grad(loss, [v.value() for v in variables])
        if carry:
            strategy.cluster.add_to_step("rows", 3 + ctx.replica_id_in_sync_group)
            strategy.cluster.add_to_step("big", 2**35 + 1)
            strategy.cluster.add_to_step("stop", torch.tensor(int(ctx.replica_id_in_sync_group == 3)))

        def merge(s, *grads):
            return [r.values[0].clone() for r in s.extended.batch_reduce_to("SUM", list(zip(grads, variables)))]

        return ctx.merge_call(merge, args=tuple(grads))

    for carry in (False, True, False, True):  # a plain step after a carried one, then another carried
        before = collective.operations
        if buckets:
            with strategy.extended.gradient_step(variables):
                result = strategy.run(step, args=(carry,))
        else:
            result = strategy.run(step, args=(carry,))
        out["operations"].append(collective.operations - before)
        out["grads"].append([g.float() for g in strategy.experimental_local_results(result)[0]])
        if carry:
            out["totals"].append([int(strategy.cluster.step_total(n)) for n in ("rows", "big", "stop")])
    strategy.extended.release_gradient_hooks()
    strategy.cluster.barrier("end")
    return out


def sharded_reductions(rank, num_workers, port, length=11, dtype="float32"):
    """``start_reduce_scatter`` of an uneven buffer (padded to equal parts), then the doubled parts gathered back
    in place with ``start_all_gather_in_place`` (NCCL's way, on gloo: ``prefer_scatter``), warnings recorded."""
    import warnings

    from replicafit.strategies.collective import Collective

    Collective.prefer_scatter = True  # the all-gather itself, not gloo's all-reduce of the parts
    strategy = strategy_for(rank, num_workers, port)
    collective = strategy.extended._collective
    kind = getattr(torch, dtype)
    buffer = torch.arange(length, dtype=kind) * (rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chunk, _ = collective.start_reduce_scatter(buffer, None, "a test's reduce-scatter").result()
        gathered = buffer.new_zeros(chunk.numel() * num_workers)
        gathered[rank * chunk.numel() : (rank + 1) * chunk.numel()] = chunk * 2
        whole = collective.start_all_gather_in_place(gathered, "a test's all-gather").result()[:length]
    return {"chunk": chunk, "whole": whole, "warnings": [str(w.message) for w in caught]}


def sharded_with_step_values(rank, num_workers, port, length=10):
    """``start_reduce_scatter`` carrying values: each worker's part of the summed buffer, and the carried values'
    total."""
    strategy = strategy_for(rank, num_workers, port)
    collective = strategy.extended._collective
    buffer = torch.arange(length, dtype=torch.float32) + rank
    carried = torch.tensor([rank + 1.0, 2.0, 0.5])
    return collective.start_reduce_scatter(buffer, carried, "a test's reduce-scatter with step values").result()


def small_sums(rank, num_workers, port, implementation="AUTO"):
    """Each way ``Collective`` sums across workers, on buffers at, under and over ``gather_sum_bytes`` (made
    small here): the result, and which torch collective each sum called (an all-gather and a local sum in
    worker order, or gloo's all-reduce)."""
    import torch.distributed as dist

    import replicafit.strategies.collective as module

    strategy = strategy_for(rank, num_workers, port, implementation=implementation)
    collective = strategy.extended._collective
    if implementation == "AUTO":
        assert collective.gather_sum_bytes == 1 << 20
        collective.gather_sum_bytes = 16 * num_workers  # 4 float32 elements per worker gathered
    calls = []
    gather, reduce = module._all_gather_single, dist.all_reduce

    def counted(name, original):
        def call(*args, **kwargs):
            calls[-1][1].append(name)
            return original(*args, **kwargs)

        return call

    module._all_gather_single, dist.all_reduce = counted("gather", gather), counted("all_reduce", reduce)
    out = {}
    try:
        for length in (3, 4, 5):  # under, at and over the bound
            values = torch.randn(length, generator=torch.Generator().manual_seed(7 + rank))
            buffer = values.clone()
            calls.append((f"bucket {length}", []))
            collective.wait_work(collective.start_all_reduce(buffer, "a bucket"), "a bucket")
            out[f"bucket {length}"] = buffer
            flat = values.clone()
            calls.append((f"flat {length}", []))
            collective.all_reduce_flat([flat], "a pack")
            out[f"flat {length}"] = flat
        calls.append(("sum_ints", []))
        out["sum_ints"] = collective.sum_ints([rank, 1], "a sum")
        calls.append(("start_sum_ints", []))
        out["start_sum_ints"] = collective.start_sum_ints([rank + 1, 2], "a started sum")()
        # A sum is written whatever autograd or inference mode the caller is in, as an all-reduce writes it: a
        # per-replica loss that still requires grad, reduced; an input agreement started under inference mode
        # and finished outside it.
        calls.append(("requires grad", []))
        weights = torch.ones(3, requires_grad=True)
        out["requires grad"] = strategy.reduce("SUM", weights * (rank + 1), axis=None).detach()
        calls.append(("inference mode", []))
        with torch.inference_mode():
            finish = collective.start_sum_ints([1, rank], "a sum started under inference mode")
        out["inference mode"] = finish()
        out["failed"] = collective.failed
    finally:
        module._all_gather_single, dist.all_reduce = gather, reduce
    out["calls"] = dict(calls)
    strategy.cluster.barrier("end")
    return out


def host_objects(rank, num_workers, port, host_workers=()):
    """Object collectives the way workers on accelerators make them (``_host_objects``, forced on the CPU):
    pickled to bytes, float64 tensors standing in for the accelerator's (marked), unpickled on the receiver's
    device; ``host_workers``: these workers make them as workers on the host do (a cluster of both kinds)."""
    from replicafit.strategies import collective as module

    class Marked(module._HostPickler):
        def _off_host(self, tensor):
            return tensor.dtype == torch.float64

    strategy = strategy_for(rank, num_workers, port)
    collective = strategy.extended._collective
    collective._host_objects, collective._pickler = rank not in host_workers, Marked
    marked = torch.full((2,), float(rank), dtype=torch.float64)
    mine = {"rank": rank, "values": [marked, torch.arange(rank + 1)], "again": marked}
    broadcast = collective.broadcast_object(mine, "an object")
    out = {
        "gathered": collective.all_gather_object(mine, "objects"),
        "broadcast": broadcast,
        "kept_own": broadcast is mine,
    }
    strategy.cluster.barrier("end")
    return out
