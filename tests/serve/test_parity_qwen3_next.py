"""Qwen3-Next served through kvjax (gated delta net + gated attention, recurrent state in the
state pool, checkpoints in ``MambaRadixCache``) gives Transformers' greedy tokens and logits.

A tiny random-weight ``Qwen3NextForCausalLM`` (float32, 3 gated-delta-net layers and 1 full
attention layer, dense MLPs: ``mlp_only_layers`` covers every layer; and one with two sparse-MoE
layers) is saved with ``save_pretrained`` and loaded by kvjax. Served (page size 1 unless said) with chunked prefill of
8 tokens:

* round 1: three prompts sharing a 24-token system prompt and a chat's first turn; round 2: the
  chat's second turn (turn 1 + its output + new tokens) and another system-prompt prompt. Later
  prompts start from a checkpoint forked into their own state slot (prefix reuse: the state
  restored, then continued), asserted;
* the same rounds with a pool small enough to evict KV and checkpoints and to retract requests
  (asserted), at page size 4 with the extra buffer (states tracked at page boundaries into
  ping-pong slots, donated as checkpoints), and with the radix cache off (cold == warm).

Each request is compared with Transformers' own greedy ``generate`` on its full prompt: the same
tokens, logits within ``LOGIT_ATOL``, and Transformers' top-2 margin at least ``MIN_MARGIN`` at
every step (a near-tie fails loudly instead of flaking). Transformers runs the chunked delta rule
for prompts and the recurrent one for decode; kvjax runs the recurrence token by token; they agree
to ~4e-5 here.
"""

from __future__ import annotations

import pytest

from kvjax.radix import MambaRadixCache
from kvjax.serve.checkpoint import LoadedModel
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import (
    CHUNK,
    TINY_CONFIG,
    assert_matches_transformers,
    hf_greedy,
    prompts,
    serve_recurrent,
    tiny_checkpoint,
    transformers,
)
from tests.serve.random_workloads import QWEN3_NEXT_DENSE_MLPS, QWEN3_NEXT_LAYERS, TINY_LAYER_SIZES

LOGIT_ATOL = 2e-4
MAX_NEW = 6
MODEL_SEED = 1


def _hf_model(tmp_path_factory, name: str, **moe) -> tuple[object, LoadedModel]:
    config = transformers.Qwen3NextConfig(
        **TINY_CONFIG, **TINY_LAYER_SIZES, **QWEN3_NEXT_LAYERS, **(moe or QWEN3_NEXT_DENSE_MLPS)
    )
    return tiny_checkpoint(config, tmp_path_factory, name, seed=MODEL_SEED)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[object, LoadedModel]:
    return _hf_model(tmp_path_factory, "qwen3_next")


def _serve(model: LoadedModel, **config) -> tuple[Scheduler, dict[str, ServingReq]]:
    return serve_recurrent(model, MAX_NEW, **config)


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_prefix_reuse_from_checkpoints_multi_turn_and_chunked_prefill(model):
    hf, loaded = model
    sched, done = _serve(loaded, max_total_tokens=1024, max_running_requests=4, max_mamba_cache_size=32)
    assert isinstance(sched.cache.tree_cache, MambaRadixCache)
    # The system prompt's chunk ends (8, 16, 24) are checkpoints: later prompts start from one.
    assert all((done[n].first_cached_tokens or 0) >= 16 for n in ("b", "c", "d"))
    assert (done["chat2"].first_cached_tokens or 0) >= len(prompts()["chat1"]), "turn 2 resumes turn 1's state"
    assert sched.stats.evicted_tokens == 0 and sched.stats.retractions == 0
    _assert_matches_transformers(hf, done)


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_eviction_of_kv_and_checkpoints_and_retraction(model, overlap):
    hf, loaded = model
    sched, done = _serve(loaded, max_total_tokens=56, max_running_requests=4, max_mamba_cache_size=6, overlap=overlap)
    tree = sched.cache.tree_cache
    assert sched.stats.cached_tokens > 0
    assert sched.stats.evicted_tokens > 0, "the pool should be small enough to evict KV"
    assert tree.mamba.num_evicted > 0, "the state pool should be small enough to evict checkpoints"
    assert sched.stats.retractions > 0, "the pool should be small enough to force retraction"
    _assert_matches_transformers(hf, done)


@pytest.mark.slow  # the suite's time budget: the second CI stage runs it
def test_page_4_with_the_extra_buffer_tracks_checkpoints_at_page_boundaries(model):
    hf, loaded = model
    sched, done = _serve(
        loaded,
        page_size=4,
        enable_mamba_extra_buffer=True,
        max_total_tokens=1024,
        max_running_requests=4,
        max_mamba_cache_size=48,
    )
    assert sched.cache.tree_cache.page_size == 4
    assert all((done[n].first_cached_tokens or 0) >= 16 for n in ("b", "c", "d"))
    assert (done["chat2"].first_cached_tokens or 0) >= 16, "turn 2 resumes from a tracked checkpoint of turn 1"
    _assert_matches_transformers(hf, done)


@pytest.mark.slow  # the suite's time budget: the second CI stage runs it
def test_sparse_moe_layers(tmp_path_factory):
    """Layers 1 and 3 are sparse MoE (4 experts, top 2, a gated shared expert: kvjax.serve.moe)."""
    hf, loaded = _hf_model(
        tmp_path_factory,
        "qwen3_next_moe",
        mlp_only_layers=[0, 2],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )
    assert loaded.config.family_config.moe_layers == (1, 3)
    _, done = _serve(loaded, max_total_tokens=1024, max_running_requests=4, max_mamba_cache_size=32)
    assert (done["b"].first_cached_tokens or 0) >= 16
    _assert_matches_transformers(hf, done)


def test_cold_equals_warm(model):
    _, loaded = model
    _, warm = _serve(loaded, max_total_tokens=1024, max_running_requests=4, max_mamba_cache_size=32)
    sched, cold = _serve(
        loaded, max_total_tokens=1024, max_running_requests=4, max_mamba_cache_size=32, disable_radix_cache=True
    )
    assert sched.stats.cached_tokens == 0
    assert {n: r.output_ids for n, r in cold.items()} == {n: r.output_ids for n, r in warm.items()}


def test_generate_serves_the_checkpoint(model):
    from kvjax.serve.generate import generate

    hf, loaded = model
    p = prompts()
    result, sched = generate(loaded, [p["a"], p["b"]], max_new_tokens=MAX_NEW, page_size=1, chunked_prefill_size=CHUNK)
    assert sched.stats.cached_tokens >= 16, "the second prompt starts from a checkpoint of the first"
    for prompt, tokens in zip([p["a"], p["b"]], result.outputs, strict=True):
        assert tokens == hf_greedy(hf, prompt, MAX_NEW)[0]
