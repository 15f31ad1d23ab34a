"""The DP serving step on host devices: one program for every rank (one device each) gives each
rank the single-rank step's tokens, logits and pools, bit for bit, at dp 2 and dp 4.

The checks run in a subprocess (``tests/mesh/dp_step_checks.py``) so that the host devices exist
whatever this process initialised before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checks() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "tests.mesh.dp_step_checks", "2", "4"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_step_equals_the_single_rank_step_on_every_rank(checks, dp):
    facts = checks[str(dp)]
    steps = 3 * dp  # a prefill and two decode steps, every rank
    assert facts["tokens_equal"] == [True] * steps
    assert facts["logits_equal"] == [True] * steps
    assert facts["pools_equal"] == [True] * steps
