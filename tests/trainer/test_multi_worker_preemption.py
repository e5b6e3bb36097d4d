"""``BackupAndRestore(save_before_preemption=True)`` on 2 gloo workers: a SIGTERM to one worker stops both at
the same step (the flags ride with the step's reduction), the chief writes one backup, both raise
``Preempted`` (75), and the rerun equals the uninterrupted run bit for bit, every step trained once."""

from __future__ import annotations

import mw_preemption_scenarios as scenarios
import pytest
import torch
from multiworker_harness import results, run_workers

SCENARIOS = scenarios.__file__
# 120 training rows in batches of 8: 15 steps per epoch; 30 validation rows: 4 validation steps; 3 epochs.
CASES = {
    # name: (scenario arguments, where both workers stop: (epoch, steps of it done))
    "worker1_mid_epoch": ({"worker": 1, "step": 20}, (1, 7)),  # flag noted after step 20, carried by step 21
    "chief_mid_epoch": ({"worker": 0, "step": 3}, (0, 5)),
    "last_step_of_the_fit": ({"worker": 1, "step": 44}, (2, 15)),  # no step left: validation's first sum agrees
    # Validation agrees every step here (max_stride 1): the flag noted after validation step 1 joins the sum
    # started after step 2, read after step 3, where both stop.
    "validation": ({"worker": 1, "val_epoch": 1, "val_step": 1, "max_stride": 1}, (1, 15)),
    # Checks 10 s apart: the chief proposes the largest stride at the first check, none comes again in this
    # validation, and the epoch's end agrees.
    "validation_with_long_strides": ({"worker": 1, "val_epoch": 1, "val_step": 1, "check_seconds": 10.0}, (2, 0)),
    # Windows of 4 over the fit: in epoch 1 they end after its steps 3 and 7. No reduction inside a window:
    # the flag noted after step 3 rides with the window that ends after step 7.
    "accumulation_window": ({"worker": 1, "step": 18, "accumulate": 4}, (1, 8)),
    "epoch_end_without_validation": ({"worker": 0, "step": 37, "validation_split": 0.0}, (2, 0)),  # 19 steps an epoch
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_a_sigterm_to_one_worker_stops_both_at_one_step_and_the_rerun_is_bit_identical(tmp_path, case):
    arguments, (epoch, step) = CASES[case]
    workers = results(
        run_workers(SCENARIOS, "preempt_and_resume", 2, timeout=150, kwargs={"outdir": str(tmp_path), **arguments})
    )
    for rank, got in enumerate(workers):
        signal_name = "SIGTERM" if rank == arguments["worker"] else None
        assert got["stop"] == {"code": 75, "epoch": epoch, "step": step, "signal": signal_name}, rank
        assert got["backup_written"]
        assert got["trained"] == got["reference_trained"]  # every step once: none twice, none missing
        reference, resumed = got["reference"], got["resumed"]
        assert resumed["history"] == reference["history"]
        assert resumed["iterations"] == reference["iterations"]
        for key, value in reference["weights"].items():
            assert torch.equal(resumed["weights"][key], value), (rank, key)
    for key, value in workers[0]["resumed"]["weights"].items():
        assert torch.equal(workers[1]["resumed"]["weights"][key], value)  # the workers agree


@pytest.mark.timeout(120)
def test_workers_that_disagree_on_saving_before_preemption_are_refused(tmp_path):
    """Regression: they trained with step values of different layouts (3 elements more on one worker)."""
    workers = results(run_workers(SCENARIOS, "disagreeing", 2, timeout=90, kwargs={"outdir": str(tmp_path)}))
    for message in workers:
        assert message.startswith("BackupAndRestore saves before preemption on 1 of 2 workers"), message


@pytest.mark.timeout(120)
def test_an_element_level_loss_resumes_bit_identical_across_workers(tmp_path):
    """Regression: after the restore the fit's loss prescale came from the chief's own rows (the cursor had
    forgotten its read-ahead), not the first global batch's, and the rerun differed in the last bits."""
    # (3 workers: the chief's 3 rows of 8 are no power of two away from the global batch, so a wrong prescale shows)
    workers = results(run_workers(SCENARIOS, "element_level_resume", 3, timeout=90, kwargs={"outdir": str(tmp_path)}))
    for got in workers:
        for key, value in got["reference"].items():
            assert torch.equal(got["resumed"][key], value), key
