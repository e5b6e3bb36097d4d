"""Import cost: ``import replicafit`` (and the everyday names) vs ``import torch``, whole processes.

Each command runs in a fresh interpreter, paired A B A B with the reference ``import torch``;
the script prints the median wall time of each and the median of the pairwise ratios.
Targets: ``import replicafit`` costs no more than ``import torch`` (it loads nothing heavy:
the names load on first use), and loading the everyday names (``rf.Trainer``,
``rf.MirroredStrategy``) costs little more than the torch they need.

Run: python benchmarks/bench_import.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

REFERENCE = "import torch"
CASES = {
    "import replicafit": "import replicafit",
    "rf.Trainer, rf.MirroredStrategy": "import replicafit as rf; rf.Trainer; rf.MirroredStrategy",
    "every package": "import replicafit as rf; rf.strategies; rf.data; rf.optimizers; rf.trainer",
}


def wall(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    wall(REFERENCE)  # warm the file cache
    print(f"{'case':<34} {'ours (s)':>9} {'torch (s)':>9} {'ours/torch':>10}")
    for name, code in CASES.items():
        wall(code)
        ours, reference, ratios = [], [], []
        for _ in range(args.repeats):
            a, b = wall(code), wall(REFERENCE)
            ours.append(a)
            reference.append(b)
            ratios.append(a / b)
        print(
            f"{name:<34} {statistics.median(ours):>9.3f} {statistics.median(reference):>9.3f} "
            f"{statistics.median(ratios):>10.3f}"
        )


if __name__ == "__main__":
    main()
