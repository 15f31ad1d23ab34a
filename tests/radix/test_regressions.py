"""Regression tests for the bug classes peers shipped in full-KV prefix trees
(user-needs §3.5): each test reproduces the scenario and checks the invariant that broke."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.alloc import make_allocator
from kvjax.radix import LockError, RadixCache
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req
from tests.radix._helpers import Harness, RecordingAllocator, sizes


def test_split_does_not_double_count_pages():
    """sglang#35270: evictable_size counted pages shared after a split twice, so
    available + evictable + protected exceeded the pool."""
    h = Harness(page_size=4, size=128)
    a = h.start(list(range(1, 17)))
    h.finish(a)
    b = h.start(list(range(1, 9)) + [99] * 8)  # shares two pages: the cached node splits
    h.finish(b)
    c = h.start(list(range(1, 5)) + [77] * 4)  # splits again, at the first page
    lock_sizes = sizes(h.tree)
    assert lock_sizes[0] + lock_sizes[1] == lock_sizes[2] == 24
    h.finish(c)
    t = h.tree
    assert t.evictable_size() + t.protected_size() == t.total_size() == 28
    assert h.alloc.available_size() + t.total_size() == h.capacity
    h.alloc.take()
    assert t.evict(10**6) == 28
    freed = h.alloc.take()
    assert len(freed) == len(set(freed)) == 28  # every page freed once, none twice
    assert h.alloc.available_size() == h.capacity
    h.check()


def test_lock_covers_the_locked_node_itself():
    """mini-sglang#52: the lock walk started at the parent, leaving the handle's own node
    evictable while a request still used it."""
    t = RadixCache()
    t.insert([1, 2, 3], np.array([1, 2, 3]))
    t.insert([1, 2, 3, 4, 5], np.array([1, 2, 3, 4, 5]))
    leaf = t.match_prefix([1, 2, 3, 4, 5]).last_node
    t.inc_lock_ref(leaf)
    assert leaf.lock_ref == 1 and t.evictable_size() == 0
    assert t.evict(100) == 0
    assert t.match_prefix([1, 2, 3, 4, 5]).prefix_len == 5


@pytest.mark.parametrize("page_size", [4, 16])
def test_key_shorter_than_a_page(page_size):
    """sglang#24371 / #10637: a key shorter than one page was indexed past its end; after
    page alignment it is empty and must match and cache nothing."""
    h = Harness(page_size=page_size, size=8 * page_size)
    short = list(range(1, page_size))
    assert h.tree.match_prefix(short).prefix_len == 0
    assert h.tree.insert(short, np.arange(page_size, 2 * page_size - 1)) == 0
    req = h.start(short)
    h.tree.cache_unfinished_req(req)
    assert req.cache_protected_len == 0 and req.prefix_indices.tolist() == h.row(req)
    freed = h.finish(req)
    assert freed == list(range(page_size, 2 * page_size - 1))  # the whole tail, once
    assert h.tree.total_size() == 0 and h.alloc.available_size() == h.capacity
    e = RadixCache(is_eagle=True)
    assert e.match_prefix([5]).prefix_len == 0 and e.insert([5], np.array([1])) == 0
    h.check()


def test_generated_tokens_are_part_of_the_key():
    """sglang#16521: the cache key omitted output tokens, so turn 2 reused only the prompt."""
    h = Harness(page_size=2, size=64)
    turn1 = h.start([1, 2, 3, 4])
    h.decode(turn1, [5, 6, 7, 8])
    h.finish(turn1)
    turn2 = h.start([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert turn2.cache_protected_len == 8
    h.finish(turn2)
    h.check()


def test_unlock_below_zero_is_rejected():
    """mllm#656: dec_lock_ref below zero was tolerated and evictable_size went negative."""
    t = RadixCache()
    t.insert([1, 2], np.array([1, 2]))
    node = t.match_prefix([1, 2]).last_node
    r = t.inc_lock_ref(node)
    t.dec_lock_ref(node)  # released by node...
    with pytest.raises(LockError):
        t.dec_lock_ref(r)  # ...so the receipt would go below zero
    with pytest.raises(LockError):
        t.dec_lock_ref(node)
    assert sizes(t) == (2, 0, 2) and node.lock_ref == 0
    t.sanity_check()


def test_row_never_points_at_freed_duplicates():
    """mini-sglang#142: the page table kept pointing at duplicate slots that had been freed
    and reused."""
    h = Harness(page_size=2, size=64)
    a = h.start([1, 2, 3, 4, 5, 6])
    b = h.start([1, 2, 3, 4, 5, 6, 7])
    h.finish(a)
    h.tree.cache_unfinished_req(b)
    freed = set(h.alloc.take())
    row = h.row(b)
    assert freed and not freed & set(row)
    assert row[:6] == h.tree.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist()
    h.finish(b)
    h.check()


def test_out_of_range_slot_rejected_before_it_reaches_the_device():
    """tpu-inference#2366: JAX clamps out-of-range ids silently; the tree must refuse them."""
    alloc = RecordingAllocator(32, 1)
    t = RadixCache(token_to_kv_pool_allocator=alloc)
    with pytest.raises(kvjax.InvalidSlotError):
        t.insert([1, 2], np.array([1, 33]))
    with pytest.raises(kvjax.InvalidSlotError):
        t.insert([1, 2], np.array([-1, 3]))
    assert t.total_size() == 0


def test_evicted_node_cannot_be_unlocked_or_locked():
    """sglang#29291: unlocking a detached node walked an invalid parent chain."""
    t = RadixCache()
    t.insert([1, 2], np.array([1, 2]))
    node = t.match_prefix([1, 2]).last_node
    t.evict(10)
    with pytest.raises(LockError, match="evicted"):
        t.dec_lock_ref(node)
    with pytest.raises(LockError, match="evicted"):
        t.inc_lock_ref(node)
    assert sizes(t) == (0, 0, 0)


def test_eviction_frees_each_page_once_node_by_node():
    """vllm#42571: the same block reached the free list twice. SGLang 0.5.23 frees evicted
    nodes one ``free`` each, in eviction order (LRU: the oldest request's first)."""
    h = Harness(page_size=4, size=256)
    rows = []
    for i in range(6):
        r = h.start([100 + i] * 4 + list(range(i * 8, i * 8 + 8)))
        rows.append(h.row(r))
        h.finish(r)
    h.alloc.freed.clear()
    h.tree.evict(10**6)
    assert h.alloc.freed == rows  # one call per node, oldest first, each node's slots in order
    ids = [i for call in h.alloc.freed for i in call]
    assert len(ids) == len(set(ids)) == 72
    assert h.alloc.available_size() == h.capacity


def test_full_hit_leaves_one_token_to_compute():
    """tpu-inference#860: a prompt fully cached left nothing to run the forward on."""
    h = Harness(page_size=1)
    a = h.start([1, 2, 3, 4])
    h.finish(a)
    b = h.start([1, 2, 3, 4])
    assert b.cache_protected_len == 3 and h.row(b)[:3] == [1, 2, 3] and h.row(b)[3] != 4
    h.finish(b)
    h.check()


def test_evicted_pages_go_back_in_row_order():
    """SGLang 0.5.23 frees a tree node through ``free_segment``: its pages go to the head of the
    free list in row order, unsorted (page 4, 64-token pool). kvjax sorted them, handing out
    [4..7] where SGLang hands out [8..11]."""
    alloc = make_allocator(64, 4)
    tree = RadixCache(page_size=4, token_to_kv_pool_allocator=alloc)
    a, b = alloc.alloc(4), alloc.alloc(4)
    alloc.free(a)
    alloc.free(b)
    v = alloc.alloc(8)
    assert v is not None and v.tolist() == [8, 9, 10, 11, 4, 5, 6, 7]
    tree.insert(list(range(8)), v)
    assert tree.evict(8) == 8
    got = alloc.alloc(4)
    assert got is not None and got.tolist() == [8, 9, 10, 11]
    alloc.check_invariants()


def test_retracted_request_frees_its_pages_in_row_order():
    """A request released without an insert (retraction) frees ``[cache_protected_len, kv_len)``
    as one row segment: its pages, in row order, head the free list (0.5.23's
    ``free_kv_row``)."""
    h = Harness(page_size=2, size=32)
    h.alloc.free_segment(h.alloc.alloc(6)[[4, 5, 0, 1, 2, 3]], start_pos=0)  # head: pages 3, 1, 2
    r = h.start([5, 6, 7, 8, 9, 10])
    assert h.row(r) == [6, 7, 2, 3, 4, 5]
    h.alloc.take()
    h.tree.cache_finished_req(r, is_insert=False)
    assert h.alloc.freed == [[6, 7, 2, 3, 4, 5]]
    assert h.alloc.free_pages.tolist()[:3] == [3, 1, 2]  # free() would have sorted them: 1, 2, 3
    h.free_row(r)
    h.check()


def test_priority_eviction_frees_leaves_in_policy_order_each_in_row_order():
    """Issue 35: under the ``priority`` policy at page 4, the pages an eviction frees go back
    leaf by leaf in eviction order (lowest ``(priority, last access)`` first), each leaf's pages
    in row order at the head of the free list, so the next ``alloc_extend`` hands out the last
    evicted leaf's pages first. SGLang 0.5.23 (its ``RadixCache`` over its paged allocator,
    driven by ``checkpoint`` / ``release_kv_cache``) gives ``604-607, 60-63, 524-527`` for this
    sequence (checked with ``benchmarks/compare_sglang_trees.py``, known case 12); the reverse
    order is the difference the issue reported.

    Three requests (priorities 2, 1, 0) each get a one-page prompt (pages 100, 101, 151) and
    decode one page of output (pages 99, 15, 131), a checkpoint after every token, then finish:
    each prompt node has priority + 1, each output leaf its request's priority. ``evict(12)``
    takes r2's output (0), r1's output (1, older than r2's prompt) and r2's prompt (1)."""
    page = 4
    alloc = make_allocator(640, page)
    assert alloc.alloc(alloc.available_size()) is not None  # every page taken: frees pick them
    rows = ReqToTokenPool(4, 64)
    tree = RadixCache(
        page_size=page, eviction_policy="priority", token_to_kv_pool_allocator=alloc, req_to_token_pool=rows
    )

    def page_slots(p: int) -> np.ndarray:
        return np.arange(p * page, (p + 1) * page)

    for prompt, priority, prompt_page, output_page in (
        ([1, 2, 3, 4], 2, 100, 99),
        ([5, 6, 7, 8], 1, 101, 15),
        ([9, 10, 11, 12], 0, 151, 131),
    ):
        got_rows = rows.alloc(1)
        assert got_rows is not None
        row = got_rows[0]
        req = Req(f"p{priority}", prompt, req_pool_idx=row, priority=priority)
        tree.match_and_lock(req)
        alloc.free_segment(page_slots(prompt_page), start_pos=0)
        rows.write(row, 0, alloc.alloc_extend([0], [4], [-1]))
        req.kv_committed_len = 4
        tree.cache_unfinished_req(req)
        alloc.free_segment(page_slots(output_page), start_pos=0)
        for n, tok in enumerate([20, 21, 22, 23], start=4):
            got = alloc.alloc_extend([n], [n + 1], [int(rows.req_to_token[row, n - 1])])
            assert got is not None
            rows.req_to_token[row, n] = got[0]
            req.output_ids.append(tok)
            req.kv_committed_len = n + 1
            tree.cache_unfinished_req(req)
        tree.cache_finished_req(req)
        rows.free(row)
    assert tree.evict(12) == 12
    got = alloc.alloc_extend([0], [12], [-1])
    assert got is not None
    assert got.tolist() == [604, 605, 606, 607, 60, 61, 62, 63, 524, 525, 526, 527]
    alloc.check_invariants()
