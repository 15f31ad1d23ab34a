"""DP attention on 8 host devices: the DP cache's layout, per-rank host state, and attention over
the ``"data"`` axis bit-equal to unsharded per-rank ``attend``, at dp 2 x tp 2 and dp 4 x tp 2.

The checks run in a subprocess (``tests/mesh/dp_attention_checks.py``) so that the 8 host
devices exist whatever this process initialised before."""

from __future__ import annotations

import pytest

from tests.mesh.subprocess_run import run_with_devices


@pytest.fixture(scope="module")
def checks() -> dict:
    return run_with_devices(["-m", "tests.mesh.dp_attention_checks", "2x2", "4x2"], timeout=600)


@pytest.mark.parametrize("dp", [2, 4])
def test_pools_have_a_rank_axis_over_data_and_heads_over_tp(checks, dp):
    facts = checks[f"{dp}x2"]
    assert facts["shape"] == [dp, 33, 4, 4, 16]  # 32 pages + trash page per rank, 2 KV heads as K/V pairs
    assert facts["shard"] == [1, 33, 4, 2, 16]  # one rank, one KV head per device
    assert facts["spec"] == ["data", "None", "None", "tp", "None"]
    assert facts["scale_shape"] == [dp, 2]
    assert facts["local_heads"] == 1  # the pytree's static fields are one device's
    assert facts["ranks"] == facts["distinct_trees"] == dp
    assert facts["allocators_independent"]


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_attends_over_its_own_pools_bit_equal_to_unsharded_attend(checks, dp):
    facts = checks[f"{dp}x2"]
    assert facts["outputs_equal"] == [True] * (2 * dp)  # prefill then decode, every rank
    assert facts["pools_equal"] == [True] * (2 * dp)
    assert facts["in_place"] == [True, True]  # donated pools are updated in place
    assert facts["nonzero"]


def test_mismatched_meshes_and_configs_are_refused_before_allocating(checks):
    errors = checks["refusals"]
    assert errors["dp_off"].startswith("ConfigError: enable_dp_attention=False")
    assert errors["dp_size"].startswith("ConfigError: dp_size=4") and "'data' axis has 2" in errors["dp_size"]
    assert errors["tp_size"].startswith("ConfigError: tp_size=2") and "'tp' axis has 2" in errors["tp_size"]
    assert errors["axes"].startswith("ConfigError: mesh=('dp', 'tp')")
    # the host and storage tiers are built per rank (tests/mesh/test_dp_host_tier.py), the storage
    # tier not yet with an fp8 KV cache
    storage = errors["storage_tier"]
    assert storage.startswith("NotImplementedError") and "hicache_storage_backend" in storage


def test_every_built_kind_gets_a_rank_axis_and_its_own_head_sharding(checks):
    kinds = checks["kinds"]
    # MLA: the latent (no head axis) is replicated over "tp", as sglang-jax lays it out
    mla = kinds["deepseek-tiny"]
    assert mla["tree"] == "RadixCache"
    assert [a[1] for a in mla["arrays"]["kv"]][:2] == [["data", "None", "None", "None"]] * 2
    # sliding window (pure and hybrid): KV heads over "tp", one tree kind per model as build_kv_cache picks it
    assert kinds["mistral-swa-tiny"]["tree"] == "PureSWARadixCache"
    assert kinds["gemma3-tiny"]["tree"] == "SWARadixCache"
    for name in ("deepseek-tiny", "mistral-swa-tiny", "gemma3-tiny"):
        for arrays in kinds[name]["arrays"].values():
            for shape, spec, laid_out_as_planned in arrays:
                assert shape[0] == 2 and spec[0] == "data" and laid_out_as_planned
        big = [spec for arrays in kinds[name]["arrays"].values() for shape, spec, _ in arrays if len(shape) == 5]
        assert all(spec[3] == "tp" for spec in big)
    # the recurrent state is sharded over each rank's attention-TP group (SGLang's get_attention_tp_size):
    # every array gets the rank axis, the state's heads go over "tp"
    recurrent = kinds["recurrent"]
    assert isinstance(recurrent, dict), recurrent
    assert recurrent["tree"] == "ChunkCache"  # built with the radix cache off
    state = [entry for arrays in recurrent["arrays"].values() for entry in arrays]
    assert all(shape[0] == 2 and spec[0] == "data" and laid_out for shape, spec, laid_out in state)
    assert any("tp" in spec for _, spec, _ in state)
