"""The demo workload at tp 8 across 2 processes x 4 CPU devices (``python -m kvjax launch``) gives
the tokens of one process with 8 devices; every process's digest equals the others' at every
step (``KVJAX_CHECK_AGREEMENT=1``), every process ends leak free.

The model is a tiny random-weight Llama with 8 query heads (the tiny demo model's 4 cannot be
split 8 ways), saved as a checkpoint and served with ``demo --model DIR``. The pool is small, so
the runs evict.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvjax.cli import main
from tests.mesh.multihost_group import child_env
from tests.mesh.subprocess_run import ROOT
from tests.serve.parity_harness import random_transformers_model, save_pretrained, transformers
from tests.serve.test_parity_transformers import COMMON, FAMILIES

WORKLOAD = ["--groups", "1", "--prompts-per-group", "3", "--chats", "1", "--turns", "2"]
WORKLOAD += ["--system-tokens", "32", "--output-tokens", "3", "--max-total-tokens", "160"]


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> str:
    """A tiny Llama checkpoint with 8 query heads over 2 KV heads: its directory."""
    cls, extra = FAMILIES["llama"]
    config = getattr(transformers, cls)(**{**COMMON, "num_attention_heads": 8}, **extra)
    return str(save_pretrained(random_transformers_model(config), tmp_path_factory, "llama8"))


def launch(argv: list[str], timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env["KVJAX_CHECK_AGREEMENT"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "kvjax", "launch", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def process_reports(stdout: str) -> dict[int, dict]:
    """The JSON report each process printed, by process id (the launcher's ``[i]`` prefix)."""
    reports = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if prefix.startswith("[") and rest.startswith("{"):
            reports[int(prefix[1:])] = json.loads(rest)
    return reports


def test_demo_at_tp_8_over_two_processes_gives_the_single_process_tokens(llama8, capsys):
    assert main(["demo", "--model", llama8, "--tp", "8", *WORKLOAD, "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["evicted_tokens"] > 0, single

    out = launch(
        [
            "--processes",
            "2",
            "--cpu-devices-per-process",
            "4",
            "--",
            "demo",
            "--model",
            llama8,
            "--tp",
            "8",
            *WORKLOAD,
            "--json",
        ]
    )
    assert out.returncode == 0, out.stderr[-4000:]
    reports = process_reports(out.stdout)
    assert sorted(reports) == [0, 1], out.stdout[-2000:]
    for pid, r in reports.items():
        assert r["processes"] == 2 and r["process_id"] == pid
        assert r["leak_free"] and r["cold_equals_warm"], r
        assert r["digest_checks"] > 0, r  # digests compared at every step, all equal
        assert r["outputs_fingerprint"] == single["outputs_fingerprint"], (r, single)
        for key in ("cached_tokens", "prefill_tokens_computed", "evicted_tokens", "retractions", "generated_tokens"):
            assert r[key] == single[key], (key, r, single)
