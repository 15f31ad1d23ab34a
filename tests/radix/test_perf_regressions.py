"""Exact-id scenarios for the tree's fast paths: each checks that a shortcut taken for speed
gives the same answer as the plain algorithm (lazy match indices, first-token child lookup,
the copy-free compare of long root edges, deferred heap pushes, the one-pass unlock, the
argmin/argmax slot check)."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.radix import LockError, RadixCache
from kvjax.radix.keys import NO_COPY_COMPARE_MIN, list_starts_with
from tests.radix._helpers import RecordingAllocator, sizes


def arr(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


# 4-token pages; A and B share their first token (and first half), C does not.
A = [1, 1, 2, 2]
B = [1, 1, 3, 3]
C = [5, 5, 5, 5]
D = [7, 7, 7, 7]


# ------------------------------------------------------------------ lazy match indices


def test_match_indices_do_not_change_when_the_tree_changes_before_they_are_read():
    t = RadixCache(page_size=4)
    t.insert(A + C, arr(*range(10, 18)))
    m = t.match_prefix(A + C + D)
    assert m.prefix_len == 8
    t.insert(A + D, arr(*range(10, 14), *range(30, 34)))  # splits the node m ends in
    t.evict(10**6)  # and evicts everything
    assert t.total_size() == 0
    assert m.indices.dtype == np.int32 and m.indices.tolist() == list(range(10, 18))
    assert m.device_indices is m.indices  # built once
    indices, node = m
    assert indices is m.indices and node is m.last_node


def test_match_indices_are_a_fresh_array():
    t = RadixCache(page_size=4)
    t.insert(A, arr(10, 11, 12, 13))
    m = t.match_prefix(A)
    m.indices[:] = 0
    assert t.match_prefix(A).indices.tolist() == [10, 11, 12, 13]
    t.sanity_check()


# ------------------------------------------------------------------ first-token child lookup


def test_children_sharing_a_first_token_are_told_apart():
    t = RadixCache(page_size=4)
    t.insert(D + A, arr(*range(10, 18)))
    t.insert(D + B, arr(10, 11, 12, 13, 20, 21, 22, 23))  # second child of D starting with 1
    t.sanity_check()
    assert t.match_prefix(D + A).indices.tolist() == list(range(10, 18))
    assert t.match_prefix(D + B).indices.tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert t.match_prefix(D + [1, 1, 9, 9]).indices.tolist() == [10, 11, 12, 13]
    # Evict the older leaf (D + A); the shared marker stays and D + B is still found.
    t.match_prefix(D + B)
    assert t.evict(4) == 4
    t.sanity_check()
    assert t.match_prefix(D + A).prefix_len == 4
    assert t.match_prefix(D + B).indices.tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert t.insert(D + A, arr(10, 11, 12, 13, 40, 41, 42, 43)) == 4
    assert t.match_prefix(D + A).indices.tolist() == [10, 11, 12, 13, 40, 41, 42, 43]
    t.sanity_check()


def test_a_candidate_whose_first_page_differs_is_neither_matched_nor_touched():
    t = RadixCache(page_size=4)  # lru
    t.insert(D, arr(10, 11, 12, 13))
    t.insert(D + A, arr(*range(10, 18)))  # D's only child starts with 1
    t.insert(C, arr(30, 31, 32, 33))
    leaf_a = t.match_prefix(D + A).last_node
    touched = leaf_a.last_access
    m = t.match_prefix(D + B)  # finds D + A's leaf by first token 1; its page differs
    assert m.prefix_len == 4 and m.last_node is leaf_a.parent
    assert leaf_a.last_access == touched
    assert t.insert(D + B, arr(10, 11, 12, 13, 20, 21, 22, 23)) == 4
    assert sorted(t.match_prefix(D).last_node.children) == [(1, 1, 2, 2), (1, 1, 3, 3)]
    # LRU: C is older than D + A, which is older than D + B.
    assert t.evict(4) == 4 and t.match_prefix(C).prefix_len == 0
    assert t.evict(4) == 4 and t.match_prefix(D + A).prefix_len == 4
    assert t.match_prefix(D + B).prefix_len == 8
    t.sanity_check()


def test_split_keeps_the_first_token_index():
    t = RadixCache(page_size=4)
    t.insert(D + A + C, arr(*range(10, 22)))
    t.insert(D + A + B, arr(*range(10, 18), 40, 41, 42, 43))  # splits D + A + C after A
    t.insert(D + B, arr(10, 11, 12, 13, 50, 51, 52, 53))  # D's second child starting with 1
    t.sanity_check()
    assert t.match_prefix(D + A + C).indices.tolist() == list(range(10, 22))
    assert t.match_prefix(D + A + B).indices.tolist() == [*range(10, 18), 40, 41, 42, 43]
    assert t.match_prefix(D + B + C).indices.tolist() == [10, 11, 12, 13, 50, 51, 52, 53]


def test_root_index_leaves_namespaces_to_their_full_keys():
    t = RadixCache(page_size=4)
    t.insert(A, arr(10, 11, 12, 13), extra_key=1)  # an int namespace equal to a token
    t.insert(B, arr(20, 21, 22, 23))  # default namespace, same first token
    t.insert(A + C, arr(10, 11, 12, 13, 30, 31, 32, 33), extra_key=1)
    t.insert(A, arr(40, 41, 42, 43))
    t.sanity_check()
    assert t.match_prefix(A + C, extra_key=1).indices.tolist() == [10, 11, 12, 13, 30, 31, 32, 33]
    assert t.match_prefix(A + C).indices.tolist() == [40, 41, 42, 43]
    assert t.match_prefix(B).indices.tolist() == [20, 21, 22, 23]
    assert t.match_prefix(B, extra_key=1).prefix_len == 0
    assert t.evict(8) == 8  # namespace 1's leaf C, then its parent A, the oldest leaves
    t.sanity_check()
    assert t.match_prefix(A, extra_key=1).prefix_len == 0
    assert t.match_prefix(B).prefix_len == 4 and t.match_prefix(A).prefix_len == 4
    assert t.evict(10**6) == 8 and t.total_size() == 0
    t.sanity_check()


def test_numpy_and_list_walks_share_the_index():
    t = RadixCache(page_size=4)
    t.insert(np.array(D + A, np.int32), arr(*range(10, 18)))
    t.insert(D + B, arr(10, 11, 12, 13, 20, 21, 22, 23))
    assert t.match_prefix(np.array(D + B, np.int64)).indices.tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert t.match_prefix(D + A).indices.tolist() == list(range(10, 18))
    t.sanity_check()


def test_bigram_keys_use_the_index_below_the_root():
    t = RadixCache(is_eagle=True)
    t.insert([4, 1, 2, 3], arr(10, 11, 12, 13))  # bigrams (4,1) (1,2) (2,3)
    t.insert([4, 1, 2, 9], arr(10, 11, 22, 0))  # (2,9) shares the first token with (2,3)
    t.sanity_check()
    assert t.match_prefix([4, 1, 2, 9]).indices.tolist() == [10, 11, 22]
    assert t.match_prefix([4, 1, 2, 3]).indices.tolist() == [10, 11, 12]
    assert t.match_prefix([4, 1, 2, 5]).indices.tolist() == [10, 11]


# ------------------------------------------------------------------ copy-free compare of long edges


def _edge_cases(n: int) -> list[tuple[list, list]]:
    """(src, head) pairs around a head of ``n`` tokens: equal, a prefix, every kind of mismatch."""
    head = list(range(1000, 1000 + n))
    longer = head + [7, 8]
    cases = [(list(head), head), (longer, head), (head[:-1], head), ([], head), (longer, [])]
    for i in (0, n // 2, n - 1):
        for delta in (-1, 1):
            bad = list(longer)
            bad[i] += delta  # differs below and above at the first, a middle and the last token
            cases.append((bad, head))
    cases.append(([int(str(t)) for t in longer], head))  # equal values, distinct int objects
    cases.append((np.array(longer).tolist(), head))
    cases.append(([np.int64(t) for t in longer], head))  # numpy scalars compare by value too
    return cases


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_list_starts_with_agrees_with_the_slice_compare_and_restores_the_head(n):
    for src, head in _edge_cases(n):
        before = list(head)
        assert list_starts_with(src, head) == (src[: len(head)] == head)
        assert head == before and len(head) == len(before)


def test_list_starts_with_restores_the_head_when_a_compare_raises():
    head = list(range(100))
    with pytest.raises(TypeError):
        list_starts_with([*range(50), "x", *range(60)], head)
    assert head == list(range(100))


@pytest.mark.parametrize("page_size", [1, 16])
def test_long_root_edges_match_insert_and_split_as_before(page_size):
    """Edges of >= NO_COPY_COMPARE_MIN tokens under the root take the copy-free compare on
    match, insert and the split probe; every answer is the one the slice compare gives."""
    n = 4 * NO_COPY_COMPARE_MIN
    system = list(range(5000, 5000 + n))
    t = RadixCache(page_size=page_size)
    assert t.insert(system + [1] * 32, np.arange(1, n + 33, dtype=np.int32)) == 0
    assert t.match_prefix(system + [1] * 32 + [9]).prefix_len == n + 32
    # A question that differs right after the shared prompt: the long leaf splits there.
    m = t.match_prefix(system + [2] * 32)
    assert m.prefix_len == n and m.indices.tolist() == list(range(1, n + 1))
    assert len(t.root.children) == 1 and next(iter(t.root.children.values())).klen == n
    assert t.insert(system + [2] * 32, np.arange(100_000, 100_000 + n + 32, dtype=np.int32)) == n
    # A prompt that differs inside the shared part matches up to its page.
    cut = n // 2 + 3
    other = system[:cut] + [1] + system[cut + 1 :]
    assert t.match_prefix(other).prefix_len == cut - cut % page_size
    # Exactly the edge, and one page short of it.
    assert t.match_prefix(list(system[: n // 2])).prefix_len == n // 2
    assert t.match_prefix(list(system)).prefix_len == n
    t.sanity_check()
    for node in t.nodes():
        assert len(node.klist) == node.klen  # no bound left behind on an edge


# ------------------------------------------------------------------ deferred heap pushes


@pytest.mark.parametrize("policy", ["lru", "mru", "fifo", "lfu"])
def test_eviction_order_follows_the_policy_after_deferred_pushes(policy):
    t = RadixCache(eviction_policy=policy)
    for i, tok in enumerate([10, 20, 30, 40]):
        t.insert([tok], arr(100 + i))
    t.match_prefix([20])
    t.match_prefix([20])
    t.match_prefix([40])
    t.insert([30], arr(102))  # a hit for lfu
    expect = {
        "lru": [10, 20, 40, 30],  # the insert of [30] touches it last
        "mru": [30, 40, 20, 10],
        "fifo": [10, 20, 30, 40],
        "lfu": [10, 20, 40, 30],  # hit counts: 10, 20, 40 once; 30 twice
    }[policy]
    order: list = []
    for _ in range(4):
        before = {c for c in t.root.children}
        assert t.evict(1) == 1
        order.extend(before - set(t.root.children))
        t.sanity_check()
    assert order == expect


def test_a_growing_tree_that_never_evicts_keeps_its_queues_bounded():
    t = RadixCache(page_size=1)
    key: list[int] = []
    for i in range(3000):
        key = key + [i]
        m = t.match_prefix(key)
        t.inc_lock_ref(m.last_node)
        t.insert(key, np.arange(1, len(key) + 1, dtype=np.int32))
        t.dec_lock_ref(m.last_node)
    assert len(t.eviction_candidates()) == 1
    assert t.eviction_queue_size() <= 6 * len(t.eviction_candidates()) + 2049
    t.sanity_check()
    assert t.evict(1) == 1 and t.total_size() == 2999


# ------------------------------------------------------------------ unlock, slot checks


def test_unlock_through_an_unlocked_ancestor_changes_nothing():
    t = RadixCache()
    t.insert([1, 2, 3], arr(10, 11, 12))
    t.insert([1, 2, 4], arr(10, 11, 13))  # splits: [1, 2] -> [3] / [4]
    upper = t.match_prefix([1, 2]).last_node
    leaf = t.match_prefix([1, 2, 3]).last_node
    t.inc_lock_ref(leaf)
    t.dec_lock_ref(upper)  # misuse: releases the ancestor's count from under the leaf
    before = (sizes(t), leaf.lock_ref, upper.lock_ref)
    with pytest.raises(LockError, match="ancestor"):
        t.dec_lock_ref(leaf)
    assert (sizes(t), leaf.lock_ref, upper.lock_ref) == before


@pytest.mark.parametrize(
    "indices",
    [arr(10, -2, 12), arr(-5, 11, 12), np.array([10, 11, -1], np.int64)],
)
def test_negative_slot_anywhere_is_rejected_without_a_limit(indices):
    t = RadixCache()
    t.insert([1, 2], arr(10, 11))
    with pytest.raises(kvjax.InvalidSlotError):
        t.insert([1, 2, 3], indices)
    assert t.total_size() == 2


def test_slot_bounds_with_an_allocator():
    t = RadixCache(page_size=4, token_to_kv_pool_allocator=RecordingAllocator(16, 4))
    for bad in (arr(4, 5, 6, 20), arr(-1, 5, 6, 7), arr(2**31 - 1, 5, 6, 7)):
        with pytest.raises(kvjax.InvalidSlotError):
            t.insert([1, 2, 3, 4], bad)
    assert t.insert([1, 2, 3, 4], arr(16, 17, 18, 19)) == 0
    t.sanity_check()
