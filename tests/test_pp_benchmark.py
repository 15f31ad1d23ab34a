"""``benchmarks/pp.py --tiny`` runs and reports what it promises: each pipeline stage's pool bytes
at ``1/pp`` of the one-stage pool (planned for Llama-3-8B and built on the CPU mesh, the built
bytes at the plan's), ``pp`` times the tokens at a fixed per-device budget, and a CPU decode-step
figure for PP 2 against TP 2 (the layouts generating the same tokens)."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import run_tiny


@pytest.mark.timeout(400)
def test_pp_benchmark_tiny_mode() -> None:
    result = run_tiny("benchmarks/pp.py")

    planned = result["planned"]
    for pp in (1, 2, 4, 8):
        row = planned["fixed_tokens"]["by_pp"][f"pp{pp}"]
        assert row["ratio_to_one_stage"] == [pytest.approx(1 / pp)] * pp
        assert planned["fixed_budget"]["by_pp"][f"pp{pp}"]["ratio_to_pp1"] == pytest.approx(pp, rel=1e-2)

    built = result["built_cpu"]
    for pp in (1, 2, 4):
        row = built[f"pp{pp}"]
        assert row["ratio_to_one_stage"] == [pytest.approx(1 / pp, rel=1e-3)] * pp
        for got, plan in zip(row["stage_device_bytes"], row["planned_stage_device_bytes"], strict=True):
            assert plan <= got <= plan + 64, "the built pools are the plan's (and the per-layer scales)"

    step = result["step_cpu"]
    assert "CPU figure" in step["note"]
    for key in ("tp2", "pp2_micro1", "pp2_micro2"):
        assert step[key]["decode_step_seconds"] > 0
    assert step["pp2_micro2"]["ratio_to_tp2"] > 0
