"""Stateful property test: ``MambaRadixCache`` (FULL + MAMBA) against a naive model.

The model (``prefix_state_machine.py``, shared with the test component's machine) knows nothing
of nodes: ``pages`` maps every cached page-aligned prefix ``(extra_key, tokens)`` to the KV slots
of its last page; ``states`` maps a prefix to the checkpoint slot after it; ``recency`` records
when each checkpoint was last refreshed (its commit, an insert ending on it, a match ending on it:
never an insert walking over it). From it
follow, exactly: every match (the checkpoint-limited length, the FULL-only length, the slots, the
checkpoint slot), every insert (already-cached length, whether the donated slot comes back), the
per-path cap (shallowest eligible checkpoints dropped), which checkpoints a state eviction frees
and in which order, and what each eviction does to the pages (one allocator call per evicted
node). After every step: ``sanity_check``, both components' sizes against the model, and
``available + evictable + protected == capacity`` for KV slots and for state slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvjax.alloc.state_slots import StateSlotAllocator
from kvjax.radix import MambaRadixCache
from tests.radix._helpers import machine_settings
from tests.radix.prefix_state_machine import (
    EXTRA_KEYS,
    KEYS,
    STATE_CAPACITY,
    PrefixStateMachine,
)

SETTINGS = machine_settings(30)


class RecordingStates(StateSlotAllocator):
    """A state allocator that records its frees, in order."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.freed: list[int] = []

    def free(self, slots: Any) -> None:
        super().free(slots)
        self.freed += np.asarray(slots).reshape(-1).tolist()

    def take(self) -> list[int]:
        out, self.freed = self.freed, []
        return out


class MambaMachine(PrefixStateMachine):
    cap = -1

    @initialize()
    def setup(self):
        ps = self.page_size
        self._start_model(RecordingStates(STATE_CAPACITY))
        self.tree = MambaRadixCache(
            page_size=ps,
            allocator=self.alloc,
            mamba_pool_size=self.state_slots,
            mamba_max_states_per_path=self.cap,
            enable_mamba_extra_buffer=ps > 1,
        )

    # -- model helpers ---------------------------------------------------------------------------

    def _children(self, pos) -> int:
        ek, prefix = pos
        n = len(prefix) + self.page_size
        return sum(1 for k in self.pages if k[0] == ek and len(k[1]) == n and k[1][: len(prefix)] == prefix)

    def _drop_state(self, pos) -> None:
        del self.states[pos]
        del self.recency[pos]

    def _apply_full_frees(self, calls, *, deleting: list | None = None) -> tuple[int, list[int]]:
        """Apply the FULL frees of an eviction: one call = one deleted node (its checkpoint goes too)."""
        owner = {v[0] // self.page_size: k for k, v in self.pages.items()}
        covered = self._covered()
        freed, states_freed = 0, []
        for call in calls:
            chain = self._freed_node(call, owner, covered)
            end = chain[-1]
            assert self._children(end) == 0, "evicted a node with children"
            assert all(e not in self.states for e in chain[:-1]), "a checkpoint inside a node"
            if deleting is not None:
                assert end == deleting.pop(0), "state eviction deleted another node"
            if end in self.states:
                states_freed.append(self.states[end])
                self._drop_state(end)
            for e in chain:
                del self.pages[e]
            freed += len(call)
        return freed, states_freed

    def _evict_full(self, n: int) -> None:
        evictable = self.tree.full_evictable_size()
        self.alloc.take()
        self.state_slots.take()
        result = self.tree.evict(num_tokens=n)
        freed, states_freed = self._apply_full_frees(self.alloc.take_calls())
        assert self.state_slots.take() == states_freed
        assert (result.num_tokens_evicted, result.mamba_num_evicted) == (freed, len(states_freed))
        assert freed >= min(n, evictable) and freed <= evictable

    def _trim(self, tail) -> list[int]:
        """The per-path cap after a checkpoint was committed on ``tail``."""
        if self.cap < 0:
            return []
        ek, key = tail
        holders = [pos for pos in self._prefixes(ek, list(key)) if pos in self.states]
        excess = len(holders) - self.cap
        locked = self._state_locked()
        dropped = []
        for pos in holders:  # shallowest first
            if excess <= 0:
                break
            if pos == tail or pos in locked or self._children(pos) != 1:
                continue
            dropped.append(self.states[pos])
            self._drop_state(pos)
            excess -= 1
        return dropped

    # -- rules -----------------------------------------------------------------------------------

    @rule(pages=KEYS, ek=EXTRA_KEYS, with_state=st.sampled_from([True, True, True, False]))
    def insert(self, pages, ek, with_state):
        self._insert(pages, ek, with_state)

    @rule(which=st.integers(0, 100), more=st.integers(0, 3))
    def extend_seen(self, which, more):
        """A seen key plus one page, with a checkpoint: chains of checkpoints (the per-path cap)."""
        ek, pages = self.seen[which % len(self.seen)]
        self._insert(pages + [more], ek, True)

    def _insert(self, pages, ek, with_state):
        self.seen.append((ek, list(pages)))
        key = self._key(pages)
        values = self._fresh(len(key))
        if values is None:
            return
        slot = None
        if with_state:
            got = self.state_slots.alloc(1)
            slot = None if got is None else int(got[0])
        prefixes = self._prefixes(ek, key)
        walk = 0
        for pos in prefixes:
            if pos not in self.pages:
                break
            walk = len(pos[1])
        self.state_slots.take()
        result = self.tree.insert(key, values, extra_key=ek, mamba_value=slot)
        assert result.prefix_len == walk
        for pos in prefixes:
            if len(pos[1]) > walk:
                end = len(pos[1])
                self.pages[pos] = tuple(values[end - self.page_size : end].tolist())
        trimmed: list[int] = []
        if slot is not None:
            tail = prefixes[-1]
            if tail in self.states:
                assert result.mamba_exist and result.results["mamba"] == slot
                self._touch(tail)
                self.state_slots.free([slot])
                self.state_slots.take()
            else:
                assert not result.mamba_exist
                self.states[tail] = slot
                self._touch(tail)
                trimmed = self._trim(tail)
        assert self.state_slots.take() == trimmed, "the per-path cap freed other checkpoints"
        assert not self.alloc.take(), "insert freed FULL slots: duplicates are the caller's"
        if walk:
            self.alloc.free(values[:walk])
            self.alloc.take()

    def _match(self, key, ek):
        m = self.tree.match_prefix(key, extra_key=ek)
        dev = 0
        best = 0
        for pos in self._prefixes(ek, key):
            if pos not in self.pages:
                break
            dev = len(pos[1])
            if pos in self.states:
                best = dev
        assert (m.full_kv_hit_length, m.prefix_len) == (dev, best)
        self._check_match_slots(m, ek, key, best, m.extras["mamba"].slot)
        return m, best

    @precondition(lambda self: len(self.states) >= 2)
    @rule(k=st.integers(1, 3))
    def evict_states(self, k):
        locked = self._state_locked()
        expected = sorted((p for p in self.states if p not in locked), key=self.recency.__getitem__)[:k]
        self.alloc.take()
        self.state_slots.take()
        result = self.tree.evict(num_tokens=0, mamba_num=k)
        assert self.state_slots.take() == [self.states[p] for p in expected], "not least recent first"
        calls = self.alloc.take_calls()
        freed = 0
        for pos in expected:
            self._drop_state(pos)
            if self._children(pos) or pos in self._covered():
                continue  # a state tombstone: only the slot is freed
            f, _ = self._apply_full_frees([calls.pop(0)], deleting=[pos])
            freed += f
        assert not calls
        assert (result.num_tokens_evicted, result.mamba_num_evicted) == (freed, len(expected))

    # -- invariants ------------------------------------------------------------------------------

    def _check_model(self, covered: set) -> None:
        tree = self.tree
        ps = self.page_size
        assert tree.total_size() == len(self.pages) * ps
        assert tree.full_protected_size() == len(covered) * ps
        assert self.alloc.available_size() + tree.full_evictable_size() + tree.full_protected_size() == self.capacity
        locked = len(self._state_locked())
        assert (tree.mamba_evictable_size(), tree.mamba_protected_size()) == (len(self.states) - locked, locked)
        assert self.state_slots.available_size() + len(self.states) == STATE_CAPACITY
        assert tree.mamba.lru_order() == sorted(
            (tree.mamba.lru_order()), key=lambda n: self.recency[self._pos_of(n)]
        ), "the tree's checkpoint recency differs from the model's"
        assert len(self.states) <= len(self.pages)
        self.state_slots.check_invariants()

    def _pos_of(self, node) -> tuple:
        toks = []
        ek = node.extra_key
        while node is not self.tree.root:
            toks[:0] = node.token_ids()
            node = node.parent
        return (ek, tuple(toks))


@pytest.mark.parametrize("page_size,cap", [(1, -1), (2, -1), (1, 2)])
def test_mamba_tree_matches_model(page_size, cap):
    machine: Any = type(f"MambaMachine_p{page_size}_c{cap}", (MambaMachine,), {"page_size": page_size, "cap": cap})
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
