"""Speculative decoding (STANDALONE) against Hugging Face Transformers.

For a Llama and a Qwen3 target (tiny random-weight checkpoints made with Transformers, two layers,
as in ``test_parity_transformers``), the draft is a smaller checkpoint of the same family: one
layer, with the target's embedding, first layer and head (so it agrees part of the time and the
rounds mix accepted and rejected tokens). Both are saved with ``save_pretrained`` and loaded by
kvjax. The two rounds of ``parity_harness`` (prefix reuse, a multi-turn chat, chunked prefill) are
served speculatively at page size 16 with a roomy pool and at page size 1 with a pool small enough
to evict and retract; every request's tokens must equal Transformers' greedy ``generate`` and its
logits (the target's, from the verify forwards) agree within ``LOGIT_ATOL``.

With the host tier on, the draft is the target checkpoint itself: it must accept every proposal,
also for the prompts whose prefix was evicted to the host and loaded back, which holds only if
the draft's pages came back with the target's (the sidecar host pool); the draft's KV equals the
target's at the slots the tree serves.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.radix import HiRadixCache
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.generate import scheduler_for
from kvjax.serve.host_tier import HostTierExtension
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.speculative import DraftDecoding
from kvjax.transfers.transfer import PageTransferEngine
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    TINY_CONFIG,
    assert_matches_transformers,
    random_transformers_model,
    save_pretrained,
    serve_two_rounds,
    torch,
    transformers,
)
from tests.serve.random_workloads import TINY_LAYER_SIZES

LOGIT_ATOL = 1e-4
MAX_NEW = 6
K = 3  # draft tokens per round

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3": ("Qwen3Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
}


def _first_layer_draft(target: Any, config_class: Any, config: dict[str, Any]) -> Any:
    """A one-layer model of the target's family with the target's embedding, first layer, final
    norm and head."""
    draft = random_transformers_model(config_class(**dict(config, num_hidden_layers=1)), seed=1)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, f"the draft should take every weight from the target; missing {missing}"
    return draft


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Any, LoadedModel, LoadedModel, Path]:
    """(family, Transformers target, kvjax's target, kvjax's one-layer draft, the target's directory)."""
    name = request.param
    class_name, extra = FAMILIES[name]
    config_class = getattr(transformers, class_name)
    config = dict(TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2, **extra)
    hf = random_transformers_model(config_class(**config))
    target_dir = save_pretrained(hf, tmp_path_factory, name)
    with torch.no_grad():
        draft = _first_layer_draft(hf, config_class, config)
    draft_dir = save_pretrained(draft, tmp_path_factory, f"{name}-draft")
    return name, hf, load_checkpoint(target_dir), load_checkpoint(draft_dir), target_dir


def _serve(
    target: LoadedModel, draft: LoadedModel, *, page_size: int, max_total_tokens: int, **config: Any
) -> tuple[Scheduler, dict[str, Any]]:
    cache = build_kv_cache(
        target.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            **config,
        ),
        draft_spec=draft.spec,
    )
    sched = scheduler_for(
        target, cache, draft=draft, num_steps=K, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.proposer, DraftDecoding)
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    return sched, done


def test_page_16_with_prefix_reuse_multi_turn_and_chunked_prefill(family):
    _, hf, target, draft, _ = family
    sched, done = _serve(target, draft, page_size=16, max_total_tokens=2048)
    assert sched.stats.cached_tokens > 0 and (done["d"].first_cached_tokens or 0) >= 16
    sp = _draft(sched).stats
    assert 0 < sp.accepted_tokens < sp.proposed_tokens, f"rounds should mix accepted and rejected drafts: {sp}"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_page_1_with_a_pool_small_enough_to_evict_and_retract(family):
    _, hf, target, draft, _ = family
    sched, done = _serve(target, draft, page_size=1, max_total_tokens=64)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _draft(sched).stats.rolled_back_slots > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_host_tier_loads_the_drafts_pages_with_the_targets(family, monkeypatch):
    _, hf, target, _, target_dir = family
    loaded: collections.Counter[str] = collections.Counter()  # slots loaded back, by pool
    start_load = PageTransferEngine.start_load

    def counting(engine: Any, host_slots: Any, device_slots: Any) -> Any:
        loaded[str(engine.pool_name)] += len(device_slots)
        return start_load(engine, host_slots, device_slots)

    monkeypatch.setattr(PageTransferEngine, "start_load", counting)
    same = load_checkpoint(target_dir)  # the target as its own draft: it must accept everything
    sched, done = _serve(target, same, page_size=1, max_total_tokens=64, enable_hierarchical_cache=True)
    assert loaded["kv_draft"] > 0 and len(loaded) == 2, f"both pools should load the same slots: {loaded}"
    assert len(set(loaded.values())) == 1, f"both pools should load the same slots: {loaded}"
    [ext] = [e for e in sched.extensions if isinstance(e, HostTierExtension)]
    tree = sched.cache.tree_cache
    assert isinstance(tree, HiRadixCache) and sched.cache.draft_host_pool is not None
    assert ext.loaded_tokens > 0, "a prefix should have been loaded back from the host"
    assert _draft(sched).stats.acceptance_rate == 1.0, "a draft KV page did not follow the target's"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    tree.check_transfers(wait=True)
    assert ext.host_balanced()
    # the same weights wrote both pools: the draft's KV is the target's wherever the tree serves it
    req = done["chat2"]
    slots = tree.match_prefix(list(req.origin_input_ids) + req.output_ids[:-1]).indices
    assert len(slots) > 0
    pools = sched.cache.pools
    for layer in range(target.config.num_hidden_layers):
        ours = np.asarray(pools["kv"].kv_buffer(layer))[np.asarray(slots)]
        draft = np.asarray(pools["kv_draft"].kv_buffer(layer))[np.asarray(slots)]
        np.testing.assert_allclose(draft, ours, atol=1e-5, rtol=0)


def _draft(sched: Scheduler) -> DraftDecoding:
    """The scheduler's draft-model proposer."""
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer
