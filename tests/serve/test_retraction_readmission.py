"""A decode step that retracts every running request, then re-admits one of them: the request
decodes from the length its re-admission gave it, with no page lost.

The scheduler keeps the running requests' lengths as arrays between decode steps while the running
set is the same requests (by identity); a retracted request that comes back alone is the same
object with another length. The step that retracts everything needs each retracted request's
prefix to stay locked (a host-tier backup in flight does that over a sharded pool); here a lock
taken on the tree for that one step stands in for it.
"""

from __future__ import annotations

import numpy as np

from kvjax import ModelSpec
from kvjax.demo import demo_cache
from kvjax.serve.model import init_params
from kvjax.serve.scheduler import Scheduler, ServingReq

PAGE = 16
PROMPT = 5 * PAGE  # page aligned: the first decode step of each request starts a page
MAX_NEW = 3


def _balanced(sched: Scheduler) -> bool:
    """``available + evictable + protected + held by live requests == capacity`` (a live request
    holds its pages ``[cache_protected_len, kv_len)``, page-rounded)."""
    live = [r for r in sched.live_requests() if r.req_pool_idx is not None]
    held = sum(-(-r.kv_len() // PAGE) * PAGE - r.cache_protected_len for r in live)
    tree = sched.tree
    return sched.alloc.available_size() + tree.evictable_size() + tree.protected_size() + held == sched.alloc.size


def test_a_request_readmitted_alone_after_every_request_was_retracted_decodes_from_its_new_length():
    spec = ModelSpec.preset("tiny")
    params = init_params(spec)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, PROMPT).tolist() for _ in range(2)]

    alone = Scheduler(spec, demo_cache(page_size=PAGE), params, max_batch_size=2, overlap=False)
    reference = [
        r.output_ids for r in alone.run([ServingReq(f"r{i}", p, max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)])
    ]

    # Two prompts fill the pool exactly: their first decode step finds no free page.
    cache = demo_cache(page_size=PAGE, max_total_tokens=2 * PROMPT)
    sched = Scheduler(spec, cache, params, max_batch_size=2, overlap=False)
    reqs = [ServingReq(f"r{i}", p, max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)]
    sched.submit(reqs)
    sched.step()  # both prefilled: the pool is full, each prefix locked by its request
    assert [r.rid for r in sched.running] == ["r0", "r1"] and sched.alloc.available_size() == 0
    tree = sched.tree
    locks = [tree.inc_lock_ref(r.last_node) for r in reqs]  # as backups in flight would
    sched.step()  # no page for either: both retracted (each prefix stays locked)
    assert not sched.running and sched.stats.retractions == 2
    for lock in locks:
        tree.dec_lock_ref(lock)
    assert _balanced(sched)
    sched.step()  # r0 re-admitted alone (r1's prefix evicted for it; r1 does not fit)
    assert [r.rid for r in sched.running] == ["r0"] and [r.rid for r in sched.waiting] == ["r1"]
    while not sched.idle:
        sched.step()
        assert _balanced(sched)
    assert sched.leak_free()
    tree.sanity_check()
    assert [r.output_ids for r in reqs] == reference
