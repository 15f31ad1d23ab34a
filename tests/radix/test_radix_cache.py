"""`RadixCache`: SGLang's conformance checklist (RadixCache unit tests) plus the kvjax contract
(DESIGN §2): exact slot ids, sizes, locks, eviction, page alignment, splits, EAGLE keys, the
request lifecycle, statistics and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.radix import LockError, LockReceipt, MatchResult, RadixCache, TreeNode
from kvjax.request import Req
from tests.radix._helpers import Harness, RecordingAllocator, sizes


def arr(*xs):
    return np.array(xs, dtype=np.int32)


# ------------------------------------------------------------------------- construction


def test_construction_defaults():
    t = RadixCache()
    assert t.page_size == 1 and t.eviction_policy == "lru" and not t.disable
    assert t.root.klen == 0 and t.root.lock_ref == 1
    assert sizes(t) == (0, 0, 0)
    assert t.is_tree_cache() and not t.is_chunk_cache()
    t16 = RadixCache(page_size=16, eviction_policy="LFU", disable=False, enable_kv_cache_events=True)
    assert t16.page_size == 16 and t16.eviction_policy == "lfu" and t16.enable_kv_cache_events


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_page_size(bad):
    with pytest.raises(kvjax.ConfigError):
        RadixCache(page_size=bad)


def test_reset_clears_sizes():
    t = RadixCache()
    t.insert([1, 2, 3], arr(10, 20, 30))
    t.insert([4, 5], arr(40, 50))
    t.reset()
    assert sizes(t) == (0, 0, 0)
    assert t.match_prefix([1, 2, 3]).prefix_len == 0
    t.sanity_check()


# ------------------------------------------------------------------------- insert / match


def test_insert_and_match_exact_values():
    t = RadixCache()
    assert t.insert([1, 2, 3], arr(10, 20, 30)) == 0
    assert sizes(t) == (3, 0, 3)
    m = t.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert m.indices.dtype == np.int32 and m.indices.tolist() == [10, 20, 30] and m.prefix_len == 3
    assert m.device_indices is m.indices and m.last_device_node is m.last_node is m.last_host_node
    assert t.match_prefix([1, 2]).indices.tolist() == [10, 20]
    assert t.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [10, 20, 30]
    assert t.match_prefix([9]).prefix_len == 0 and t.match_prefix([9]).last_node is t.root
    assert t.match_prefix([]).prefix_len == 0
    # Already cached: returns the cached length; the tree keeps its own slots.
    assert t.insert([1, 2, 3, 4], arr(91, 92, 93, 40)) == 3
    assert t.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 20, 30, 40]
    t.sanity_check()


def test_match_returns_fresh_arrays():
    t = RadixCache()
    t.insert([1, 2, 3], arr(10, 20, 30))
    a = t.match_prefix([1, 2, 3]).indices
    a[:] = 0
    assert t.match_prefix([1, 2, 3]).indices.tolist() == [10, 20, 30]


def test_numpy_and_list_inputs_share_the_tree():
    t = RadixCache(page_size=2)
    t.insert(np.array([1, 2, 3, 4, 5, 6], np.int64), np.arange(10, 16))
    assert t.match_prefix([1, 2, 3, 4, 7, 7]).indices.tolist() == [10, 11, 12, 13]
    assert t.insert([1, 2, 3, 4, 5, 6, 7, 8], np.arange(20, 28)) == 6
    assert t.match_prefix(np.array([1, 2, 3, 4, 5, 6, 7, 8], np.int32)).indices.tolist() == [
        10,
        11,
        12,
        13,
        14,
        15,
        26,
        27,
    ]
    assert t.match_prefix((1, 2, 3, 9)).indices.tolist() == [10, 11]
    t.sanity_check()


def test_insert_without_values_counts_tokens():
    t = RadixCache()
    assert t.insert([1, 2, 3]) == 0
    assert t.total_size() == 3
    m = t.match_prefix([1, 2, 3])
    assert m.prefix_len == 3 and len(set(m.indices.tolist())) == 3 and 0 not in m.indices
    t.sanity_check()


def test_disabled_tree_caches_nothing():
    t = RadixCache(disable=True)
    assert t.insert([1, 2, 3], arr(1, 2, 3)) == 0
    assert t.total_size() == 0
    assert t.match_prefix([1, 2, 3]).prefix_len == 0
    assert t.is_chunk_cache()


def test_total_size_across_branches():
    t = RadixCache()
    t.insert([1, 2, 3], arr(1, 2, 3))
    t.insert([4, 5, 6, 7], arr(4, 5, 6, 7))
    t.insert([1, 2, 8], arr(11, 12, 8))
    assert t.total_size() == 8
    assert sorted(t.all_values_flatten().tolist()) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_extra_key_isolation():
    t = RadixCache()
    t.insert([1, 2, 3], arr(10, 20, 30), extra_key="key1")
    t.insert([1, 2, 3], arr(40, 50, 60), extra_key="key2")
    t.insert([1, 2, 3], arr(70, 80, 90))
    assert t.match_prefix([1, 2, 3], extra_key="key1").indices.tolist() == [10, 20, 30]
    assert t.match_prefix([1, 2, 3], extra_key="key2").indices.tolist() == [40, 50, 60]
    assert t.match_prefix([1, 2, 3]).indices.tolist() == [70, 80, 90]
    assert t.match_prefix([1, 2, 3], extra_key="other").prefix_len == 0
    assert t.total_size() == 9
    # Namespaces never share nodes, even below the root.
    a = t.match_prefix([1, 2], extra_key="key1").last_node
    b = t.match_prefix([1, 2], extra_key="key2").last_node
    assert a is not b and a.extra_key == "key1" and b.extra_key == "key2"
    t.sanity_check()


def test_child_keys_are_first_tokens_and_pages_where_first_tokens_clash():
    t1 = RadixCache(page_size=1)
    t1.insert([7, 8, 9], arr(1, 2, 3))
    assert list(t1.root.children) == [7]  # page size 1: SGLang's key
    t4 = RadixCache(page_size=4)
    t4.insert([1, 2, 3, 4, 5, 6, 7, 8], np.arange(10, 18), extra_key="lora")
    assert list(t4.root.children) == [("lora", (1, 2, 3, 4))]  # a namespace: SGLang's key
    t4.insert([1, 2, 3, 4, 5, 6, 7, 8], np.arange(20, 28))
    assert list(t4.root.children)[1:] == [1]  # below: the first token alone
    # A second child beginning with token 1 files both by their first page from then on.
    t4.insert([1, 9, 9, 9], np.arange(30, 34))
    assert t4.root.clash == {1} and sorted(k for k in t4.root.children if isinstance(k, tuple) and k[0] == 1) == [
        (1, 2, 3, 4),
        (1, 9, 9, 9),
    ]
    t4.sanity_check()
    for key, expect in [
        ([1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25, 26, 27]),
        ([1, 9, 9, 9, 0], [30, 31, 32, 33]),
    ]:
        assert t4.match_prefix(key).indices.tolist() == expect
        assert t4.match_prefix(np.array(key, dtype=np.int32)).indices.tolist() == expect
    assert t4.match_prefix([1, 5, 5, 5]).prefix_len == 0
    t4.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], extra_key="lora")
    t4.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # [1, 9, 9, 9] is now the least recent leaf
    # The clash stays after one of them leaves; a third child with that token is paged too.
    assert t4.evict(4) == 4 and list(k for k in t4.root.children if k != ("lora", (1, 2, 3, 4))) == [(1, 2, 3, 4)]
    t4.insert([1, 7, 7, 7], np.arange(40, 44))
    assert (1, 7, 7, 7) in t4.root.children and t4.match_prefix([1, 7, 7, 7]).prefix_len == 4
    # Splits keep the upper part under the same key; the lower part is its only child.
    t4.insert([1, 2, 3, 4, 0, 0, 0, 0], np.arange(50, 58))
    upper = t4.root.children[(1, 2, 3, 4)]
    assert upper.klen == 4 and sorted(upper.children) == [0, 5]
    t4.sanity_check()


# ------------------------------------------------------------------------- locks


def test_lock_moves_tokens_between_evictable_and_protected():
    t = RadixCache()
    t.insert([1, 2, 3], arr(10, 20, 30))
    node = t.match_prefix([1, 2, 3]).last_node
    r = t.inc_lock_ref(node)
    assert isinstance(r, LockReceipt) and r.delta == -3
    assert sizes(t) == (0, 3, 3)
    assert t.evict(10) == 0
    assert t.dec_lock_ref(r) == 3
    assert sizes(t) == (3, 0, 3)
    t.sanity_check()


def test_lock_covers_ancestors_and_node_itself():
    t = RadixCache()
    t.insert([1, 2, 3, 4], arr(1, 2, 3, 4))
    t.insert([1, 2, 5], arr(11, 12, 5))
    leaf = t.match_prefix([1, 2, 3, 4]).last_node
    r = t.inc_lock_ref(leaf)
    assert leaf.lock_ref == 1 and leaf.parent.lock_ref == 1
    assert sizes(t) == (1, 4, 5)
    assert t.evict(100) == 1  # only the unlocked sibling [5]
    assert t.match_prefix([1, 2, 3, 4]).prefix_len == 4
    t.dec_lock_ref(r)
    t.sanity_check()


def test_lock_on_root_is_a_no_op():
    t = RadixCache()
    r = t.inc_lock_ref(t.root)
    assert r.delta == 0 and t.dec_lock_ref(r) == 0
    assert t.dec_lock_ref(t.root) == 0 and t.inc_lock_ref(None).delta == 0


def test_locked_node_survives_split_and_unlocks_cleanly():
    t = RadixCache()
    t.insert([1, 2, 3, 4], arr(1, 2, 3, 4))
    node = t.match_prefix([1, 2, 3, 4]).last_node
    r = t.inc_lock_ref(node)
    t.match_prefix([1, 2])  # splits the locked node; the parent inherits the lock
    assert node.parent.lock_ref == 1 and node.parent.klen == 2
    assert sizes(t) == (0, 4, 4)
    t.sanity_check()
    t.dec_lock_ref(r)
    assert sizes(t) == (4, 0, 4)
    t.sanity_check()


# ------------------------------------------------------------------------- eviction


def test_evict_frees_into_allocator_and_reduces_total():
    alloc = RecordingAllocator(16, 1)
    t = RadixCache(token_to_kv_pool_allocator=alloc)
    slots = alloc.alloc(3)
    t.insert([1, 2, 3], slots)
    before = alloc.available_size()
    assert t.evict(2) == 3  # whole node, may free more than asked
    assert alloc.take() == slots.tolist()
    assert t.total_size() == 0 and alloc.available_size() == before + 3


def test_evict_lru_order_and_parent_cascade():
    t = RadixCache()
    t.insert([1, 2, 3], arr(1, 2, 3))
    t.insert([1, 2, 4], arr(11, 12, 4))
    t.insert([5, 6], arr(5, 6))
    t.match_prefix([1, 2, 4])  # refresh [4] (and [1, 2])
    # [3] was last touched when the insert of [1, 2, 4] split its node, before [5, 6] existed.
    assert t.evict(1) == 1
    assert t.match_prefix([1, 2, 3]).prefix_len == 2
    assert t.evict(1) == 2  # [5, 6]
    assert t.match_prefix([5, 6]).prefix_len == 0
    assert t.evict(2) == 3  # [4], then its parent [1, 2] became a leaf
    assert t.total_size() == 0
    t.sanity_check()


def test_evict_nothing_when_asked_nothing():
    t = RadixCache()
    t.insert([1, 2], arr(1, 2))
    assert t.evict(0) == 0 and t.evict(-5) == 0 and t.total_size() == 2


# ------------------------------------------------------------------------- pages and splits


@pytest.mark.parametrize("page_size,length", [(1, 5), (2, 5), (4, 6)])
def test_page_aligned_match(page_size, length):
    t = RadixCache(page_size=page_size)
    toks = list(range(1, length + 1))
    t.insert(toks, np.arange(100, 100 + length))
    m = t.match_prefix(toks)
    assert m.prefix_len > 0 and m.prefix_len % page_size == 0
    assert m.prefix_len == length // page_size * page_size
    assert m.indices.tolist() == list(range(100, 100 + m.prefix_len))


def test_key_shorter_than_a_page_matches_and_caches_nothing():
    t = RadixCache(page_size=4)
    assert t.insert([1, 2, 3], arr(4, 5, 6)) == 0
    assert t.total_size() == 0
    t.insert([1, 2, 3, 4], arr(4, 5, 6, 7))
    m = t.match_prefix([1, 2, 3])
    assert m.prefix_len == 0 and m.last_node is t.root


@pytest.mark.parametrize("page_size", [1, 2])
def test_split_moves_no_data(page_size):
    t = RadixCache(page_size=page_size)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], np.arange(10, 18))
    t.insert([1, 2, 9, 10], arr(30, 31, 32, 33))
    assert t.total_size() == 10
    m = t.match_prefix([1, 2, 3, 4, 999, 998])
    assert m.indices.tolist() == [10, 11, 12, 13] and t.total_size() == 10
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 999, 998])
    assert m.indices.tolist() == [10, 11, 12, 13, 14, 15] and t.total_size() == 10
    assert t.match_prefix([1, 2, 9, 10]).indices.tolist() == [10, 11, 32, 33]
    t.sanity_check()


def test_paged_mismatch_inside_a_page_stops_at_page_before():
    t = RadixCache(page_size=4)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], np.arange(20, 32))
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    assert m.indices.tolist() == [20, 21, 22, 23] and m.last_node.klen == 4
    assert t.insert([1, 2, 3, 4, 5, 6, 99, 8], np.arange(40, 48)) == 4
    assert t.match_prefix([1, 2, 3, 4, 5, 6, 99, 8]).indices.tolist() == [20, 21, 22, 23, 44, 45, 46, 47]
    t.sanity_check()


def test_long_match_mismatch_found_in_the_middle():
    t = RadixCache()
    a = list(range(1, 3001))
    t.insert(a, np.arange(1, 3001))
    b = a[:1777] + [0] + a[1778:]
    assert t.match_prefix(b).prefix_len == 1777
    assert t.match_prefix(np.array(b)).prefix_len == 1777
    t.sanity_check()


# ------------------------------------------------------------------------- EAGLE bigram keys


def test_bigram_keys_are_one_shorter():
    t = RadixCache(is_eagle=True)
    assert t.insert([1, 2, 3, 4], arr(10, 20, 30, 40)) == 0
    assert t.total_size() == 3  # (1,2) (2,3) (3,4)
    assert t.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 20, 30]
    assert t.match_prefix([1, 2, 3]).indices.tolist() == [10, 20]
    assert t.match_prefix([1, 2, 3, 5]).indices.tolist() == [10, 20]
    assert t.match_prefix([1]).prefix_len == 0
    assert t.insert([1, 2, 3, 5, 6], arr(10, 20, 35, 50, 60)) == 2
    assert t.match_prefix(np.array([1, 2, 3, 5, 6])).indices.tolist() == [10, 20, 35, 50]
    assert list(t.root.children) == [1]  # filed by first token; (1, 2) is SGLang's key
    t.sanity_check()


def test_bigram_paged():
    t = RadixCache(page_size=2, is_eagle=True)
    assert t.insert([1, 2, 3, 4, 5], np.arange(10, 15)) == 0
    assert t.total_size() == 4
    assert t.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 11]  # 3 pairs -> 1 page
    assert t.match_prefix([1, 2, 3, 9, 9]).indices.tolist() == [10, 11]
    t.sanity_check()


# ------------------------------------------------------------------------- statistics


def test_stats_and_force_miss():
    t = RadixCache(page_size=2)
    t.insert([1, 2, 3, 4], arr(10, 11, 12, 13))
    t.match_prefix([1, 2, 3, 4, 5])
    assert t.stats.last_query_tokens == 4 and t.stats.last_hit_tokens == 4
    t.match_prefix([9, 9])
    assert (t.stats.num_matches, t.stats.query_tokens, t.stats.hit_tokens) == (2, 6, 4)
    assert t.stats.hit_rate == pytest.approx(4 / 6)
    t.force_miss = True
    m = t.match_prefix([1, 2, 3, 4])
    assert m.prefix_len == 0 and m.last_node is t.root and t.stats.hit_tokens == 4
    # The walk still ran: a match ending inside a node still splits it.
    t.match_prefix([1, 2, 7, 7])
    assert t.root.children[1].klen == 2
    assert t.insert([1, 2, 3, 4], arr(20, 21, 22, 23)) == 4  # inserts still see the cache
    t.force_miss = False
    assert t.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert t.stats.to_dict()["inserted_tokens"] == 4


def test_pretty_print_is_text():
    t = RadixCache()
    t.insert([1, 2, 3], arr(1, 2, 3))
    t.insert([1, 2, 4], arr(11, 12, 4))
    text = t.pretty_print()
    assert "[2] [1, 2]" in text and "#tokens: 4" in text


# ------------------------------------------------------------------------- bad input


def _snapshot(t):
    return sizes(t), t.pretty_print(), sorted(t.all_values_flatten().tolist())


@pytest.mark.parametrize(
    "indices,err",
    [
        (np.array([1, 2], np.int32), ValueError),  # wrong length
        (np.array([1.0, 2.0, 3.0]), ValueError),  # float dtype
        (np.array([True, False, True]), ValueError),  # bool dtype
        (np.array([[1, 2, 3]]), ValueError),  # 2-D
        (np.array([1, -2, 3]), kvjax.InvalidSlotError),  # negative
    ],
)
def test_bad_indices_raise_and_leave_tree_unchanged(indices, err):
    t = RadixCache()
    t.insert([1, 2, 3], arr(10, 20, 30))
    before = _snapshot(t)
    with pytest.raises(err):
        t.insert([1, 2, 4], indices)
    assert _snapshot(t) == before
    t.sanity_check()


def test_out_of_range_slot_with_allocator():
    alloc = RecordingAllocator(16, 4)
    t = RadixCache(page_size=4, token_to_kv_pool_allocator=alloc)
    with pytest.raises(kvjax.InvalidSlotError, match="20"):
        t.insert([1, 2, 3, 4], arr(16, 17, 18, 20))  # slots live in [0, 16 + 4)
    assert t.insert([1, 2, 3, 4], arr(16, 17, 18, 19)) == 0
    with pytest.raises(ValueError, match="indices=None"):
        t.insert([5, 6, 7, 8])
    assert t.total_size() == 4


def test_unlock_errors_leave_tree_unchanged():
    t = RadixCache()
    t.insert([1, 2, 3], arr(1, 2, 3))
    t.insert([1, 2, 4], arr(11, 12, 4))
    node = t.match_prefix([1, 2, 3]).last_node
    before = _snapshot(t)
    with pytest.raises(LockError, match="below zero"):
        t.dec_lock_ref(node)
    r = t.inc_lock_ref(node)
    t.dec_lock_ref(r)
    with pytest.raises(LockError, match="already released"):
        t.dec_lock_ref(r)
    assert _snapshot(t) == before
    with pytest.raises(TypeError):
        t.dec_lock_ref("not a node")
    other = RadixCache()
    other.insert([1, 2, 3], arr(1, 2, 3))
    with pytest.raises(LockError, match="another tree"):
        t.inc_lock_ref(other.match_prefix([1, 2, 3]).last_node)
    t.evict(100)
    with pytest.raises(LockError, match="evicted"):
        t.inc_lock_ref(node)


def test_reset_refuses_while_locked_and_invalidates_old_nodes():
    t = RadixCache()
    t.insert([1, 2, 3], arr(1, 2, 3))
    node = t.match_prefix([1, 2, 3]).last_node
    r = t.inc_lock_ref(node)
    with pytest.raises(LockError, match="locked"):
        t.reset()
    assert t.total_size() == 3
    t.dec_lock_ref(r)
    t.reset()
    with pytest.raises(LockError):
        t.inc_lock_ref(node)


def test_reset_frees_slots_into_the_allocator():
    alloc = RecordingAllocator(16, 1)
    t = RadixCache(token_to_kv_pool_allocator=alloc)
    cap = alloc.available_size()
    t.insert([1, 2, 3], alloc.alloc(3))
    t.reset()
    assert alloc.available_size() == cap and sorted(alloc.take()) == [1, 2, 3]


def test_a_donated_key_becomes_the_edge_and_a_copied_one_stays_the_callers():
    key = list(range(100, 140))  # 40 tokens: two 16-token pages and a partial one
    t = RadixCache(page_size=16)
    assert t.insert(key, np.arange(16, 56, dtype=np.int32), donate_key=True) == 0
    (leaf,) = t.root.children.values()
    assert leaf.klist is key and key == list(range(100, 132))  # kept, partial page cut off
    # A match that ends inside the edge splits it; the donated list is the upper part now.
    m = t.match_prefix(list(range(100, 116)) + [7] * 16)
    assert m.prefix_len == 16 and m.last_node.klist is key and key == list(range(100, 116))
    assert [n.token_ids() for n in m.last_node.children.values()] == [list(range(116, 132))]
    t.sanity_check()

    kept = list(range(200, 240))
    t.insert(kept, np.arange(64, 104, dtype=np.int32))
    assert kept == list(range(200, 240))  # copied: the caller's list is untouched
    t.match_prefix(list(range(200, 216)) + [7] * 16)
    assert kept == list(range(200, 240))
    assert all(n.klist is not kept for n in t._nodes())
    t.sanity_check()


def test_the_hybrid_trees_take_a_donated_key_too():
    from kvjax.radix import MambaRadixCache, SWARadixCache

    swa = SWARadixCache(page_size=1, sliding_window_size=4, eviction_policy="lru")
    key = list(range(1, 13))
    swa.insert(key, swa_evicted_seqlen=8, donate_key=True)
    assert swa.match_prefix(list(range(1, 13))).prefix_len == 12
    mamba = MambaRadixCache(page_size=1, mamba_pool_size=8)
    slot = int(mamba.mamba_allocator.alloc(1)[0])
    key = [1, 2, 3, 4, 5, 6, 7]
    assert mamba.insert(key, mamba_value=slot, donate_key=True).prefix_len == 0
    (leaf,) = mamba.root.children.values()
    assert leaf.klist is key
    assert mamba.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).prefix_len == 7


def test_a_donated_key_with_a_cached_head_is_kept_whole_until_its_edge_is_needed():
    system = list(range(1000, 1032))  # two 16-token pages
    t = RadixCache(page_size=16)
    t.insert(list(system), np.arange(16, 48, dtype=np.int32))
    key = system + list(range(2000, 2040))  # 40 new tokens: two pages and a partial one
    assert t.insert(key, np.arange(48, 120, dtype=np.int32), donate_key=True) == 32
    leaf = t.last_insert_node
    # Neither form of the edge was built: the leaf holds the donated list, cut to whole pages.
    assert leaf.klist is None and leaf.key is None and leaf.kshare is key and leaf.kshare_from == 32
    assert key == system + list(range(2000, 2032)) and leaf.token_ids() == list(range(2000, 2032))
    t.sanity_check()
    # A numpy match reads the edge's bytes, a list match its list; both are cut from the tail.
    m = t.match_prefix(np.array(system + list(range(2000, 2016)) + [7], dtype=np.int32))
    assert m.prefix_len == 48 and m.indices.tolist() == list(range(16, 48)) + list(range(80, 96))
    assert leaf.kshare is None and leaf.token_ids() == list(range(2016, 2032))  # split: the lower part
    assert leaf.parent.token_ids() == list(range(2000, 2016))
    assert t.match_prefix(key + [5]).prefix_len == 64
    t.sanity_check()


def test_a_donated_key_with_a_long_cached_head_is_copied():
    """The donated list is kept only while its cached head is at most SHARE_MAX_HEAD times the
    new edge, so the keys a tree holds stay proportional to the tokens it caches."""
    from kvjax.radix.walk import SHARE_MAX_HEAD

    head = list(range(1000, 1000 + 4 * (SHARE_MAX_HEAD + 1)))
    t = RadixCache(page_size=4)
    t.insert(list(head), np.arange(4, 4 + len(head), dtype=np.int32))
    key = head + [1, 2, 3, 4]
    t.insert(key, np.arange(100, 100 + len(key), dtype=np.int32), donate_key=True)
    leaf = t.last_insert_node
    assert leaf.kshare is None and leaf.klist == [1, 2, 3, 4]
    t.sanity_check()


def test_a_shared_edge_splits_and_evicts_like_its_own():
    t = RadixCache(page_size=4, eviction_policy="lru")
    t.insert([9, 9, 9, 9], np.arange(4, 8, dtype=np.int32))
    t.insert([9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8], np.arange(8, 20, dtype=np.int32), donate_key=True)
    # An insert that diverges inside the shared edge splits it there.
    t.insert([9, 9, 9, 9, 1, 2, 3, 4, 0, 0, 0, 0], np.arange(20, 32, dtype=np.int32), donate_key=True)
    t.sanity_check()
    assert sorted(n.token_ids() for n in t._nodes()) == [[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert t.evict(4) == 4 and t.evict(100) == 12
    t.sanity_check()


@pytest.mark.parametrize(("page_size", "is_eagle"), [(4, False), (1, False), (4, True)])
def test_donation_matches_copying_on_a_random_stream(page_size, is_eagle):
    rng = np.random.default_rng(3)
    system = [int(x) for x in rng.integers(1000, 9000, 64)]
    trees = {d: RadixCache(page_size=page_size, is_eagle=is_eagle) for d in (False, True)}
    for i in range(60):
        key = system[: int(rng.integers(0, 64))] + [int(x) for x in rng.integers(0, 50, int(rng.integers(1, 40)))]
        slots = np.arange(4 + 200 * i, 4 + 200 * i + len(key), dtype=np.int32)
        prompt = key[: int(rng.integers(1, len(key) + 1))]
        as_array = bool(rng.integers(0, 2))  # numpy matches read the edges' bytes
        got = []
        for donate, t in trees.items():
            m = t.match_prefix(np.array(prompt, dtype=np.int32) if as_array else list(prompt))
            receipt = t.inc_lock_ref(m.last_node)
            got.append((m.prefix_len, t.insert(list(key), slots, donate_key=donate)))
            t.dec_lock_ref(receipt)
            t.evict(max(0, t.total_size() - 300))
            t.sanity_check()
        assert got[0] == got[1]
    snap = {d: sorted((n.depth, tuple(n.token_ids()), n.value.tolist()) for n in t._nodes()) for d, t in trees.items()}
    assert snap[False] == snap[True]


def test_the_lifecycle_never_cuts_a_requests_own_token_lists():
    """The request lifecycle donates the keys it builds itself, never the request's lists."""
    h = Harness(page_size=4, size=128)
    a = h.start(list(range(1, 21)))
    h.decode(a, [50, 51, 52, 53])
    inp, out = list(a.origin_input_ids), list(a.output_ids)
    h.finish(a)
    b = h.start(list(range(1, 9)) + [99] * 8)  # splits the cached path inside a's first edge
    h.finish(b)
    assert a.origin_input_ids == inp and a.output_ids == out
    assert h.tree.match_prefix(inp + out).prefix_len == 24
    h.check()


# ------------------------------------------------------------------------- request lifecycle (exact ids)


def test_finished_request_page1_exact_ids():
    h = Harness(page_size=1, size=32)
    req = h.start([1, 2, 3, 4])
    assert h.row(req) == [1, 2, 3, 4] and req.cache_protected_len == 0
    h.decode(req, [5, 6])
    assert h.finish(req) == []  # nothing duplicated, no tail at page size 1
    assert h.tree.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == [1, 2, 3, 4, 5, 6]
    assert sizes(h.tree) == (6, 0, 6)
    # A second request shares the prefix: it locks it, and only its new tokens get slots.
    req2 = h.start([1, 2, 3, 4, 9])
    assert req2.cache_protected_len == 4 and req2.cached_tokens == 4
    assert h.row(req2) == [1, 2, 3, 4, 7] and h.tree.protected_size() == 4
    assert h.finish(req2) == []
    assert h.tree.match_prefix([1, 2, 3, 4, 9]).indices.tolist() == [1, 2, 3, 4, 7]
    assert h.alloc.available_size() + h.tree.total_size() == h.capacity
    h.check()


def test_finished_request_frees_duplicates_and_unaligned_tail_page4():
    h = Harness(page_size=4, size=64)
    a = h.start([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # slots 4..13 (pages 1..3)
    assert h.row(a) == list(range(4, 14))
    b = h.start([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # nothing cached yet: its own pages 4..6
    assert h.row(b) == list(range(16, 26))
    assert h.finish(a) == [12, 13]  # the unaligned tail (page 3)
    assert h.tree.match_prefix(list(range(1, 11))).indices.tolist() == list(range(4, 12))
    # b computed the same 8 tokens: its slots for them are duplicates, then its tail.
    assert h.finish(b) == [16, 17, 18, 19, 20, 21, 22, 23, 24, 25]
    assert h.alloc.available_size() + h.tree.total_size() == h.capacity
    h.check()


def test_generated_tokens_are_in_the_key():
    h = Harness(page_size=1)
    req = h.start([1, 2, 3])
    h.decode(req, [7, 8])
    h.finish(req)
    # Turn two resends prompt + answer: it must hit all five tokens, not just the prompt.
    m = h.tree.match_prefix([1, 2, 3, 7, 8, 4])
    assert m.prefix_len == 5 and m.indices.tolist() == [1, 2, 3, 4, 5]


def test_kv_committed_len_limits_the_key():
    h = Harness(page_size=1)
    req = h.start([1, 2, 3])
    h.decode(req, [7, 8])
    req.kv_committed_len = 4  # the last sampled token has no KV yet
    assert h.finish(req) == []
    assert h.tree.match_prefix([1, 2, 3, 7, 8]).prefix_len == 4
    # Its slot (5) still belongs to the request's caller: not freed, not cached.
    assert 5 not in h.tree.all_values_flatten().tolist()


def test_finished_without_insert_frees_own_slots():
    h = Harness(page_size=2, size=32)
    h.tree.insert([1, 2], h.alloc.alloc(2))
    req = h.start([1, 2, 3, 4, 5])
    assert req.cache_protected_len == 2 and h.row(req) == [2, 3, 4, 5, 6]
    h.alloc.take()
    h.tree.cache_finished_req(req, is_insert=False)
    assert h.alloc.take() == [4, 5, 6]
    assert h.tree.total_size() == 2 and h.tree.protected_size() == 0
    h.check()


def test_chunked_prefill_exact_ids_and_lock_moves():
    h = Harness(page_size=4, size=64)
    prompt = list(range(1, 15))  # 14 tokens, prefilled in chunks of 6
    row = h.new_row()
    req = Req("c", prompt, req_pool_idx=row)
    m = h.tree.match_and_lock(req)
    assert m.prefix_len == 0
    h.pool.write(row, 0, h.alloc.alloc(8)[:6])  # slots 4..9 for tokens 0..5
    req.fill_ids = prompt[:6]
    h.tree.cache_unfinished_req(req)
    assert req.cache_protected_len == 4 and req.prefix_indices.tolist() == [4, 5, 6, 7, 8, 9]
    assert not req.prefix_indices.flags.writeable
    assert h.tree.protected_size() == 4 and req.last_node.klen == 4
    first_node = req.last_node
    h.pool.write(row, 6, [10, 11] + h.alloc.alloc(4).tolist())  # tokens 6..11
    req.fill_ids = prompt[:12]
    h.alloc.take()
    h.tree.cache_unfinished_req(req)
    assert h.alloc.take() == []
    assert req.cache_protected_len == 12 and h.tree.protected_size() == 12
    assert req.last_node.parent is first_node and first_node.lock_ref == 1
    assert req.prefix_indices.tolist() == list(range(4, 16))
    h.pool.write(row, 12, h.alloc.alloc(4)[:2])  # tokens 12, 13 -> slots 16, 17
    assert h.finish(req) == [16, 17]
    assert sizes(h.tree) == (12, 0, 12)
    assert h.tree.match_prefix(prompt).indices.tolist() == list(range(4, 16))
    h.check()


def test_unfinished_frees_duplicates_and_points_row_at_tree():
    h = Harness(page_size=1, size=32)
    a = h.start([1, 2, 3, 4])
    b = h.start([1, 2, 3, 4, 5])  # started before a was cached: own slots 5..9
    assert h.row(b) == [5, 6, 7, 8, 9]
    h.finish(a)
    h.alloc.take()
    h.tree.cache_unfinished_req(b)
    assert h.alloc.take() == [5, 6, 7, 8]  # duplicates of a's cached tokens
    assert h.row(b) == [1, 2, 3, 4, 9] and b.prefix_indices.tolist() == [1, 2, 3, 4, 9]
    assert b.cache_protected_len == 5
    assert h.finish(b) == []
    assert h.alloc.available_size() + h.tree.total_size() == h.capacity
    h.check()


def test_bigram_request_lifecycle():
    h = Harness(page_size=1, is_eagle=True)
    req = h.start([1, 2, 3, 4])
    h.decode(req, [5])
    assert h.finish(req) == [5]  # the last token has no bigram: freed as the tail
    assert h.tree.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [1, 2, 3, 4]
    h.check()


def test_lifecycle_with_extra_key_and_priority():
    h = Harness(page_size=1, eviction_policy="priority")
    a = h.start([1, 2, 3], extra_key="lora-a", priority=5)
    h.finish(a)
    assert h.tree.match_prefix([1, 2, 3]).prefix_len == 0
    m = h.tree.match_prefix([1, 2, 3], extra_key="lora-a")
    assert m.prefix_len == 3 and m.last_node.priority == 5
    h.check()


def test_lifecycle_needs_a_request_pool():
    t = RadixCache()
    with pytest.raises(ValueError, match="req_to_token_pool"):
        t.cache_finished_req(Req("x", [1, 2, 3], req_pool_idx=0))


def test_node_repr_and_tokens():
    t = RadixCache()
    t.insert(list(range(1, 20)), np.arange(1, 20))
    node = t.match_prefix([1, 2]).last_node
    assert isinstance(node, TreeNode) and node.token_ids() == [1, 2] and "len=2" in repr(node)


def test_lifecycle_with_numpy_tokens_then_list_match():
    h = Harness(page_size=2, size=64)
    row = h.new_row()
    req = Req("np", np.array([5, 6, 7, 8, 9], np.int32), req_pool_idx=row)
    h.tree.match_and_lock(req)
    h.pool.write(row, 0, h.alloc.alloc(6)[:5])
    h.decode(req, [10])
    assert h.finish(req) == []  # 6 tokens: 3 whole pages, no tail
    assert h.tree.match_prefix([5, 6, 7, 8, 9, 10]).indices.tolist() == [2, 3, 4, 5, 6, 7]
    h.check()


def _chunked_request(h, n_chunks, chunk):
    row = h.new_row()
    prompt = list(range(1, n_chunks * chunk + 1))
    req = Req("long", prompt, req_pool_idx=row)
    h.tree.match_and_lock(req)
    for i in range(n_chunks):
        h.pool.write(row, i * chunk, h.alloc.alloc(chunk))
        req.kv_committed_len = (i + 1) * chunk
        yield req


def test_chunked_step_does_not_walk_the_cached_prefix():
    """A chunked-prefill step resumes at the request's locked node: the nodes above it are
    neither compared nor touched, so a step's cost does not grow with the request."""
    h = Harness(page_size=4, size=1024, width=1024)
    nodes = []
    for req in _chunked_request(h, 8, 64):
        h.tree.cache_unfinished_req(req, chunked=True)
        nodes.append(req.last_node)
    first = nodes[0]
    stamp = (first.last_access, first.hit_count)
    assert [n.depth for n in nodes] == [64 * (i + 1) for i in range(8)]
    assert all(nodes[i + 1].parent is nodes[i] for i in range(7))
    # Counted once, by the step that created it (0.5.23 counts chunked steps too); untouched since.
    assert stamp == (nodes[0].last_access, 1)
    assert h.tree.protected_size() == 512
    assert h.finish(req) == []
    assert first.hit_count == 1 and first.last_access == nodes[-1].last_access  # finish refreshed the path
    h.check()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_counts_each_node_once(chunked):
    """SGLang 0.5.23: a node counts one hit per request (``cache_inserted_len``), whether the
    request's steps are chunked or not; another request through the same node counts again."""
    h = Harness(page_size=1, size=256, width=256, eviction_policy="lfu")
    reqs = _chunked_request(h, 3, 8)
    req = next(reqs)
    h.tree.cache_unfinished_req(req, chunked=chunked)
    first = req.last_node
    assert first.hit_count == 1 and req.cache_inserted_len == 8
    for req in reqs:
        h.tree.cache_unfinished_req(req, chunked=chunked)
    assert first.hit_count == 1
    h.finish(req)
    assert first.hit_count == 1 and req.cache_inserted_len == 0
    other = h.start(list(range(1, 13)))
    assert other.cache_protected_len == 11
    h.tree.cache_unfinished_req(other, chunked=chunked)  # its first insert counts the matched path
    assert first.hit_count == 2
    h.finish(other)
    assert first.hit_count == 2
    h.check()
