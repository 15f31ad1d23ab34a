"""``benchmarks/side_by_side.py``: numeric leaves are paired by path, and a run over two checkouts
(here the same one twice) reports before, after and their ratio for each figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.side_by_side import numeric_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_numeric_leaves_by_path() -> None:
    value = {"a": {"b": 1, "c": [2.5, {"d": 3}]}, "flag": True, "name": "x", "none": None}
    assert numeric_leaves(value) == {"a.b": 1.0, "a.c.0": 2.5, "a.c.1.d": 3.0}


def _checkout(root, figure: float) -> str:
    """A stand-in checkout whose benchmark prints ``figure`` after a line of chatter."""
    bench = root / "benchmarks"
    bench.mkdir(parents=True)
    body = {"cases": {"x_us": figure, "n": 4}, "label": "probe"}
    (bench / "probe.py").write_text(f"import json\nprint('warming up')\nprint(json.dumps({body!r}))\n")
    return str(root)


def test_side_by_side_runs_both_checkouts(tmp_path) -> None:
    before, after = _checkout(tmp_path / "old", 4.0), _checkout(tmp_path / "new", 2.0)
    cmd = [sys.executable, "benchmarks/side_by_side.py", "--baseline-path", before, "--path", after]
    out = subprocess.run(
        [*cmd, "--rounds", "2", "--keys", "_us", "--", "probe.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["rounds"] == 2 and report["checkouts"] == {"before": before, "after": after}
    assert report["figures"] == {"cases.x_us": {"before": 4.0, "after": 2.0, "ratio": 0.5}}


def test_side_by_side_names_a_missing_benchmark() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/side_by_side.py", "--baseline-path", ROOT, "--", "no_such_bench.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode != 0 and "benchmarks/no_such_bench.py" in proc.stderr
