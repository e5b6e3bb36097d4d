"""The GPU battery (``bash .ci/gpu``): every CUDA path's tests and the GPU benchmark, in one command.

On a machine with a CUDA GPU it runs, from this checkout and without any download:

1. ``pytest -m gpu`` over ``tests/`` (the GPU tests: ``tests/gpu`` and the GPU cases elsewhere),
   with the determinism settings the tests name (``CUBLAS_WORKSPACE_CONFIG=:4096:8``; the tests set
   cuDNN's and TF32's), within ``--test-seconds``;
2. ``benchmarks/bench_all.py --device cuda``: the step-cost rows where a step is small and launch-bound (the
   shared MLP at batch 8 and 64: fit over the hand loop, Mirrored over two logical GPUs against its ceiling),
   with the host synchronisations per steady step counted (0 expected), in at most 90 s;
3. ``benchmarks/bench_gpu.py`` (fit against a hand loop and Lightning) in what is left of ``--seconds``
   (280 by default: the battery stays under 5 minutes on one H100);

and writes a short report (machine, pass/fail per test, skips with their reasons, the benchmark
table) to stdout and, when ``$OUT`` is set, to ``$OUT/gpu-report.md``. Exit status 0 when every
test passed (or there is no GPU: every check is skipped and the report says why), 1 otherwise.

The project is imported from the checkout through a folder of links that maps the top-level
package folders under ``replicafit`` as setup.cfg does (nothing is installed). ``greenlet`` (a
dependency the GPU image lacks) is installed from a wheel in ``.whl/`` when one is there
(``bash .ci/gpu-wheels`` fetches it on a machine with network); otherwise replicas that share a
device run on threads, the runner's fallback (bit-identical results), and the report says so.
"""

from __future__ import annotations

import argparse
import configparser
import datetime
import glob
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def probe() -> tuple[bool, str, dict]:
    """Whether there is a CUDA GPU here, why not, and what the machine is."""
    try:
        import torch
    except ImportError as error:
        return False, f"torch does not import ({error})", {}
    facts = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        reason = "torch.cuda.is_available() is False"
        reason += f" (torch {torch.__version__} is a CPU build)" if torch.version.cuda is None else ""
        return False, reason, facts
    facts["gpu"] = torch.cuda.get_device_name(0)
    facts["gpus"] = torch.cuda.device_count()
    facts["memory"] = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB"
    return True, "", facts


def link_checkout(folder: str) -> str:
    """A folder holding ``replicafit`` as links into the checkout (setup.cfg's package map)."""
    parser = configparser.ConfigParser()
    parser.read(os.path.join(ROOT, "setup.cfg"))
    mapping = {}
    for line in parser["options"]["package_dir"].strip().splitlines():
        name, _, path = (part.strip() for part in line.partition("="))
        mapping[name] = os.path.join(ROOT, path)
    package = os.path.join(folder, "replicafit")
    os.makedirs(package)
    root = mapping.pop("replicafit")
    for entry in os.listdir(root):
        os.symlink(os.path.join(root, entry), os.path.join(package, entry))
    for name, path in mapping.items():
        os.symlink(path, os.path.join(folder, *name.split(".")))
    return folder


def greenlet_path(site: str) -> tuple[str | None, str]:
    """``(folder to add to the path or None, what the report says about greenlet)``."""
    try:
        import greenlet  # noqa: F401
    except ImportError:
        pass
    else:
        return None, "greenlet is installed: replicas that share a device take turns on one thread"
    fallback = (
        "replicas that share a device ran on threads instead of taking turns, the runner's fallback "
        "(bit-identical results)"
    )
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "greenlet-*.whl")))
    if not wheels:
        return None, f"greenlet is missing (no wheel in .whl/; `bash .ci/gpu-wheels` fetches one): {fallback}"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site]
    done = subprocess.run([*pip, wheels[-1]], capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        return site, f"greenlet installed from {os.path.basename(wheels[-1])}: replicas that share a device take turns"
    why = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"greenlet is missing and {os.path.basename(wheels[-1])} did not install ({why}): {fallback}"


def run_tests(env: dict, seconds: float, junit: str) -> tuple[int, str]:
    command = [
        sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-p", "no:cacheprovider", "-q", "-rs",
        f"--junitxml={junit}", "-o", "junit_family=xunit1",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as error:
        return 124, f"the GPU tests ran past {seconds:.0f} s and were stopped\n{error.stdout or ''}"
    return done.returncode, done.stdout + done.stderr


def read_junit(path: str) -> list[dict]:
    """One entry per test: ``{"name", "outcome", "seconds", "message"}``."""
    if not os.path.exists(path):
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[kind]
                message = (node.get("message") or node.text or "").strip().splitlines()[0:1]
                message = message[0] if message else ""
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases.append({"name": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
    return cases


def run_bench(env: dict, seconds: float, table: str, dry_run: bool) -> tuple[int, str]:
    """The benchmark within ``seconds``: it stops starting configurations 15 s before (its own
    budget), and is stopped past them."""
    budget = f"{max(10.0, seconds - 15.0):.0f}"
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "bench_gpu.py"),
        "--markdown",
        table,
        "--seconds",
        budget,
    ]
    if dry_run:  # a check of the script on the CPU: one small configuration
        command += ["--device", "cpu", "--models", "mlp", "--batches", "64", "--rows", "1024", "--rounds", "1"]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as error:
        partial = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        return 124, f"(stopped after {seconds:.0f} s; the rows measured by then)\n" + partial
    if done.returncode == 0 and os.path.exists(table):
        with open(table) as file:
            return 0, file.read()
    return done.returncode, done.stdout + done.stderr[-3000:]


def run_step_cost(env: dict, seconds: float, dry_run: bool) -> tuple[int, str]:
    """``benchmarks/bench_all.py``'s fit and Mirrored rows on the GPU (the shared workload's small, launch-bound
    steps: fit over the hand loop, Mirrored over two logical GPUs against its ceiling, and the host
    synchronisations per steady step), one process a row; stopped past ``seconds`` with the rows done by then."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_all.py"), "--rounds", "1"]
    command += ["--rows", "fit8", "fit64", "mirrored8", "mirrored64", "--pairs", "1" if dry_run else "8"]
    command += ["--device", "cpu" if dry_run else "cuda"]
    # A process group of its own: on the deadline its children (one process a row) end with it, and no row
    # goes on using the GPU while bench_gpu.py measures.
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        return 124, f"(stopped after {seconds:.0f} s; the rows measured by then)\n" + out
    return process.returncode, out + (err[-3000:] if process.returncode else "")


def report_lines(facts, greenlet_note, cases, test_status, test_output, bench_status, bench_text, seconds) -> list:
    counts = {kind: sum(c["outcome"] == kind for c in cases) for kind in ("passed", "FAILED", "ERROR", "skipped")}
    verdict = "PASS" if test_status == 0 and not counts["FAILED"] and not counts["ERROR"] else "FAIL"
    lines = [
        f"# GPU battery: {verdict}",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {facts.get('gpu')} x{facts.get('gpus')} "
        f"({facts.get('memory')}); torch {facts.get('torch')} (CUDA {facts.get('cuda')}); "
        f"Python {facts.get('python')}; {seconds:.0f} s in all.",
        f"- {greenlet_note}.",
        "",
        f"## GPU tests: {counts['passed']} passed, {counts['FAILED'] + counts['ERROR']} failed, "
        f"{counts['skipped']} skipped (pytest exit status {test_status})",
        "",
        "| test | outcome | s |",
        "| --- | --- | --- |",
    ]
    for case in cases:
        shown = case["outcome"] if case["outcome"] == "passed" else f"{case['outcome']}: {case['message'][:160]}"
        lines.append(f"| {case['name']} | {shown.replace('|', '/')} | {case['seconds']:.1f} |")
    if not cases:
        lines += ["", "No test results were read (pytest's output follows).", "", "```", test_output[-4000:], "```"]
    elif verdict == "FAIL":
        lines += ["", "pytest's output (the end):", "", "```", test_output[-6000:], "```"]
    lines += ["", f"## Benchmark (benchmarks/bench_gpu.py, exit status {bench_status})", "", bench_text.strip(), ""]
    return lines


def step_cost_lines(status: int, text: str, dry_run: bool) -> list:
    device = "cpu, a dry run" if dry_run else "cuda"
    title = f"## Step cost (benchmarks/bench_all.py --device {device}, one process a row; exit status {status})"
    note = "(Figures, not checks: the battery's verdict is the tests'. Host synchronisations: 0 expected.)"
    return [title, "", note, "", "```", text.strip(), "```", ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The GPU battery (see .ci/gpu_battery.py's docstring).")
    parser.add_argument("--test-seconds", type=float, default=150.0, help="the GPU tests' limit")
    parser.add_argument(
        "--seconds", type=float, default=280.0, help="the whole battery's budget (the bench gets the rest)"
    )
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="without a GPU: run the battery's steps on the CPU (the GPU tests' logic, REPLICAFIT_GPU_DRY_RUN=1, and "
        "the benchmark script on one small configuration), to check the battery itself before a GPU visit",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = os.environ.get("OUT")
    have_gpu, reason, facts = probe()
    if args.dry_run and not have_gpu:
        facts.update(gpu=f"no GPU (dry run on the CPU: {reason})", gpus=0, memory="-")
    elif not have_gpu:
        lines = [
            "# GPU battery: skipped",
            "",
            f"Skipped every GPU check: no CUDA GPU here: {reason}. On a machine with one, `bash .ci/gpu` runs",
            "`pytest -m gpu` and `benchmarks/bench_gpu.py` (REPLICAFIT_GPU_DRY_RUN=1 python -m pytest -m gpu runs the",
            "GPU tests' own logic on logical CPUs).",
        ]
        _emit(lines, out)
        return 0
    work = tempfile.mkdtemp(prefix="rf-gpu-")
    try:
        site = os.path.join(work, "site")
        extra, greenlet_note = greenlet_path(site)
        paths = [link_checkout(os.path.join(work, "checkout")), *([extra] if extra else [])]
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        if args.dry_run and not have_gpu:
            env["REPLICAFIT_GPU_DRY_RUN"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        test_status, test_output = run_tests(env, args.test_seconds, os.path.join(work, "junit.xml"))
        cases = read_junit(os.path.join(work, "junit.xml"))
        if args.no_bench:
            bench_status, bench_text = 0, "(not run: --no-bench)"
            cost_status, cost_text = 0, "(not run: --no-bench)"
        dry_run = args.dry_run and not have_gpu
        if not args.no_bench:
            left = max(60.0, args.seconds - (time.monotonic() - started))
            cost_status, cost_text = run_step_cost(env, min(90.0, left / 2), dry_run)
            left = max(30.0, args.seconds - (time.monotonic() - started))
            bench_status, bench_text = run_bench(env, left, os.path.join(work, "bench.md"), dry_run)
        lines = report_lines(
            facts, greenlet_note, cases, test_status, test_output, bench_status, bench_text, time.monotonic() - started
        )
        lines += step_cost_lines(cost_status, cost_text, dry_run)
        _emit(lines, out)
        return 0 if lines[0].endswith("PASS") else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _emit(lines: list, out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text, end="", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu-report.md"), "w") as file:
            file.write(text)


if __name__ == "__main__":
    sys.exit(main())
