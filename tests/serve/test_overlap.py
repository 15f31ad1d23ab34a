"""Overlap scheduling (the scheduler's default): the same tokens as the loop that runs each step to
completion, finish detection one step late with the speculative step's slot released exactly, and
retraction and the host tier under overlap. The memory balance is checked after every step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelSpec, dict]:
    spec = ModelSpec.preset("tiny")
    return spec, init_params(spec)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 20).tolist()
    return [shared + rng.integers(0, 256, 3 + i).tolist() for i in range(n)]


def _assert_balanced(sched: Scheduler) -> None:
    """``available + evictable + protected + held by live requests == capacity``, where a live
    request holds its own pages ``[cache_protected_len, kv_committed_len)`` (page-rounded; with
    overlap this includes a speculative step's slot until the request is found finished)."""
    ps = sched.page_size
    live = sched.live_requests()
    held = sum(-(-r.kv_len() // ps) * ps - r.cache_protected_len for r in live if r.req_pool_idx is not None)
    tree = sched.tree
    assert sched.alloc.available_size() + tree.evictable_size() + tree.protected_size() + held == sched.alloc.size
    assert sched.rows.available_size() + sum(r.req_pool_idx is not None for r in live) == sched.rows.size


def _run_balanced(sched: Scheduler, batch: Sequence[ServingReq]) -> None:
    """Submit ``batch`` and step ``sched`` until it is idle, checking the balance after every step."""
    sched.submit(batch)
    while not sched.idle:
        sched.step()
        _assert_balanced(sched)


def _serve(spec, params, reqs, *, overlap: bool, page_size: int = 16, then=(), **config) -> Scheduler:
    """Serve ``reqs``, then (once they are done) ``then``, checking the balance after every step
    and the leaks and the tree after each batch."""
    config.setdefault("chunked_prefill_size", 64)
    sched = Scheduler(
        spec,
        demo_cache(page_size=page_size, **config),
        params,
        max_batch_size=4,
        chunked_prefill_size=config["chunked_prefill_size"],
        overlap=overlap,
    )
    for batch in (reqs, then):
        _run_balanced(sched, batch)
        assert sched.leak_free()
        sched.tree.sanity_check()
    return sched


def _serve_both_ways(spec, params, prompts, max_new_tokens: int, *, first: int | None = None, **config):
    """Serve ``prompts`` without overlap and with it (the first ``first`` of them, then the rest);
    asserts both give the same tokens. Returns the two schedulers."""
    outs, scheds = {}, []
    for overlap in (False, True):
        reqs = [ServingReq(i, p, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)]
        n = len(reqs) if first is None else first
        scheds.append(_serve(spec, params, reqs[:n], overlap=overlap, then=reqs[n:], **config))
        outs[overlap] = [r.output_ids for r in reqs]
    assert outs[True] == outs[False]
    return scheds


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_stop_token_found_one_step_late_frees_the_speculative_slot(tiny, page_size):
    spec, params = tiny
    prompts = _prompts(4)
    free = _serve(spec, params, [ServingReq(i, p, max_new_tokens=8) for i, p in enumerate(prompts)], overlap=False)
    outputs = {r.rid: r.output_ids for r in free.finished}
    # Each request stops on its own token at a different step (its first occurrence ends it).
    stops = {i: outputs[i][1 + i % 4] for i in outputs}
    expected = {i: outputs[i][: outputs[i].index(stops[i]) + 1] for i in outputs}
    assert any(len(e) < 8 for e in expected.values())
    got = {}
    for overlap in (False, True):
        reqs = [ServingReq(i, p, max_new_tokens=8, stop_token_ids=[stops[i]]) for i, p in enumerate(prompts)]
        sched = _serve(spec, params, reqs, overlap=overlap, page_size=page_size)
        got[overlap] = {r.rid: r.output_ids for r in reqs}
        assert all(r.finished for r in reqs)
        if overlap:
            # Requests stopped while a decode step for them was in flight: its tokens were dropped.
            assert sched.stats.dropped_tokens > 0
            assert sched.stats.generated_tokens == sum(map(len, expected.values()))
    assert got[False] == expected and got[True] == expected


def test_max_new_tokens_is_known_at_launch_and_never_runs_ahead(tiny):
    spec, params = tiny
    reqs = [ServingReq(i, p, max_new_tokens=1 + i) for i, p in enumerate(_prompts(4, seed=1))]
    sched = _serve(spec, params, reqs, overlap=True)
    assert [len(r.output_ids) for r in reqs] == [1, 2, 3, 4]
    assert sched.stats.dropped_tokens == 0


def test_retraction_and_eviction_under_overlap_give_the_same_tokens(tiny):
    spec, params = tiny
    config = {"page_size": 1, "max_total_tokens": 96, "chunked_prefill_size": 16}
    for sched in _serve_both_ways(spec, params, _prompts(6, seed=2), 24, **config):
        assert sched.stats.retractions > 0 and sched.stats.evicted_tokens > 0


def test_host_tier_under_overlap_gives_the_same_tokens(tiny):
    spec, params = tiny
    config = {"page_size": 1, "max_total_tokens": 96, "chunked_prefill_size": 16, "enable_hierarchical_cache": True}
    for sched in _serve_both_ways(spec, params, _prompts(6, seed=3), 12, first=3, **config):
        [ext] = [e for e in sched.extensions if hasattr(e, "host_balanced")]
        assert ext.host_balanced()


def test_decode_steps_read_their_input_ids_on_the_device(tiny):
    """A steady decode step is dispatched before the previous one's tokens are read: the host
    never reads them first (each decode after the first resolves the step before it)."""
    spec, params = tiny
    reqs = [ServingReq(i, p, max_new_tokens=6) for i, p in enumerate(_prompts(3, seed=4))]
    sched = Scheduler(spec, demo_cache(chunked_prefill_size=256), params, max_batch_size=4)
    assert sched.overlap
    sched.submit(reqs)
    sched.step()  # the prefill: launched, its tokens unread
    assert sched.in_flight and all(r.output_ids == [] for r in reqs)
    sched.step()  # decode 1 launched from the prefill's tokens on the device, then the prefill read
    assert sched.in_flight and all(len(r.output_ids) == 1 for r in reqs)
    assert sched.stats.decode_steps == 1
    sched.run()
    assert sched.leak_free() and all(len(r.output_ids) == 6 for r in reqs)


@pytest.mark.parametrize("preset", ["gemma3-tiny", "mistral-swa-tiny"])
def test_a_stop_token_found_one_step_late_on_sliding_window_caches(preset):
    """Hybrid (Gemma 3) and pure (every layer sliding) SWA: the speculative slot is released on
    both sides of the hybrid allocator; window freeing runs on the speculative batch too."""
    spec = ModelSpec.preset(preset)
    params = init_params(spec)
    prompts = [p[:12] for p in _prompts(3, seed=5)]

    def serve(stops: dict, overlap: bool) -> Scheduler:
        cache = demo_cache(spec=spec, page_size=4, chunked_prefill_size=64, max_total_tokens=512)
        sched = Scheduler(spec, cache, params, max_batch_size=4, chunked_prefill_size=64, overlap=overlap)
        sched.run([ServingReq(i, p, max_new_tokens=24, stop_token_ids=stops.get(i, ())) for i, p in enumerate(prompts)])
        assert sched.leak_free()
        return sched

    free = {r.rid: r.output_ids for r in serve({}, False).finished}
    stops = {i: [free[i][5 + 4 * i]] for i in free}
    expected = {i: free[i][: free[i].index(stops[i][0]) + 1] for i in free}
    for overlap in (False, True):
        sched = serve(stops, overlap)
        assert {r.rid: r.output_ids for r in sched.finished} == expected
    assert sched.stats.dropped_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_steady_decode_step_reuses_the_page_table_it_would_build(tiny, overlap):
    """A decode step in which no request starts a page, over the same running requests as the
    step before, hands the last step's page table to the step instead of rebuilding it: every
    such table equals the one built from the request table, as requests finish (on a stop token
    and on ``max_new_tokens``) and join."""
    spec, params = tiny
    prompts = _prompts(6, seed=5)
    reqs = [ServingReq(i, p, max_new_tokens=20 + 3 * i) for i, p in enumerate(prompts[:4])]
    first = ServingReq(0, prompts[0], max_new_tokens=20)
    _serve(spec, params, [first], overlap=False)
    reqs[0].stop_token_ids = frozenset({first.output_ids[9]})  # stops on its 10th token (or before)
    then = [ServingReq(4 + i, p, max_new_tokens=12) for i, p in enumerate(prompts[4:])]
    sched = Scheduler(spec, demo_cache(page_size=16), params, max_batch_size=4, overlap=overlap)
    builder = sched.metadata
    build = builder.build
    kept = []

    def checked_build(**batch):
        table = batch.get("page_table")
        if table is not None:
            expected = builder.page_tables.build(batch["rows"], batch["seq_lens"], builder.max_seqs)
            np.testing.assert_array_equal(table, expected)
            kept.append(table)
        return build(**batch)

    builder.build = checked_build
    for batch in (reqs, then):
        _run_balanced(sched, batch)
    assert sched.leak_free()
    assert len(reqs[0].output_ids) <= 10 and reqs[0].output_ids[-1] in reqs[0].stop_token_ids
    # Pages of 16 tokens: most decode steps start no page and keep the table.
    assert len(kept) > sched.stats.decode_steps // 2
