"""Seeded random workloads through the serving loop (``random_workloads.py``): every preset and
tiny recurrent model, eviction policies, page sizes, pools small enough to evict and retract, the
host and storage tiers; invariants after every step, leak-free at the end, cold == warm.

The default cases share one compiled step per model (the same pool shape and a chunk of 8 tokens,
so every batch fits one token bucket) to stay within the suite's time budget; the ``slow`` sweep
runs more seeds, shapes (page 16), chunk sizes, Nemotron-H and a storage-tier prefetch. Each
failure names its case and seed; rerun one with ``run_case(Case(...))``.
"""

from __future__ import annotations

import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.errors import ConfigError, OutOfMemoryError
from kvjax.serve.recurrent_extension import RecurrentStateExtension
from kvjax.serve.scheduler import Scheduler, ServingReq
from tests.serve.random_workloads import Case, check_end, model, run_case

CHUNK = 8
E, R, U = "evict", "retract", "reuse"
HOST, L3, CKPT = "host_load", "storage_prefetch", "checkpoint_evict"


def _case(model: str, seed: int, *, expect: tuple[str, ...] = (), **settings) -> Case:
    return Case(model, seed=seed, chunk=settings.pop("chunk", CHUNK), expect=frozenset(expect), **settings)


# Issue 19's extra-buffer case: tiny Qwen3-Next, page 4, 1,024 tokens, 10 running requests
# (the state pool then fits two requests' slots; the regression below serves the exact case).
QWEN3_NEXT_EXTRA_BUFFER = dict(page_size=4, pool=1024, running=10, extra_buffer=True)

CASES = [
    # Full attention, a pool that forces eviction and retraction; every policy once (page 16:
    # the slow sweep; page 4 below).
    _case("tiny", 0, pool=96, policy="lru", expect=(E, R, U)),
    _case("tiny", 1, pool=96, policy="lfu", host=True, expect=(E, R, U, HOST)),
    _case("tiny", 2, pool=96, policy="fifo", host=True, storage=True, expect=(E, R, U, HOST)),
    _case("tiny", 3, pool=96, policy="priority", expect=(E, R, U)),
    _case("tiny", 4, pool=96, policy="slru", expect=(E, U)),
    _case("tiny", 5, pool=96, policy="mru", host=True, expect=(E, U, HOST)),
    _case("tiny", 6, pool=96, policy="filo", expect=(E, U)),
    # MLA (latent pool, MoE layers).
    _case("deepseek-tiny", 7, pool=96, expect=(E, R, U)),
    # Hybrid sliding window (window 16): SWA and full pools, with and without the host tier.
    _case("gemma3-tiny", 8, page_size=4, pool=128, expect=(E, U)),
    _case("gemma3-tiny", 9, page_size=4, pool=128, policy="lfu", host=True, expect=(E, U, HOST)),
    # ... with the storage tier: the sliding layers' pages of the last window stored beside the full
    # layers' and prefetched with them (a pool of 96: prefixes leave the host).
    _case("gemma3-tiny", 303, page_size=4, pool=96, host=True, storage=True, requests=24, expect=(L3,)),
    # Every layer sliding: one SWA pool, the pure-SWA tree.
    _case("mistral-swa-tiny", 10, page_size=4, pool=64, expect=(E, R, U)),
    # Recurrent state, page 4 with the extra buffer: checkpoints evicted, a request short of state
    # slots waits (page 1 with a small state pool: the slow sweep, and the Qwen3-Next parity tests).
    _case("qwen3-next-tiny", 12, **QWEN3_NEXT_EXTRA_BUFFER, expect=(U, CKPT)),
]

SLOW_CASES = (
    [
        _case("tiny", 4, page_size=16, pool=128, policy="slru", expect=(E, R, U)),
        _case("tiny", 5, page_size=16, pool=128, policy="mru", host=True, expect=(E, R, U, HOST)),
        _case("tiny", 6, page_size=16, pool=128, policy="filo", expect=(E, U)),
        _case("qwen3-next-tiny", 11, pool=96, states=12, running=4, expect=(E, U, CKPT)),
    ]
    + [
        Case(
            name, seed=100 + i, page_size=ps, pool=pool, chunk=chunk, policy=policy, host=host, batch=batch, requests=14
        )
        for i, (name, ps, pool, chunk, policy, host, batch) in enumerate(
            [
                ("tiny", 1, 64, 16, "lru", False, 4),
                ("tiny", 4, 80, 32, "lfu", True, 8),
                ("tiny", 16, 96, 16, "slru", True, 2),
                ("deepseek-tiny", 16, 128, 16, "fifo", False, 4),
                ("deepseek-tiny", 1, 64, 8, "mru", True, 4),
                ("gemma3-tiny", 16, 128, 16, "priority", True, 4),
                ("gemma3-tiny", 1, 64, 8, "filo", False, 2),
                ("mistral-swa-tiny", 1, 48, 16, "lfu", False, 4),
                ("mistral-swa-tiny", 16, 64, 8, "lru", False, 8),
            ]
        )
    ]
    + [
        Case(name, seed=200 + i, page_size=ps, pool=pool, chunk=8, extra_buffer=ps > 1, states=states, running=4)
        for i, (name, ps, pool, states) in enumerate(
            [
                ("qwen3-next-tiny", 1, 64, 8),
                ("qwen3-next-tiny", 4, 96, 13),
                ("nemotron-h-tiny", 1, 96, 12),
                ("nemotron-h-tiny", 4, 128, 16),
            ]
        )
    ]
    + [Case("tiny", seed=300, pool=96, chunk=8, host=True, storage=True, requests=24, expect=frozenset({L3}))]
    # the storage tier under the recurrent-state tree (a checkpoint beside the KV pages)
    + [
        Case(
            "qwen3-next-tiny",
            302,
            pool=96,
            chunk=8,
            host=True,
            storage=True,
            requests=24,
            states=12,
            running=4,
            expect=frozenset({L3}),
        ),
    ]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_random_workload(case, tmp_path):
    run_case(case, storage_dir=str(tmp_path / "l3") if case.storage else None)


@pytest.mark.slow  # a wider sweep: more seeds, page sizes, chunk sizes and Nemotron-H
@pytest.mark.parametrize("case", SLOW_CASES, ids=str)
def test_random_workload_sweep(case, tmp_path):
    run_case(case, storage_dir=str(tmp_path / "l3"))


# --- regressions found by random workloads -------------------------------------------------------


def _qwen3_next_scheduler() -> Scheduler:
    """Qwen3-Next tiny with the extra buffer: 1024 tokens in 4-token pages, 10 requests, chunks of 64."""
    spec, serving, params = model("qwen3-next-tiny")
    sizes = dict(page_size=4, max_total_tokens=1024, max_running_requests=10, chunked_prefill_size=64)
    config = CacheConfig(context_length=128, enable_mamba_extra_buffer=True, **sizes)
    cache = build_kv_cache(spec, config)
    return Scheduler(serving, cache, params, max_batch_size=8, chunked_prefill_size=config.chunked_prefill_size)


def test_extra_buffer_admission_evicts_every_checkpoint_it_needs():
    """A request needs 1 + mamba_ping_pong_size state slots with the extra buffer; admission
    evicted one checkpoint and gave up with checkpoints still evictable (issue 19's case)."""
    sched = _qwen3_next_scheduler()
    for i in range(6):
        sched.run([ServingReq(f"r{i}", [i + 1] * 9, max_new_tokens=1)])
    tree = sched.cache.tree_cache
    table = sched.cache.req_to_token_pool
    assert table.mamba_allocator.available_size() < 2 * (1 + table.mamba_ping_pong_size)
    before = tree.mamba.num_evicted
    done = sched.run([ServingReq("x", [50] * 9, max_new_tokens=1), ServingReq("y", [60] * 9, max_new_tokens=1)])
    assert {str(r.rid) for r in done} >= {"x", "y"}
    assert tree.mamba.num_evicted - before >= 2, "more than one checkpoint had to go"
    assert sched.leak_free()
    tree.sanity_check()


def test_state_slots_short_with_nothing_evictable_is_a_clear_error():
    """With every slot held by requests (none in the tree to evict), admission fails with an
    error naming what is short, and takes nothing."""
    sched = _qwen3_next_scheduler()
    [ext] = [e for e in sched.extensions if isinstance(e, RecurrentStateExtension)]
    table = sched.cache.req_to_token_pool
    held = ServingReq("held", [1] * 9, max_new_tokens=1)
    held.req_pool_idx = table.alloc(1)[0]
    ext.after_admit(held)  # its slot and two ping-pong slots
    others = table.mamba_allocator.alloc(table.mamba_allocator.available_size() - 1)  # held elsewhere
    assert others is not None
    late = ServingReq("late", [2] * 9, max_new_tokens=1)
    late.req_pool_idx = table.alloc(1)[0]
    short = r"request 'late': needs 3 recurrent-state slots, 1 of \d+ are free and 0 checkpoints"
    with pytest.raises(OutOfMemoryError, match=short):
        ext.after_admit(late)
    assert late.mamba_pool_idx is None and late.mamba_ping_pong_track_buffer is None
    assert table.mamba_allocator.available_size() == 1


def test_a_request_longer_than_the_pool_is_refused_at_submission():
    spec, serving, params = model("tiny")
    cache = build_kv_cache(spec, CacheConfig(page_size=16, max_total_tokens=64, context_length=512))
    sched = Scheduler(serving, cache, params, max_batch_size=2)
    fits = ServingReq("fits", [1] * 40, max_new_tokens=8)
    long = ServingReq("long", [1] * 60, max_new_tokens=8)  # 67 tokens of KV: 5 pages of 16
    with pytest.raises(ConfigError, match=r"max_total_tokens=64: request 'long' needs 80 KV token slots") as err:
        sched.submit([fits, long])
    assert err.value.option == "max_total_tokens"
    assert sched.idle and sched.stats.prompt_tokens == 0, "nothing queued"
    sched.submit([fits])
    assert list(sched.waiting) == [fits]


def test_a_request_short_of_state_slots_waits_while_others_run():
    """Slots held by running requests come back when they finish: a request short of them waits
    (as for KV) instead of failing, and is served after."""
    sched = _qwen3_next_scheduler()
    table = sched.cache.req_to_token_pool
    # Held elsewhere: what is left is one request's share (its 3 slots and 2 checkpoints).
    others = table.mamba_allocator.alloc(table.mamba_allocator.available_size() - 5)
    assert others is not None
    a, b = ServingReq("a", [3] * 9, max_new_tokens=3), ServingReq("b", [4] * 9, max_new_tokens=3)
    sched.submit([a, b])
    sched.step()
    assert sched.running == [a] and list(sched.waiting) == [b] and b.req_pool_idx is None
    sched.run()
    assert a.finished and b.finished
    table.mamba_allocator.free(others)
    check_end(sched)
