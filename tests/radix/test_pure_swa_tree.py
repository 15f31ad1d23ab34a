"""PureSWARadixCache: the one-pool SWA tree of models whose every layer is sliding-window.

Scenarios with exact slot ids (window 4, page 1 and 2), SGLang bug #31486 (KV already evicted
from the window must never be re-inserted or freed twice, even once its ids belong to another
request), tombstone revival, eviction and tombstone-leaf pruning, the request lifecycle with
window freeing, bad input, and a Hypothesis state machine with one-pool accounting after every
step and each match checked against the rule written out naively.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvjax.alloc import SWATokenToKVPoolAllocator, make_allocator
from kvjax.errors import ConfigError
from kvjax.radix import LockError, PureSWARadixCache, TreeOptions, create_tree_cache
from kvjax.request import Req
from tests.radix._helpers import WindowHarness
from tests.radix.window_machine import WindowTreeMachine


def shape(tree: PureSWARadixCache) -> list[tuple[list[int], list[int]]]:
    """(tokens, slot ids) of every node, DFS in child-key order (zeros: a tombstone)."""
    out = []

    def walk(node):
        for ck in sorted(node.children, key=repr):
            child = node.children[ck]
            out.append((child.token_ids(), child.value.tolist()))
            walk(child)

    walk(tree.root)
    return out


def balanced(tree: PureSWARadixCache, alloc, held: int = 0) -> bool:
    tree.sanity_check()
    alloc.check_invariants()
    return alloc.available_size() + tree.evictable_size() + tree.protected_size() + held == alloc.size


# --------------------------------------------------------------------------- scenarios


def test_insert_with_an_evicted_prefix_stores_tombstones_and_frees_nothing_twice():
    alloc = make_allocator(32, 1)
    t = PureSWARadixCache(page_size=1, sliding_window_size=4, allocator=alloc)
    slots = alloc.alloc(12)
    assert slots is not None and slots.tolist() == list(range(1, 13))
    alloc.free(slots[:8])  # decode freed the out-of-window slots
    assert t.insert(list(range(1, 13)), slots, swa_evicted_seqlen=8) == 0
    assert shape(t) == [(list(range(1, 9)), [0] * 8), ([9, 10, 11, 12], [9, 10, 11, 12])]
    assert (t.evictable_size(), t.protected_size(), t.total_size()) == (4, 0, 4)
    assert t.evictable_size("full") == 12  # key tokens, the tombstone's included (no KV)
    assert balanced(t, alloc)
    assert t.match_prefix(list(range(1, 13))).prefix_len == 12  # the last window is live
    assert t.match_prefix(list(range(1, 9))).prefix_len == 0  # ends in the tombstone
    m = t.match_prefix(list(range(1, 13)))
    assert m.indices.tolist() == [0] * 8 + [9, 10, 11, 12]  # out-of-window positions: the trash slot


def test_revival_takes_the_incoming_slots_and_frees_the_duplicates():
    alloc = make_allocator(32, 1)
    t = PureSWARadixCache(page_size=1, sliding_window_size=4, allocator=alloc)
    first = alloc.alloc(12)
    alloc.free(first[:8])
    t.insert(list(range(1, 13)), first, swa_evicted_seqlen=8)
    second = alloc.alloc(12)
    assert second is not None
    assert t.insert(list(range(1, 13)), second) == 12
    # The tombstone took second[:8]; second[8:] duplicated live slots and were freed.
    assert shape(t) == [(list(range(1, 9)), second[:8].tolist()), ([9, 10, 11, 12], first[8:].tolist())]
    assert t.match_prefix(list(range(1, 9))).prefix_len == 8
    assert (t.evictable_size(), alloc.available_size()) == (12, 32 - 12)
    assert balanced(t, alloc)


def test_swa_eviction_tombstones_internal_nodes_deletes_leaves_and_prunes_tombstone_leaves():
    alloc = make_allocator(32, 1)
    t = PureSWARadixCache(page_size=1, sliding_window_size=4, allocator=alloc)
    a = alloc.alloc(8)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], a)  # capped: [1..4] -> [5..8]
    b = alloc.alloc(8)
    t.insert([1, 2, 3, 4, 50, 60, 70, 80], b)  # b[:4] duplicates [1..4]: freed
    assert alloc.available_size() == 32 - 12
    r = t.inc_lock_ref(t.match_prefix([1, 2, 3, 4, 50, 60, 70, 80]).last_node)
    # Least recent first: [5..8] is an unlocked leaf (deleted); [1..4] is FULL-locked under the
    # lock but outside its SWA window, so it becomes a tombstone.
    assert t.evict(8) == 8
    assert shape(t) == [([1, 2, 3, 4], [0] * 4), ([50, 60, 70, 80], b[4:].tolist())]
    assert t.match_prefix([1, 2, 3, 4, 50, 60, 70, 80]).prefix_len == 8
    assert (t.evictable_size(), t.protected_size()) == (0, 4)
    assert balanced(t, alloc)
    t.dec_lock_ref(r)
    assert t.evict(4) == 4  # the [50..80] leaf; then the unlocked tombstone leaf [1..4] is pruned
    assert shape(t) == [] and alloc.available_size() == 32
    assert balanced(t, alloc)


def test_pages_of_two():
    alloc = make_allocator(32, 2)
    t = PureSWARadixCache(page_size=2, sliding_window_size=3, allocator=alloc)  # cap: 4 tokens
    slots = alloc.alloc(10)
    assert slots is not None
    alloc.free(slots[:4])
    t.insert(list(range(1, 11)), slots, swa_evicted_seqlen=4)
    assert shape(t) == [
        ([1, 2, 3, 4], [0] * 4),
        ([5, 6], slots[4:6].tolist()),
        ([7, 8, 9, 10], slots[6:].tolist()),
    ]
    assert t.match_prefix(list(range(1, 11))).prefix_len == 10
    assert t.match_prefix(list(range(1, 7))).prefix_len == 0  # 2 live tokens after the tombstone < 3
    assert balanced(t, alloc)
    with pytest.raises(ValueError, match="not page aligned"):
        t.insert(list(range(1, 11)), slots, swa_evicted_seqlen=3)
    assert balanced(t, alloc)


def test_standalone_simulation():
    t = PureSWARadixCache(page_size=1, sliding_window_size=2)
    t.insert([1, 2, 3, 4, 5, 6], swa_evicted_seqlen=2)
    assert [v == [0] * len(v) for _, v in shape(t)] == [True, False, False]
    assert t.insert([1, 2, 3, 4, 5, 6]) == 6  # revives [1, 2] with synthesized slots
    assert all(0 not in v for _, v in shape(t))
    assert t.evict(6) == 6 and shape(t) == []
    t.sanity_check()


def test_bad_input_is_refused_and_changes_nothing():
    with pytest.raises(ConfigError, match="SWATokenToKVPoolAllocator"):
        PureSWARadixCache(page_size=1, sliding_window_size=4, allocator=SWATokenToKVPoolAllocator(8, 8, 1))
    with pytest.raises(ConfigError, match="page size"):
        PureSWARadixCache(page_size=1, sliding_window_size=4, allocator=make_allocator(8, 2))
    with pytest.raises(ConfigError, match="sliding_window_size"):
        PureSWARadixCache(page_size=1, allocator=make_allocator(8, 1))
    alloc = make_allocator(16, 1)
    t = PureSWARadixCache(page_size=1, sliding_window_size=4, allocator=alloc)
    slots = alloc.alloc(6)
    t.insert([1, 2, 3, 4, 5, 6], slots)
    before = (t.pretty_print(), shape(t), alloc.available_size())
    for e in (7, -1, 2.0):
        with pytest.raises(ValueError, match="swa_evicted_seqlen"):
            t.insert([1, 2, 3, 4, 5, 6, 7], np.arange(1, 8), swa_evicted_seqlen=e)
    with pytest.raises(ValueError, match="num_tokens"):
        t.evict(-1)
    r = t.inc_lock_ref(t.match_prefix([1, 2, 3, 4, 5, 6]).last_node)
    t.dec_lock_ref(r)
    with pytest.raises(LockError):
        t.dec_lock_ref(r)
    assert (t.pretty_print(), shape(t), alloc.available_size()) == before


def test_registry_builds_it_for_pure_swa_plans():
    options = TreeOptions(tree_cache_kind="pure_swa_radix", tree_components=("swa",), sliding_window_size=4)
    alloc = make_allocator(16, 1)
    tree = create_tree_cache(options, token_to_kv_pool_allocator=alloc)
    assert isinstance(tree, PureSWARadixCache) and tree.sliding_window_size == 4
    with pytest.raises(NotImplementedError, match="host tier"):
        create_tree_cache(replace(options, attach_host_tier=True), token_to_kv_pool_allocator=alloc)


# --------------------------------------------------------------------------- request lifecycle


class Harness(WindowHarness):
    def __init__(self, size: int = 32, page_size: int = 1, window: int = 4) -> None:
        super().__init__(PureSWARadixCache, make_allocator(size, page_size), window, page_size)

    def leave_window(self, req: Req, upto: int) -> None:
        """Decode frees the request's own slots before ``upto`` with a plain ``free`` (the row keeps
        the stale ids, as a careless caller's would)."""
        row = self.pool.req_to_token[req.req_pool_idx]
        start = max(req.swa_evicted_seqlen, req.cache_protected_len)  # the tree's prefix is not its own
        if upto > start:
            self.alloc.free(row[start:upto])
            req.swa_evicted_seqlen = upto


def test_sglang_31486_freed_window_slots_are_neither_reinserted_nor_freed_twice():
    h = Harness()
    r1 = h.start(list(range(100, 112)))
    h.leave_window(r1, 6)
    # Another request now owns the ids r1 freed (FIFO token allocator: they come back last, so
    # drain the free list until they are handed out).
    other = h.alloc.alloc(h.alloc.available_size())
    assert other is not None and set(range(1, 7)) <= set(other.tolist())
    h.finish(r1)
    # The tree holds zeros for [0, 6), r1's live slots after; the other owner's ids are untouched.
    assert [v for _, v in shape(h.tree)] == [[0] * 6, [7, 8], [9, 10, 11, 12]]
    assert h.alloc.available_size() == 0
    h.alloc.free(other)
    assert balanced(h.tree, h.alloc)


@pytest.mark.parametrize("insert", [True, False])
def test_lifecycle_with_window_freeing_reuse_and_retraction(insert: bool):
    h = Harness()
    prompt = list(range(100, 112))
    r1 = h.start(prompt)
    h.leave_window(r1, 8)
    assert balanced(h.tree, h.alloc, held=4)
    h.finish(r1, insert)
    assert balanced(h.tree, h.alloc)
    r2 = h.start(prompt + [5, 6])
    assert r2.cache_protected_len == (12 if insert else 0)
    row = h.pool.req_to_token[r2.req_pool_idx]
    if insert:
        assert row[:8].tolist() == [0] * 8  # the trash slot where the window has passed
        assert h.tree.protected_size() == 4  # the SWA lock covers the last window only
    h.tree.cache_unfinished_req(r2)
    assert balanced(h.tree, h.alloc)
    h.leave_window(r2, 10)
    h.finish(r2)
    assert balanced(h.tree, h.alloc)
    assert h.tree.match_prefix(prompt + [5, 6]).prefix_len == 14


# --------------------------------------------------------------------------- state machine


class PureSWATreeMachine(WindowTreeMachine):
    @initialize(ps=st.sampled_from([1, 2]), window=st.integers(1, 5))
    def setup(self, ps: int, window: int) -> None:
        alloc = make_allocator(16 * ps, ps)
        self._start(ps, alloc, PureSWARadixCache(page_size=ps, sliding_window_size=window, allocator=alloc))

    def _make_room(self, n: int) -> None:
        self.tree.evict(n)

    def _free_out_of_window(self, slots: np.ndarray) -> None:
        self.alloc.free(slots)

    def _check_match(self, key: list[int], m: Any) -> None:
        assert m.prefix_len == self.naive_match(key)[0]  # after any split the rule agrees exactly
        if m.prefix_len:
            window = m.indices[max(0, m.prefix_len - self.tree.sliding_window_size) :]
            assert (window != 0).all()  # the last window of a match is live KV

    @rule(amount=st.integers(0, 12))
    def evict(self, amount: int) -> None:
        evictable = self.tree.evictable_size()
        assert self.tree.evict(amount) >= min(amount, evictable)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "tree"):
            assert balanced(self.tree, self.alloc)


PureSWATreeMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPureSWATreeMachine = PureSWATreeMachine.TestCase
