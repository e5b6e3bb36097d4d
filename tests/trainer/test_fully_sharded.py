"""``FullyShardedStrategy`` (torch's ``fully_shard``) against one process on the same global batches: 2 and 3
workers (gloo over loopback) equal the default strategy within 1e-6 after 2 epochs with a partial last batch,
and agree bit for bit, for every optimizer path (built-ins, a ``build`` + ``update_step`` subclass, ``from_torch``,
global and per-variable clipping, weight decay exclusions, moving averages, loss scaling, accumulation), an
element-level loss with ``ignore_index`` padding and a Hugging Face GPT-2 with its own loss."""

from __future__ import annotations

import os

import pytest
import torch
from multiworker_harness import results, run_workers

SCENARIOS = os.path.join(os.path.dirname(__file__), "fsdp_scenarios.py")
TOLERANCE = 1e-6

import fsdp_scenarios  # noqa: E402  (tests/trainer is on the path: the one-process oracle)

pytestmark = pytest.mark.timeout(240)

KINDS = (
    "adam",
    "adamw_global_clipnorm",
    "adamw_clipnorm_excluded",
    "sgd_momentum_ema",
    "lion",
    "torch_adamw",
    "adam_accumulation",
    "loss_scaled",
)


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def run(name: str, workers: int, **kwargs) -> list:
    outcomes = run_workers(SCENARIOS, name, workers, timeout=200, kwargs=kwargs)
    return results(outcomes)


def check_equal_to_one_process(expected: dict, got: list) -> None:
    for worker in got:
        assert largest_difference(worker["weights"], expected["weights"]) <= TOLERANCE
        for key in expected["history"]:
            assert worker["history"][key] == pytest.approx(expected["history"][key], abs=TOLERANCE)
    for worker in got[1:]:  # every worker holds the same whole values, bit for bit
        assert all(torch.equal(worker["weights"][k], got[0]["weights"][k]) for k in got[0]["weights"])


@pytest.mark.parametrize("workers", [2, 3])
def test_every_optimizer_path_equals_one_process(workers):
    expected = {kind: fsdp_scenarios.fit(0, None, 0, kind=kind) for kind in KINDS}
    got = run("fits", workers, kinds=KINDS)
    for kind in KINDS:
        check_equal_to_one_process(expected[kind], [worker[kind] for worker in got])
        # The optimizer's state, gathered whole, is the one process's (slots of every worker's shards).
        for worker in got:
            for position, slots in expected[kind]["state"].get("slots", {}).items():
                for name, value in slots.items():
                    assert float((worker[kind]["state"]["slots"][position][name] - value).abs().max()) <= 1e-5


@pytest.mark.parametrize("workers", [2, 3])
def test_element_level_loss_with_padding_equals_one_process(workers):
    """``CrossEntropyLoss(ignore_index=-100)`` divides by the global count of real tokens: the count is summed over
    the workers in a small all-reduce of its own (fully_shard reduces the gradients)."""
    check_equal_to_one_process(fsdp_scenarios.element_fit(0, None, 0), run("element_fit", workers))


@pytest.mark.parametrize("workers", [2, 3])
def test_gpt2_with_its_own_loss_equals_one_process(workers):
    pytest.importorskip("transformers")
    expected = fsdp_scenarios.gpt2_fit(0, None, 0)
    got = run("gpt2_fit", workers)
    check_equal_to_one_process(expected, got)
    assert len(got[0]["units"]) == 2  # GPT-2's _no_split_modules: one unit per GPT2Block
    # Validation, evaluate and predict with a partial last batch (3 workers: a worker without rows runs a stand-in
    # row, since GPT-2 cannot take an empty batch and every worker must gather the parameters).
    for worker in got:
        assert worker["history"]["val_loss"] == pytest.approx(expected["history"]["val_loss"], abs=TOLERANCE)
        assert worker["evaluated"] == pytest.approx(expected["evaluated"], abs=TOLERANCE)
        assert worker["predicted"].shape == expected["predicted"].shape == (10, 9, 40)
        assert float((worker["predicted"] - expected["predicted"]).abs().max()) <= 1e-5


def test_one_worker_equals_the_default_strategy_bit_for_bit():
    expected = fsdp_scenarios.one_worker_fit(0, None, 0)
    (got,) = run("one_worker_fit", 1)
    assert all(torch.equal(got["weights"][k], expected["weights"][k]) for k in expected["weights"])
    assert got["history"] == expected["history"]


def test_bf16_mixed_gathers_bfloat16_and_keeps_float32_shards():
    got = run("precision_fit", 2)
    for worker in got:
        assert worker["forward"] == ["torch.bfloat16"]  # the unit's parameters as its forward sees them
        assert worker["stored"] == ["torch.float32"]  # the sharded parameters (and so the optimizer) stay float32
        assert torch.isfinite(torch.tensor(worker["history"]["loss"])).all()


# --- checkpoints -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return {
        kind: fsdp_scenarios.backed_up_fit(0, None, 0, str(tmp_path_factory.mktemp("full")), kind=kind)
        for kind in ("adamw_global_clipnorm", "adam_accumulation")
    }


@pytest.mark.parametrize(
    "resume_on,kind",
    [(3, "adamw_global_clipnorm"), (1, "adamw_global_clipnorm"), ("default", "adamw_global_clipnorm")]
    + [(3, "adam_accumulation"), ("default", "adam_accumulation")],
)
def test_a_sharded_backup_of_2_workers_resumes_on_other_counts(tmp_path, uninterrupted, resume_on, kind):
    """Interrupted at global step 7 of 10 (the last backup at step 6, mid-epoch; with windows of 3 steps, mid-window
    too): every worker wrote its shards into ``backup.sharded``; the run resumed on 3 workers, 1 worker, and in one
    process (the default strategy, reading whole tensors) equals the uninterrupted one."""
    uninterrupted = uninterrupted[kind]
    backup_dir = str(tmp_path)
    crashed = run("backed_up_fit", 2, backup_dir=backup_dir, crash_at=7, kind=kind)
    assert all(worker["crashed"] for worker in crashed)
    assert crashed[0]["files"] == ["backup.sharded"]
    assert sorted(os.listdir(os.path.join(backup_dir, "backup.sharded"))) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "state.pt",
    ]
    if resume_on == "default":
        got = [fsdp_scenarios.backed_up_fit(0, None, 0, backup_dir, kind=kind)]
    else:
        got = run("backed_up_fit", resume_on, backup_dir=backup_dir, kind=kind)
    for worker in got:
        assert not worker["crashed"] and worker["files"] == []  # the fit completed: its backup deleted
        assert largest_difference(worker["weights"], uninterrupted["weights"]) <= TOLERANCE
        assert worker["history"]["loss"] == pytest.approx(uninterrupted["history"]["loss"], abs=TOLERANCE)


def test_the_consolidated_export_loads_with_torch_load(tmp_path):
    """``trainer.save_checkpoint(path)`` under 2 workers: one file, written by the chief, which ``torch.load``
    reads in this process (no strategy) and a plain model loads; its weights are the workers' shards put
    together."""
    path = str(tmp_path / "model.pt")
    got = run("exported", 2, path=path)
    state = torch.load(path, weights_only=True)
    model = fsdp_scenarios.Net()
    model.load_state_dict(state["model"])
    for name, whole in state["model"].items():
        assert torch.equal(torch.cat([worker["shards"][name] for worker in got]), whole)
    assert set(state["optimizer"]["slots"][0]) == {"momentum", "velocity"}
    assert state["optimizer"]["slots"][0]["momentum"].shape == state["model"]["inp.weight"].shape


@pytest.mark.parametrize(
    "options",
    [
        {"activation_checkpointing": True},
        {"reshard_after_forward": False},
        {"shard_units": None},  # by size: none of these blocks is big enough, the model is the one unit
    ],
    ids=["activation_checkpointing", "no_reshard_after_forward", "model_only"],
)
def test_strategy_options_keep_the_results(options):
    expected = fsdp_scenarios.variant_fit(0, None, 0)
    got = run("variant_fit", 2, **options)
    check_equal_to_one_process(expected, got)
    # Activation checkpointing recomputes each unit's forward in its backward: one more forward pass per step (the
    # first batch's probe, in eval mode without gradients, has no backward).
    steps = expected["forward_calls"] - 1
    extra = steps if options.get("activation_checkpointing") else 0
    assert all(worker["forward_calls"] == expected["forward_calls"] + extra for worker in got)


def test_16_mixed_keeps_its_loss_scaling():
    got = run("variant_fit", 2, precision="16-mixed")
    for worker in got:
        assert torch.isfinite(torch.tensor(worker["history"]["loss"])).all()
        assert {v.dtype for v in worker["weights"].values()} == {torch.float32}


def test_the_tf_distribute_surface_works_alike():
    got = run("surface", 2)
    for rank, worker in enumerate(got):
        assert worker["replicas"] == 2 and worker["chief"] == (rank == 0)
        assert worker["total"] == [3.0] and worker["gathered"] == [1.0, 2.0]
        assert worker["variable"] == 0.0
        caps = worker["capabilities"]
        assert caps.shards_parameters and caps.shards_optimizer_states and not caps.whole_state_on_every_worker
    # Each worker reads its rows of every global batch (4, 4, 2: split 2/2, 2/2, 1/1).
    assert got[0]["rows"] == [[0.0, 1.0], [4.0, 5.0], [8.0]]
    assert got[1]["rows"] == [[2.0, 3.0], [6.0, 7.0], [9.0]]


@pytest.mark.parametrize("weights_only", [False, True])
def test_model_checkpoint_writes_sharded_directories_that_load_anywhere(tmp_path, weights_only):
    folder = str(tmp_path)
    trained = run("model_checkpoints", 2, folder=folder, weights_only=weights_only)[0]["weights"]
    assert sorted(os.listdir(folder)) == ["ckpt-1", "ckpt-2"]
    assert "state.pt" in os.listdir(os.path.join(folder, "ckpt-2"))
    if weights_only:
        from replicafit.trainer import sharded_checkpoint

        state = sharded_checkpoint.load(os.path.join(folder, "ckpt-2"), "weights", _whole_target, _OneProcess())
        assert largest_difference(state, trained) == 0.0
        return
    for got in [*run("load_model_checkpoint", 3, path=os.path.join(folder, "ckpt-2")), _load_here(folder)]:
        assert largest_difference(got["weights"], trained) == 0.0
        assert got["iterations"] == 10 and got["epoch"] == 1  # (saved in the last epoch's end, 0-based)


def _whole_target(where, shape, dtype, skeleton):
    return torch.empty(shape, dtype=dtype)


class _OneProcess:
    num_workers = 1


def _load_here(folder):
    return fsdp_scenarios.load_model_checkpoint(0, None, 0, os.path.join(folder, "ckpt-2"))


def test_a_rule_that_reads_whole_variables_is_refused():
    for message in run("refused", 2):
        assert message is not None and "elementwise_update = False" in message and "sharded parameters" in message


def test_per_output_losses_count_no_stand_in_row():
    """A worker without rows runs a stand-in row for the collectives; the per-output losses do not count it."""
    expected = fsdp_scenarios.two_outputs(0, None, 0)
    for worker in run("two_outputs", 2):
        for key, values in expected["history"].items():
            assert worker["history"][key] == pytest.approx(values, abs=TOLERANCE), key
        assert worker["evaluate"] == pytest.approx(expected["evaluate"], abs=TOLERANCE)


def test_the_mesh_tensorboard_histograms_and_minimize(tmp_path):
    """The workers' mesh is the default group (bounded by the strategy's timeout) even where CUDA is present;
    TensorBoard's histograms gather a sharded model's weights; ``Optimizer.minimize`` takes the strategy's gradients
    (sharded parameters: ``torch.autograd.grad`` cannot reach them) and equals one process."""
    expected = fsdp_scenarios.edges(0, None, 0, str(tmp_path))
    got = run("edges", 2, folder=str(tmp_path))
    assert all(worker["world"] for worker in got)
    assert got[0]["logs"] == ["train"]
    for worker in got:
        assert largest_difference(worker["weights"], expected["weights"]) <= TOLERANCE


def test_a_checkpoint_left_aside_by_a_crashed_replacement_is_found(tmp_path):
    """A save that crashed between renaming the old checkpoint aside and renaming the new one in leaves the path
    empty: ``load_checkpoint`` puts the complete one back (in one process here: the format is the same)."""
    from replicafit.trainer import Trainer

    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    trainer = Trainer(optimizer="adam", loss="cross_entropy")
    trainer.fit(fsdp_scenarios.Net(), fsdp_scenarios.data(), batch_size=24, epochs=1, verbose=0)
    trainer.save_checkpoint(path, sharded=True)
    os.rename(path, str(path) + ".old-0123abcd")
    fresh = Trainer(optimizer="adam", loss="cross_entropy")
    fresh.load_checkpoint(path, fsdp_scenarios.Net())
    assert largest_difference(fresh.model_state_dict(), trainer.model_state_dict()) == 0.0
    # A file over a sharded directory: the directory is set aside until the file is written, then removed.
    trainer.save_checkpoint(path)
    assert path.is_file() and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_configure_takes_the_cluster_it_has_and_refuses_another():
    """A one-worker strategy here; ``configure`` restates the cluster (not "runs in one process")."""
    import replicafit.strategies as ds

    strategy = ds.FullyShardedStrategy(cluster_resolver=ds.SimpleClusterResolver(1, 0))
    strategy.configure(cluster_spec={"worker": ["localhost:1234"]}, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="names 2 tasks, but this strategy's cluster has 1 workers"):
        strategy.configure(cluster_spec={"worker": ["a:1", "b:2"]})
