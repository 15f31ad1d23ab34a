"""The DP serving step on host devices: one program for every rank (one device each) gives each
rank the single-rank step's tokens, logits and pools, bit for bit, at dp 2 and dp 4.

The checks run in a subprocess (``tests/mesh/dp_step_checks.py``) so that the host devices exist
whatever this process initialised before."""

from __future__ import annotations

import pytest

from tests.mesh.subprocess_run import run_with_devices


@pytest.fixture(scope="module")
def checks() -> dict:
    return run_with_devices(["-m", "tests.mesh.dp_step_checks", "2", "4"], timeout=600)


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_step_equals_the_single_rank_step_on_every_rank(checks, dp):
    facts = checks[str(dp)]
    steps = 3 * dp  # a prefill and two decode steps, every rank
    assert facts["tokens_equal"] == [True] * steps
    assert facts["logits_equal"] == [True] * steps
    assert facts["pools_equal"] == [True] * steps
