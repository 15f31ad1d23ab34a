"""Any JSON-printing benchmark of this folder, run from two checkouts side by side in one run.

    python benchmarks/side_by_side.py --baseline-path DIR [--path DIR] [--rounds N]
        [--keys SUBSTR ...] -- radix.py --quick

``--baseline-path`` is the root of another kvjax checkout (e.g. the commit before a change),
``--path`` the one timed against it (default: this one). Each round runs
the benchmark once from each checkout, alternating which goes first,
each in a fresh process importing ``kvjax`` from its own root (``PYTHONPATH``), so load from other
processes on a shared machine hits both alike. Every numeric leaf of the two JSON outputs is
paired by its path (``a.b.c``); per path the median (``--stat min``: the minimum, for a time
measured on a loaded machine) over rounds is kept for each checkout, with
``ratio`` = after / before (for a time, below 1 is faster; for a throughput, above 1 is better:
the benchmark's own docs say which a figure is). ``--keys`` keeps only the paths containing one
of the given substrings. Prints one JSON object. CPU figures of this host, not TPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numeric_leaves(value: Any, prefix: str = "") -> dict[str, float]:
    """Every int/float leaf of a JSON value by its dotted path (list items by their index;
    booleans are not numbers here)."""
    items: list[tuple[str, Any]]
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(str(i), v) for i, v in enumerate(value)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return {prefix: float(value)}
    else:
        return {}
    leaves: dict[str, float] = {}
    for key, child in items:
        leaves.update(numeric_leaves(child, f"{prefix}.{key}" if prefix else key))
    return leaves


def run_once(root: str, script: str, args: list[str]) -> dict[str, float]:
    """Run ``benchmarks/<script>`` of checkout ``root`` and return its numeric leaves."""
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    cmd = [sys.executable, os.path.join(root, "benchmarks", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"{script} from {root} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    start = proc.stdout.find("{")
    if start < 0:
        raise SystemExit(f"{script} from {root} printed no JSON object:\n{proc.stdout[-2000:]}")
    return numeric_leaves(json.loads(proc.stdout[start:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-path", required=True, help="root of the other kvjax checkout")
    parser.add_argument("--path", default=_ROOT, help="root of the checkout timed as 'after' (default: this one)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per checkout (median kept)")
    parser.add_argument(
        "--stat", choices=("median", "min"), default="median", help="per figure over rounds (min: a time under load)"
    )
    parser.add_argument("--keys", nargs="*", default=[], help="keep only paths containing one of these")
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] (a file of benchmarks/)")
    args = parser.parse_args()
    command = args.benchmark[1:] if args.benchmark[:1] == ["--"] else args.benchmark
    if not command:
        parser.error("name the benchmark after --, e.g. -- radix.py --quick")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    script, script_args = command[0], command[1:]
    roots = {"before": os.path.abspath(args.baseline_path), "after": os.path.abspath(args.path)}
    for label, root in roots.items():
        if not os.path.isfile(os.path.join(root, "benchmarks", script)):
            parser.error(f"{label} checkout {root} has no benchmarks/{script}")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for label in order:
            runs[label].append(run_once(roots[label], script, script_args))
    figures: dict[str, dict[str, float | None]] = {}
    for path in runs["after"][0]:
        if args.keys and not any(k in path for k in args.keys):
            continue
        if not all(path in r for r in runs["before"]):
            continue
        pick = statistics.median if args.stat == "median" else min
        before = pick(r[path] for r in runs["before"])
        after = pick(r[path] for r in runs["after"] if path in r)
        figures[path] = {"before": before, "after": after, "ratio": round(after / before, 3) if before else None}
    print(
        json.dumps(
            {
                "benchmark": f"side_by_side {script}",
                "args": script_args,
                "rounds": args.rounds,
                "checkouts": roots,
                "note": f"{args.stat} over rounds per checkout; ratio = after / before; CPU figures, not TPU figures",
                "figures": figures,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
