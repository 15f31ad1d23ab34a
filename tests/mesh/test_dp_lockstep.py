"""Lockstep DP serving (dp 2, one device per rank): every rank's batch in one device step, the
single scheduler's tokens, cold == warm, no leak on any rank.

The checks run in a subprocess (``tests/mesh/dp_lockstep_checks.py``) so that the host devices
exist whatever this process initialised before."""

from __future__ import annotations

from tests.mesh.subprocess_run import run_with_devices


def test_lockstep_dp2_serves_the_single_scheduler_tokens():
    facts = run_with_devices(["-m", "tests.mesh.dp_lockstep_checks"], timeout=900)
    assert facts["cold_equals_warm"]
    for run in ("cold", "warm"):
        assert facts[run]["equal_single"]
        assert facts[run]["leak_free"] == [True, True]
        assert facts[run]["ranks_used"] == [0, 1]
        # lockstep: one device step per round, as many as the busiest rank's steps
        assert facts[run]["dp_steps"] == max(facts[run]["rank_steps"])
    assert facts["cold"]["cached_tokens"] == 0 and facts["warm"]["cached_tokens"] > 0
