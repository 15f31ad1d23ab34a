"""Wall time of ``python -m kvjax plan`` next to ``python -c "import jax"``, in one run.

Each repetition runs both commands once, alternating which goes first, so machine load hits both
alike. Prints one JSON object: the median seconds of each, their ratio, whether ``plan`` stayed
under the 0.5 s target, and whether the plan process imported jax. CPU wall times of this machine.

    python benchmarks/plan_cli.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PLAN = [sys.executable, "-m", "kvjax", "plan", "--model", "llama-3-8b", "--memory", "16GiB"]
IMPORT_JAX = [sys.executable, "-c", "import jax"]
PLAN_IMPORTS_JAX = [
    sys.executable,
    "-c",
    "import sys; from kvjax.cli import main; main(['plan', '--model', 'llama-3-8b', '--memory', '16GiB']); "
    "print(any(m.split('.')[0] in ('jax', 'jaxlib') for m in sys.modules), file=sys.stderr)",
]
TARGET_SECONDS = 0.5


def wall(cmd: list[str]) -> float:
    """Seconds one run of ``cmd`` takes, start to exit (its output discarded); raises on failure."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    wall(PLAN)  # warm the file cache for both
    wall(IMPORT_JAX)
    plan_s, jax_s = [], []
    for i in range(args.repeats):
        order = [(PLAN, plan_s), (IMPORT_JAX, jax_s)]
        for cmd, out in order if i % 2 == 0 else order[::-1]:
            out.append(wall(cmd))
    imports = subprocess.run(PLAN_IMPORTS_JAX, check=True, capture_output=True, text=True).stderr.strip()
    plan_median, jax_median = statistics.median(plan_s), statistics.median(jax_s)
    print(
        json.dumps(
            {
                "benchmark": "plan_cli",
                "repeats": args.repeats,
                "plan_median_s": round(plan_median, 4),
                "import_jax_median_s": round(jax_median, 4),
                "plan_over_import_jax": round(plan_median / jax_median, 3),
                "plan_min_s": round(min(plan_s), 4),
                "import_jax_min_s": round(min(jax_s), 4),
                "target_s": TARGET_SECONDS,
                "plan_within_target": plan_median <= TARGET_SECONDS,
                "plan_imports_jax": imports == "True",
            }
        )
    )


if __name__ == "__main__":
    main()
