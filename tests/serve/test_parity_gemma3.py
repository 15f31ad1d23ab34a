"""Gemma 3 (text) served through the hybrid-SWA cache matches Hugging Face Transformers.

A tiny random-weight ``Gemma3ForCausalLM`` (float32, fixed seed; layers sliding, sliding, full,
sliding; window 8 tokens; per-layer RoPE: linear-scaled base 1e6 on the full layer, 1e4 on the
sliding ones; ``query_pre_attn_scalar`` 24, not the head dim) is saved with ``save_pretrained`` and
loaded by kvjax, which serves on one cache, with chunked prefill of 8 tokens:

* round 1: three prompts sharing a 24-token system prompt (3x the window), and a chat's turn 1;
* round 2: the chat's second turn (turn 1 + its output + new tokens: a prefix reused across the
  window boundary) and a prompt sharing the system prompt again.

Decoding 12 tokens per request moves every window past its prompt, so the scheduler frees
out-of-window SWA slots and the tree stores tombstones. At page size 4 with a roomy pool, and at
page size 1 with pools small enough to force eviction in both pools and retraction (asserted), each
request's greedy tokens equal Transformers' ``generate`` on the same prompt and its logits agree
within ``LOGIT_ATOL``; after both rounds the full and SWA accounting is leak free. The near-tie
guard of ``test_parity_transformers.py`` applies (seeds kept where the top-2 margin is at least
``MIN_MARGIN``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need the 'parity' extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="parity tests need the 'parity' extra (torch, transformers)")

from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.alloc import SWATokenToKVPoolAllocator  # noqa: E402
from kvjax.radix import SWARadixCache  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from kvjax.serve.swa_extension import SWAServing  # noqa: E402

LOGIT_ATOL = 1e-4
MIN_MARGIN = 10 * LOGIT_ATOL
MAX_NEW = 12
CHUNK = 8
WINDOW = 8
PROMPT_SEED = 3
VOCAB = 128

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
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
def gemma3(tmp_path_factory) -> tuple[object, LoadedModel]:
    config = transformers.Gemma3TextConfig(**CONFIG)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    directory: Path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(directory)
    return hf, load_checkpoint(directory)


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), np.stack([step[0].numpy() for step in out.logits])


def _serve(
    model: LoadedModel, *, page_size: int, max_total_tokens: int, hybrid: bool = True
) -> tuple[Scheduler, dict[str, ServingReq]]:
    cache = build_kv_cache(
        model.spec,
        CacheConfig(
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            context_length=124,
            chunked_prefill_size=CHUNK,
            disable_hybrid_swa_memory=not hybrid,
        ),
    )
    sched = Scheduler(
        model.config, cache, model.params, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    if not hybrid:
        assert not cache.is_hybrid_swa and not sched.extensions
        p = _prompts()
        reqs = [ServingReq(n, p[n], max_new_tokens=MAX_NEW) for n in ("a", "b", "chat1")]
        sched.run(reqs)
        assert sched.leak_free()
        return sched, {str(r.rid): r for r in reqs}
    assert isinstance(cache.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    assert isinstance(cache.tree_cache, SWARadixCache)
    assert isinstance(sched.extensions[0], SWAServing)
    tree = cache.tree_cache
    evict = tree.evict
    evicted: dict[str, int] = {"full": 0, "swa": 0}

    def recording_evict(*args, **kwargs):  # the per-pool counts of every eviction the loop asks for
        out = evict(*args, **kwargs)
        if isinstance(out, dict):
            for k in evicted:
                evicted[k] += out.get(k, 0)
        return out

    tree.evict = recording_evict  # type: ignore[method-assign]
    sched.evicted_per_pool = evicted  # type: ignore[attr-defined]
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
    cache.token_to_kv_pool_allocator.check_invariants()
    return sched, done


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    for name, req in done.items():
        tokens, logits = _hf_greedy(hf, list(req.origin_input_ids))
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin >= MIN_MARGIN, f"{name}: Transformers' top-2 margin {margin:.2e} is a near-tie; pick other seeds"
        assert req.output_ids == tokens, f"{name}: kvjax {req.output_ids} != transformers {tokens}"
        ours = np.stack(req.logits)
        np.testing.assert_allclose(ours, logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name}: logits")


def test_page_4_with_prefix_reuse_across_the_window_multi_turn_and_chunked_prefill(gemma3):
    hf, model = gemma3
    sched, done = _serve(model, page_size=4, max_total_tokens=1024)
    assert sched.stats.cached_tokens > 0
    assert (done["chat2"].first_cached_tokens or 0) >= 16 and (done["d"].first_cached_tokens or 0) >= 16
    swa = sched.extensions[0]
    assert isinstance(swa, SWAServing) and swa.freed_swa_tokens > 0, "decode should free out-of-window SWA slots"
    tree = sched.cache.tree_cache
    assert any(tree.swa.is_tombstone(n) for n in tree.nodes()), "the tree should hold SWA tombstones"
    _assert_matches_transformers(hf, done)


@pytest.mark.slow  # ~20 s: the default suite keeps the page-4 run above
def test_page_1_with_pools_small_enough_to_evict_and_retract(gemma3):
    hf, model = gemma3
    sched, done = _serve(model, page_size=1, max_total_tokens=64)
    assert sched.stats.cached_tokens > 0
    evicted = sched.evicted_per_pool  # type: ignore[attr-defined]
    assert evicted["full"] > 0 and evicted["swa"] > 0, f"both pools should be evicted from, got {evicted}"
    assert sched.stats.retractions > 0, "the pools should be small enough to force retraction"
    _assert_matches_transformers(hf, done)


@pytest.mark.slow  # SGLang's way to serve Gemma 3: one full-size pool, windowed attention
def test_full_size_pools_without_hybrid_swa(gemma3):
    hf, model = gemma3
    _, done = _serve(model, page_size=4, max_total_tokens=1024, hybrid=False)
    _assert_matches_transformers(hf, done)


@pytest.mark.slow  # the same scheduler as above, through the command's entry point
def test_served_through_generate(gemma3):
    from kvjax.serve.generate import generate

    hf, model = gemma3
    p = _prompts()
    prompts = [p["a"], p["b"]]
    result, sched = generate(model, prompts, max_new_tokens=MAX_NEW, page_size=4, chunked_prefill_size=CHUNK)
    assert sched.leak_free()
    for prompt, out in zip(prompts, result.outputs, strict=True):
        assert out == _hf_greedy(hf, prompt)[0]
