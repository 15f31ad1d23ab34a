"""A Hypothesis state machine over SWARadixCache with a real SWATokenToKVPoolAllocator.

Random inserts (some with an SWA-evicted prefix the caller freed first), matches, locks, early SWA
releases, unlocks and evictions of either pool. After every step: both components' invariants, the
allocator's, and ``available + evictable + protected == capacity`` for the full and the SWA pool
(no request holds slots between steps here). Each match is checked against the rule written out
naively: it ends at the deepest node of the walked path with no tombstone above it or at least
``W`` live SWA tokens after the last one, and its slots are that path's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.radix import SWARadixCache
from tests.radix.window_machine import WindowTreeMachine


class SWATreeMachine(WindowTreeMachine):
    @initialize(ps=st.sampled_from([1, 2]), window=st.integers(1, 5), eagle=st.booleans())
    def setup(self, ps: int, window: int, eagle: bool) -> None:
        alloc = SWATokenToKVPoolAllocator(24 * ps, 12 * ps, ps)
        tree = SWARadixCache(page_size=ps, sliding_window_size=window, allocator=alloc, is_eagle=eagle)
        self._start(ps, alloc, tree, eagle)

    def _make_room(self, n: int) -> None:
        self.tree.evict(n, n)

    def _free_out_of_window(self, slots: np.ndarray) -> None:
        self.alloc.free_swa(slots)

    def _check_match(self, key: list[int], m: Any) -> None:
        expect, _ = self.naive_match(key)
        assert m.prefix_len <= expect  # the match may split the last node; never longer
        if m.prefix_len:
            assert not self.tree.swa.is_tombstone(m.last_node)
            assert m.indices.tolist() == self.tree.path_slots(m.last_node, m.prefix_len).tolist()
        again, _ = self.naive_match(key)
        assert m.prefix_len == again  # after the split, the naive rule agrees exactly

    @rule(full=st.integers(0, 12), swa=st.integers(0, 12))
    def evict(self, full: int, swa: int) -> None:
        t = self.tree
        fe, se = t.full_evictable_size(), t.swa_evictable_size()
        got_full, got_swa = t.evict(full, swa)
        assert got_full >= min(full, fe)
        if not full:
            assert got_swa >= min(swa, se)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        t, a = self.tree, self.alloc
        t.sanity_check()
        a.check_invariants()
        assert a.full_available_size() + t.full_evictable_size() + t.full_protected_size() == a.size_full
        assert a.swa_available_size() + t.swa_evictable_size() + t.swa_protected_size() == a.size_swa
        assert t.total_size() == (
            t.full_evictable_size() + t.full_protected_size(),
            t.swa_evictable_size() + t.swa_protected_size(),
        )


SWATreeMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSWATreeMachine = SWATreeMachine.TestCase
