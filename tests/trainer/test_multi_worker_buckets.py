"""Gradient buckets started during backward (issue 12, item 2): bit-identical to reducing after
backward, with every worker making the same collectives whatever ran locally."""

from __future__ import annotations

import mw_bucket_scenarios as scenarios
import pytest
import torch
from multiworker_harness import results, run_workers

from replicafit.strategies.buckets import reading_back_waits

SCENARIOS = scenarios.__file__


def _same(a: dict, b: dict, what: str) -> None:
    assert a["history"] == b["history"], what
    for key, value in a["weights"].items():
        assert torch.equal(b["weights"][key], value), f"{what}: {key}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "workers, kwargs",
    [
        (2, {}),
        (3, {}),
        (2, {"unused": True}),  # a parameter without gradient: its bucket starts in batch_reduce_to
        (2, {"local": 2}),  # two replicas per worker, summed in replica order into each bucket
        (2, {"flag_on_host": True}),  # the accelerators' way of agreeing on transformed gradients
    ],
)
def test_buckets_started_during_backward_equal_reducing_after_backward(workers, kwargs):
    overlapped = results(run_workers(SCENARIOS, "fit", workers, timeout=150, kwargs={"overlap": True, **kwargs}))
    after = results(run_workers(SCENARIOS, "fit", workers, timeout=150, kwargs={"overlap": False, **kwargs}))
    for rank in range(workers):
        _same(after[0], overlapped[rank], f"overlapped worker {rank}")
        _same(after[0], after[rank], f"after-backward worker {rank}")
        assert overlapped[rank]["hooks_left"] == 0  # fit removed its hooks from the model
    started, total = zip(*overlapped[0]["started"])
    assert min(total) >= 3  # 2 KB buckets: several
    if not kwargs.get("unused"):
        # every bucket but the last started during backward, on every step
        assert all(s == t - 1 for s, t in overlapped[0]["started"])
    else:
        assert all(s < t - 1 for s, t in overlapped[0]["started"])  # the unused layer's bucket waited
    assert all(s == 0 for s, _ in after[0]["started"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag_on_host", [False, True], ids=["flag-in-bucket", "flag-on-host"])
@pytest.mark.parametrize("scale_on", [(1,), (0, 1), ()])
def test_gradients_changed_after_backward_are_the_ones_reduced(scale_on, flag_on_host):
    # flag-on-host: how buckets on an accelerator agree (summing the flags on the host instead of
    # reading a device buffer back, which would make the host wait for the device every step).
    kwargs = {"overlap": True, "scale_on": scale_on, "flag_on_host": flag_on_host}
    overlapped = results(run_workers(SCENARIOS, "transformed", 2, timeout=90, kwargs=kwargs))
    after = results(
        run_workers(SCENARIOS, "transformed", 2, timeout=90, kwargs={"overlap": False, "scale_on": scale_on})
    )
    for rank in range(2):
        for key, value in after[0]["weights"].items():
            assert torch.equal(overlapped[rank]["weights"][key], value), key
        # one worker changing its gradients makes every worker reduce again (the same collectives)
        assert overlapped[rank]["redone"] == [bool(scale_on)] * 3
        assert overlapped[rank]["extra"] == (0 if flag_on_host else 1)  # the flag element, only in a CPU bucket


def test_buckets_on_an_accelerator_agree_on_the_host():
    # Reading the flag back from a CUDA bucket would make the host wait for the GPU every step.
    assert reading_back_waits(torch.device("cuda", 0)) and reading_back_waits(torch.device("mps"))
    assert not reading_back_waits(torch.device("cpu"))
