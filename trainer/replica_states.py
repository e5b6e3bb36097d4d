"""Every replica's own values of distributed variables, for checkpoints and backups: gathered in global
replica order (across workers too) and given back to the replicas of a run with as many replicas.

A ``SyncOnRead`` variable (a metric's accumulator, a plain BatchNorm statistic) keeps one value per replica
until it is read; a backup that holds each replica's own value (rather than their aggregate, divided among
the replicas on restore) resumes bit-identically.

Used by ``CompileMetrics`` (the metrics' accumulators) and ``TrainingState`` (the model's per-replica
buffers).

Example::

    saved = gather_replica_states(strategy, {"bn.running_mean": variable})  # {"bn.running_mean": [t0, t1]}
    restore_replica_states(strategy, {"bn.running_mean": variable}, saved)
"""

from __future__ import annotations

import torch

__all__ = ["gather_replica_states", "restore_replica_states"]


def gather_replica_states(strategy, variables: dict) -> dict:
    """``{key: [every replica's value, in global replica order]}`` of ``{key: distributed variable}``
    (gathered across workers: every worker calls it).

    Example::

        gather_replica_states(strategy, {"accuracy/total": variable})  # {"accuracy/total": [t0, t1]}
    """
    crossing = strategy.cluster.num_workers > 1  # (then host copies: what a file keeps, not every worker's GPU)
    own = {
        key: [
            c.value().detach().to("cpu", copy=True) if crossing else c.value().detach().clone()
            for c in strategy.experimental_local_results(variable)
        ]
        for key, variable in variables.items()
    }
    parts = strategy.cluster.all_gather(own)  # every worker's replicas, in order
    return {key: [t for part in parts for t in part[key]] for key in own}


def restore_replica_states(strategy, variables: dict, saved: dict) -> None:
    """Gives this worker's replicas their values in ``saved`` (``gather_replica_states``), where it was
    written with this number of replicas; otherwise what was loaded (the aggregate) stands.

    Example::

        restore_replica_states(strategy, {"accuracy/total": variable}, backup["metric_replicas"])
    """
    cluster = strategy.cluster
    first, count = cluster.first_replica_id, cluster.num_local_replicas
    for key, variable in variables.items():
        values = saved.get(key)
        components = strategy.experimental_local_results(variable)
        if not isinstance(values, list) or len(values) != strategy.num_replicas_in_sync:
            continue  # another replica count: the aggregate, divided among the replicas, stands
        for index, (component, value) in enumerate(zip(components, values[first : first + count])):
            if isinstance(value, torch.Tensor) and value.shape == component.shape:
                variable.assign_component(index, value)
