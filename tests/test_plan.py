"""The planner: one test per decision of the seed, named after it, plus sizes and rendering."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import ConfigError
from kvjax.config import CacheConfig
from kvjax.plan import plan_kv_cache
from kvjax.spec import ModelSpec
from tests.specs import F, R, S, dense, mla, ssm, swa

GiB = 2**30


def plan(spec, **kw):
    kw.setdefault("memory_budget_bytes", GiB)
    return plan_kv_cache(spec, CacheConfig(**kw))


# --- 1. model kind ------------------------------------------------------------------------------


def test_is_hybrid_swa_detected_for_sliding_layers():
    p = plan(swa())
    assert p.is_hybrid_swa and not p.is_hybrid_ssm
    assert p.sliding_window_size == 1024
    assert p.kv_pool_kind == "swa"


def test_disable_hybrid_swa_memory_sizes_sliding_layers_as_full():
    p = plan(swa(), disable_hybrid_swa_memory=True)
    assert not p.is_hybrid_swa
    assert p.sliding_window_size is None and p.full_tokens_per_layer is None
    assert p.kv_pool_kind == "mha"


def test_is_hybrid_ssm_detected_for_recurrent_layers():
    p = plan(ssm())
    assert p.is_hybrid_ssm and not p.is_hybrid_swa
    assert p.kv_pool_kind == "hybrid_linear"
    assert p.num_kv_layers == 1 and p.num_recurrent_layers == 3


def test_is_dsa_marked_for_indexer_models():
    assert plan(mla(dsa=True)).is_dsa
    assert not plan(mla()).is_dsa


def test_non_hybrid_model_leaves_swa_fields_none():
    p = plan(dense())
    assert (p.sliding_window_size, p.full_tokens_per_layer, p.swa_tokens_per_layer) == (None, None, None)


# --- 2. sizes -----------------------------------------------------------------------------------


def test_bytes_per_token_mha_counts_k_and_v_of_every_layer():
    p = plan(dense(layers=4, kv_heads=8, head_dim=128), platform="cpu")
    assert p.bytes_per_token == 4 * 2 * 8 * 128 * 2


def test_bytes_per_token_pads_head_dim_to_128_on_tpu():
    on_tpu = plan(dense(layers=2, kv_heads=2, head_dim=64), platform="tpu")
    on_cpu = plan(dense(layers=2, kv_heads=2, head_dim=64), platform="cpu")
    assert on_tpu.head_dim_padded == 128 and on_cpu.head_dim_padded == 64
    assert on_tpu.bytes_per_token == 2 * on_cpu.bytes_per_token


def test_bytes_per_token_pads_k_and_v_to_the_larger_head_dim():
    p = plan(dense(layers=1, kv_heads=1, head_dim=192, v_head_dim=128), platform="cpu")
    assert p.head_dim_padded == 192
    assert p.bytes_per_token == 2 * 192 * 2


def test_bytes_per_token_fp8_is_one_byte_per_element():
    p = plan(dense(layers=4), kv_cache_dtype="fp8_e4m3", platform="cpu")
    assert p.storage_dtype == "uint8"
    assert p.bytes_per_token == 4 * 2 * 8 * 128


def test_bf16_stored_as_uint16_on_cpu_only():
    assert plan(dense(), platform="cpu").storage_dtype == "uint16"
    assert plan(dense(), platform="tpu").storage_dtype == "bfloat16"


def test_bytes_per_token_mla_is_one_latent_row_per_layer():
    p = plan(mla(layers=4), platform="cpu")
    assert p.bytes_per_token == 4 * (512 + 64) * 2
    assert plan(mla(layers=4), platform="tpu").head_dim_padded == 640


def test_bytes_per_token_dsa_adds_indexer_keys_and_scales():
    plain = plan(mla(layers=2), platform="cpu")
    dsa = plan(mla(layers=2, dsa=True), platform="cpu")
    assert dsa.bytes_per_token - plain.bytes_per_token == 2 * (128 + 128 // 128 * 4)


def test_max_total_tokens_from_budget_page_aligned():
    p = plan(dense(layers=4), platform="cpu", memory_budget_bytes=GiB + 12345, page_size=16)
    per_token = 4 * 2 * 8 * 128 * 2
    # The trash page is paid out of the budget first.
    assert p.max_total_tokens == (GiB + 12345 - 16 * per_token) // per_token // 16 * 16
    assert p.num_pages == p.max_total_tokens // 16


def test_max_total_tokens_caps_the_budget():
    p = plan(dense(), max_total_tokens=1000, page_size=16)
    assert p.max_total_tokens == 992  # page aligned down


def test_max_total_tokens_above_budget_warns_and_uses_budget():
    p = plan(dense(layers=4), platform="cpu", memory_budget_bytes=2**20, max_total_tokens=10**9)
    per_token = 4 * 2 * 8 * 128 * 2
    assert p.max_total_tokens == (2**20 - 16 * per_token) // per_token // 16 * 16
    assert any("exceeds" in w for w in p.warnings)


def test_max_total_tokens_alone_sizes_the_pool():
    p = plan_kv_cache(dense(), CacheConfig(max_total_tokens=4096))
    assert p.max_total_tokens == 4096 and p.kv_budget_bytes is None


def test_mem_fraction_static_uses_device_memory_minus_reserved():
    config = CacheConfig(mem_fraction_static=0.5, reserved_memory_bytes=GiB, platform="cpu")
    p = plan_kv_cache(dense(layers=4), config, device_memory_bytes=4 * GiB)
    assert p.kv_budget_bytes == GiB
    with pytest.raises(ConfigError, match="device_memory_bytes"):
        plan_kv_cache(dense(), config)


def test_nothing_sizes_the_cache_is_a_config_error():
    with pytest.raises(ConfigError, match="memory_budget_bytes"):
        plan_kv_cache(dense(), CacheConfig())


def test_budget_too_small_for_one_page_names_the_bytes_needed():
    with pytest.raises(ConfigError, match="at least"):
        plan(dense(), memory_budget_bytes=1000)


def test_max_total_tokens_is_the_minimum_across_pipeline_stages():
    spec = dense(layers=5)
    p0 = plan(spec, pp_size=2, pp_rank=0, platform="cpu")
    p1 = plan(spec, pp_size=2, pp_rank=1, platform="cpu")
    assert (p0.start_layer, p0.end_layer, p1.start_layer, p1.end_layer) == (0, 3, 3, 5)
    per_layer = 2 * 8 * 128 * 2
    assert p0.max_total_tokens == p1.max_total_tokens == (GiB - 16 * 3 * per_layer) // (3 * per_layer) // 16 * 16


def test_kv_heads_split_over_tensor_parallel_ranks_and_replicated_below_one():
    assert plan(dense(kv_heads=8), tp_size=4).num_kv_heads_per_rank == 2
    assert plan(dense(kv_heads=8), tp_size=16).num_kv_heads_per_rank == 1


def test_req_to_token_width_is_context_plus_4_plus_draft_tokens():
    assert plan(dense(context=4096)).req_to_token_width == 4100
    p = plan(
        dense(context=4096), speculative_algorithm="EAGLE", speculative_num_draft_tokens=8, page_size=1, platform="cpu"
    )
    assert p.req_to_token_width == 4096 + 4 + 8


def test_req_to_token_width_reserves_a_decode_double_buffer_on_pages_with_speculation():
    p = plan(
        dense(context=4096),
        speculative_algorithm="EAGLE",
        speculative_num_draft_tokens=4,
        speculative_num_steps=3,
        speculative_eagle_topk=4,
        page_size=16,
    )
    assert p.req_to_token_width == 4096 + max(4 + 4, 2 * 12 + 16 - 1)


def test_max_running_requests_default_formula():
    # clamp(int(tokens / context * 512), 2048, 4096), on pages of one token so the page cap is not hit
    def rows(tokens):
        return plan(dense(context=4096), max_total_tokens=tokens, page_size=1, platform="cpu").max_running_requests

    assert rows(4096 * 2) == 2048
    assert rows(4096 * 6) == 3072
    assert rows(4096 * 100) == 4096


def test_max_running_requests_default_is_capped_by_the_pages():
    # 8192 tokens in pages of 16: at most 512 requests can hold a page each (SGLang would plan 2048 rows).
    p = plan(dense(context=4096), max_total_tokens=4096 * 2, page_size=16)
    assert p.num_pages == 512 and p.max_running_requests == 512


def test_max_running_requests_given_above_the_pages_warns():
    p = plan(dense(), max_total_tokens=160, page_size=16, max_running_requests=64)
    assert p.max_running_requests == 64
    assert any("max_running_requests=64 exceeds the 10 pages" in w for w in p.warnings)


def test_max_running_requests_given_is_kept():
    assert plan(dense(), max_running_requests=7).max_running_requests == 7


def test_swa_split_by_swa_full_tokens_ratio():
    p = plan(swa((S, S, S, F)), platform="cpu", page_size=1)
    per_layer = 2 * 4 * 128 * 2
    total = (GiB - 4 * per_layer) // (4 * per_layer) * 4  # one trash page (of one token) in each pool
    full = int(total / (0.8 * 3 + 1))
    assert p.full_tokens_per_layer == full
    assert p.swa_tokens_per_layer == int(full * 0.8)
    assert p.max_total_tokens == p.full_tokens_per_layer


def test_swa_split_page_aligns_both_pools():
    p = plan(swa(), page_size=16, swa_full_tokens_ratio=0.5)
    assert p.full_tokens_per_layer % 16 == 0 and p.swa_tokens_per_layer % 16 == 0


def test_swa_all_layers_sliding_is_pure_swa():
    p = plan(swa((S, S, S, S)), page_size=16)
    assert p.full_tokens_per_layer == 0
    assert p.swa_tokens_per_layer == p.max_total_tokens > 0


def test_ssm_state_memory_set_aside_by_mamba_full_memory_ratio():
    spec = ssm()
    p = plan(spec, platform="cpu", page_size=1)
    assert spec.recurrent is not None
    per_req = 3 * spec.recurrent.bytes_per_slot()
    mamba_mem = int(GiB * 0.9 / 1.9)
    assert p.mamba_state_bytes_per_req == per_req
    assert p.max_mamba_cache_size == mamba_mem // per_req - 1  # the padding slot is paid for
    assert p.max_total_tokens == (GiB - mamba_mem - p.bytes_per_token) // p.bytes_per_token


def test_ssm_state_with_radix_disabled_sized_by_running_requests():
    p = plan(ssm(), disable_radix_cache=True, max_running_requests=64)
    assert p.max_mamba_cache_size == 64
    assert p.max_running_requests == 64  # one state per request with radix off


def test_ssm_caps_running_requests_by_state_slots():
    p = plan(ssm(), max_mamba_cache_size=30)
    assert p.max_running_requests == 10  # 3 states per request with the radix cache
    p = plan(ssm(), max_mamba_cache_size=30, enable_mamba_extra_buffer=True)
    assert p.max_running_requests == 6  # + 2 ping-pong buffers without speculation


def test_ssm_state_sharded_over_tensor_parallel():
    one = plan(ssm(), tp_size=1).mamba_state_bytes_per_req
    assert plan(ssm(), tp_size=2).mamba_state_bytes_per_req == one // 2


# --- 3. retraction backup and hicache_ratio ------------------------------------------------------


def decode(spec=None, **kw):
    return plan(spec or dense(), disaggregation_mode="decode", **kw)


def test_retraction_backup_host_pool_for_plain_decode_server():
    p = decode()
    assert p.decode_retraction_backup == "host_pool" and p.hicache_ratio == 1.0
    assert p.attach_host_tier and p.tree_cache_kind == "unified"


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp_size=2, dcp_size=2),
        dict(disaggregation_decode_enable_radix_cache=True),
        dict(disaggregation_decode_enable_offload_kvcache=True),
        dict(enable_priority_scheduling=True),
    ],
    ids=["dcp", "decode_radix_cache", "kv_offload", "priority_preemption"],
)
def test_retraction_backup_cpu_tensor_when_a_condition_fails(kw):
    p = decode(**kw)
    assert p.decode_retraction_backup == "cpu_tensor" and p.hicache_ratio == 2.0


def test_retraction_backup_priority_scheduling_without_preemption_keeps_host_pool():
    p = decode(enable_priority_scheduling=True, disable_priority_preemption=True)
    assert p.decode_retraction_backup == "host_pool"


def test_retraction_backup_cpu_tensor_outside_decode_mode():
    assert plan(dense()).decode_retraction_backup == "cpu_tensor"
    assert plan(dense(), disaggregation_mode="prefill").decode_retraction_backup == "cpu_tensor"


def test_retraction_backup_is_active_on_a_decode_server_or_when_set():
    assert not plan(dense()).decode_retraction_active  # resolved, but SGLang re-prefills outside decode
    assert not plan(dense(), disaggregation_mode="prefill").decode_retraction_active
    assert decode().decode_retraction_active
    assert plan(dense(), disaggregation_decode_retraction_backup="cpu_tensor").decode_retraction_active


@pytest.mark.parametrize("spec", [mla(), ssm(), swa((S, S, S, S))], ids=["mla", "ssm", "pure_swa"])
def test_retraction_backup_cpu_tensor_when_pool_has_no_host_copy(spec):
    assert decode(spec).decode_retraction_backup == "cpu_tensor"


def test_retraction_backup_host_pool_for_swa_with_full_layers():
    assert decode(swa()).decode_retraction_backup == "host_pool"


def test_retraction_backup_explicit_setting_kept():
    p = decode(disaggregation_decode_retraction_backup="cpu_tensor")
    assert p.decode_retraction_backup == "cpu_tensor" and p.hicache_ratio == 2.0
    p = plan(dense(), disaggregation_decode_retraction_backup="host_pool")
    assert p.decode_retraction_backup == "host_pool" and p.hicache_ratio == 1.0


def test_hicache_ratio_explicit_setting_kept():
    assert decode(hicache_ratio=3.0).hicache_ratio == 3.0


def test_host_pool_requires_a_tree_that_holds_a_host_tier():
    with pytest.raises(ConfigError, match="requires UnifiedRadixCache"):
        plan(swa((S, S, S, S)), disaggregation_decode_retraction_backup="host_pool")


def test_host_pool_rejected_for_ssm_models():
    with pytest.raises(ConfigError, match="Mamba/SSM"):
        plan(ssm(), disaggregation_decode_retraction_backup="host_pool")


# --- 4. radix cache on or off ------------------------------------------------------------------


def test_radix_cache_disabled_when_asked():
    p = plan(dense(), disable_radix_cache=True)
    assert p.disable_radix_cache and p.tree_cache_kind == "chunk"


def test_radix_cache_disabled_for_multimodal_on_transformers_backend_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvjax.plan"):
        p = plan(dense(multimodal=True), model_impl="transformers")
    assert p.disable_radix_cache
    assert "multimodal" in caplog.text and any("Transformers backend" in w for w in p.warnings)


def test_multimodal_on_transformers_backend_turns_chunked_prefill_off():
    p = plan(dense(multimodal=True), model_impl="transformers")
    assert p.chunked_prefill_size is None
    assert p.tree_cache_kind == "unified"  # row 1 needs chunked prefill: a disabled tree instead


def test_multimodal_on_native_backend_keeps_radix_cache():
    p = plan(dense(multimodal=True))
    assert not p.disable_radix_cache and not p.warnings
    assert p.chunked_prefill_size == 8192


# --- 5. decode-side radix cache ------------------------------------------------------------------


def test_decode_radix_cache_rejected_for_swa_models():
    with pytest.raises(ValueError, match="incompatible with sliding window attention"):
        decode(swa(), disaggregation_decode_enable_radix_cache=True)


def test_decode_radix_cache_rejected_for_ssm_models():
    with pytest.raises(ValueError, match="incompatible with Mamba/SSM models"):
        decode(ssm(), disaggregation_decode_enable_radix_cache=True)


def test_decode_radix_cache_allowed_for_dense_models():
    assert decode(disaggregation_decode_enable_radix_cache=True).tree_cache_kind == "unified"


# --- 6. tree cache kind --------------------------------------------------------------------------


def test_tree_row0_radix_disabled_with_host_pool_is_disabled_unified_tree():
    p = decode(disable_radix_cache=True)
    assert p.tree_cache_kind == "unified" and p.disable_radix_cache and p.attach_host_tier


def test_tree_row1_chunk_cache():
    assert plan(dense(), disable_radix_cache=True).tree_cache_kind == "chunk"


def test_tree_row1_swa_chunk_cache():
    assert plan(swa(), disable_radix_cache=True).tree_cache_kind == "swa_chunk"


def test_tree_row1_pure_swa_chunk_cache():
    p = plan(swa((S, S)), disable_radix_cache=True)
    assert p.tree_cache_kind == "pure_swa_chunk" and p.tree_components == ("swa",)


def test_tree_disabled_radix_without_chunked_prefill_is_disabled_unified_tree():
    p = plan(dense(), disable_radix_cache=True, chunked_prefill_size=None)
    assert p.tree_cache_kind == "unified" and p.disable_radix_cache


def test_tree_row4_pure_swa_radix():
    assert plan(swa((S, S, S))).tree_cache_kind == "pure_swa_radix"


@pytest.mark.parametrize(
    "spec,components",
    [(dense(), ("full",)), (swa(), ("full", "swa")), (ssm(), ("full", "mamba")), (mla(dsa=True), ("full",))],
    ids=["plain", "swa", "ssm", "dsa"],
)
def test_tree_row7_unified_with_components(spec, components):
    p = plan(spec)
    assert p.tree_cache_kind == "unified" and p.tree_components == components


def test_tree_hierarchical_cache_attaches_host_tier_to_unified_tree():
    p = plan(dense(), enable_hierarchical_cache=True)
    assert p.attach_host_tier and p.host_pool_tokens == (p.max_total_tokens * 2 // 16 + 1) * 16


def test_tree_hierarchical_cache_ignored_with_chunk_cache():
    p = plan(dense(), enable_hierarchical_cache=True, disable_radix_cache=True)
    assert not p.attach_host_tier and any("ignored" in w for w in p.warnings)


def test_host_tier_sized_by_hicache_size_in_gb():
    p = plan(dense(layers=4), enable_hierarchical_cache=True, hicache_size=1, platform="cpu")
    tokens = 10**9 // p.bytes_per_token
    # SGLang's HostKVCache: pages rounded down, plus one page (no reserved host slot)
    assert p.host_pool_tokens == (tokens // 16 + 1) * 16


def test_session_radix_cache_requires_unified_tree():
    with pytest.raises(ConfigError, match="enable_session_radix_cache"):
        plan(dense(), enable_session_radix_cache=True, disable_radix_cache=True)
    assert plan(dense(), enable_session_radix_cache=True).enable_session_radix_cache


def test_tree_page_size_under_decode_context_parallelism():
    p = plan(dense(), page_size=16, tp_size=4, dcp_size=4)
    assert p.alloc_page_size == 64 and p.tree_page_size == 64
    assert p.max_total_tokens % 64 == 0
    assert plan(dense(), page_size=16).tree_page_size == 16


def test_the_host_page_under_decode_context_parallelism_holds_every_ranks_rows():
    """A device pool holds one rank's 16 rows of each striped page; the host page is the tree's
    page of 64 rows (every rank's, once), so the host tier's bytes count all of them."""
    one = plan(dense(), page_size=16, enable_hierarchical_cache=True, max_total_tokens=1024)
    four = plan(dense(), page_size=16, tp_size=4, dcp_size=4, enable_hierarchical_cache=True, max_total_tokens=1024)
    assert four.pool("kv").shape[1] == 16 and four.pool("host_kv").shape[1] == 64
    assert one.pool("host_kv").shape[1] == 16
    host = four.pool("host_kv")
    assert host.shape[0] * host.shape[1] >= four.host_pool_tokens
    per_token = one.pool("host_kv").nbytes // (one.pool("host_kv").shape[0] * 16)
    assert host.nbytes == host.shape[0] * 64 * per_token


def test_the_host_pool_of_heads_split_over_tp_holds_every_distinct_head_once():
    """A device holds one rank's KV heads; the one host pool of the process keeps every distinct
    head (replicated heads once), so the plan's host bytes and its host-memory check count them all."""
    spec = ModelSpec.preset("llama-3-8b")  # 8 KV heads
    host = {
        tp: plan(spec, tp_size=tp, enable_hierarchical_cache=True, hicache_size=4).pool("host_kv") for tp in (1, 8, 16)
    }
    for tp in (8, 16):  # heads split over 8 ranks; over 16, each head on two ranks
        assert host[tp].shape[2] == host[1].shape[2] == 2 * 8
        assert host[tp].bytes_per_token == host[1].bytes_per_token
        assert host[tp].nbytes // host[tp].shape[0] == host[1].nbytes // host[1].shape[0]
    # hicache_size is per rank, as SGLang's (each TP rank's host pool): 8 ranks' 4 GB is 32 GB here
    config = CacheConfig(memory_budget_bytes=GiB, tp_size=8, enable_hierarchical_cache=True, hicache_size=4)
    with pytest.raises(ConfigError, match=r"host tier needs 29\.\d\d GiB"):
        plan_kv_cache(spec, config, host_memory_bytes=20 * GiB)
    assert plan_kv_cache(spec, dataclasses.replace(config, tp_size=1), host_memory_bytes=20 * GiB).attach_host_tier


def test_tree_settings_passed_through():
    p = plan(dense(), radix_eviction_policy="lfu", enable_kv_cache_events=True, speculative_algorithm="EAGLE3")
    assert p.radix_eviction_policy == "lfu" and p.enable_kv_cache_events and p.is_eagle
    assert not plan(dense(), speculative_algorithm="STANDALONE").is_eagle


def test_need_sort_under_disaggregation():
    assert plan(dense(), disaggregation_mode="prefill").need_sort
    assert not plan(dense()).need_sort


# --- 7. drafts, multimodal ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(enable_hierarchical_cache=True, speculative_algorithm="EAGLE"), True),
        (dict(disaggregation_mode="decode", speculative_algorithm="EAGLE"), True),
        (dict(enable_hierarchical_cache=True, speculative_algorithm="NGRAM"), False),
        (dict(speculative_algorithm="EAGLE"), False),
        (dict(enable_hierarchical_cache=True), False),
    ],
    ids=["hicache_eagle", "host_pool_eagle", "ngram_has_no_draft_model", "no_host_tier", "no_draft"],
)
def test_draft_host_pools(kw, expected):
    assert plan(dense(), **kw).draft_host_pools is expected


def test_mm_embedding_cache_size_from_vlm_cache_size_mb():
    assert plan(dense(), vlm_cache_size_mb=7).mm_embedding_cache_bytes == 7 * 2**20


# --- the plan object -----------------------------------------------------------------------------


def test_plan_is_pure_and_deterministic():
    spec, config = swa(), CacheConfig(memory_budget_bytes=GiB)
    assert plan_kv_cache(spec, config) == plan_kv_cache(spec, config)


def test_plan_to_dict_is_json_able_and_complete():
    p = plan(ssm(), enable_hierarchical_cache=True)
    d = json.loads(json.dumps(p.to_dict()))
    for key in (
        "is_hybrid_swa",
        "is_hybrid_ssm",
        "sliding_window_size",
        "full_tokens_per_layer",
        "swa_tokens_per_layer",
        "max_total_tokens",
        "num_pages",
        "bytes_per_token",
        "disable_radix_cache",
        "tree_cache_kind",
        "decode_retraction_backup",
        "hicache_ratio",
    ):
        assert key in d
    assert {pool["name"] for pool in d["pools"]} >= {"kv", "conv_state_0", "ssm_state", "req_to_token", "host_kv"}


def test_plan_str_is_a_table_of_pools():
    text = str(plan(dense(layers=4), platform="cpu"))
    assert "pool" in text and "kv " in text and "req_to_token" in text and "uint16" in text


def test_plan_pool_bytes_match_shapes():
    p = plan(dense(layers=4), platform="cpu")
    kv = p.pool("kv")
    assert kv.count == 4 and kv.shape == (p.num_pages + 1, 16, 16, 128)
    assert kv.nbytes == 4 * (p.num_pages + 1) * 16 * 16 * 128 * 2
    with pytest.raises(KeyError, match="kv_swa"):
        p.pool("kv_swa")


# --- the budget is never exceeded ------------------------------------------------------------------

PRESETS = ModelSpec.presets()
# What SGLang refuses among the presets: query heads that do not split over the TP ranks.
REFUSED_TP = {
    ("qwen2.5-7b", 8): "28 attention heads",
    ("tiny", 8): "4 attention heads",
    ("deepseek-tiny", 8): "4 attention heads",
    ("gemma3-tiny", 8): "4 attention heads",
    ("mistral-swa-tiny", 8): "4 attention heads",
}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("model", PRESETS)
def test_device_bytes_never_exceed_the_budget_for_every_preset(model, tp):
    spec = ModelSpec.preset(model)
    for budget in (16 * GiB, 80 * GiB):
        config = CacheConfig(memory_budget_bytes=budget, tp_size=tp)
        if (model, tp) in REFUSED_TP:
            with pytest.raises(ConfigError, match=REFUSED_TP[model, tp]):
                plan_kv_cache(spec, config)
            continue
        p = plan_kv_cache(spec, config)
        assert p.kv_budget_bytes == budget and p.device_bytes <= budget
        assert p.device_bytes > 0.9 * budget, "the budget is used, not wasted"


def test_recurrent_state_is_sized_and_laid_out_per_rank():
    # qwen3-next: 32 value heads and 8,192 conv channels per layer, split over 8 ranks.
    spec = ModelSpec.preset("qwen3-next-80b-a3b")
    p = plan_kv_cache(spec, CacheConfig(memory_budget_bytes=80 * GiB, tp_size=8))
    conv, ssm_state = p.pool("conv_state_0"), p.pool("ssm_state")
    assert conv.shape[2:] == (8192 // 8, 3) and ssm_state.shape[2:] == (32 // 8, 128, 128)
    assert p.device_bytes <= 80 * GiB
    slots = p.max_mamba_cache_size
    assert slots is not None
    assert ssm_state.shape[:2] == (36, slots + 1)
    per_rank = 36 * ((8192 // 8) * 3 * 2 + (32 // 8) * 128 * 128 * 4)
    assert p.mamba_state_bytes_per_req == per_rank
    assert conv.nbytes + ssm_state.nbytes == (slots + 1) * per_rank


def test_a_budget_of_one_page_is_refused_since_the_trash_page_needs_one_too():
    per_page = 16 * 4 * 2 * 8 * 128 * 2
    with pytest.raises(ConfigError, match="no page of 16 tokens besides the trash page"):
        plan(dense(), memory_budget_bytes=per_page, platform="cpu")
    p = plan(dense(), memory_budget_bytes=2 * per_page, platform="cpu")
    assert p.num_pages == 1 and p.max_running_requests == 1
    assert p.device_bytes == 2 * per_page


def test_a_pool_shorter_than_the_context_says_so():
    p = plan(dense(context=4096), memory_budget_bytes=64 * 16 * 4 * 2 * 8 * 128 * 2, platform="cpu")
    assert p.max_total_tokens < 4096
    assert any("fewer than one request of context_length=4,096" in w for w in p.warnings)
    assert not plan(dense(context=4096)).warnings


# --- parallel and page validation ------------------------------------------------------------------


def test_tp_that_does_not_split_the_kv_heads_is_refused_with_the_fix():
    spec = dense(kv_heads=8)
    spec = dataclasses.replace(spec, num_attention_heads=24)  # 24 query heads split over 3
    with pytest.raises(
        ConfigError, match=r"tp_size=3: the model's 8 KV heads cannot be split evenly over 3 ranks"
    ) as e:
        plan(spec, tp_size=3)
    # Only sizes that plan: they split the 24 query heads and the 8 KV heads (or replicate them).
    assert str(e.value).endswith("use tp_size 1, 2, 4, 8 or 24")


def test_tp_above_the_kv_heads_replicates_them_or_is_refused():
    p = plan(dense(kv_heads=8), tp_size=16)
    assert (p.num_kv_heads_per_rank, p.kv_head_replicas) == (1, 2)
    assert any("replicated 2x" in note for note in p.padding)
    spec = dataclasses.replace(dense(kv_heads=8), num_attention_heads=24)
    with pytest.raises(ConfigError, match="must be a multiple of 8; use tp_size 1, 2, 4, 8 or 24") as e:
        plan(spec, tp_size=12)
    assert e.value.option == "tp_size"
    assert e.value.render_fix({"tp_size": "--tp"}).endswith("use --tp 1, 2, 4, 8 or 24")


def test_more_pipeline_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="the model has 4 layers, so at most 4 pipeline stages") as e:
        plan(dense(layers=4), pp_size=5)
    assert e.value.option == "pp_size"
    assert plan(dense(layers=4), pp_size=4).max_total_tokens > 0


def test_a_page_larger_than_the_budget_names_the_page_size():
    with pytest.raises(ConfigError, match="use a smaller page_size such as 16") as e:
        plan(dense(), memory_budget_bytes=2**24, page_size=2**20)
    assert e.value.option == "page_size"
    with pytest.raises(ConfigError) as e:
        plan(dense(), memory_budget_bytes=1024, page_size=16)
    assert e.value.option == "memory_budget_bytes"
    with pytest.raises(ConfigError, match="holds no whole page of 16 tokens") as e:
        plan(dense(), memory_budget_bytes=None, max_total_tokens=15)
    assert e.value.option == "max_total_tokens"


def test_tp_that_does_not_split_the_attention_heads_is_refused():
    with pytest.raises(ConfigError, match="32 attention heads cannot be split evenly over 3 ranks"):
        plan(dense(kv_heads=8), tp_size=3)


def test_tpu_page_size_must_be_a_multiple_of_the_packing():
    with pytest.raises(ConfigError, match=r"page_size=3: .*packs 2 bfloat16 tokens.*multiple of 2"):
        plan(dense(), page_size=3)
    with pytest.raises(ConfigError, match=r"packs 4 fp8_e4m3 tokens"):
        plan(dense(), page_size=2, kv_cache_dtype="fp8_e4m3")
    assert plan(dense(), page_size=3, platform="cpu").alloc_page_size == 3
    assert plan(dense(), page_size=4, kv_cache_dtype="fp8_e4m3").page_size == 4


# --- readable numbers --------------------------------------------------------------------------------


def test_pools_report_bytes_per_token_separately_for_full_and_sliding_layers():
    p = plan(swa((S, S, S, F)), platform="cpu")
    per_layer = 2 * 4 * 128 * 2
    assert p.pool("kv_full").bytes_per_token == 1 * per_layer
    assert p.pool("kv_swa").bytes_per_token == 3 * per_layer
    assert p.pool("kv_full").layer_ids == (3,) and p.pool("kv_swa").layer_ids == (0, 1, 2)
    assert p.bytes_per_token == 4 * per_layer
    assert p.pool("req_to_token").bytes_per_token == 0


def test_plan_records_the_platform_and_the_padding_it_applied():
    p = plan(dense(layers=2, kv_heads=2, head_dim=64))
    assert p.platform == "tpu" and p.padding == ("head_dim 64 -> 128 (TPU lane width)",)
    assert "planned for tpu" in str(p) and "padding: head_dim 64 -> 128 (TPU lane width)" in str(p)
    assert p.to_dict()["padding"] == ["head_dim 64 -> 128 (TPU lane width)"]
    assert plan(dense(layers=2, kv_heads=2, head_dim=64), platform="cpu").padding == ()
    assert plan(mla(), platform="tpu").padding == (
        "MLA row kv_lora_rank 512 + qk_rope_head_dim 64 = 576 -> 640 (TPU lane width)",
    )


def test_requests_that_fit_counts_pages_and_rows():
    p = plan(dense(context=4096), max_total_tokens=1600, page_size=16, max_running_requests=8)
    assert p.num_pages == 100
    assert p.requests_that_fit(16) == 8  # rows bind
    assert p.requests_that_fit(17 * 16) == 100 // 17  # pages bind
    assert p.requests_that_fit(17 * 16 + 1) == 100 // 18
    assert p.requests_that_fit(4097) == 0  # beyond the context length
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tokens_per_request"):
            p.requests_that_fit(bad)


def test_max_context_for_is_the_longest_request_that_still_fits():
    p = plan(dense(context=4096), max_total_tokens=1600, page_size=16, max_running_requests=8)
    assert p.max_context_for(1) == 1600
    assert p.max_context_for(8) == 12 * 16  # 8 requests of 12 pages = 96 <= 100 pages
    assert p.requests_that_fit(p.max_context_for(8)) >= 8 > p.requests_that_fit(p.max_context_for(8) + 1)
    assert p.max_context_for(9) == 0  # only 8 request rows
    with pytest.raises(ValueError, match="num_requests"):
        p.max_context_for(0)


def test_requests_that_fit_honours_the_swa_split():
    p = plan(swa((S, S, S, F), window=64), memory_budget_bytes=GiB // 64, platform="cpu")
    full_pages, swa_pages = p.full_tokens_per_layer // 16, p.swa_tokens_per_layer // 16
    # A long request needs its whole length in the full pool, only window + one page in the SWA pool.
    t = 1024
    assert p.requests_that_fit(t) == min(p.max_running_requests, full_pages // 64, swa_pages // (64 // 16 + 1))
    pure = plan(swa((S, S, S, S), window=64), memory_budget_bytes=GiB // 64, platform="cpu")
    assert pure.requests_that_fit(t) == min(pure.max_running_requests, pure.swa_tokens_per_layer // 16 // 5)


def test_plan_of_a_sharded_ssm_model_prints_per_rank_state():
    text = str(
        plan_kv_cache(ModelSpec.preset("qwen3-next-80b-a3b"), CacheConfig(memory_budget_bytes=80 * GiB, tp_size=8))
    )
    assert "[36, " in text and "1,024, 3]" in text and "4, 128, 128]" in text


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(["dense", "swa", "pure_swa", "ssm", "mla"]),
    budget=st.integers(2**20, 2**34),
    page=st.sampled_from([2, 16, 64]),
    tp=st.sampled_from([1, 2]),
    ratio=st.sampled_from([0.25, 0.8, 1.0]),
)
def test_device_bytes_never_exceed_any_budget(which, budget, page, tp, ratio):
    spec = {"dense": dense(), "swa": swa(), "pure_swa": swa((S, S)), "ssm": ssm(), "mla": mla()}[which]
    config = CacheConfig(memory_budget_bytes=budget, page_size=page, tp_size=tp, swa_full_tokens_ratio=ratio)
    try:
        p = plan_kv_cache(spec, config)
    except ConfigError as e:  # too small a budget: refused, naming what to raise
        # (the page size when a page of 16 tokens would have fitted)
        assert e.option in ("memory_budget_bytes", "mamba_full_memory_ratio", "page_size"), e
        return
    assert p.device_bytes <= budget
    assert p.max_running_requests <= max(1, p.num_pages)
    assert p.requests_that_fit(1) >= 1 and p.max_context_for(1) >= 1


def test_a_pipeline_stage_of_only_recurrent_layers_does_not_size_the_pool():
    spec = ssm((R, R, F, F))
    p0 = plan(spec, pp_size=2, pp_rank=0)
    p1 = plan(spec, pp_size=2, pp_rank=1)
    assert p0.num_kv_layers == 0 and p1.num_kv_layers == 2
    assert p0.max_total_tokens == p1.max_total_tokens > 0
    assert p0.max_running_requests == p1.max_running_requests  # capped by stage 0's state slots
    assert p0.device_bytes <= GiB and p1.device_bytes <= GiB


def test_a_model_without_attention_layers_is_refused():
    with pytest.raises(ConfigError, match="no layer caches per-token attention"):
        plan(ssm((R, R)))


def test_swa_split_that_leaves_a_pool_without_a_page_is_refused():
    # 1 MiB, pages of 64: the full pool gets 2 pages and the SWA pool 0.25 x 128 = 32 tokens, no page.
    with pytest.raises(ConfigError, match="after the sliding-window split"):
        plan(swa(), memory_budget_bytes=2**20, page_size=64, swa_full_tokens_ratio=0.25)


def test_host_tier_larger_than_host_memory_is_refused_with_the_figures():
    config = CacheConfig(memory_budget_bytes=GiB, enable_hierarchical_cache=True, hicache_size=40)
    with pytest.raises(
        ConfigError, match=r"host tier needs 37\.25 GiB but the host has 12\.00 GiB available less a 10 GiB reserve"
    ):
        plan_kv_cache(dense(), config, host_memory_bytes=12 * GiB)
    assert plan_kv_cache(dense(), config, host_memory_bytes=64 * GiB).attach_host_tier
    assert plan_kv_cache(dense(), config).attach_host_tier  # no figure given: not checked


def test_host_tier_not_larger_than_the_device_pool_warns():
    p = plan(dense(), enable_hierarchical_cache=True, hicache_ratio=0.5)
    assert any("not larger than the device pool" in w for w in p.warnings)
