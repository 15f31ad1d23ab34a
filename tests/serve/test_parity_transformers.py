"""Parity with Hugging Face Transformers: a model served through kvjax's paged cache gives the
same greedy tokens as the same weights in Transformers, and logits within ``LOGIT_ATOL``.

For every family kvjax serves (Llama 3 with its RoPE scaling, Qwen2 with q/k/v biases and a tied
head, Qwen3 with q/k norms, Mistral), a tiny random-weight checkpoint is built with Transformers
(``AutoModelForCausalLM.from_config``, float32, fixed seed) and saved with ``save_pretrained``
(the Llama one sharded, with ``model.safetensors.index.json``). kvjax loads the directory and
serves, on one cache per run:

* round 1: three prompts sharing a 24-token system prompt, and the first turn of a chat;
* round 2: the chat's second turn (turn 1's prompt + its output + new tokens) and a prompt that
  shares the system prompt again;

with chunked prefill of 8 tokens (smaller than every prompt), at page size 16 with a roomy pool
and at page size 1 with a pool small enough to force eviction and retraction (asserted). Each
request is compared with Transformers' own greedy ``generate`` on the same full prompt.

Tolerance: kvjax and Transformers both compute in float32; logits agree to ~2e-5 here (different
summation orders), so ``LOGIT_ATOL = 1e-4``. How prompts and seeds were chosen: weights are drawn
with ``initializer_range=0.2`` (logits of order 1, so greedy tokens are not all alike), prompts
from ``numpy.random.default_rng(PROMPT_SEED)``; seeds were kept where Transformers' top-1/top-2
logit margin is at least 10x the tolerance at every compared step, so a token can only differ if
the logits really disagree. The test asserts that margin rather than assuming it, so a near-tie
shows up as a clear failure, not a flaky one. The rounds, the prompts and these checks are
``parity_harness``'s, shared by every parity test.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax.radix import RadixCache
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import (
    TINY_CONFIG,
    assert_matches_transformers,
    build_scheduler,
    random_transformers_model,
    save_pretrained,
    serve_two_rounds,
    transformers,
)
from tests.serve.random_workloads import TINY_LAYER_SIZES

LOGIT_ATOL = 1e-4
MAX_NEW = 6

COMMON = dict(TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, object, LoadedModel]:
    """(family, Transformers model, kvjax's load of its saved checkpoint)."""
    name = request.param
    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    hf = random_transformers_model(config)
    directory = save_pretrained(hf, tmp_path_factory, name, max_shard_size="100KB" if name == "llama" else "50GB")
    if name == "llama":
        assert (directory / "model.safetensors.index.json").is_file(), "the llama checkpoint should be sharded"
    return name, hf, load_checkpoint(directory)


def _serve(
    model: LoadedModel,
    *,
    page_size: int,
    max_total_tokens: int,
    enable_hierarchical_cache: bool = False,
    retraction_backup: str | None = None,
    overlap: bool = True,
) -> tuple[Scheduler, dict[str, ServingReq]]:
    """The two rounds of the module docstring on one cache; requests by name (``overlap``: the
    scheduler's overlap scheduling, on by default in every test here)."""
    sched = build_scheduler(
        model,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=8,
        enable_hierarchical_cache=enable_hierarchical_cache,
        disaggregation_decode_retraction_backup=retraction_backup,
        overlap=overlap,
    )
    done = serve_two_rounds(sched, MAX_NEW)
    assert isinstance(sched.cache.tree_cache, RadixCache)
    sched.cache.tree_cache.sanity_check()
    return sched, done


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_page_16_with_prefix_reuse_multi_turn_and_chunked_prefill(family):
    _, hf, model = family
    sched, done = _serve(model, page_size=16, max_total_tokens=2048)
    assert sched.stats.cached_tokens > 0, "later prompts should reuse the system prompt and the first turn"
    assert (done["chat2"].first_cached_tokens or 0) >= 16 and (done["d"].first_cached_tokens or 0) >= 16
    assert sched.stats.evicted_tokens == 0 and sched.stats.retractions == 0
    _assert_matches_transformers(hf, done)


def test_page_1_with_a_pool_small_enough_to_evict_and_retract(family):
    _, hf, model = family
    sched, done = _serve(model, page_size=1, max_total_tokens=64)
    assert sched.stats.cached_tokens > 0
    assert sched.stats.evicted_tokens > 0, "the pool should be small enough to force eviction"
    assert sched.stats.retractions > 0, "the pool should be small enough to force retraction"
    _assert_matches_transformers(hf, done)


# One family within the suite's time budget (every family passes: drop the parametrize to run all).
@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_page_1_small_pool_with_the_host_tier(family):
    _, hf, model = family
    sched, done = _serve(model, page_size=1, max_total_tokens=64, enable_hierarchical_cache=True)
    assert sched.stats.evicted_tokens > 0 and sched.cache.host_pool is not None
    _assert_matches_transformers(hf, done)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_page_1_small_pool_restoring_retracted_requests_from_cpu_tensor_copies(family):
    _, hf, model = family
    sched, done = _serve(model, page_size=1, max_total_tokens=64, retraction_backup="cpu_tensor")
    [ext] = sched.extensions
    assert sched.stats.retractions > 0 and ext.retraction.restored > 0, "retracted requests should be restored"
    _assert_matches_transformers(hf, done)


# The tests above run with overlap scheduling (the default); these run the loop without it.
@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_without_overlap_prefix_reuse_and_chunked_prefill(family):
    _, hf, model = family
    sched, done = _serve(model, page_size=16, max_total_tokens=2048, overlap=False)
    assert sched.stats.cached_tokens > 0 and not sched.overlap
    _assert_matches_transformers(hf, done)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_without_overlap_eviction_and_retraction(family):
    _, hf, model = family
    sched, done = _serve(model, page_size=1, max_total_tokens=64, overlap=False)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    _assert_matches_transformers(hf, done)
