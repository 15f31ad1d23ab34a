"""Lockstep DP serving (dp 2, one device per rank): every rank's batch in one device step, the
single scheduler's tokens, cold == warm, no leak on any rank.

The checks run in a subprocess (``tests/mesh/dp_lockstep_checks.py``) so that the host devices
exist whatever this process initialised before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lockstep_dp2_serves_the_single_scheduler_tokens():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "tests.mesh.dp_lockstep_checks"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["cold_equals_warm"]
    for run in ("cold", "warm"):
        assert facts[run]["equal_single"]
        assert facts[run]["leak_free"] == [True, True]
        assert facts[run]["ranks_used"] == [0, 1]
        # lockstep: one device step per round, as many as the busiest rank's steps
        assert facts[run]["dp_steps"] == max(facts[run]["rank_steps"])
    assert facts["cold"]["cached_tokens"] == 0 and facts["warm"]["cached_tokens"] > 0
