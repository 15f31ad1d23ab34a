"""``benchmarks/mesh.py --tiny`` runs and reports what it promises: per-device pool bytes that
fall as 1/tp while the KV heads divide (MLA's replicated latent stays whole), the built shards
equal to the plan, more tokens per device budget with TP and fewer with DP attention, a CPU step
time, the place of the TPU collectives, and cache-aware DP routing's hit rate against round robin."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import run_tiny


@pytest.mark.timeout(400)
def test_mesh_benchmark_tiny_mode() -> None:
    result = run_tiny("benchmarks/mesh.py")

    llama = result["pool_bytes_per_device"]["planned"]["llama-3-8b"]["by_tp"]
    for tp in (1, 2, 4, 8):
        assert llama[f"tp{tp}"]["ratio_to_tp1"] == pytest.approx(1 / tp, rel=1e-3)
    mla = result["pool_bytes_per_device"]["planned"]["deepseek-v3"]["by_tp"]
    assert {row["ratio_to_tp1"] for row in mla.values()} == {1.0}, "the latent is replicated over TP"

    built = result["pool_bytes_per_device"]["built"]["by_tp"]
    for row in built.values():
        assert row["device_bytes"] == row["planned_device_bytes"]
    assert built["tp2"]["ratio_to_tp1"] == 0.5 and built["tp4"]["ratio_to_tp1"] == 0.5  # 2 KV heads: tp 4 replicates

    tokens = result["tokens_per_device_budget"]["max_total_tokens"]["llama-3-8b"]
    assert tokens["tp1"] < tokens["tp2"] < tokens["tp4"] < tokens["tp8"]
    assert tokens["tp8_dp2"] == tokens["tp4"], "dp 2 of tp 8: attention TP 4"

    step = result["step_time_cpu"]
    assert step["devices_1_seconds"] > 0 and step["devices_8_seconds"] > 0 and "CPU" in step["note"]
    assert result["collectives_per_decode_layer"]["measured"] is False
    routing = result["dp_routing"]["dp2"]
    assert set(routing) >= {"demo", "multi_tenant"}, routing.keys()
    for row in routing.values():
        rr, ca = row["round_robin"]["hit_rate"], row["cache_aware"]["hit_rate"]
        assert 0 <= rr <= 1 and 0 <= ca <= row["shared_tree_hit_rate"] + 1e-9
        assert row["ratio"] == pytest.approx(ca / rr)
    assert routing["multi_tenant"]["ratio"] > 1, "cache-aware routing keeps each tenant's prompt on one rank"
