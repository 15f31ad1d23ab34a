"""Stateful property test: a tree with FULL and the test state component against a naive model.

``StateSlotComponent`` (``state_component.py``) uses every hook of the component interface:
its own tombstones, its own recency, insert payloads, the insert-overlap and commit hooks,
match finalisation, its own lock scope and node residency (host-only nodes). Hypothesis drives
inserts (with or without a donated state slot), matches, locks, unlocks, FULL eviction, state
eviction and reset in random orders. The model (``prefix_state_machine.py``, shared with the Mamba
tree's machine) knows nothing of nodes:

* ``pages``: every cached page-aligned prefix ``(extra_key, elems[:k * page])`` -> the slots of
  its last page, or None while host-only (device copy evicted, kept because of a state);
* ``states``: prefix -> state slot; ``recency``: prefix -> the model's clock when the state was
  last refreshed (inserts walking over it, commits, matches ending on it).

From it follow, exactly: every match (device length, state-limited length, slots, the state
slot, the host-hit length, ``full_kv_hit_length``), every insert (already-cached length, the
slots the tree takes, whether the donated slot comes back), which states a state eviction frees
and in which order (least recent unlocked first), and what each eviction does to the pages (the
FULL allocator is freed one call per node, so each call names one node: it is deleted or kept
host-only by the cascade rules of ``component.py``). After every step: ``check_invariants``, sizes
per component against the model, and ``available + evictable + protected == capacity`` for both
resources (FULL slots and state slots).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvjax.radix import RadixCache
from tests.radix._helpers import machine_settings
from tests.radix.prefix_state_machine import (
    CUTS,
    EMPTY_OR_KEYS,
    EXTRA_KEYS,
    STATE_CAPACITY,
    PrefixStateMachine,
)
from tests.radix.state_component import StatePool, StateSlotComponent

SETTINGS = machine_settings(50)


class ComponentMachine(PrefixStateMachine):
    @initialize()
    def setup(self):
        self._start_model(StatePool(STATE_CAPACITY))
        self.tree = RadixCache(
            page_size=self.page_size,
            token_to_kv_pool_allocator=self.alloc,
            components=[StateSlotComponent(self.state_slots)],
        )

    # -- model helpers ---------------------------------------------------------------------------

    def _extends(self, pos) -> bool:
        ek, prefix = pos
        n = len(prefix) + self.page_size
        return any(k[0] == ek and len(k[1]) == n and k[1][: len(prefix)] == prefix for k in self.pages)

    def _walk(self, ek, key):
        """(cached length incl. host-only, device length) along ``key``."""
        walk = dev = 0
        for pos in self._prefixes(ek, key):
            if pos not in self.pages:
                break
            walk = len(pos[1])
            if self.pages[pos] is not None and dev == walk - self.page_size:
                dev = walk
        return walk, dev

    def _page_owner(self) -> dict[int, tuple]:
        return {v[0] // self.page_size: k for k, v in self.pages.items() if v is not None}

    def _drop_host_leaves(self) -> None:
        """Host-only prefixes no longer extended and holding no state leave (the cascade)."""
        changed = True
        while changed:
            changed = False
            for pos in [k for k, v in self.pages.items() if v is None]:
                if pos not in self.states and not self._extends(pos):
                    del self.pages[pos]
                    changed = True

    def _apply_full_frees(self, calls, *, deleting: list | None = None) -> int:
        """Apply the FULL frees of an eviction: one call = one node, whole pages, unlocked."""
        owner = self._page_owner()
        covered = self._covered()
        freed = 0
        for call in calls:
            chain = self._freed_node(call, owner, covered)
            end = chain[-1]
            if deleting is not None:
                assert end == deleting.pop(0), "state eviction deleted another node"
                keep = False
            else:
                keep = end in self.states or self._extends(end)
            for e in chain:
                if keep:
                    self.pages[e] = None
                else:
                    del self.pages[e]
            freed += len(call)
        return freed

    def _evict_full(self, n: int) -> None:
        evictable = self.tree.evictable_size()
        self.alloc.take()
        counts = self.tree.evict({"full": n})
        freed = self._apply_full_frees(self.alloc.take_calls())
        assert counts == {"full": freed, "state": 0}, counts
        assert freed >= min(n, evictable) and freed <= evictable
        assert not self.state_slots.take(), "FULL eviction freed a state"

    # -- rules -----------------------------------------------------------------------------------

    @rule(pages=EMPTY_OR_KEYS, ek=EXTRA_KEYS, with_state=st.sampled_from([True, True, True, False]))
    def insert(self, pages, ek, with_state):
        self._insert(pages, ek, with_state)

    def _insert(self, pages, ek, with_state):
        self.seen.append((ek, list(pages)))
        key = self._key(pages)
        n = len(key)
        values = self._fresh(n)
        if values is None:
            return
        slot = self.state_slots.alloc() if with_state else None
        prefixes = self._prefixes(ek, key)
        walk, _ = self._walk(ek, key)
        result = self.tree.insert_with(key, values, extra_key=ek, payloads={"state": slot} if with_state else None)
        assert result.prefix_len == walk
        # Model: host-only pages on the path come back to device with the incoming slots;
        # states on the walked path are refreshed top-down; the end commits the donated slot.
        taken: set[int] = set()
        for pos in prefixes:
            end = len(pos[1])
            if end <= walk:
                if self.pages[pos] is None:
                    self.pages[pos] = tuple(values[end - self.page_size : end].tolist())
                    taken.update(range(end - self.page_size, end))
                if pos in self.states:
                    self._touch(pos)
            else:
                self.pages[pos] = tuple(values[end - self.page_size : end].tolist())
        handed_back = result.results["state"]
        if with_state:
            tail: tuple | None = prefixes[-1] if prefixes else None
            if tail is None or tail in self.states:
                assert handed_back == slot, "an end node with a state keeps it and hands the slot back"
                if tail is not None:
                    self._touch(tail)
                if slot is not None:
                    self.state_slots.free(slot)
                    self.state_slots.take()
            else:
                assert handed_back is None
                if slot is not None:
                    self.states[tail] = slot
                    self._touch(tail)
        dup = [int(values[i]) for i in range(walk) if i not in taken]
        assert not self.alloc.take(), "insert freed FULL slots: duplicates are the caller's"
        if dup:
            self.alloc.free(np.asarray(dup, np.int32))
            self.alloc.take()

    def _match(self, key, ek):
        m = self.tree.match_prefix(key, extra_key=ek)
        walk, dev = self._walk(ek, key)
        best = 0
        for pos in self._prefixes(ek, key):
            if len(pos[1]) <= dev and pos in self.states:
                best = len(pos[1])
        extras = m.extras["state"]
        assert m.full_kv_hit_length == m.device_kv_hit_length == dev, (m.full_kv_hit_length, dev)
        assert m.prefix_len == best, (m.prefix_len, best, dev)
        assert extras["host_hit_length"] == walk - dev
        self._check_match_slots(m, ek, key, best, extras["slot"])
        return m, best

    @rule(which=st.integers(0, 100), cut=CUTS, more=EMPTY_OR_KEYS)
    def match_near_seen(self, which, cut, more):
        ek, pages = self._seen(which, cut, more[:1])
        self._match(self._key(pages), ek)

    @precondition(lambda self: len(self.states) >= 3)
    @rule(k=st.integers(1, 3))
    def evict_states(self, k):
        locked = self._state_locked()
        order = sorted((pos for pos in self.states if pos not in locked), key=self.recency.__getitem__)
        expected = order[:k]
        self.alloc.take()
        counts = self.tree.evict({"state": k})
        assert self.state_slots.take() == [self.states[pos] for pos in expected], "not least recent first"
        calls = self.alloc.take_calls()
        freed = 0
        for pos in expected:  # in the component's order: each decision sees the earlier ones
            del self.states[pos]
            if self._extends(pos) or pos in self._covered():
                continue  # a tombstone: only the state slot is freed
            if self.pages[pos] is not None:  # a device leaf: deleted outright, FULL KV included
                assert calls, f"state eviction of the leaf {pos} freed no FULL slots"
                freed += self._apply_full_frees([calls.pop(0)], deleting=[pos])
            self._drop_host_leaves()  # a host-only leaf goes, with host-only parents it leaves bare
        assert not calls, "state eviction freed FULL slots of nodes it did not delete"
        assert counts == {"full": freed, "state": len(expected)}, counts

    @rule(how=st.sampled_from(["name", "negative"]))
    def bad_evict_raises(self, how):
        before = self.tree.sizes()
        with pytest.raises(ValueError):
            self.tree.evict({"swa": 1} if how == "name" else {"state": -1})
        assert self.tree.sizes() == before

    # -- invariants ------------------------------------------------------------------------------

    def _check_model(self, covered: set) -> None:
        tree = self.tree
        ps = self.page_size
        device = [k for k, v in self.pages.items() if v is not None]
        full, state = tree.sizes()["full"], tree.sizes()["state"]
        assert full.total == len(device) * ps == tree.total_size()
        assert full.protected == len(covered) * ps == tree.protected_size()
        assert self.alloc.available_size() + full.evictable + full.protected == self.capacity
        assert state.total == len(self.states) == tree.total_size("state")
        assert state.protected == len(self._state_locked()) == tree.protected_size("state")
        assert self.state_slots.available_size() + state.evictable + state.protected == self.state_slots.capacity
        assert (tree.host_only_count > 0) == any(v is None for v in self.pages.values())


@pytest.mark.parametrize("page_size", [1, 2])
def test_component_tree_matches_model(page_size):
    machine: Any = type(f"ComponentMachine_p{page_size}", (ComponentMachine,), {"page_size": page_size})
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
