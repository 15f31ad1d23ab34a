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
logit margin is at least ``MIN_MARGIN`` (10x the tolerance) at every compared step, so a token
can only differ if the logits really disagree. The test asserts that margin rather than assuming
it, so a near-tie shows up as a clear failure, not a flaky one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need the 'parity' extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="parity tests need the 'parity' extra (torch, transformers)")

from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.radix import RadixCache  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402

LOGIT_ATOL = 1e-4
MIN_MARGIN = 10 * LOGIT_ATOL
MAX_NEW = 6
CHUNK = 8
PROMPT_SEED = 3
VOCAB = 128

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
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


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, object, LoadedModel]:
    """(family, Transformers model, kvjax's load of its saved checkpoint)."""
    name = request.param
    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory: Path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory, max_shard_size="100KB" if name == "llama" else "50GB")
    if name == "llama":
        assert (directory / "model.safetensors.index.json").is_file(), "the llama checkpoint should be sharded"
    return name, hf, load_checkpoint(directory)


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Transformers' greedy tokens and the logits they were picked from (``[MAX_NEW, vocab]``)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, np.stack([step[0].numpy() for step in out.logits])


def _serve(
    model: LoadedModel,
    *,
    page_size: int,
    max_total_tokens: int,
    enable_hierarchical_cache: bool = False,
    retraction_backup: str | None = None,
) -> tuple[Scheduler, dict[str, ServingReq]]:
    """The two rounds of the module docstring on one cache; requests by name."""
    cache = build_kv_cache(
        model.spec,
        CacheConfig(
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            context_length=124,
            chunked_prefill_size=CHUNK,
            enable_hierarchical_cache=enable_hierarchical_cache,
            disaggregation_decode_retraction_backup=retraction_backup,
        ),
    )
    sched = Scheduler(
        model.config, cache, model.params, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
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
    assert isinstance(cache.tree_cache, RadixCache)
    cache.tree_cache.sanity_check()
    return sched, done


def _assert_matches_transformers(hf, done: dict[str, ServingReq]) -> None:
    for name, req in done.items():
        tokens, logits = _hf_greedy(hf, list(req.origin_input_ids))
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        assert margin >= MIN_MARGIN, f"{name}: Transformers' top-2 margin {margin:.2e} is a near-tie; pick other seeds"
        assert req.output_ids == tokens, f"{name}: kvjax {req.output_ids} != transformers {tokens}"
        ours = np.stack(req.logits)
        assert ours.shape == logits.shape
        np.testing.assert_allclose(ours, logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name}: logits")


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
