"""What the GPU tests share: the marker, the determinism settings, the models and data, logical GPUs.

Every test in ``tests/gpu`` compares a CUDA run against an oracle (the same run on the CPU, torch's
own recipe, a one-process run), under these settings (``cuda_determinism``):

* ``torch.backends.cudnn.deterministic = True``, ``torch.backends.cudnn.benchmark = False``;
* TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``, ``torch.backends.cudnn.allow_tf32 = False``),
  so float32 matrix products are float32 on the GPU as on the CPU;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (``bash .ci/gpu`` exports it before CUDA starts), which makes
  cuBLAS deterministic.

Tolerances: a CUDA run against the same run on the CPU, ``RTOL``/``ATOL`` (float32 kernels sum in
another order: a few ulps per operation, compounded over the steps); two runs on the GPU with the
same seed, bit for bit.

Without CUDA every test here is skipped. ``REPLICAFIT_GPU_DRY_RUN=1`` runs the tests' own logic on
logical CPUs instead (``GPU`` stands for ``"cpu:1"``, logical GPUs for logical CPUs), the tests that
need CUDA itself still skipped: a check of the tests, not of CUDA, for a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import replicafit.strategies as ds

HAVE_CUDA = torch.cuda.is_available() and torch.cuda.device_count() > 0
DRY_RUN = not HAVE_CUDA and os.environ.get("REPLICAFIT_GPU_DRY_RUN") == "1"

#: The GPU the tests run on (its logical-CPU stand-in in a dry run), and the host.
GPU = "cuda:0" if HAVE_CUDA else "cpu:1"
GPU_TYPE = "cuda" if HAVE_CUDA else "cpu"
HOST = "cpu:0"

#: A CUDA run against the same run on the CPU.
RTOL, ATOL = 1e-4, 1e-5

#: For every test module here: ``pytestmark = GPU_TESTS``.
GPU_TESTS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (HAVE_CUDA or DRY_RUN),
        reason="needs a CUDA GPU (this machine has none; REPLICAFIT_GPU_DRY_RUN=1 runs the tests' logic on the CPU)",
    ),
]

#: For the tests that check CUDA itself (pinned memory, sync debug mode, NCCL): not in a dry run.
cuda_only = pytest.mark.skipif(not HAVE_CUDA, reason="checks CUDA itself: runs on a GPU only, not in a dry run")


@pytest.fixture(autouse=True)
def cuda_determinism():
    """The settings of the module docstring, put back after the test."""
    if not HAVE_CUDA:
        yield
        return
    saved = (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        (
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
        ) = saved
        torch.cuda.set_sync_debug_mode(0)


@contextlib.contextmanager
def logical_gpus(count: int):
    """``count`` logical GPUs on the one GPU (``set_logical_device_configuration``), as device names;
    logical CPUs ``cpu:1`` ... in a dry run."""
    if not HAVE_CUDA:
        yield [f"cpu:{i + 1}" for i in range(count)]
        return
    ds.set_logical_device_configuration("cuda:0", count)
    try:
        yield [f"cuda:{i}" for i in range(count)]
    finally:
        ds.set_logical_device_configuration("cuda:0", 1)


def digits(rows: int = 480):
    """The bundled UCI digits (offline): ``x`` of shape ``(rows, 64)`` in [0, 1], labels 0..9."""
    from replicafit.data import datasets

    x, y = datasets.load_digits(normalize=True)
    return torch.tensor(x[:rows], dtype=torch.float32), torch.tensor(y[:rows], dtype=torch.int64)  # copies


def mlp(dropout: float = 0.0, seed: int = 100) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        middle = [torch.nn.Dropout(dropout)] if dropout else []
        return torch.nn.Sequential(
            torch.nn.Linear(64, 64),
            torch.nn.ReLU(),
            *middle,
            torch.nn.Linear(64, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 10),
        )


def cnn(seed: int = 100) -> torch.nn.Module:
    """A small CNN on the 8x8 digits (convolutions, batch normalization, pooling)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 4 * 4, 10),
        )


def weights(model: torch.nn.Module) -> dict:
    """The model's state on the host."""
    return {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}


def assert_close_weights(got: dict, expected: dict, rtol: float = RTOL, atol: float = ATOL, what: str = "") -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=f"{what} {name}")


def assert_same_weights(got: dict, expected: dict, what: str = "") -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{what} {name} differs"


def assert_close_history(got, expected, rtol: float = RTOL, rows: int = 120) -> None:
    """Losses within ``rtol``; accuracies within one example of ``rows`` (the 120 validation rows of
    the tests' fits: a prediction on the edge may go the other way)."""
    assert got.history.keys() == expected.history.keys()
    for key, values in expected.history.items():
        tolerance = 1.0 / rows + 1e-9 if "accuracy" in key else None
        for a, b in zip(got.history[key], values):
            assert a == pytest.approx(b, rel=rtol, abs=tolerance or 1e-6), (key, got.history[key], values)


def on_gpu(tensor) -> bool:
    """Whether ``tensor`` lives on the test GPU (always true of its stand-in in a dry run)."""
    return tensor.device.type == GPU_TYPE
