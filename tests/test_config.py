"""CacheConfig: SGLang's names, validation on construction, derived facts."""

from __future__ import annotations

import dataclasses

import pytest

from kvjax import CacheConfig, ConfigError


def test_defaults_are_valid_and_use_sglang_names():
    config = CacheConfig()
    names = {f.name for f in dataclasses.fields(config)}
    for name in (
        "page_size",
        "kv_cache_dtype",
        "max_total_tokens",
        "max_running_requests",
        "context_length",
        "disable_radix_cache",
        "chunked_prefill_size",
        "radix_eviction_policy",
        "enable_hierarchical_cache",
        "hicache_ratio",
        "hicache_size",
        "hicache_write_policy",
        "hicache_mem_layout",
        "disaggregation_mode",
        "disaggregation_decode_enable_radix_cache",
        "disaggregation_decode_retraction_backup",
        "disaggregation_decode_enable_offload_kvcache",
        "enable_priority_scheduling",
        "disable_priority_preemption",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
        "enable_session_radix_cache",
        "enable_kv_cache_events",
        "enable_metrics",
        "model_impl",
        "swa_full_tokens_ratio",
        "mamba_full_memory_ratio",
        "enable_mamba_extra_buffer",
        "tp_size",
        "pp_size",
        "pp_rank",
        "dp_size",
        "enable_dp_attention",
        "dcp_size",
        "vlm_cache_size_mb",
    ):
        assert name in names
    assert config.radix_eviction_policy == "lru" and config.swa_full_tokens_ratio == 0.8
    assert config.mamba_full_memory_ratio == 0.9 and config.hicache_write_policy == "write_through"


@pytest.mark.parametrize(
    "field,value",
    [
        ("page_size", 0),
        ("page_size", 1.5),
        ("kv_cache_dtype", "int4"),
        ("radix_eviction_policy", "random"),
        ("disaggregation_mode", "both"),
        ("disaggregation_decode_retraction_backup", "disk"),
        ("hicache_mem_layout", "row_major"),
        ("hicache_mem_layout", "page_first_direct"),
        ("hicache_mem_layout", "page_head"),
        ("hicache_write_policy", "never"),
        ("speculative_algorithm", "MEDUSA"),
        ("model_impl", "vllm"),
        ("swa_full_tokens_ratio", 0.0),
        ("mem_fraction_static", 1.5),
        ("tp_size", 0),
        ("hicache_ratio", 0),
        ("max_total_tokens", -5),
        ("platform", "ipu"),
    ],
)
def test_bad_value_names_field_and_value(field, value):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**{field: value})
    assert err.value.option == field and repr(value) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_pp_rank_must_be_below_pp_size():
    with pytest.raises(ConfigError, match="pp_rank=2"):
        CacheConfig(pp_size=2, pp_rank=2)


def test_draft_tokens_need_an_algorithm():
    with pytest.raises(ConfigError, match="speculative_algorithm"):
        CacheConfig(speculative_num_draft_tokens=4)


def test_decode_radix_cache_needs_decode_mode():
    with pytest.raises(ConfigError, match="disaggregation_mode='decode'"):
        CacheConfig(disaggregation_decode_enable_radix_cache=True)


def test_chunked_prefill_minus_one_disables_it():
    assert CacheConfig(chunked_prefill_size=-1).chunked_prefill_size is None


def test_derived_facts():
    config = CacheConfig(
        page_size=16,
        dcp_size=4,
        tp_size=8,
        dp_size=2,
        enable_dp_attention=True,
        disaggregation_mode="decode",
        enable_priority_scheduling=True,
    )
    assert config.dcp_enabled and config.alloc_page_size == 64
    assert config.attn_tp_size == 1  # KV-head ranks: tp 8 / dp 2 / dcp 4 (DCP divides each DP rank's group)
    assert config.need_sort and config.priority_preemption


def test_replace_validates():
    with pytest.raises(ConfigError):
        CacheConfig().replace(page_size=-1)
    assert CacheConfig().replace(page_size=32).page_size == 32


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().page_size = 4  # type: ignore[misc]


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_host_layouts_kvjax_does_not_build_are_refused_by_name(layout):
    """SGLang's other host layouts are refused when the config is made, naming the built ones,
    not later at build."""
    with pytest.raises(ConfigError, match=f"hicache_mem_layout='{layout}'.*'layer_first', 'page_first'"):
        CacheConfig(enable_hierarchical_cache=True, hicache_mem_layout=layout)
