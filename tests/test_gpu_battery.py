"""The GPU battery (``bash .ci/gpu``) on a machine without a GPU, and its parts that need none."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _battery():
    spec = importlib.util.spec_from_file_location("gpu_battery", os.path.join(ROOT, ".ci", "gpu_battery.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a GPU")
def test_without_a_gpu_the_battery_says_it_skipped_and_exits_0(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run(["bash", ".ci/gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Skipped every GPU check" in done.stdout and "torch.cuda.is_available() is False" in done.stdout
    assert (tmp_path / "gpu-report.md").read_text() == done.stdout


def test_the_checkout_is_importable_through_links(tmp_path):
    folder = _battery().link_checkout(str(tmp_path / "checkout"))
    code = (
        "import replicafit, replicafit.strategies, replicafit.data.datasets, replicafit.recipes, os; "
        "print(os.path.dirname(replicafit.strategies.__file__)); "
        "print(replicafit.data.datasets.load_digits()[0].shape)"
    )
    env = dict(os.environ, PYTHONPATH=folder)
    done = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    where, shape = done.stdout.split("\n")[:2]
    assert where == os.path.join(folder, "replicafit", "strategies") and shape == "(1797, 64)"


def test_the_report_lists_every_test_and_fails_on_a_failure(tmp_path):
    battery = _battery()
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.gpu.test_a" name="test_bad" time="0.2">'
        '<failure message="AssertionError: 1 != 2">trace</failure></testcase>'
        '<testcase classname="tests.gpu.test_b" name="test_two_gpus" time="0">'
        '<skipped message="needs 2 CUDA GPU(s), this machine has 1"/></testcase>'
        "</testsuite></testsuites>"
    )
    cases = battery.read_junit(str(junit))
    assert [(c["name"], c["outcome"]) for c in cases] == [
        ("tests/gpu/test_a.py::test_ok", "passed"),
        ("tests/gpu/test_a.py::test_bad", "FAILED"),
        ("tests/gpu/test_b.py::test_two_gpus", "skipped"),
    ]
    facts = {"gpu": "NVIDIA H100", "gpus": 1, "memory": "80 GiB", "torch": "2.11", "cuda": "13.0", "python": "3.12"}
    lines = battery.report_lines(facts, "greenlet is installed", cases, 1, "pytest output", 0, "| table |", 42.0)
    text = "\n".join(lines)
    assert lines[0] == "# GPU battery: FAIL"
    assert "1 passed, 1 failed, 1 skipped" in text and "FAILED: AssertionError: 1 != 2" in text
    assert "needs 2 CUDA GPU(s)" in text and "| table |" in text and "NVIDIA H100" in text
    passing = battery.report_lines(facts, "greenlet is installed", cases[:1], 0, "", 0, "", 1.0)
    assert passing[0] == "# GPU battery: PASS"


def test_the_step_cost_rows_count_every_host_synchronisation_of_the_steady_steps(monkeypatch):
    """``bench_all.py --device cuda`` reports the synchronisations torch's debug mode warns of between the second
    step and the last; here torch's CUDA calls are stood in for and a train step warns as the debug mode would."""
    spec = importlib.util.spec_from_file_location("bench_all", os.path.join(ROOT, "benchmarks", "bench_all.py"))
    bench_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_all)
    modes = [0]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    class Leaky(bench_all.Trainer):
        def train_step(self, data):
            logs = super().train_step(data)
            if modes[-1] == "warn":
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            return logs

    data, _, _ = bench_all._data(256, "cpu")  # 32 steps of 8: the second to the last but one are watched
    found = {}
    for trainer_class in (bench_all.Trainer, Leaky):
        trainer = trainer_class(optimizer="sgd", loss="cross_entropy", metrics=(), seed=0)
        found[trainer_class] = bench_all.host_syncs(trainer, bench_all.bench_fit.make_model(), data, 8, "cuda:0")
        assert modes[-1] == 0  # the debug mode is off again after the epoch
    assert found[bench_all.Trainer] == {"syncs": 0, "watched": 30}
    assert found[Leaky] == {"syncs": 30, "watched": 30}
    assert bench_all.host_syncs(None, None, data, 8, "cpu") == {}
