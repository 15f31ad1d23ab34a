"""SWARadixCache: SGLang 0.5.23's conformance scenarios (window 4, page 1), EAGLE bigrams, leaf
capping, the SWA-evicted-prefix insert, the lock-release lifecycle, bad input, the request
lifecycle over an SWATokenToKVPoolAllocator, and the chunk caches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvjax.alloc import SWATokenToKVPoolAllocator, make_allocator
from kvjax.errors import ConfigError
from kvjax.radix import LockError, PureSWAChunkCache, SWAChunkCache, SWARadixCache
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req
from tests.radix._helpers import WindowHarness


def shape(tree: SWARadixCache) -> list[tuple[list[int], bool, int]]:
    """(tokens, SWA live, FULL lock) of every node, DFS in child-key order."""
    out = []

    def walk(node, depth):
        for ck in sorted(node.children, key=repr):
            child = node.children[ck]
            out.append((child.token_ids(), not tree.swa.is_tombstone(child), child.lock_ref))
            walk(child, depth + 1)

    walk(tree.root, 0)
    return out


def state(tree: SWARadixCache) -> tuple:
    return (tree.pretty_print(), shape(tree), tree.total_size(), tree.swa_evictable_size(), tree.swa_protected_size())


# --------------------------------------------------------------------------- conformance


def release_leaves_nothing_locked(t: SWARadixCache, receipt: Any) -> None:
    """Release ``receipt``'s lock: nothing stays protected in either pool, and the tree is sound."""
    t.dec_lock_ref(receipt)
    assert (t.full_protected_size(), t.swa_protected_size()) == (0, 0)
    t.sanity_check()


def request_holding_six_tokens(pool: ReqToTokenPool, alloc: Any) -> tuple[Req, np.ndarray]:
    """A request in the pool's first row whose 6 tokens hold fresh slots of ``alloc``."""
    assert pool.alloc(1) == [0]
    req = Req("a", list(range(6)), req_pool_idx=0)
    slots = alloc.alloc(6)
    assert slots is not None
    pool.write(0, 0, slots)
    return req, slots


def test_sglang_0523_window4_page1():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    assert [t.insert([1, 2, 3]), t.insert([1, 2, 3, 4, 5, 6, 7]), t.insert([10, 11, 12])] == [0, 3, 0]
    assert t.insert([1, 2, 3, 4, 5, 60, 70]) == 5
    t.sanity_check()
    assert t.evict(1, 0) == (3, 3)  # FULL: the [10, 11, 12] leaf (the split stamped [6, 7] fresh)
    assert t.evict(0, 1) == (2, 2)  # SWA: deletes the [6, 7] leaf, no internal tombstone
    assert t.evict(1, 2) == (2, 2)  # FULL: the [60, 70] leaf; its SWA slots count toward the 2
    t.sanity_check()
    m = t.match_prefix([1, 2, 3, 4, 5])
    assert m.prefix_len == 5
    m = t.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert m.prefix_len == 5 and m.last_node.token_ids() == [4, 5]
    assert shape(t) == [([1, 2, 3], True, 0), ([4, 5], True, 0)]


def test_sglang_0523_window4_page1_eagle_bigrams():
    t = SWARadixCache(page_size=1, sliding_window_size=4, is_eagle=True)
    got = [t.insert([1, 2, 3]), t.insert([1, 2, 3, 4, 5, 6, 7]), t.insert([10, 11, 12])]
    got.append(t.insert([1, 2, 3, 4, 5, 60, 70]))
    assert got == [0, 2, 0, 4]
    assert t.evict(1, 0) == (2, 2)
    assert t.evict(0, 1) == (2, 2)
    assert t.evict(1, 2) == (2, 2)
    t.sanity_check()
    assert t.match_prefix([1, 2, 3, 4, 5]).prefix_len == 4
    m = t.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert m.prefix_len == 4 and m.last_node.token_ids() == [3, 4, 5]


def test_leaf_capping_at_one_page_aligned_window():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    t.insert(list(range(1, 9)))
    assert shape(t) == [([1, 2, 3, 4], True, 0), ([5, 6, 7, 8], True, 0)]
    t2 = SWARadixCache(page_size=2, sliding_window_size=3)  # ceil_to_page(3) = 4
    t2.insert(list(range(1, 11)))
    assert shape(t2) == [([1, 2, 3, 4, 5, 6], True, 0), ([7, 8, 9, 10], True, 0)]
    t2.sanity_check()


def test_insert_with_swa_evicted_prefix_and_revival():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    key = list(range(1, 13))
    assert t.insert(key, swa_evicted_seqlen=8) == 0
    assert shape(t) == [(key[:8], False, 0), (key[8:], True, 0)]
    assert t.match_prefix(key).prefix_len == 12
    assert t.match_prefix(key[:8]).prefix_len == 0
    assert t.match_prefix(key[:10]).prefix_len == 0
    assert t.total_size() == (12, 4)
    # Re-inserting with live SWA revives the tombstone.
    assert t.insert(key) == 12
    assert t.match_prefix(key[:8]).prefix_len == 8
    assert t.total_size() == (12, 12)
    t.sanity_check()


def test_partial_revival_splits_the_tombstone_at_the_evicted_length():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    key = list(range(1, 13))
    t.insert(key, swa_evicted_seqlen=8)
    assert t.insert(key, swa_evicted_seqlen=4) == 12  # positions 4..7 come back
    assert [(toks, live) for toks, live, _ in shape(t)] == [(key[:4], False), (key[4:8], True), (key[8:], True)]
    assert t.match_prefix(key[:8]).prefix_len == 8  # 4 live tokens after the tombstone
    t.sanity_check()


def test_lock_release_lifecycle():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    key = list(range(1, 13))
    t.insert(key)  # nodes [1..8] and [9..12] (capped)
    m = t.match_prefix(key)
    r = t.inc_lock_ref(m.last_node)
    assert (t.full_protected_size(), t.swa_protected_size()) == (12, 4)  # SWA: one window only
    assert (t.full_evictable_size(), t.swa_evictable_size()) == (0, 8)
    assert t.dec_swa_lock_only(r) == 4  # frees nothing, protected -> evictable
    assert (t.swa_protected_size(), t.swa_evictable_size(), t.total_size()) == (0, 12, (12, 12))
    before = state(t)
    assert t.dec_swa_lock_only(r) == 0  # a second release does nothing (SGLang's release_swa)
    assert state(t) == before
    # FULL is still locked: SWA eviction tombstones (the internal node first, then the locked leaf).
    assert t.evict(0, 1) == (0, 8)
    assert t.match_prefix(key).prefix_len == 12  # a whole window of live SWA after the tombstone
    assert t.evict(0, 1) == (0, 4)
    assert t.match_prefix(key).prefix_len == 0
    assert shape(t) == [(key[:8], False, 1), (key[8:], False, 1)]
    t.sanity_check()
    assert t.dec_lock_ref(r) == 12  # FULL only
    with pytest.raises(LockError):
        t.dec_lock_ref(r)
    assert t.evict(12, 0) == (12, 0)  # tombstoned leaves are deleted by FULL eviction
    assert t.total_size() == (0, 0)
    t.sanity_check()


def test_swa_lock_that_reaches_the_root_is_not_released_early():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    t.insert([1, 2])
    r = t.inc_lock_ref(t.match_prefix([1, 2]).last_node)
    assert t.swa_protected_size() == 2
    assert t.dec_swa_lock_only(r) == 0  # the segment reached the root: nothing to release early
    assert t.swa_protected_size() == 2
    release_leaves_nothing_locked(t, r)


def test_split_of_a_locked_segment_moves_its_boundary():
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    t.insert([1, 2, 3, 4, 5, 6])  # [1, 2] + [3..6]
    r = t.inc_lock_ref(t.match_prefix([1, 2, 3, 4, 5, 6]).last_node)
    t.match_prefix([1, 2, 3, 9])  # splits the locked [3..6] at [3]
    assert t.swa_protected_size() == 4
    release_leaves_nothing_locked(t, r)


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_and_changes_nothing():
    t = SWARadixCache(page_size=2, sliding_window_size=4)
    t.insert(list(range(1, 9)))
    before = state(t)
    with pytest.raises(ValueError, match="not page aligned"):
        t.insert(list(range(1, 13)), swa_evicted_seqlen=3)
    with pytest.raises(ValueError, match="reaches the end of the key"):
        t.insert(list(range(1, 13)), swa_evicted_seqlen=12)
    with pytest.raises(ValueError, match=">= 0"):
        t.insert(list(range(1, 13)), swa_evicted_seqlen=-2)
    with pytest.raises(ValueError, match="prev_prefix_len"):
        t.insert(list(range(1, 13)), prev_prefix_len=14)
    with pytest.raises(ValueError, match="amount"):
        t.evict(-1, 0)
    with pytest.raises(ValueError, match="amount"):
        t.evict(0, -1)
    with pytest.raises(TypeError):
        t.dec_swa_lock_only(t.root)  # type: ignore[arg-type]
    assert state(t) == before
    with pytest.raises(ConfigError, match="sliding_window_size"):
        SWARadixCache(page_size=1, sliding_window_size=0)
    with pytest.raises(ConfigError, match="sliding_window_size"):
        SWARadixCache(page_size=1)
    with pytest.raises(ConfigError, match="SWATokenToKVPoolAllocator"):
        SWARadixCache(page_size=1, sliding_window_size=4, allocator=make_allocator(8, 1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="page"):
        SWARadixCache(page_size=2, sliding_window_size=4, allocator=SWATokenToKVPoolAllocator(8, 8, 1))


# --------------------------------------------------------------------------- with an allocator


class SWAHarness(WindowHarness):
    """A request table, an SWA allocator and the tree; requests get fresh slots for their tokens."""

    def __init__(self, window: int = 4, page_size: int = 1, size: int = 64, size_swa: int = 32) -> None:
        super().__init__(SWARadixCache, SWATokenToKVPoolAllocator(size, size_swa, page_size), window, page_size)

    def leave_window(self, req: Req, upto: int) -> None:
        """The request frees the SWA slots of its own positions before ``upto`` (decode)."""
        row = self.pool.req_to_token[req.req_pool_idx]
        self.alloc.free_swa(row[req.swa_evicted_seqlen : upto])
        req.swa_evicted_seqlen = upto

    def check(self, held_full: int = 0, held_swa: int = 0) -> None:
        t, a = self.tree, self.alloc
        t.sanity_check()
        a.check_invariants()
        assert a.full_available_size() + t.full_evictable_size() + t.full_protected_size() + held_full == a.size_full
        assert a.swa_available_size() + t.swa_evictable_size() + t.swa_protected_size() + held_swa == a.size_swa


def test_request_lifecycle_with_window_freeing_and_tombstone_revival():
    h = SWAHarness()
    prompt = list(range(100, 112))
    r1 = h.start(prompt)
    assert r1.req_pool_idx is not None
    slots1 = h.pool.req_to_token[r1.req_pool_idx, :12].copy()
    h.check(held_full=12, held_swa=12)
    h.leave_window(r1, 6)  # decode moved on: positions 0..5 left the window
    h.check(held_full=12, held_swa=6)
    h.finish(r1)
    # The first 6 positions are a tombstone; the live part is capped at one window.
    assert [(len(toks), live) for toks, live, _ in shape(h.tree)] == [(6, False), (2, True), (4, True)]
    assert h.alloc.translate_loc_from_full_to_swa(slots1[:6]).tolist() == [0] * 6
    h.check()
    # A request sharing only the tombstoned part cannot reuse it; its insert revives the tombstone.
    r2 = h.start(prompt[:6] + [7, 7])
    assert r2.cache_protected_len == 0
    assert r2.req_pool_idx is not None
    slots2 = h.pool.req_to_token[r2.req_pool_idx, :8].copy()
    h.finish(r2)
    node = h.tree.match_prefix(prompt[:6]).last_node
    assert node.value.tolist() == slots2[:6].tolist()  # the tree took r2's slots ...
    assert h.tree.match_prefix(prompt[:6]).prefix_len == 6  # ... and its SWA
    h.check()
    assert h.alloc.full_available_size() == 64 - 14


def test_revival_of_a_full_locked_tombstone_keeps_the_locked_full_slots():
    h = SWAHarness()
    prompt = list(range(100, 112))
    r1 = h.start(prompt)
    h.leave_window(r1, 6)
    h.finish(r1)  # tombstone [0, 6) + live [6, 12)
    r2 = h.start(prompt + [5])  # matches all 12 (a window of live SWA after the tombstone)
    assert r2.cache_protected_len == 12
    tomb = h.tree.root.children[100]  # the tombstone [0, 6), FULL-locked by r2
    assert tomb.lock_ref == 1 and h.tree.swa.is_tombstone(tomb)
    assert tomb.value is not None
    locked_full = tomb.value.copy()
    r3 = h.start(prompt[:6] + [9, 9])
    h.finish(r3)
    assert tomb.value is not None and tomb.value.tolist() == locked_full.tolist()  # FULL slots kept (locked) ...
    assert not h.tree.swa.is_tombstone(tomb)  # ... with r3's SWA slots
    assert (h.alloc.translate_loc_from_full_to_swa(locked_full) > 0).all()
    h.check(held_full=1, held_swa=1)  # r2's own last token
    h.finish(r2)
    h.check()


def test_eviction_under_pressure_frees_both_pools():
    h = SWAHarness(size=32, size_swa=16)
    for base in (100, 200):
        h.finish(h.start(list(range(base, base + 8))))
        h.check()
    assert (h.alloc.full_available_size(), h.alloc.swa_available_size()) == (16, 0)
    assert h.alloc.alloc(8) is None  # the SWA pool is full
    # SWA LRU: [100..103] (internal: a tombstone), then the leaf [104..107] (deleted, FULL KV too).
    assert h.tree.evict(0, 8) == (4, 8)
    assert h.tree.match_prefix(list(range(100, 108))).prefix_len == 0
    assert h.tree.match_prefix(list(range(200, 208))).prefix_len == 8
    h.finish(h.start(list(range(300, 308))))
    h.check()
    assert h.tree.evict(32, 0) == (20, 16)  # the tombstoned [100..103] holds FULL KV only
    assert h.tree.total_size() == (0, 0) and h.alloc.available_size() == 16
    h.check()


# --------------------------------------------------------------------------- chunk caches


def test_swa_chunk_cache_frees_full_and_remaining_swa():
    alloc = SWATokenToKVPoolAllocator(16, 8, 1)
    pool = ReqToTokenPool(2, 16)
    cache = SWAChunkCache(pool, alloc, 1, sliding_window_size=4)
    assert cache.supports_swa() and cache.is_chunk_cache()
    req, slots = request_holding_six_tokens(pool, alloc)
    alloc.free_swa(slots[:2])
    req.swa_evicted_seqlen = 2
    cache.cache_finished_req(req)
    assert alloc.full_available_size() == 16 and alloc.swa_available_size() == 8
    assert req.swa_evicted_seqlen == 0
    with pytest.raises(ConfigError, match="SWATokenToKVPoolAllocator"):
        SWAChunkCache(pool, make_allocator(8, 1), 1, sliding_window_size=4)


def test_pure_swa_chunk_cache_skips_what_decode_freed():
    alloc = make_allocator(16, 1)
    pool = ReqToTokenPool(2, 16)
    cache = PureSWAChunkCache(pool, alloc, 1, sliding_window_size=4)
    req, slots = request_holding_six_tokens(pool, alloc)
    alloc.free(slots[:2])  # decode freed the out-of-window slots
    req.swa_evicted_seqlen = 2
    cache.cache_finished_req(req)  # would double-free without the skip
    assert alloc.available_size() == 16
    np.testing.assert_array_equal(np.sort(alloc.free_pages)[:6], np.arange(1, 7))


# --------------------------------------------------------------------------- recency (issue 19)


def test_match_refreshes_recency_only_up_to_where_the_window_lets_it_end():
    """0.5.23 refreshes FULL recency from the node where the match finally ends up to the root
    (``_match_post_processor``). The walk passed [1..5] but the window shortened the match to
    nothing, so [1..5] keeps its old time and the next FULL eviction deletes that tombstone leaf,
    not [20..23] (kvjax stamped the whole walk: (4, 4))."""
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    t.insert(list(range(1, 10)), swa_evicted_seqlen=5)
    t.evict(4)
    t.insert([20, 21, 22, 23])
    assert t.match_prefix([1, 2, 3, 4, 5]).prefix_len == 0
    assert t.evict(1) == (5, 0)
    assert shape(t) == [([20, 21, 22, 23], True, 0)]
    t.sanity_check()


def test_split_keeps_the_suffix_place_in_the_swa_recency_order():
    """0.5.23's ``_split_node`` leaves the suffix where it was in the SWA LRU and puts the new
    upper half just older than it (only FULL's time is refreshed). The match on [1] splits
    [1..8]; the least recent SWA node is then [2..8], tombstoned (kvjax moved both halves to
    the recent end and deleted the [9..12] leaf: (4, 4))."""
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    t.insert(list(range(1, 13)))  # leaf capping: [1..8], [9..12]
    assert t.match_prefix([1]).prefix_len == 1
    assert t.evict(0, 1) == (0, 7)
    assert shape(t) == [([1], True, 0), (list(range(2, 9)), False, 0), ([9, 10, 11, 12], True, 0)]
    t.sanity_check()


def test_retraction_frees_the_out_of_window_part_first_each_in_row_order():
    """0.5.23's ``free_kv_row_segments``: a released request's positions before its
    ``swa_evicted_seqlen`` go back full-side only, first, then the rest; each is a row segment, so
    the full free list starts with the live part's pages, then the out-of-window ones."""
    h = SWAHarness(window=4, page_size=2)
    r = h.start(list(range(100, 108)))  # full pages 1, 2, 3, 4
    h.leave_window(r, 4)  # pages 1, 2 left the window
    h.tree.cache_finished_req(r, is_insert=False)
    assert h.alloc.full_attn_allocator.free_pages.tolist()[:4] == [3, 4, 1, 2]
    assert r.req_pool_idx is not None
    h.pool.free(r.req_pool_idx)
    h.check()


# --------------------------------------------------------------------------- SGLang 0.5.23 free order


def _ids(x: object) -> list[int]:
    return [int(v) for v in np.asarray(x).ravel()]


def test_insert_frees_duplicate_then_revival_in_walk_order():
    """An insert whose walk passes a live node holding the caller's duplicate, then revives an SWA
    tombstone below it: SGLang 0.5.23 frees node by node in walk order (the duplicate first,
    then the tombstone's old full slots), so the free list hands them out in that order."""
    a = SWATokenToKVPoolAllocator(32, 16, 2)
    t = SWARadixCache(page_size=2, sliding_window_size=4, allocator=a)
    x = _ids(a.alloc_extend([0], [8], [-1]))
    assert x == [2, 3, 4, 5, 6, 7, 8, 9]
    assert t.insert([1, 0, 0, 1, 0, 0, 2, 1], np.asarray(x)) == 0  # [1,0,0,1] | [0,0,2,1] (leaf cap)
    b = _ids(a.alloc_extend([2], [4], [x[1]]))
    assert t.insert([1, 0, 2, 2], np.asarray(x[:2] + b), prev_prefix_len=2) == 2  # splits [1,0] | [0,1]
    assert t.evict(0, 6) == (4, 6)
    v = _ids(a.alloc_extend([0], [6], [-1]))
    assert v == [6, 7, 8, 9, 12, 13]
    # [1,0] is live (v's 6, 7 are duplicates), [0,1] a tombstone revived from v's 8, 9 (its old 4,
    # 5 freed), [0,1] past it new.
    assert t.insert([1, 0, 0, 1, 0, 1], np.asarray(v), prev_prefix_len=0) == 4
    assert [_ids(a.alloc_extend([0], [2], [-1])) for _ in range(2)] == [[4, 5], [6, 7]]
    t.sanity_check()


def test_early_swa_release_of_a_lock_without_swa_is_a_no_op():
    """SGLang's scheduler releases the SWA part of every decode request past the window; a lock
    whose match ended at the root holds none, and a second release finds none: both do nothing."""
    t = SWARadixCache(page_size=1, sliding_window_size=4)
    t.insert([5, 6, 7])
    r = t.inc_lock_ref(t.match_prefix([1, 2]).last_node)
    before = state(t)
    assert t.dec_swa_lock_only(r) == 0
    assert t.release_swa_prefix_lock(r) == 0
    assert state(t) == before
    t.dec_lock_ref(r)
    with pytest.raises(LockError, match="already released"):
        t.dec_swa_lock_only(r)  # after dec_lock_ref the receipt is spent (SGLang asserts)
    other = SWARadixCache(page_size=1, sliding_window_size=4)
    with pytest.raises(LockError, match="another tree"):
        t.dec_swa_lock_only(other.inc_lock_ref(other.root))
    assert state(t) == before


def test_checkpoint_protects_the_inserted_path_where_a_match_stops_short():
    """0.5.23's checkpoint locks the node its insert ended on: here a match of the inserted key
    stops at the root (its SWA prefix is tombstoned, the new tail is shorter than the window),
    yet the request keeps the whole path FULL-locked, so another request's revival of the
    tombstone keeps the request's slots and its finish frees nothing twice."""
    h = SWAHarness()
    prompt = list(range(100, 108))
    h.finish(h.start(prompt))
    r1 = h.start(prompt + [1, 2])
    assert r1.cache_protected_len == 8 and r1.req_pool_idx is not None
    assert h.tree.dec_swa_lock_only(r1.lock_receipt) == 4
    assert h.tree.evict(0, 8) == (0, 8)  # the FULL-locked path's SWA: a tombstone
    h.tree.cache_unfinished_req(r1)
    assert h.tree.match_prefix(prompt + [1, 2]).prefix_len == 0  # a re-match would protect nothing
    assert r1.cache_protected_len == 10 and r1.last_node.depth == 10 and r1.last_node.lock_ref == 1
    mine = h.pool.req_to_token[r1.req_pool_idx, :10].copy()
    r2 = h.start(prompt[:4] + [7, 7, 7, 7])
    h.finish(r2)  # revives the tombstone [0, 4) with r2's SWA, keeps r1's locked FULL slots
    assert h.tree.match_prefix(prompt[:4]).indices.tolist() == mine[:4].tolist()
    h.finish(r1)
    h.check()


def test_a_tombstone_revived_inside_a_locked_swa_segment_comes_back_protected():
    """0.5.23's SWA lock walks through tombstones (their positions count towards the window) and
    locks them: a revival under the lock makes the node SWA-protected, and the unlock releases it
    (was: the walk stopped at the tombstone, the revived node counted as evictable)."""
    h = SWAHarness()
    prompt = list(range(100, 108))
    h.finish(h.start(prompt))  # [0, 4) + [4, 8): the leaf capped at one window
    r1 = h.start(prompt + [1, 2])
    assert h.tree.dec_swa_lock_only(r1.lock_receipt) == 4
    assert h.tree.evict(0, 8) == (0, 8)  # both nodes: tombstones, FULL-locked by r1
    h.tree.cache_unfinished_req(r1)  # the lock moves to [8, 10); its SWA segment covers [4, 10)
    assert (h.tree.swa_evictable_size(), h.tree.swa_protected_size()) == (0, 2)
    r2 = h.start(prompt + [7, 7])
    h.finish(r2)  # revives [0, 4) (evictable) and [4, 8) (in r1's segment: protected)
    assert (h.tree.swa_evictable_size(), h.tree.swa_protected_size()) == (4 + 2, 4 + 2)
    h.check(held_full=0, held_swa=0)
    h.finish(r1)
    assert (h.tree.swa_evictable_size(), h.tree.swa_protected_size()) == (12, 0)
    h.check()
