"""A real trained model served through kvjax: SmolLM2-135M-Instruct (``tests/serve/real_model.py``)
against Transformers' own load of the same GGUF file.

Every request's greedy tokens equal Transformers' ``generate`` and its logits agree within
``LOGIT_ATOL`` (with the near-tie guard), on the chat workload with prefix reuse across prompts and
turns: at page size 1 with chunked prefill of 8 tokens; at page size 16 in a pool small enough to
evict and retract; and decoded speculatively with the model as its own draft (every proposal
accepted). The text side is Transformers' too: kvjax's tokenizer rebuilt from the GGUF metadata
gives Transformers' ids, and the chat template renders the same prompt.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.generate import scheduler_for
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.parity_harness import (
    CHUNK,
    CONTEXT_LENGTH,
    assert_matches_transformers,
    build_scheduler,
    torch,
)
from tests.serve.real_model import (
    LOGIT_ATOL,
    MAX_NEW,
    QUESTIONS,
    chat_prompts,
    kvjax_model,
    model_file,
    second_turn,
    tokenizer,
    transformers_model,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _serve_chat(sched: Scheduler) -> dict[str, ServingReq]:
    """The four first turns, then the first chat's second turn; the cache leak free after."""
    stops = kvjax_model().stop_token_ids
    first = [ServingReq(f"q{i}", p, max_new_tokens=MAX_NEW, stop_token_ids=stops) for i, p in enumerate(chat_prompts())]
    sched.run(first)
    turn2 = ServingReq("q0-turn2", second_turn(first[0].origin_input_ids, first[0].output_ids), max_new_tokens=MAX_NEW)
    turn2.stop_token_ids = frozenset(stops)
    sched.run([turn2])
    assert sched.leak_free()
    return {str(r.rid): r for r in [*first, turn2]}


def _assert_matches(done: dict[str, ServingReq]) -> None:
    assert_matches_transformers(transformers_model(), done, max_new=MAX_NEW, atol=LOGIT_ATOL)


def test_page_1_prefix_reuse_across_prompts_and_turns_with_chunked_prefill():
    sched = build_scheduler(kvjax_model(), page_size=1, max_total_tokens=1024)
    done = _serve_chat(sched)
    _assert_matches(done)
    assert "Paris" in tokenizer().decode(done["q0"].output_ids)
    # Every later prompt reuses the template's opening (its system prompt); the second turn reuses
    # the whole first turn.
    prompts = chat_prompts()
    shared = next(i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1)
    assert shared >= 20  # the system prompt and the user turn's opening
    assert all(done[f"q{i}"].first_cached_tokens >= shared for i in range(1, len(QUESTIONS)))
    first_turn = len(done["q0"].origin_input_ids) + len(done["q0"].output_ids)
    assert done["q0-turn2"].first_cached_tokens >= first_turn - 1


def test_page_16_in_a_pool_small_enough_to_evict_and_retract():
    sched = build_scheduler(kvjax_model(), page_size=16, max_total_tokens=160, max_running_requests=4)
    done = _serve_chat(sched)
    _assert_matches(done)
    stats = sched.stats
    assert stats.evicted_tokens > 0 or stats.retractions > 0, stats


def test_speculative_decoding_with_the_model_as_its_own_draft_accepts_every_proposal():
    model = kvjax_model()
    steps = 3
    config = CacheConfig(
        context_length=CONTEXT_LENGTH,
        chunked_prefill_size=CHUNK,
        page_size=16,
        max_total_tokens=1024,
        speculative_algorithm="STANDALONE",
        speculative_num_steps=steps,
        speculative_num_draft_tokens=steps + 1,
    )
    cache = build_kv_cache(model.spec, config, draft_spec=model.spec)
    sched = scheduler_for(
        model, cache, draft=model, num_steps=steps, max_batch_size=4, chunked_prefill_size=CHUNK, record_logits=True
    )
    done = _serve_chat(sched)
    _assert_matches(done)
    counters = sched.proposer.stats
    assert counters.proposed_tokens > 0 and counters.accepted_tokens == counters.proposed_tokens


def test_tokenizer_and_chat_template_equal_transformers():
    transformers = pytest.importorskip("transformers")
    file = model_file()
    theirs: Any = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    texts = ["The capital of France is", "In 2024, 3 cats ate 15 fish.", "  tabs\tand\n\nlines", "héllo wörld 日本語"]
    for text in texts:
        assert tokenizer().encode(text) == theirs.encode(text), text
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer().chat_prompt(question) == rendered
        assert tokenizer().encode_chat(question) == theirs(rendered, add_special_tokens=False)["input_ids"]
    assert torch is not None
