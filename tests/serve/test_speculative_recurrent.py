"""Speculative decoding (STANDALONE) of a recurrent-state target against Transformers (issue 35).

The target is the tiny Qwen3-Next of ``test_parity_qwen3_next`` (3 gated-delta-net layers and one
full-attention layer, float32); the draft a one-layer Qwen3 (full attention) with the target's
vocabulary, embedding and head, so it agrees now and then and most rounds reject drafts. A
rejecting round's recurrent state is restored from before the round and the kept tokens replayed
(``kvjax.serve.speculative.state_replay``). The two rounds of ``parity_harness`` (prefix reuse
from the tree's state checkpoints, a multi-turn chat, chunked prefill) are served at page size 1
with a roomy pool and with one small enough to evict and retract, and at page size 4 with the
extra buffer (states tracked at page boundaries, recorded only within the tokens a round keeps):
every request's tokens equal Transformers' greedy ``generate``, its logits agree within
``LOGIT_ATOL``, and no KV or state slot leaked.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.errors import ConfigError
from kvjax.radix import MambaRadixCache
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative import DraftDecoding
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    TINY_CONFIG,
    assert_matches_transformers,
    prompts,
    random_transformers_model,
    save_pretrained,
    serve_two_rounds,
    torch,
    transformers,
)
from tests.serve.random_workloads import QWEN3_NEXT_DENSE_MLPS, QWEN3_NEXT_LAYERS, TINY_LAYER_SIZES

LOGIT_ATOL = 2e-4  # the Qwen3-Next parity test's: Transformers' chunked delta rule against the recurrence
MAX_NEW = 6
K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Any, LoadedModel, LoadedModel]:
    """(Transformers' Qwen3-Next target, kvjax's target, kvjax's one-layer Qwen3 draft)."""
    config = transformers.Qwen3NextConfig(
        **TINY_CONFIG, **TINY_LAYER_SIZES, **QWEN3_NEXT_LAYERS, **QWEN3_NEXT_DENSE_MLPS
    )
    hf = random_transformers_model(config, seed=1)
    target_dir = save_pretrained(hf, tmp_path_factory, "qwen3_next")
    draft_config = transformers.Qwen3Config(
        **TINY_CONFIG,
        **TINY_LAYER_SIZES,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    draft = random_transformers_model(draft_config, seed=2)
    with torch.no_grad():  # the target's embedding and head: the draft agrees now and then
        draft.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(hf.lm_head.weight)
    draft_dir = save_pretrained(draft, tmp_path_factory, "qwen3_draft")
    return hf, load_checkpoint(target_dir), load_checkpoint(draft_dir)


def _cache(target: LoadedModel, draft: LoadedModel, *, max_total_tokens: int, **config: Any) -> Any:
    return build_kv_cache(
        target.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=config.pop("page_size", 1),
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            **config,
        ),
        draft_spec=draft.spec,
    )


def _serve(models: Any, *, max_total_tokens: int, **config: Any) -> tuple[Scheduler, dict[str, Any]]:
    _, target, draft = models
    cache = _cache(target, draft, max_total_tokens=max_total_tokens, **config)
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    done = serve_two_rounds(sched, MAX_NEW)
    table, tree = sched.cache.req_to_token_pool, sched.cache.tree_cache
    assert isinstance(tree, MambaRadixCache)
    tree.sanity_check()
    held = tree.mamba_evictable_size() + tree.mamba_protected_size()
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    return sched, done


def _draft(sched: Scheduler) -> DraftDecoding:
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer


def test_rejected_drafts_roll_the_state_back_with_reuse_multi_turn_and_chunked_prefill(models):
    hf = models[0]
    sched, done = _serve(models, max_total_tokens=2048)
    sp = _draft(sched).stats
    assert sp.replayed_requests > 0 and sp.rolled_back_slots > 0, sp
    assert sp.accepted_tokens < sp.proposed_tokens, sp
    assert sched.stats.cached_tokens > 0  # later prompts start from the tree's state checkpoints
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_a_pool_small_enough_to_evict_and_retract(models):
    hf = models[0]
    sched, done = _serve(models, max_total_tokens=64)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _draft(sched).stats.replayed_requests > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_page_4_with_the_extra_buffer_records_the_states_the_rounds_keep(models):
    """Each round's verify forward tracks the state at its page boundary; only a boundary within
    the kept tokens is recorded (a rejecting round's replay tracks its own), so turn 2 resumes
    from a checkpoint tracked while turn 1 decoded, and the tokens stay Transformers'."""
    hf = models[0]
    sched, done = _serve(models, max_total_tokens=2048, page_size=4, enable_mamba_extra_buffer=True)
    assert sched.cache.tree_cache.page_size == 4 and _draft(sched).stats.replayed_requests > 0
    assert (done["chat2"].first_cached_tokens or 0) > len(prompts()["chat1"]), "a checkpoint tracked in decode"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_the_extra_buffer_over_pipeline_stages_is_refused_by_name(models):
    """Its rounds' tracked states are recorded on one scheduler only (``kvjax.plan.draft``)."""
    _, target, draft = models
    with pytest.raises(ConfigError, match="enable_mamba_extra_buffer=True: .* under pipeline stages"):
        _cache(target, draft, max_total_tokens=2048, page_size=4, enable_mamba_extra_buffer=True, pp_size=2)
