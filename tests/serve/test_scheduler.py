"""The serving loop: prefix reuse without changing results, eviction and retraction without leaks,
and a step that updates the pool in place."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import ModelSpec
from kvjax.attention import build_attention_metadata
from kvjax.demo import demo_cache, serve
from kvjax.radix import RadixCache
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.step import make_step
from tests.workloads import SMALL

# ``SMALL`` with more reuse: 4 prompts a group over a longer system prompt, chats of 3 turns.
REUSE = dataclasses.replace(SMALL, prompts_per_group=4, system_tokens=80, turns=3, turn_tokens=12, output_tokens=6)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cold_equals_warm_on_a_reuse_heavy_workload(page_size):
    cold, cold_out = serve(REUSE, page_size=page_size, disable_radix_cache=True, chunked_prefill_size=64)
    warm, warm_out = serve(REUSE, page_size=page_size, chunked_prefill_size=64)
    assert warm_out == cold_out
    assert warm.stats.cached_tokens > 0 and cold.stats.cached_tokens == 0
    assert warm.stats.prefill_tokens_computed < cold.stats.prefill_tokens_computed
    assert warm.leak_free() and cold.leak_free()
    assert isinstance(warm.cache.tree_cache, RadixCache)
    warm.cache.tree_cache.sanity_check()


def test_small_pool_forces_eviction_and_retraction_and_finishes_without_leak():
    _, reference = serve(REUSE, disable_radix_cache=True, chunked_prefill_size=64)
    tight, out = serve(REUSE, max_total_tokens=256, chunked_prefill_size=64)
    assert tight.stats.evicted_tokens > 0
    assert tight.stats.retractions > 0
    assert len(out) == REUSE.num_requests and out == reference
    assert tight.leak_free()


def test_chunked_prefill_of_a_long_prompt_matches_one_shot_prefill():
    spec = ModelSpec.preset("tiny")
    prompt = list(np.random.default_rng(1).integers(0, 256, 300))
    outs = []
    for chunk in (32, 512):
        cache = demo_cache(chunked_prefill_size=chunk)
        sched = Scheduler(spec, cache, init_params(spec), max_batch_size=4, chunked_prefill_size=chunk)
        [req] = sched.run([ServingReq("long", prompt, max_new_tokens=5)])
        assert sched.leak_free()
        outs.append(req.output_ids)
    assert outs[0] == outs[1]


def test_step_donates_the_pools_and_updates_in_place():
    spec = ModelSpec.preset("tiny")
    cache = demo_cache()
    params = init_params(spec)
    slots = cache.allocator.alloc_extend(np.array([0]), np.array([5]), np.array([-1]))
    rows = cache.req_to_token_pool.alloc(1)
    assert slots is not None and rows is not None
    row = rows[0]
    cache.req_to_token_pool.write(row, 0, slots)
    table = cache.req_to_token_pool.page_table_numpy([row], [5], 16, 64)
    tokens, meta = build_attention_metadata(
        tokens=[np.arange(5, dtype=np.int32)], starts=[0], slots=slots, page_table=table, max_seqs=8
    )
    before = cache.pools.kv.kv[0]
    pointer = before.unsafe_buffer_pointer()
    pools, next_tokens = make_step(spec)(cache.pools, params, tokens, meta)
    assert before.is_deleted(), "the old pool state must be consumed"
    assert pools.kv.kv[0].unsafe_buffer_pointer() == pointer, "no copy of the pool"
    k, _ = pools.kv.get_kv(0, slots)
    assert np.abs(np.asarray(k)).sum() > 0
    assert next_tokens.shape == (8,)


def test_submit_rejects_requests_longer_than_the_context():
    spec = ModelSpec.preset("tiny")
    cache = demo_cache()
    sched = Scheduler(spec, cache, init_params(spec))
    with pytest.raises(ValueError, match="exceed the context"):
        sched.submit([ServingReq("x", [1] * 1020, max_new_tokens=10)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        ServingReq("y", [1], max_new_tokens=0)


def test_the_cache_holds_the_current_pools_after_run():
    """The step donates the pools; the scheduler stores each step's result back in the cache, so
    the caller's handle reads the state the run left (issue 8, ownership of device state)."""
    spec = ModelSpec.preset("tiny")
    cache = demo_cache(chunked_prefill_size=64)
    first = cache.pools.kv.kv[0]
    sched = Scheduler(spec, cache, init_params(spec), max_batch_size=4)
    [req] = sched.run([ServingReq("r", list(range(1, 40)), max_new_tokens=4)])
    assert first.is_deleted(), "the pools passed to the first step were donated"
    assert not cache.pools.kv.kv[0].is_deleted()
    # The request's prompt and output are in the tree; their K/V are readable through the cache.
    match = cache.tree_cache.match_prefix(list(req.origin_input_ids) + req.output_ids[:-1])
    assert len(match.indices) >= 32
    k, v = cache.pools.kv.get_kv(0, match.indices)
    assert np.abs(np.asarray(k)).sum() > 0 and np.abs(np.asarray(v)).sum() > 0


def test_a_stop_token_ends_a_request_and_is_kept():
    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    prompt = list(range(5, 25))
    [free] = Scheduler(spec, demo_cache(), params, max_batch_size=4).run([ServingReq("a", prompt, max_new_tokens=6)])
    stop = free.output_ids[2]
    expected = free.output_ids[: free.output_ids.index(stop) + 1]
    sched = Scheduler(spec, demo_cache(), params, max_batch_size=4)
    [req] = sched.run([ServingReq("b", prompt, max_new_tokens=6, stop_token_ids=[stop])])
    assert req.output_ids == expected
    assert sched.leak_free()
