"""Sharded optimizer states (``MultiWorkerMirroredStrategy(shard_optimizer_states=True)``) against the unsharded
run on 2 and 3 gloo workers: every element-wise optimizer unchanged, the pipeline's features agreed across
shards, checkpoints in the unsharded layout that load anywhere."""

from __future__ import annotations

import os

import mw_sharding_scenarios as scenarios
import pytest
import torch
from multiworker_harness import results, run_workers

SCENARIOS = scenarios.__file__
TOLERANCE = 1e-6


def _largest(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0 for k in a)


def _same_layout(sharded, whole, where: str) -> float:
    """The largest difference of two optimizer states with the same layout (``AssertionError`` otherwise)."""
    if isinstance(whole, dict):
        assert set(sharded) == set(whole), where
        return max([_same_layout(sharded[k], whole[k], f"{where}/{k}") for k in whole] or [0.0])
    if isinstance(whole, (list, tuple)):
        assert len(sharded) == len(whole), where
        return max([_same_layout(a, b, where) for a, b in zip(sharded, whole)] or [0.0])
    if isinstance(whole, torch.Tensor):
        assert isinstance(sharded, torch.Tensor) and sharded.shape == whole.shape and sharded.dtype == whole.dtype, (
            where
        )
        return float((sharded.double() - whole.double()).abs().max()) if whole.numel() else 0.0
    assert sharded == whole, where
    return 0.0


CASES_2 = [
    ("adam", {}),
    ("adamw_global_clipnorm", {}),
    ("lion", {}),
    ("torch_adamw", {}),
    ("adam_accumulation", {}),
    ("loss_scaled", {}),
    ("adamw_excluded", {}),  # clipnorm per variable, weight decay with exclusions by name
    ("sgd_momentum_ema", {}),  # the averages are pieces; fit's finalize gathers them
    ("rmsprop_clipvalue", {}),
    ("adagrad", {"units": 1}),  # a 1-unit layer: segments shorter than the number of workers
    ("adam", {"bytes_per_pack": 512}),  # several buckets reduce-scattered during backward
    ("adam", {"bytes_per_pack": 512, "overlap": False}),  # ... or after it
    ("adam", {"local": 2}),  # two replicas per worker
    ("adam", {"reader": True}),  # a callback reads the weights after every step: the update is there
    ("sgd_momentum_later", {}),  # slots a hyper-parameter asks for after the build: made for the pieces
    ("adam", {"bytes_per_pack": 512, "min_bytes": 600}),  # buckets under 600 bytes stay whole, the others cut
    ("adam", {"bytes_per_pack": 512, "min_bytes": 600, "local": 2}),
    ("adamw_global_clipnorm", {"bytes_per_pack": 512, "min_bytes": 600}),  # whole buckets' squares counted once
    ("adamw_excluded", {"bytes_per_pack": 512, "min_bytes": 600}),
    ("adam", {"bytes_per_pack": 512, "min_bytes": 1 << 30}),  # every bucket whole: not sharded at all
]
CASES_3 = [*CASES_2[:6], ("adam", {"bytes_per_pack": 512})]


# scatter: the reduction and gather as reduce-scatter and all-gather (NCCL's way), or as all-reduces (gloo's way)
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "workers, cases, scatter",
    [(2, CASES_2, False), (3, CASES_3, False), (2, CASES_2, True), (3, CASES_3, True)],
    ids=["2-workers", "3-workers", "2-workers-scatter", "3-workers-scatter"],
)
def test_sharded_runs_equal_the_unsharded_runs_and_every_worker_agrees_bit_for_bit(workers, cases, scatter):
    kwargs = {"cases": cases, "scatter": scatter}
    outcomes = results(run_workers(SCENARIOS, "compare", workers, timeout=280, kwargs=kwargs))
    for number, (kind, kwargs) in enumerate(cases):
        what = f"{kind} {kwargs}"
        sharded, whole = outcomes[0][number]["sharded"], outcomes[0][number]["whole"]
        assert _largest(sharded["weights"], whole["weights"]) <= TOLERANCE, what
        for ours, theirs in zip(sharded["read"] or (), whole["read"] or ()):  # after every step, as unsharded
            assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) <= TOLERANCE, what
        assert (sharded["read"] is None) == (whole["read"] is None) and len(sharded["read"] or ()) == len(
            whole["read"] or ()
        ), what
        assert _same_layout(sharded["state"], whole["state"], what) <= TOLERANCE, what  # gathered, unsharded layout
        for name in ("loss",):
            assert sharded["history"][name] == pytest.approx(whole["history"][name], abs=1e-5), what
        owned = [outcomes[rank][number]["sharded"]["owned"] for rank in range(workers)]
        kept = [outcomes[rank][number]["sharded"]["whole"] for rank in range(workers)]
        total = sum(v.numel() for v in whole["weights"].values())
        if kwargs.get("min_bytes", 0) > 1 << 20:  # nothing cut: the unsharded run, the same collectives
            assert owned == [None] * workers and sharded["operations"] == whole["operations"], what
            continue
        assert sum(owned) + kept[0] == total and len(set(kept)) == 1, what  # every element: one owner, or all
        assert (kept[0] > 0) == ("min_bytes" in kwargs) and sum(owned) > 0, what
        assert max(owned) - min(owned) <= 3 * workers, what  # balanced, give or take a chunk's padding per segment
        for rank in range(1, workers):
            theirs = outcomes[rank][number]["sharded"]
            for key, value in sharded["weights"].items():
                assert torch.equal(theirs["weights"][key], value), f"{what}: worker {rank} {key}"


@pytest.mark.timeout(200)
def test_checkpoints_hold_the_unsharded_layout_and_load_in_one_process_and_on_three_sharded_workers(tmp_path):
    kinds = ("adam", "torch_adamw", "sgd_momentum_ema")
    results(run_workers(SCENARIOS, "first_epoch", 2, timeout=120, kwargs={"directory": str(tmp_path), "kinds": kinds}))
    for kind in kinds:  # the chief wrote the whole state: the sharded run's file holds what the unsharded one does
        sharded = torch.load(tmp_path / f"{kind}-sharded.pt", weights_only=True)["optimizer"]
        whole = torch.load(tmp_path / f"{kind}-whole.pt", weights_only=True)["optimizer"]
        assert _same_layout(sharded, whole, kind) == 0.0  # two workers sum in the same order: bit for bit
    one = results(
        run_workers(SCENARIOS, "second_epoch", 1, timeout=120, kwargs={"directory": str(tmp_path), "kinds": kinds})
    )
    three = results(
        run_workers(SCENARIOS, "second_epoch", 3, timeout=150, kwargs={"directory": str(tmp_path), "kinds": kinds})
    )
    for kind in kinds:
        for runs, label in ((one, "one process"), (three, "3 sharded workers")):
            resumed, oracle = runs[0][kind, "sharded"], runs[0][kind, "whole"]
            assert _same_layout(resumed["loaded"], oracle["loaded"], f"{kind} {label}") == 0.0
            assert _largest(resumed["weights"], oracle["weights"]) <= TOLERANCE, f"{kind} {label}"
            assert _same_layout(resumed["state"], oracle["state"], f"{kind} {label}") <= TOLERANCE
        for rank in (1, 2):
            for key, value in three[0][kind, "sharded"]["weights"].items():
                assert torch.equal(three[rank][kind, "sharded"]["weights"][key], value), f"{kind} worker {rank}"


@pytest.mark.timeout(200)
def test_the_sharded_checkpoint_format_loads_in_one_process_and_on_three_sharded_workers(tmp_path):
    """``save_checkpoint(path, sharded=True)`` under sharded optimizer states: a directory every worker writes its
    chunks of the slots into (nothing gathered); it loads as the whole file does."""
    kinds = ("adam", "torch_adamw", "sgd_momentum_ema")
    kwargs = {"directory": str(tmp_path), "kinds": kinds, "sharded_format": True}
    results(run_workers(SCENARIOS, "first_epoch", 2, timeout=120, kwargs=kwargs))
    assert sorted(os.listdir(tmp_path / "adam-sharded.pt")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    one = results(
        run_workers(SCENARIOS, "second_epoch", 1, timeout=120, kwargs={"directory": str(tmp_path), "kinds": kinds})
    )
    three = results(
        run_workers(SCENARIOS, "second_epoch", 3, timeout=150, kwargs={"directory": str(tmp_path), "kinds": kinds})
    )
    for kind in kinds:
        for runs, label in ((one, "one process"), (three, "3 sharded workers")):
            resumed, oracle = runs[0][kind, "sharded"], runs[0][kind, "whole"]
            assert _same_layout(resumed["loaded"], oracle["loaded"], f"{kind} {label}") == 0.0
            assert _largest(resumed["weights"], oracle["weights"]) <= TOLERANCE, f"{kind} {label}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scatter", [False, True])
def test_custom_loops_reduce_scatter_without_buckets_and_whole_rules_are_refused(scatter):
    outcomes = results(run_workers(SCENARIOS, "custom_loops", 2, timeout=100, kwargs={"scatter": scatter}))
    for cross in (False, True):
        sharded, whole = outcomes[0][True, cross], outcomes[0][False, cross]
        for a, b in zip(sharded["weights"], whole["weights"]):
            assert float((a - b).abs().max()) <= TOLERANCE, f"cross_replica={cross}"
        assert _same_layout(sharded["state"], whole["state"], f"cross_replica={cross}") <= TOLERANCE
        for a, b in zip(sharded["weights"], outcomes[1][True, cross]["weights"]):
            assert torch.equal(a, b)
        total = sum(w.numel() for w in whole["weights"])
        assert whole["owned"] is None and sharded["owned"] + outcomes[1][True, cross]["owned"] == total
    for outcome in outcomes:
        message = outcome["refused"]
        assert message is not None and "elementwise_update = False" in message, message
        assert "shard_optimizer_states=False" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scatter", [False, True])
def test_an_element_level_loss_counts_its_real_elements_through_the_reduce_scatter(scatter):
    outcomes = results(run_workers(SCENARIOS, "element_level", 2, timeout=100, kwargs={"scatter": scatter}))
    for outcome in outcomes:
        assert _largest(outcome[True], outcome[False]) <= TOLERANCE


@pytest.mark.timeout(120)
def test_moved_parameters_empty_parameters_and_the_refusals():
    outcomes = results(run_workers(SCENARIOS, "edges", 2, timeout=100))
    for outcome in outcomes:
        for kind in ("adam", "torch_adamw"):  # param.data = ... after the first step: the pieces follow
            for a, b in zip(outcome["moved", kind, True], outcome["moved", kind, False]):
                assert float((a - b).abs().max()) <= TOLERANCE, kind
        sharded, whole = outcome["empty", True], outcome["empty", False]
        assert _largest(sharded["weights"], whole["weights"]) <= TOLERANCE
        assert _same_layout(sharded["state"], whole["state"], "empty parameters") <= TOLERANCE
        assert "would own no element" in outcome["tiny"] and "shard_optimizer_states=False" in outcome["tiny"]
        assert "elementwise_update = False" in outcome["adafactor"]


@pytest.mark.timeout(120)
def test_a_step_that_fails_after_its_update_leaves_every_worker_with_the_whole_update():
    outcomes = results(run_workers(SCENARIOS, "failed_step", 2, timeout=100))
    for outcome in outcomes:
        assert outcome[True, "error"] == outcome[False, "error"] == "boom"
        assert _largest(outcome[True], outcome[False]) <= TOLERANCE
    for key, value in outcomes[0][True].items():
        assert torch.equal(outcomes[1][True][key], value), key


@pytest.mark.timeout(120)
def test_a_second_optimizer_of_the_same_variables_builds_its_own_slots_and_exclusions():
    """Regression: the strategy hands every optimizer of these variables the same shards; the second one built
    no slots (KeyError) or no exclusions (it decayed the excluded bias)."""
    outcomes = results(run_workers(SCENARIOS, "second_optimizers", 2, timeout=100))
    for outcome in outcomes:
        assert _largest(outcome[True], outcome[False]) <= TOLERANCE


@pytest.mark.timeout(120)
def test_model_checkpoint_weights_stay_one_file_and_full_checkpoints_are_sharded(tmp_path):
    """The weights are whole on every worker: ``save_weights_only`` writes one file ``torch.load`` reads; a full
    checkpoint is a sharded directory (the slots are each worker's)."""
    (got, _) = results(run_workers(SCENARIOS, "weights_checkpoints", 2, timeout=100, kwargs={"folder": str(tmp_path)}))
    assert (tmp_path / "weights.pt").is_file() and (tmp_path / "full").is_dir()
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in got["weights"].items())
