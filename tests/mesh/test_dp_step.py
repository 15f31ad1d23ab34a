"""The DP serving step on host devices: one program for every rank gives each rank the
single-rank step's tokens, logits and pools, bit for bit: at dp 2 and dp 4 with one device per
rank, and at dp 2 x tp 2 (ranks of two devices, the forward tensor parallel inside each rank)
against the sharded step over the rank's own two devices; the donated pools are written in
place. At dp 2 x tp 2 the compiled program's collectives are Megatron's minimum inside each
rank: one all-reduce of ``[tokens, hidden]`` after attention and one after the MLP per layer,
each over one rank's ``"tp"`` devices, none across ranks, and no other collective.

The checks run in a subprocess (``tests/mesh/dp_step_checks.py``) so that the host devices exist
whatever this process initialised before."""

from __future__ import annotations

import pytest

from tests.mesh.subprocess_run import run_with_devices


@pytest.fixture(scope="module")
def checks() -> dict:
    return run_with_devices(["-m", "tests.mesh.dp_step_checks", "2", "4", "2x2"], timeout=600)


@pytest.mark.parametrize("shape", ["2", "4", "2x2"])
def test_dp_step_equals_the_single_rank_step_on_every_rank(checks, shape):
    facts = checks[shape]
    steps = 3 * int(shape.split("x")[0])  # a prefill and two decode steps, every rank
    assert facts["tokens_equal"] == [True] * steps
    assert facts["logits_equal"] == [True] * steps
    assert facts["pools_equal"] == [True] * steps
    assert facts["written_in_place"] == [True] * 3  # donated: every step writes the pools' own buffers


def test_dp2_tp2_all_reduces_stay_inside_each_rank(checks):
    facts = checks["2x2"]["collectives"]
    reduces = facts["all_reduces"]
    assert len(reduces) == 2 * facts["layers"], reduces
    rank_groups = sorted(sorted(row) for row in facts["rank_devices"])
    for shape, groups in reduces:
        assert f",{facts['hidden']}]" in shape, shape  # [tokens, hidden] partial sums
        assert sorted(sorted(g) for g in groups) == rank_groups, (groups, rank_groups)
    assert facts["others"] == []
