"""Recipe fuzz: seeded mutations of the shipped recipes through ``replicafit validate``.

Every mutation must end in ``ok`` (exit 0) or one ``error: file:line: ...`` line (exit 2): never a
traceback, never a hang, never unbounded memory, and never a file created or removed (``validate``
calls no code outside replicafit, so ``type: "os:system"`` with ``command: "touch CANARY"`` must not
create ``CANARY``). Mutations: byte flips, truncations, NUL and invalid UTF-8, control characters,
deleted / duplicated / swapped lines, values swapped between keys, scalars replaced with huge,
negative, NaN, infinite, string, list or mapping values, deep nesting, anchors and aliases (recursive
ones and "billion laughs"), merge keys, YAML tags, unknown keys and sections, ``${VAR}``, ``module:attr``
types (``os:system``, ``builtins:eval``, ``.foo:bar``, ``subprocess:Popen``, ...) and ``--set`` values;
one to three of them stacked per case.

Each case runs in a fresh temporary directory holding a ``KEEP`` file, under a memory cap
(``RLIMIT_AS``) and a timeout. A share of the cases runs ``python -m replicafit validate`` as a child
process (real exit statuses and stderr); the rest call ``replicafit.cli.main`` in a pool of
worker processes, for speed. Prints the counts; exits 1 if any case printed a traceback, exited with
another status, hung, or created or removed a file.

Run: python benchmarks/fuzz_recipes.py [--count 400] [--seed 0] [--subprocess-share 0.3] [--workers 2]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
MEMORY_CAP = 2 << 30  # bytes of address space per case (torch and the digits take about 0.7 GiB)
KEEP, CANARY = "KEEP", "CANARY"

# --- mutations ---------------------------------------------------------------------------------------

HUGE = ["1000000000000000000000000000000", "18446744073709551616", "-9223372036854775809", "1e400", "1.0e+308"]
SCALARS = HUGE + [
    "-1", "0", "-0.5", ".nan", ".NaN", ".inf", "-.inf", "''", "abc", "'0.1'", "true", "no", "null", "~",
    "[]", "[1, 2]", "[[[]]]", "{}", "{type: x}", "{a: {b: {c: 1}}}", "2024-01-01", "!!binary aGVsbG8=",
    "'" + "x" * 5000 + "'", "'\u00e9\u6570'", "0x10", "0o17", "1_000", "[-1, 0]", "[a, 8]", "[8, true]",
    "!!set {a, b}", "!!float 'nan'", "!!python/object/apply:os.system ['touch CANARY']",
]  # fmt: skip
DANGEROUS_TYPES = [
    ("os:system", "command: 'touch CANARY'"),
    ("posix:system", "command: 'touch CANARY'"),
    ("builtins:eval", "source: \"open('CANARY', 'w')\""),
    ("builtins:exec", "source: \"open('CANARY', 'w')\""),
    ("builtins:open", "file: CANARY\n  mode: w"),
    ("subprocess:Popen", "args: [touch, CANARY]"),
    ("subprocess:run", "args: [touch, CANARY]"),
    ("subprocess:call", "args: [touch, CANARY]"),
    ("subprocess:check_output", "args: [touch, CANARY]"),
    ("os:remove", "path: KEEP"),
    ("shutil:rmtree", "path: ."),
    ("pathlib:Path", "args: [CANARY]"),
    ("os:makedirs", "name: CANARY"),
    ("io:open", "file: CANARY\n  mode: w"),
    ("pickle:loads", "data: !!binary gASVAAAAAAAAAA=="),
    ("importlib:import_module", "name: antigravity"),
    ("replicafit.cli:main", "argv: [fit, digits_mlp, --run-dir, CANARY]"),
    ("replicafit.recipes:build", "recipe: CANARY"),
    (".foo:bar", ""),
    ("..x:y", ""),
    (":attr", ""),
    ("os:", ""),
    ("os:path.join", ""),
    ("no_such_module_xyz:f", ""),
    ("json:loads", "s: '[1]'"),
    ("torch.nn:Linear", "in_features: 2\n  out_features: 2"),
    ("replicafit.strategies:MirroredStrategy", "devices: [cpu:0, cpu:1]"),
    ("replicafit.recipes.models:mlp", "hidden: [4]"),
    ("a:b:c", ""),
    ("os:system\x00x", ""),
]
SECTIONS = ["strategy", "model", "data", "optimizer", "loss", "callbacks", "metrics"]


def billion_laughs(levels: int) -> str:
    lines = ["lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels):
        lines.append(f"lol{level}: &lol{level} [" + ", ".join([f"*lol{level - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def _lines(data: bytes) -> list:
    return data.split(b"\n")


def _value_lines(data: bytes) -> list:
    """Indices of lines ``key: value`` with a value on the line."""
    return [i for i, line in enumerate(_lines(data)) if re.match(rb"^\s*-?\s*[\w.]+:\s+[^\s#]", line)]


def _replace_value(data: bytes, rng: random.Random, value: str) -> bytes:
    lines, candidates = _lines(data), _value_lines(data)
    if not candidates:
        return data
    i = rng.choice(candidates)
    lines[i] = re.sub(
        rb"^(\s*-?\s*[\w.]+:\s+)([^#]*?)(\s*(#.*)?)$", lambda m: m.group(1) + value.encode() + m.group(3), lines[i]
    )
    return b"\n".join(lines)


def m_flip(data, rng):
    if not data:
        return data
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] ^= rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 0xFF])
    return bytes(out)


def m_truncate(data, rng):
    return data[: rng.randrange(len(data) + 1)]


def m_insert_bytes(data, rng):
    chunk = rng.choice(
        [
            b"\x00",
            b"\xff",
            b"\xc3\x28",
            b"\xed\xa0\x80",
            b"\xe2\x82",
            b"\x07",
            b"\x1b[31m",
            b"\r",
            b"\t",
            b"\xef\xbb\xbf",
            b"\x85",
            b"\xe2\x80\xa8",
        ]
    )
    at = rng.randrange(len(data) + 1)
    return data[:at] + chunk + data[at:]


def m_delete_line(data, rng):
    lines = _lines(data)
    del lines[rng.randrange(len(lines))]
    return b"\n".join(lines)


def m_duplicate_line(data, rng):
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines.insert(i + rng.choice([0, 1, 2]), lines[i])
    return b"\n".join(lines)


def m_swap_lines(data, rng):
    lines = _lines(data)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


def m_indent(data, rng):
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines[i] = rng.choice([b"  ", b" ", b"\t"]) + lines[i] if rng.random() < 0.6 else lines[i].lstrip()
    return b"\n".join(lines)


def m_scalar(data, rng):
    return _replace_value(data, rng, rng.choice(SCALARS))


def m_swap_values(data, rng):
    lines, candidates = _lines(data), _value_lines(data)
    if len(candidates) < 2:
        return data
    i, j = rng.sample(candidates, 2)
    (key_i, value_i), (key_j, value_j) = lines[i].split(b":", 1), lines[j].split(b":", 1)
    lines[i], lines[j] = key_i + b":" + value_j, key_j + b":" + value_i
    return b"\n".join(lines)


def m_unknown_key(data, rng):
    lines = _lines(data)
    i = rng.randrange(len(lines) + 1)
    indent = rng.choice([b"", b"  ", b"    "])
    lines.insert(
        i,
        indent
        + rng.choice(
            [
                b"bogus: 1",
                b"epoch: 3",
                b"learning_rat: 0.1",
                b"optimiser: adam",
                b"1: 2",
                b"null: x",
                b"? [a]\n  : 1",
                b"<<: {type: sgd}",
                b"type: mlp",
            ]
        ),
    )
    return b"\n".join(lines)


def m_nesting(data, rng):
    depth = rng.choice([5, 40, 49, 50, 51, 200, 5000])
    style = rng.random()
    if style < 0.5:
        return _replace_value(data, rng, "[" * depth + "1" + "]" * depth)
    if style < 0.8:
        return _replace_value(data, rng, "{a: " * depth + "1" + "}" * depth)
    block = "".join("  " * level + f"k{level}:\n" for level in range(min(depth, 400)))
    return data + b"\nfit:\n" + block.encode() + b"  " * min(depth, 400) + b"end: 1\n"


def m_anchor(data, rng):
    choice = rng.randrange(7)
    if choice == 0:
        return _replace_value(data, rng, "&h [128, *h]")
    if choice == 1:
        return data + b"\nmodel: &m {type: mlp, hidden: *m}\n"
    if choice == 2:
        return data + b"\n" + billion_laughs(rng.choice([3, 6, 9, 12])).encode()
    if choice == 3:
        return _replace_value(data, rng, "*undefined_anchor")
    if choice == 4:
        return b"base: &b {type: sgd, learning_rate: 0.1}\n" + data + b"\noptimizer: {<<: *b, momentum: 0.9}\n"
    if choice == 5:
        return data.replace(b"data:", b"data: &d", 1) + b"\nmodel: *d\n"
    return data + b"\nbig: &big [" + b", ".join([b"1"] * 30000) + b"]\nfit: {x: [*big, *big, *big, *big]}\n"


def m_type(data, rng):
    name, args = rng.choice(DANGEROUS_TYPES)
    section = rng.choice(SECTIONS)
    body = f"type: '{name}'" + (f"\n  {args}" if args else "")
    if section in ("callbacks", "metrics"):
        entry = f"{section}:\n  - " + body.replace("\n  ", "\n    ")
    else:
        entry = f"{section}:\n  " + body
    text = data.decode("utf-8", "replace")
    text = re.sub(rf"(?ms)^{section}:.*?(?=^\S|\Z)", "", text)  # drop the section, then write it anew
    return (text.rstrip("\n") + "\n" + entry + "\n").encode()


def m_env(data, rng):
    return _replace_value(data, rng, rng.choice(["${RF_FUZZ_UNSET}", "${RF_FUZZ_UNSET:-3}", "${HOME}", "${:-x}", "${"]))


def m_document(data, rng):
    return rng.choice(
        [
            b"--- \n" + data + b"\n---\nmodel: mlp\n",
            b"- " + data,
            b"42\n",
            b"",
            b"\xef\xbb\xbf" + data,
            data + b"\n..." + b"\n" * 3,
            b"!!map " + data,
            data.replace(b": ", b":", 3),
        ]
    )


def m_big_data(data, rng):
    """A built-in dataset far larger than memory: validate builds it, so the cap must turn it into an error."""
    samples, features = rng.choice([(10**8, 20), (10**6, 10**5), (3 * 10**9, 2)])
    text = re.sub(r"(?ms)^data:.*?(?=^\S|\Z)", "", data.decode("utf-8", "replace"))
    section = f"data:\n  type: classification\n  n_samples: {samples}\n  n_features: {features}\n"
    return (text.rstrip("\n") + "\n" + section).encode()


def m_large(data, rng):
    return data + b"# padding\n" * rng.choice([10, 120_000])


MUTATORS = [
    m_flip, m_truncate, m_insert_bytes, m_delete_line, m_duplicate_line, m_swap_lines, m_indent, m_scalar,
    m_scalar, m_scalar, m_swap_values, m_unknown_key, m_nesting, m_anchor, m_type, m_type, m_type, m_env,
    m_document, m_large,
]  # fmt: skip
SET_VALUES = [
    "fit.epochs=0", "fit.epochs=[[[[1]]]]", "model.hidden=[-1]", "seed=1e30", "seed=100000000000000000000000",
    "strategy.devices=[]", "optimizer.learning_rate=.nan", "model.type=os:system", "data.type=.foo:bar",
    "a.\u00b2=1", "model.hidden.0=x", "x=" + "[" * 500, "fit.x=" + "[" * 60 + "]" * 60, "model=\x07",
    "fit.epochs=*a", "callbacks.9=1", "seed.x=1", "model.hidden=&a [1, *a]",
]  # fmt: skip


HEAVY = [m_big_data]  # needs the memory cap: left out where the caller runs without one


def mutations(seed: int, count: int, heavy: bool = True) -> list:
    """``[(name, recipe bytes, extra argv), ...]``: ``count`` seeded mutations of the shipped recipes.

    ``heavy=False`` leaves out the mutations that only a memory cap keeps bounded (a huge built-in dataset).
    """
    rng = random.Random(seed)
    mutators = MUTATORS + (HEAVY if heavy else [])
    sources = {
        name: open(os.path.join(RECIPES, name), "rb").read()
        for name in sorted(os.listdir(RECIPES))
        if name.endswith(".yaml")
    }
    cases = []
    for index in range(count):
        source = rng.choice(sorted(sources))
        data, names = sources[source], []
        for _ in range(rng.choice([1, 1, 2, 3])):
            mutator = rng.choice(mutators)
            data = mutator(data, rng)
            names.append(mutator.__name__[2:])
        argv = ["--set", rng.choice(SET_VALUES)] if rng.random() < 0.1 else []
        cases.append((f"{index:04d}-{source[:-5]}-{'+'.join(names)}", data, argv))
    return cases


# --- running a case ------------------------------------------------------------------------------------


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def _prepare(data: bytes) -> str:
    folder = tempfile.mkdtemp(prefix="rf-fuzz-")
    with open(os.path.join(folder, "recipe.yaml"), "wb") as file:
        file.write(data)
    open(os.path.join(folder, KEEP), "w").close()
    return folder


def _files_changed(folder: str) -> list:
    """Anything created in or removed from the case's folder: validate must touch nothing."""
    found = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    return sorted((found ^ {"recipe.yaml", KEEP}) | ({CANARY} & found))


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang


def _in_process(case, timeout: float) -> dict:
    """Runs in a pool worker: ``cli.main(["validate", ...])`` with the worker's memory cap and an alarm."""
    from replicafit import cli

    name, data, argv = case
    folder, here = _prepare(data), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    status, escaped = None, None
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(timeout))
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(["validate", "recipe.yaml", *argv])
    except _Hang:
        escaped = "hang"
    except SystemExit as exit_:  # argparse on a bad --set spelling
        status = exit_.code
    except BaseException:  # noqa: BLE001 - what the fuzz looks for
        escaped = traceback.format_exc()
    finally:
        signal.alarm(0)
        os.chdir(here)
    changed = _files_changed(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return _result(name, "in-process", status, err.getvalue(), escaped, changed)


def _child(case, timeout: float) -> dict:
    """``python -m replicafit validate`` in a child process with the memory cap and a timeout."""
    name, data, argv = case
    folder = _prepare(data)
    escaped = None
    try:
        result = subprocess.run(
            [sys.executable, "-m", "replicafit", "validate", "recipe.yaml", *argv],
            cwd=folder,
            capture_output=True,
            timeout=timeout,
            preexec_fn=_cap_memory,
        )
        status, err = result.returncode, result.stderr.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        status, err, escaped = None, "", "hang"
    changed = _files_changed(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return _result(name, "subprocess", status, err, escaped, changed)


def _result(name, how, status, err, escaped, changed) -> dict:
    if escaped == "hang":
        outcome = "hang"
    elif escaped is not None or "Traceback" in err or status not in (0, 2):
        outcome = "traceback"
        err = escaped or err
    else:
        outcome = f"exit {status}"
    memory = "MemoryError" in err or "can't allocate" in err or "Unable to allocate" in err
    lines = err.strip().splitlines()
    one_line = outcome != "exit 2" or (len(lines) == 1 and lines[0].startswith("error: "))
    return {
        "name": name,
        "how": how,
        "outcome": outcome,
        "memory": memory,
        "changed": changed,
        "one_line": one_line,
        "err": err[-2000:],
    }


def _worker_init() -> None:
    _cap_memory()
    os.environ["PYTHONUNBUFFERED"] = "1"
    from replicafit import cli  # noqa: F401 - imported once per worker: in-process cases are fast


def _run(task) -> dict:
    case, child, timeout = task
    return _child(case, timeout) if child else _in_process(case, timeout)


def run(cases, subprocess_share: float, workers: int, timeout: float, seed: int) -> list:
    """Runs the cases, ``workers`` at a time. A case without a result ``timeout + 30`` s after it was handed
    to a worker (a hang the alarm could not break, or a worker that died) counts as a hang, and the pool is
    replaced, so one bad case never stalls the rest."""
    rng = random.Random(seed + 1)
    tasks = collections.deque((case, rng.random() < subprocess_share, timeout) for case in cases)
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    results, in_flight = [], []  # in_flight: [(task, async result, deadline)]
    pool = context.Pool(workers, initializer=_worker_init)
    try:
        while tasks or in_flight:
            while tasks and len(in_flight) < workers:
                task = tasks.popleft()
                in_flight.append((task, pool.apply_async(_run, (task,)), time.monotonic() + timeout + 30))
            in_flight[0][1].wait(0.05)
            for entry in list(in_flight):
                task, handle, deadline = entry
                if handle.ready():
                    in_flight.remove(entry)
                    try:
                        results.append(handle.get())
                    except Exception as error:  # noqa: BLE001 - the harness itself failed on this case
                        results.append(_result(task[0][0], "in-process", None, "", repr(error), []))
                elif time.monotonic() > deadline:
                    in_flight.remove(entry)
                    how = "subprocess" if task[1] else "in-process"
                    results.append(_result(task[0][0], how, None, "", "hang", []))
                    pool.terminate()
                    pool = context.Pool(workers, initializer=_worker_init)
                    tasks.extendleft(other for other, _, _ in reversed(in_flight))  # run again on the new pool
                    in_flight.clear()
                    break
    finally:
        pool.terminate()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--subprocess-share", type=float, default=0.3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--show", type=int, default=8, help="how many failures to print in full")
    args = parser.parse_args(argv)

    started = time.monotonic()
    cases = mutations(args.seed, args.count)
    results = run(cases, args.subprocess_share, args.workers, args.timeout, args.seed)
    elapsed = time.monotonic() - started

    outcomes = collections.Counter(r["outcome"] for r in results)
    hows = collections.Counter(r["how"] for r in results)
    changed = [r for r in results if r["changed"]]
    not_one_line = [r for r in results if not r["one_line"]]
    failures = [r for r in results if r["outcome"] in ("traceback", "hang")] + changed + not_one_line
    shipped = len([name for name in os.listdir(RECIPES) if name.endswith(".yaml")])
    print(
        f"recipe fuzz: seed {args.seed}, {len(results)} mutations of {shipped} shipped recipes in {elapsed:.0f} s "
        f"({hows['subprocess']} as `python -m replicafit validate` child processes, {hows['in-process']} "
        f"in-process; memory cap {MEMORY_CAP >> 30} GiB, timeout {args.timeout:.0f} s)"
    )
    print(f"  total            {len(results)}")
    print(f"  exit 0 (ok)      {outcomes['exit 0']}")
    print(f"  exit 2 (error)   {outcomes['exit 2']}")
    print(f"  tracebacks       {outcomes['traceback']}  (a traceback, or an exit status other than 0 and 2)")
    print(f"  hangs            {outcomes['hang']}  (over {args.timeout:.0f} s)")
    failed_memory = sum(r["memory"] and r["outcome"] in ("traceback", "hang") for r in results)
    refused_memory = sum(r["memory"] and r["outcome"] == "exit 2" for r in results)
    print(f"  memory failures  {failed_memory}  (a MemoryError traceback; {refused_memory} more reported as exit 2)")
    print(f"  files changed    {len(changed)}  (CANARY created, KEEP removed, anything else written)")
    print(f"  not one line     {len(not_one_line)}  (an exit-2 message that is not one 'error: ...' line)")
    for result in failures[: args.show]:
        print(
            f"\n--- {result['name']} ({result['how']}): {result['outcome']}, changed {result['changed']}\n"
            f"{result['err']}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
