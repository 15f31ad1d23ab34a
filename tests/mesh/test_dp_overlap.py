"""Lockstep DP serving (dp 2, one device per rank) with overlap scheduling: the single
scheduler's tokens with overlap on and off, cold and warm, every rank's balance after every
round; a stop token found one round late drops the speculative token and leaks nothing.

The checks run in a subprocess (``tests/mesh/dp_overlap_checks.py``) so that the host devices
exist whatever this process initialised before."""

from __future__ import annotations

from tests.mesh.subprocess_run import run_with_devices


def test_lockstep_overlap_serves_the_tokens_of_the_loop_without_it():
    facts = run_with_devices(["-m", "tests.mesh.dp_overlap_checks"], timeout=900)
    assert facts["all_equal"]
    for overlap in ("overlap", "no_overlap"):
        for label in ("cold", "warm"):
            run = facts[f"{label}_{overlap}"]
            assert run["equal_single"], (label, overlap)
            assert run["leak_free"] == [True, True]
            assert run["overlap"] == [overlap == "overlap"] * 2
            assert run["ranks_used"] == [0, 1]
            assert run["rounds_checked"] >= run["dp_steps"] > 0
        assert facts[f"cold_{overlap}"]["cached_tokens"] == 0 and facts[f"warm_{overlap}"]["cached_tokens"] > 0
    assert facts["stops_shorten"] > 0
    for overlap in ("overlap", "no_overlap"):
        run = facts[f"stop_{overlap}"]
        assert run["equal_expected"] and run["leak_free"] == [True, True], overlap
        assert run["generated_tokens"] == run["want_tokens"]
    # Requests stopped while a DP step for them was in flight: their tokens were dropped.
    assert facts["stop_overlap"]["dropped_tokens"] > 0
    assert facts["stop_no_overlap"]["dropped_tokens"] == 0
