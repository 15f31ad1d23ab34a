"""Overlap scheduling of speculative rounds (``kvjax.serve.speculative.overlap``) under tensor
parallelism: the tiny Llama target and its partly agreeing one-layer STANDALONE draft of
``tests/serve/test_speculative_parity.py`` over a tp 2 mesh, overlap on, at page size 1 with a
64-token pool (prefix reuse, a multi-turn chat, chunked prefill, eviction, retraction, roll-back):
Transformers' greedy tokens and logits within 1e-4, the token accounting (with each request's
allocated reserve) after every step, rounds launched ahead of the round before them, leak free.
"""

from __future__ import annotations

import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.generate import scheduler_for
from tests.mesh.tp_serving import assert_sharded, mesh_of
from tests.serve.parity_harness import CHUNK, CONTEXT_LENGTH, assert_matches_transformers, serve_two_rounds
from tests.serve.test_speculative_overlap import _proposer, checked
from tests.serve.test_speculative_parity import LOGIT_ATOL, MAX_NEW, K
from tests.serve.test_speculative_parity import family as family  # noqa: F401, PLC0414  (the fixture)

pytestmark = pytest.mark.mesh


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_tp2_page_1_overlapped_rounds_evict_retract_and_roll_back(family):
    _, hf, target, draft, _ = family
    cache = build_kv_cache(
        target.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=1,
            max_total_tokens=64,
            max_running_requests=8,
            speculative_algorithm="STANDALONE",
            speculative_num_steps=K,
            speculative_num_draft_tokens=K + 1,
            tp_size=2,
        ),
        draft_spec=draft.spec,
        mesh=mesh_of(2),
    )
    sched = scheduler_for(
        target,
        cache,
        draft=draft,
        num_steps=K,
        overlap=True,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
    )
    assert_sharded(sched, 2)
    done = serve_two_rounds(checked(sched), MAX_NEW)
    sched.cache.tree_cache.sanity_check()
    assert sched.stats.evicted_tokens > 0 and sched.stats.retractions > 0
    stats = _proposer(sched).stats
    assert stats.overlapped_rounds > 0 and stats.rolled_back_slots > 0, stats
    assert_matches_transformers(hf, done, max_new=MAX_NEW, atol=LOGIT_ATOL)
