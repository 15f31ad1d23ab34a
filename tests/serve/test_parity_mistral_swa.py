"""Mistral with a sliding window on every layer (a pure sliding-window model) served through the
one-pool SWA cache matches Hugging Face Transformers.

A tiny random-weight ``MistralForCausalLM`` (float32, fixed seed, window 8 tokens on both layers)
is saved with ``save_pretrained`` and loaded by kvjax. Its plan has no full-attention pool: the
only pool is the SWA pool under a plain allocator, the tree a ``PureSWARadixCache`` (a
``PureSWAChunkCache`` with the radix cache off). Served with chunked prefill of 8 tokens:

* round 1: three prompts sharing a 24-token system prompt (3x the window), and a chat's turn 1;
* round 2: the chat's second turn (a prefix reused across the window boundary: only its last
  window is live KV, the rest of the match is tombstones) and a prompt sharing the system prompt.

Decoding 12 tokens per request moves every window past its prompt, so decode frees out-of-window
slots, zeroes them in the request table, and the tree stores tombstones. At page size 4 with a
roomy pool, at page size 1 with a pool small enough to force eviction and retraction (asserted),
and with the radix cache off, each request's greedy tokens equal Transformers' ``generate`` and
its logits agree within ``LOGIT_ATOL``; the pool balances afterwards.
"""

from __future__ import annotations

import pytest

from kvjax.radix import PureSWAChunkCache, PureSWARadixCache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.swa_extension import SWAServing
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    build_scheduler,
    serve_two_rounds,
    tiny_checkpoint,
    transformers,
)
from tests.serve.random_workloads import TINY_LAYER_SIZES

LOGIT_ATOL = 1e-4
MAX_NEW = 12
WINDOW = 8
PROMPT_SEED = 5

CONFIG = dict(TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2, sliding_window=WINDOW, rope_theta=10_000.0)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[object, LoadedModel]:
    return tiny_checkpoint(transformers.MistralConfig(**CONFIG), tmp_path_factory, "mistral")


def _serve(model: LoadedModel, **config) -> tuple[Scheduler, dict[str, ServingReq]]:
    sched = build_scheduler(model, max_running_requests=8, **config)
    cache = sched.cache
    assert cache.is_hybrid_swa and not cache.full_tokens_per_layer and cache.pools.swa.full is None
    assert isinstance(sched.extensions[0], SWAServing) and sched.extensions[0].pure
    done = serve_two_rounds(sched, MAX_NEW, seed=PROMPT_SEED)
    cache.tree_cache.sanity_check()
    return sched, done


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_page_4_with_prefix_reuse_across_the_window(mistral):
    hf, model = mistral
    sched, done = _serve(model, page_size=4, max_total_tokens=1024)
    tree = sched.cache.tree_cache
    assert isinstance(tree, PureSWARadixCache)
    assert (done["chat2"].first_cached_tokens or 0) >= 16 and (done["d"].first_cached_tokens or 0) >= 16
    assert sched.extensions[0].freed_swa_tokens > 0, "decode should free out-of-window slots"
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes()), "the tree should hold tombstones"
    _assert_matches_transformers(hf, done)


def test_page_1_with_a_pool_small_enough_to_evict_and_retract(mistral):
    hf, model = mistral
    sched, done = _serve(model, page_size=1, max_total_tokens=48)
    assert sched.stats.cached_tokens > 0
    assert sched.stats.evicted_tokens > 0, "the pool should be small enough to evict"
    assert sched.stats.retractions > 0, "the pool should be small enough to force retraction"
    _assert_matches_transformers(hf, done)


@pytest.mark.slow  # the chunk cache: nothing shared, decode still frees its window
def test_radix_cache_off(mistral):
    hf, model = mistral
    sched, done = _serve(model, page_size=2, max_total_tokens=256, disable_radix_cache=True)
    assert isinstance(sched.cache.tree_cache, PureSWAChunkCache)
    assert sched.extensions[0].freed_swa_tokens > 0
    _assert_matches_transformers(hf, done)
