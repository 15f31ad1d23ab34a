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

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need the 'parity' extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="parity tests need the 'parity' extra (torch, transformers)")

from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.radix import PureSWAChunkCache, PureSWARadixCache  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.swa_extension import SWAServing  # noqa: E402

LOGIT_ATOL = 1e-4
MIN_MARGIN = 10 * LOGIT_ATOL
MAX_NEW = 12
CHUNK = 8
WINDOW = 8
PROMPT_SEED = 5
VOCAB = 128

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
    sliding_window=WINDOW,
    rope_theta=10_000.0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@functools.cache
def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(PROMPT_SEED)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    system = draw(24)
    return {
        "a": system + draw(6),
        "b": system + draw(9),
        "c": system + draw(5),
        "chat1": draw(18),
        "chat2_new": draw(7),
        "d": system + draw(11),
    }


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[object, LoadedModel]:
    config = transformers.MistralConfig(**CONFIG)
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(config).to(torch.float32).eval()
    directory: Path = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(directory)
    return hf, load_checkpoint(directory)


@functools.cache
def _hf_greedy(hf, prompt: tuple[int, ...]) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), np.stack([step[0].numpy() for step in out.logits])


def _serve(model: LoadedModel, **config) -> tuple[Scheduler, dict[str, ServingReq]]:
    cache = build_kv_cache(
        model.spec,
        CacheConfig(max_running_requests=8, context_length=124, chunked_prefill_size=CHUNK, **config),
    )
    assert cache.is_hybrid_swa and not cache.full_tokens_per_layer and cache.pools.swa.full is None
    sched = Scheduler(
        model.config, cache, model.params, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    assert isinstance(sched.extensions[0], SWAServing) and sched.extensions[0].pure
    p = _prompts()
    done: dict[str, ServingReq] = {}
    first = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("a", "b", "c", "chat1")]
    sched.run(first)
    done.update((str(r.rid), r) for r in first)
    chat2 = p["chat1"] + done["chat1"].output_ids + p["chat2_new"]
    second = [ServingReq("chat2", chat2, max_new_tokens=MAX_NEW), ServingReq("d", p["d"], max_new_tokens=MAX_NEW)]
    sched.run(second)
    done.update((str(r.rid), r) for r in second)
    assert sched.leak_free()
    cache.tree_cache.sanity_check()
    return sched, done


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    for name, req in done.items():
        tokens, logits = _hf_greedy(hf, tuple(req.origin_input_ids))
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin >= MIN_MARGIN, f"{name}: Transformers' top-2 margin {margin:.2e} is a near-tie; pick other seeds"
        assert req.output_ids == tokens, f"{name}: kvjax {req.output_ids} != transformers {tokens}"
        np.testing.assert_allclose(np.stack(req.logits), logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name}: logits")


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
