"""Qwen3-Next served through kvjax (gated delta net + gated attention, recurrent state in the
state pool, checkpoints in ``MambaRadixCache``) gives Transformers' greedy tokens and logits.

A tiny random-weight ``Qwen3NextForCausalLM`` (float32, 3 gated-delta-net layers and 1 full
attention layer, dense MLPs: ``mlp_only_layers`` covers every layer) is saved with
``save_pretrained`` and loaded by kvjax. Served at page size 1 with chunked prefill of 8 tokens:

* round 1: three prompts sharing a 24-token system prompt and a chat's first turn; round 2: the
  chat's second turn (turn 1 + its output + new tokens) and another system-prompt prompt. Later
  prompts start from a checkpoint forked into their own state slot (prefix reuse: the state
  restored, then continued), asserted;
* the same rounds with a pool small enough to evict KV and checkpoints and to retract requests
  (asserted), and with the radix cache off (cold == warm).

Each request is compared with Transformers' own greedy ``generate`` on its full prompt: the same
tokens, logits within ``LOGIT_ATOL``, and Transformers' top-2 margin at least ``MIN_MARGIN`` at
every step (a near-tie fails loudly instead of flaking). Transformers runs the chunked delta rule
for prompts and the recurrent one for decode; kvjax runs the recurrence token by token; they agree
to ~4e-5 here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need the 'parity' extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="parity tests need the 'parity' extra (torch, transformers)")

from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.radix import MambaRadixCache  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402

LOGIT_ATOL = 2e-4
MIN_MARGIN = 10 * LOGIT_ATOL
MAX_NEW = 6
CHUNK = 8
PROMPT_SEED = 3
MODEL_SEED = 1
VOCAB = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[object, LoadedModel]:
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_only_layers=[0, 1, 2, 3],
        num_experts=0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(MODEL_SEED)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory: Path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(directory)
    return hf, load_checkpoint(directory)


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


def _serve(model: LoadedModel, **config) -> tuple[Scheduler, dict[str, ServingReq]]:
    cache = build_kv_cache(
        model.spec,
        CacheConfig(page_size=1, context_length=124, chunked_prefill_size=CHUNK, **config),
    )
    sched = Scheduler(
        model.config, cache, model.params, max_batch_size=2, chunked_prefill_size=CHUNK, record_logits=True
    )
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
    table = cache.req_to_token_pool
    tree = cache.tree_cache
    held = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    if isinstance(tree, MambaRadixCache):
        tree.sanity_check()
    return sched, done


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    for name, req in done.items():
        prompt = list(req.origin_input_ids)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logits = np.stack([step[0].numpy() for step in out.logits])
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin >= MIN_MARGIN, f"{name}: Transformers' top-2 margin {margin:.2e} is a near-tie; pick other seeds"
        assert req.output_ids == tokens, f"{name}: kvjax {req.output_ids} != transformers {tokens}"
        np.testing.assert_allclose(np.stack(req.logits), logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name}: logits")


def test_prefix_reuse_from_checkpoints_multi_turn_and_chunked_prefill(model):
    hf, loaded = model
    sched, done = _serve(loaded, max_total_tokens=1024, max_running_requests=4, max_mamba_cache_size=32)
    assert isinstance(sched.cache.tree_cache, MambaRadixCache)
    # The system prompt's chunk ends (8, 16, 24) are checkpoints: later prompts start from one.
    assert all((done[n].first_cached_tokens or 0) >= 16 for n in ("b", "c", "d"))
    assert (done["chat2"].first_cached_tokens or 0) >= len(_prompts()["chat1"]), "turn 2 resumes turn 1's state"
    assert sched.stats.evicted_tokens == 0 and sched.stats.retractions == 0
    _assert_matches_transformers(hf, done)


def test_eviction_of_kv_and_checkpoints_and_retraction(model):
    hf, loaded = model
    sched, done = _serve(loaded, max_total_tokens=56, max_running_requests=4, max_mamba_cache_size=6)
    tree = sched.cache.tree_cache
    assert sched.stats.cached_tokens > 0
    assert sched.stats.evicted_tokens > 0, "the pool should be small enough to evict KV"
    assert tree.mamba.num_evicted > 0, "the state pool should be small enough to evict checkpoints"
    assert sched.stats.retractions > 0, "the pool should be small enough to force retraction"
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
    p = _prompts()
    result, sched = generate(loaded, [p["a"], p["b"]], max_new_tokens=MAX_NEW, page_size=1, chunked_prefill_size=CHUNK)
    assert sched.stats.cached_tokens >= 16, "the second prompt starts from a checkpoint of the first"
    for prompt, tokens in zip([p["a"], p["b"]], result.outputs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt) :]
        assert tokens == want.tolist()
