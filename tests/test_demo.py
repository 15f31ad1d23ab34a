"""The main job: ``python -m kvjax demo`` runs from nothing and reports a consistent, leak-free run."""

from __future__ import annotations

import json
import subprocess
import sys

from kvjax.demo import run_demo


def test_demo_report_is_consistent():
    report = run_demo(num_requests=10, page_size=16, max_total_tokens=4096, progress=False)
    assert report.ok and report.readback_ok and report.leak_free
    assert report.requests == 10
    assert report.kv_tokens_written == report.prompt_tokens + report.generated_tokens
    assert 0 < report.peak_pool_occupancy <= 1


def test_demo_page_size_one():
    assert run_demo(num_requests=4, page_size=1, max_total_tokens=2048, progress=False).ok


def test_python_dash_m_kvjax_demo_json():
    out = subprocess.run([sys.executable, "-m", "kvjax", "demo", "--json", "--requests", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["requests"] == 8 and report["leak_free"]
