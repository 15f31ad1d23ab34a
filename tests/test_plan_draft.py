"""The draft (speculative) model's KV pool in the plan: sized with the target's, same slots."""

from __future__ import annotations

import dataclasses

import pytest

from kvjax import CacheConfig, ConfigError
from kvjax.plan import plan_kv_cache
from kvjax.spec import LayerKind
from tests.specs import dense, mla, swa

MiB = 2**20


def plan(spec, draft_spec=None, **kw):
    kw.setdefault("memory_budget_bytes", 64 * MiB)
    kw.setdefault("platform", "cpu")
    kw.setdefault("context_length", 256)
    kw.setdefault("max_running_requests", 4)
    return plan_kv_cache(spec, CacheConfig(**kw), draft_spec=draft_spec)


def small_draft(name="draft", kind=LayerKind.FULL, layers=2, kv_heads=2, head_dim=64):
    return dataclasses.replace(
        dense(layers=layers, kv_heads=kv_heads, head_dim=head_dim), name=name, layer_kinds=(kind,) * layers
    )


# --- plan ---------------------------------------------------------------------------------------


def test_eagle_draft_is_one_target_layer_sharing_the_token_slots_and_the_budget():
    p = plan(dense(layers=4), speculative_algorithm="EAGLE")
    kv, draft = p.pool("kv"), p.pool("kv_draft")
    assert (draft.kind, draft.count, draft.layer_ids, draft.memory) == ("mha", 1, (0,), "device")
    assert draft.shape == kv.shape  # same pages, page size and head layout: slot ids index both
    assert p.draft_bytes_per_token == draft.bytes_per_token == p.bytes_per_token // 4
    per_token = p.bytes_per_token + p.draft_bytes_per_token
    ps = p.alloc_page_size
    assert p.max_total_tokens == (64 * MiB - ps * per_token) // per_token // ps * ps
    assert p.device_bytes <= p.kv_budget_bytes
    assert [q.name for q in p.pools] == ["kv", "kv_draft", "req_to_token"]
    assert "(+ " in str(p) and "kv_draft" in str(p) and p.to_dict()["draft_bytes_per_token"] == draft.bytes_per_token


def test_no_draft_pool_without_a_draft_model():
    for kw in (dict(), dict(speculative_algorithm="NGRAM")):
        p = plan(dense(), **kw)
        assert p.draft is None and p.draft_bytes_per_token == 0
        assert "kv_draft" not in [q.name for q in p.pools]


def test_nextn_draft_is_the_targets_mtp_layers_of_its_attention_kind():
    spec = dataclasses.replace(mla(layers=3), num_nextn_predict_layers=2)
    p = plan(spec, speculative_algorithm="NEXTN")
    draft = p.pool("kv_draft")
    assert (draft.kind, draft.layer_ids, draft.shape) == ("mla", (3, 4), p.pool("kv").shape)
    assert p.draft_bytes_per_token == 2 * p.pool("kv").bytes_per_token // 3


def test_standalone_draft_uses_its_own_spec_and_without_one_plans_nothing():
    p = plan(dense(layers=4), small_draft(), speculative_algorithm="STANDALONE")
    draft = p.pool("kv_draft")
    assert draft.count == 2 and draft.shape[:3] == (p.num_pages + 1, p.alloc_page_size, 4)
    p = plan(dense(), speculative_algorithm="STANDALONE")
    assert p.draft is None and any("STANDALONE" in w for w in p.warnings)


def test_bad_drafts_are_refused_naming_the_value():
    with pytest.raises(ConfigError, match="draft_spec.*'mha' pool.*'full_attention'"):
        plan(dense(), dataclasses.replace(mla(layers=1), name="mla-draft"), speculative_algorithm="EAGLE")
    with pytest.raises(ConfigError, match="'mla' pool"):
        plan(mla(), small_draft(), speculative_algorithm="EAGLE3")
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0"):
        plan(dense(), speculative_algorithm="NEXTN")
    with pytest.raises(ConfigError, match="NEXTN drafts with the target's own MTP layers"):
        plan(dataclasses.replace(dense(), num_nextn_predict_layers=1), small_draft(), speculative_algorithm="NEXTN")
    with pytest.raises(ConfigError, match="has no draft model"):
        plan(dense(), small_draft(), speculative_algorithm="NGRAM")


def test_swa_target_draft_is_not_planned_and_says_so():
    p = plan(swa(), speculative_algorithm="EAGLE")
    assert p.draft is None and any("draft KV pools" in w for w in p.warnings)


def test_under_pipeline_parallelism_the_draft_is_on_the_last_stage_only():
    first = plan(dense(layers=4), speculative_algorithm="EAGLE", pp_size=2, pp_rank=0)
    last = plan(dense(layers=4), speculative_algorithm="EAGLE", pp_size=2, pp_rank=1)
    assert "kv_draft" not in [q.name for q in first.pools] and first.draft_bytes_per_token == 0
    assert last.pool("kv_draft").count == 1 and last.draft_bytes_per_token == last.bytes_per_token // 2
    assert first.max_total_tokens == last.max_total_tokens  # the last stage (with the draft) holds fewest
    assert last.max_total_tokens < plan(dense(layers=4), pp_size=2, pp_rank=1).max_total_tokens
