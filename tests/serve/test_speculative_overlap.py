"""Overlap scheduling of speculative rounds (``kvjax.serve.speculative.overlap``) against
Transformers and against the same run without overlap.

Two targets, as in ``test_speculative_parity`` and ``test_speculative_eagle``: a tiny Llama with a
STANDALONE draft (one layer with the target's embedding, first layer and head: it agrees part of
the time, so acceptance varies per request and per round) and the tiny DeepSeek-V2 with a random
MTP layer (EAGLE / NEXTN); and a tiny Llama with a random EAGLE head (``test_eagle_head``), at page
size 1 under eviction and retraction. Each is served with overlap on through the two rounds of
``parity_harness`` (prefix reuse, a multi-turn chat, chunked prefill) at page size 16, and at page
size 1 with a pool small enough to evict and retract; then requests with stop tokens met inside a
round. After every step the token accounting holds with each request's allocated length (the
double reserve of the round in flight); tokens equal Transformers' greedy ``generate`` with logits
within ``LOGIT_ATOL``, and equal the ``overlap=False`` run's; some rounds were launched before the
round before them was read; everything ends leak free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.speculative import DraftDecoding, speculative_scheduler
from kvjax.serve.speculative.eagle import eagle_scheduler
from kvjax.serve.speculative.nextn import NextNDraftModel, load_nextn_draft, nextn_params
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
from tests.serve.random_workloads import TINY_LAYER_SIZES
from tests.serve.test_eagle_head import _checkpoints as eagle_head_checkpoints
from tests.serve.test_speculative_eagle import _checkpoints, nextn_config
from tests.serve.test_speculative_parity import FAMILIES, _first_layer_draft

LOGIT_ATOL = 1e-4
MAX_NEW = 10
K = 3


def check_accounting(sched: Scheduler) -> None:
    """``available + evictable + protected + held == capacity``, a live request holding its
    allocated positions (``DraftDecoding.allocated_len``: with a round in flight, up to its reserve)
    page-rounded, past its protected prefix."""
    proposer = sched.proposer
    assert isinstance(proposer, DraftDecoding)
    alloc, tree, ps = sched.alloc, sched.tree, sched.page_size
    held = 0
    for req in sched.live_requests():
        if req.req_pool_idx is not None:
            held += -(-proposer.allocated_len(req) // ps) * ps - req.cache_protected_len
    accounted = alloc.available_size() + tree.evictable_size() + tree.protected_size() + held
    assert accounted == alloc.size, f"token accounting {accounted} != capacity {alloc.size}"


def checked(sched: Scheduler) -> Scheduler:
    """``sched`` checking the accounting after every step."""
    step = sched.step

    def checked_step() -> list[ServingReq]:
        done = step()
        check_accounting(sched)
        return done

    sched.step = checked_step  # type: ignore[method-assign]
    return sched


def _proposer(sched: Scheduler) -> DraftDecoding:
    assert isinstance(sched.proposer, DraftDecoding)
    return sched.proposer


def serve_stop_tokens(sched: Scheduler, reference: dict[str, ServingReq]) -> dict[str, list[int]]:
    """Serve the parity prompts again (cached by now), each stopping on a token its reference
    output holds at a position inside a round; return the outputs by name."""
    p = prompts()
    reqs = []
    for name in ("a", "b", "c", "d"):
        out = reference[name].output_ids
        reqs.append(ServingReq(f"{name}-stop", p[name], max_new_tokens=MAX_NEW, stop_token_ids=[out[4]]))
    sched.run(reqs)
    assert sched.leak_free()
    return {str(r.rid): list(r.output_ids) for r in reqs}


def _assert_same_run(overlapped: dict[str, ServingReq], plain: dict[str, ServingReq]) -> None:
    for name, req in overlapped.items():
        assert req.output_ids == plain[name].output_ids, name
        np.testing.assert_allclose(np.stack(req.logits), np.stack(plain[name].logits), atol=1e-5, rtol=0)


# --- Llama with a STANDALONE draft ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Any, LoadedModel, LoadedModel]:
    """(Transformers' target, kvjax's target, kvjax's one-layer draft)."""
    class_name, extra = FAMILIES["llama"]
    config_class = getattr(transformers, class_name)
    config = dict(TINY_CONFIG, **TINY_LAYER_SIZES, num_hidden_layers=2, **extra)
    hf = random_transformers_model(config_class(**config))
    target_dir = save_pretrained(hf, tmp_path_factory, "llama")
    with torch.no_grad():
        draft = _first_layer_draft(hf, config_class, config)
    draft_dir = save_pretrained(draft, tmp_path_factory, "llama-draft")
    return hf, load_checkpoint(target_dir), load_checkpoint(draft_dir)


def _standalone(target: LoadedModel, draft: LoadedModel, *, page_size: int, pool: int, overlap: bool) -> Scheduler:
    cache = build_kv_cache(
        target.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=page_size,
            max_total_tokens=pool,
            max_running_requests=8,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
        ),
        draft_spec=draft.spec,
    )
    sched = speculative_scheduler(
        target.config,
        cache,
        target.params,
        draft=draft.config,
        draft_params=draft.params,
        num_steps=K,
        overlap=overlap,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    return checked(sched) if overlap else sched


def test_standalone_page_16_equals_transformers_and_the_run_without_overlap(llama):
    hf, target, draft = llama
    sched = _standalone(target, draft, page_size=16, pool=2048, overlap=True)
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.stats.cached_tokens > 0 and (done["d"].first_cached_tokens or 0) >= 16
    sp = _proposer(sched).stats
    assert sp.overlapped_rounds > 0, sp
    assert 0 < sp.accepted_tokens < sp.proposed_tokens, f"rounds should mix accepted and rejected drafts: {sp}"
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    plain = _standalone(target, draft, page_size=16, pool=2048, overlap=False)
    plain_done = serve_two_rounds(plain, MAX_NEW)
    _assert_same_run(done, plain_done)
    # stop tokens met inside a round: found one round late, the round launched since dropped
    stopped = serve_stop_tokens(sched, done)
    assert stopped == serve_stop_tokens(plain, plain_done)
    for name, out in stopped.items():
        full = done[name.removesuffix("-stop")].output_ids
        assert out == full[: len(out)] and len(out) < MAX_NEW, name
    assert _proposer(sched).stats.dropped_request_rounds > 0


def test_standalone_page_1_evicts_and_retracts(llama):
    hf, target, draft = llama
    sched = _standalone(target, draft, page_size=1, pool=64, overlap=True)
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    sp = _proposer(sched).stats
    assert sp.overlapped_rounds > 0 and sp.rolled_back_slots > 0, sp
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


# --- DeepSeek-V2 with a random MTP layer (EAGLE / NEXTN) ---------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Any, Path]:
    """(Transformers' target, its checkpoint with random MTP weights)."""
    hf, _, directory, _, _ = _checkpoints(str(tmp_path_factory.mktemp("deepseek_mtp_overlap")))
    return hf, directory


def _eagle(directory: Path, *, page_size: int, pool: int, overlap: bool) -> Scheduler:
    model = load_checkpoint(directory)
    sched = eagle_scheduler(
        model.config,
        build_kv_cache(model.spec, nextn_config(page_size=page_size, max_total_tokens=pool)),
        model.params,
        draft_params=nextn_params(model.config, model.params, directory),
        num_steps=K,
        overlap=overlap,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    return checked(sched) if overlap else sched


def test_eagle_page_16_equals_transformers_and_the_run_without_overlap(deepseek):
    hf, directory = deepseek
    sched = _eagle(directory, page_size=16, pool=2048, overlap=True)
    done = serve_two_rounds(sched, MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert _proposer(sched).stats.overlapped_rounds > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
    plain = _eagle(directory, page_size=16, pool=2048, overlap=False)
    plain_done = serve_two_rounds(plain, MAX_NEW)
    _assert_same_run(done, plain_done)
    assert serve_stop_tokens(sched, done) == serve_stop_tokens(plain, plain_done)


def test_eagle_page_1_evicts_and_retracts(deepseek):
    hf, directory = deepseek
    sched = _eagle(directory, page_size=1, pool=64, overlap=True)
    done = serve_two_rounds(sched, MAX_NEW)
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _proposer(sched).stats.overlapped_rounds > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)


# --- Llama with an EAGLE head -------------------------------------------------------------------------


def test_llama_eagle_head_page_1_evicts_and_retracts(tmp_path_factory):
    hf, target_dir, head_dir = eagle_head_checkpoints(str(tmp_path_factory.mktemp("eagle_head_overlap")))
    model = load_checkpoint(target_dir)
    draft = load_nextn_draft(head_dir, model)
    assert isinstance(draft, NextNDraftModel) and draft.algorithm == "EAGLE"
    cache = build_kv_cache(
        model.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            speculative_algorithm="EAGLE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
        ),
    )
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=draft.params,
        num_steps=K,
        overlap=True,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    done = serve_two_rounds(checked(sched), MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    assert _proposer(sched).stats.overlapped_rounds > 0
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
