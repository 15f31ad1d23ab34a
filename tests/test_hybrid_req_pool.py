"""`HybridReqToTokenPool`: a state slot per admitted request, the extra buffer's ping-pong slots."""

from __future__ import annotations

import pytest

from kvjax.errors import DoubleFreeError, InvalidSlotError
from kvjax.hybrid_req_pool import HybridReqToTokenPool
from kvjax.request import Req


def test_sglang_mamba_pool_accounting():
    # SGLang's test_mamba_pool: 10 rows, 20 state slots.
    pool = HybridReqToTokenPool(10, 128, mamba_size=20)
    req = Req(0, [])
    assert pool.alloc_reqs([req]) == [0]
    assert (pool.available_size(), pool.mamba_allocator.available_size()) == (9, 19)
    assert pool.get_mamba_indices([0]).tolist() == [req.mamba_pool_idx] == [1]
    pool.free_mamba_cache(req)
    pool.free_req(req)
    assert (pool.available_size(), pool.mamba_allocator.available_size()) == (10, 20)
    # freeing the row without the state slot leaks that slot
    pool.alloc_reqs([req])
    pool.free_req(req)
    assert (pool.available_size(), pool.mamba_allocator.available_size()) == (10, 19)
    # re-admission keeps the request's existing slot
    pool.alloc_reqs([req])
    assert (pool.available_size(), pool.mamba_allocator.available_size()) == (9, 19)
    pool.check_invariants()


def test_all_or_nothing_when_state_slots_run_out():
    pool = HybridReqToTokenPool(4, 16, mamba_size=1)
    a, b = Req("a", []), Req("b", [])
    assert pool.alloc_reqs([a, b]) is None
    assert (a.req_pool_idx, a.mamba_pool_idx, pool.available_size(), pool.mamba_allocator.available_size()) == (
        None,
        None,
        4,
        1,
    )


def test_extra_buffer_ping_pong_slots_donate_and_keep():
    pool = HybridReqToTokenPool(2, 16, mamba_size=6, enable_mamba_extra_buffer=True)
    req = Req("r", [])
    pool.alloc_reqs([req])
    assert req.mamba_pool_idx == 1 and req.mamba_ping_pong_track_buffer.tolist() == [2, 3]
    assert pool.req_index_to_mamba_ping_pong_track_buffer_mapping[0].tolist() == [2, 3]
    req.mamba_last_track_idx = 1
    new = int(pool.mamba_allocator.alloc(1)[0])
    assert pool.donate_mamba_ping_pong_slot(req, new) == 3  # the tree now owns slot 3
    assert req.mamba_ping_pong_track_buffer.tolist() == [2, new]
    pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=1)  # slot `new` goes to the tree
    assert pool.mamba_allocator.available_size() == 6 - 2  # slots 3 and `new` are the tree's
    with pytest.raises(InvalidSlotError, match="ping-pong"):
        req2 = Req("s", [])
        pool.alloc_reqs([req2])
        pool.free_mamba_cache(req2, mamba_ping_pong_track_buffer_to_keep=5)
    pool.check_invariants()


def test_state_slot_freed_twice_raises_and_changes_nothing():
    pool = HybridReqToTokenPool(2, 16, mamba_size=3)
    req = Req("r", [])
    pool.alloc_reqs([req])
    slot = req.mamba_pool_idx
    pool.free_mamba_cache(req)
    req.mamba_pool_idx = slot
    with pytest.raises(DoubleFreeError, match="double free"):
        pool.free_mamba_cache(req)
    assert pool.mamba_allocator.available_size() == 3 and req.mamba_pool_idx == slot
    pool.check_invariants()
