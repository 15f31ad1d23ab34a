"""What the FULL + state-slot tree machines share (``test_component_machine.py`` with the test
``StateSlotComponent``, ``test_mamba_machine.py`` with ``MambaRadixCache``).

``PrefixStateMachine`` is a Hypothesis ``RuleBasedStateMachine`` over a naive model that knows
nothing of nodes:

* ``pages``: every cached page-aligned prefix ``(extra_key, tokens[:k * page])`` -> the slots of
  its last page (the component machine also keeps None: host-only);
* ``states``: prefix -> state slot; ``recency``: prefix -> the model's clock when that state was
  last refreshed (``_touch``);
* ``locks``: ``(extra_key, locked prefix, receipt, state position or None)``; ``seen``: the
  ``(extra_key, page list)`` of every inserted key, so later keys land near cached ones.

It holds the model's helpers and the rules whose strategies and bodies the machines share
(``insert_near_seen``, ``match``, ``lock``, ``unlock``, ``evict_full``, ``reset``), and the
invariant ``agrees_with_model``. A subclass builds its tree in an ``@initialize`` rule that first
calls ``_start_model`` with its recording state-slot allocator, and writes ``_insert``, ``_match``,
``_evict_full`` and ``_check_model`` against its tree (and its own rules).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.radix._helpers import RecordingAllocator

PALETTE: dict[int, list[tuple[int, ...]]] = {
    1: [(0,), (1,), (2,), (3,)],
    2: [(0, 0), (0, 1), (1, 1), (2, 3)],
}
CAPACITY_PAGES = 32
STATE_CAPACITY = 6
KEYS = st.lists(st.integers(0, 3), min_size=1, max_size=5)
EXTRA_KEYS = st.sampled_from([None, None, "ns"])
EMPTY_OR_KEYS: st.SearchStrategy[list[int]] = st.one_of(st.just([]), KEYS)
CUTS = st.sampled_from([5, 5, 5, 0, 1, 2, 3])  # pages of a seen key to keep (mostly all)


class PrefixStateMachine(RuleBasedStateMachine):
    """The shared model and rules (module docstring); ``page_size`` is set per test."""

    page_size = 1

    def _start_model(self, state_slots) -> None:
        """An empty model, a fresh recording token allocator ``alloc`` of ``capacity`` slots, and
        ``state_slots``: the state-slot allocator (recording its frees: ``take()``)."""
        ps = self.page_size
        self.alloc = RecordingAllocator(CAPACITY_PAGES * ps, ps)
        self.capacity = self.alloc.available_size()
        self.state_slots = state_slots
        self.pages: dict[tuple, tuple[int, ...] | None] = {}
        self.states: dict[tuple, int] = {}
        self.recency: dict[tuple, int] = {}
        self.clock = 0
        self.locks: list[tuple] = []  # (extra_key, locked prefix, receipt, state position or None)
        self.seen: list[tuple] = [(None, [0])]  # (extra_key, page list) of inserted keys

    # -- model helpers ---------------------------------------------------------------------------

    def _key(self, pages) -> list[int]:
        return [t for p in pages for t in PALETTE[self.page_size][p]]

    def _prefixes(self, ek, key):
        ps = self.page_size
        return [(ek, tuple(key[:end])) for end in range(ps, len(key) // ps * ps + 1, ps)]

    def _touch(self, pos) -> None:
        self.clock += 1
        self.recency[pos] = self.clock

    def _covered(self) -> set:
        out = set()
        for ek, prefix, _, _ in self.locks:
            out.update(self._prefixes(ek, list(prefix)))
        return out

    def _state_locked(self) -> set:
        return {pos for _, _, _, pos in self.locks if pos is not None}

    def _fresh(self, n: int):
        short = n - self.alloc.available_size()
        if short > 0:
            self._evict_full(short)
        got = self.alloc.alloc(n)
        return None if got is None else np.asarray(got, np.int32)

    def _seen(self, which, cut, more):
        """A key near an inserted one: its first ``cut`` pages, then ``more``."""
        ek, pages = self.seen[which % len(self.seen)]
        return ek, pages[: cut % (len(pages) + 1)] + more

    def _freed_node(self, call: list[int], owner: dict[int, tuple], covered: set) -> list[tuple]:
        """The model prefixes (shortest first) of the one node an eviction freed with the
        allocator call ``call``: whole pages (``owner``: page -> prefix ending on it), none of
        them ``covered`` by a lock, each one page longer than the one before."""
        ps = self.page_size
        chain = sorted((owner[p] for p in sorted({s // ps for s in call})), key=lambda k: len(k[1]))
        end = chain[-1]
        assert all(e not in covered for e in chain), f"evicted a locked prefix {end}"
        assert len(call) == len(chain) * ps
        for a, b in zip(chain, chain[1:], strict=False):
            assert b[1][: len(a[1])] == a[1] and len(b[1]) == len(a[1]) + ps, "not one node"
        return chain

    def _check_match_slots(self, m, ek, key, best: int, state_slot) -> None:
        """A match of ``key`` that ends at ``best`` (the model's answer) returns the model's KV
        slots up to there and, when ``best`` > 0, the state slot cached there (which the match
        refreshes); otherwise no state slot and the root."""
        expected = [s for pos in self._prefixes(ek, key)[: best // self.page_size] for s in self.pages[pos] or ()]
        assert m.indices.tolist() == expected
        if best:
            pos = (ek, tuple(key[:best]))
            assert state_slot == self.states[pos]
            self._touch(pos)
        else:
            assert state_slot is None and m.last_node is self.tree.root

    def _lock_near_seen(self, which, cut, more) -> None:
        """Lock the match of a key near an inserted one; the model's lock covers the match and,
        when it ends on a state, that state."""
        ek, pages = self._seen(which, cut, more[:1])
        key = self._key(pages)
        m, best = self._match(key, ek)
        receipt = self.tree.inc_lock_ref(m.last_node)
        self.locks.append((ek, tuple(key[:best]), receipt, (ek, tuple(key[:best])) if best else None))

    # -- what each machine writes against its tree -----------------------------------------------

    def _insert(self, pages, ek, with_state) -> None:
        raise NotImplementedError

    def _match(self, key, ek):
        raise NotImplementedError

    def _evict_full(self, n: int) -> None:
        raise NotImplementedError

    def _check_model(self, covered: set) -> None:
        """After every step, once the tree's own invariants hold: its sizes (and what else the
        machine checks) against the model; ``covered``: the prefixes the model's locks cover."""
        raise NotImplementedError

    # -- shared rules ----------------------------------------------------------------------------

    @rule(which=st.integers(0, 100), cut=st.integers(0, 5), more=KEYS, with_state=st.booleans())
    def insert_near_seen(self, which, cut, more, with_state):
        ek, pages = self._seen(which, cut, more[:2])
        self._insert(pages, ek, with_state)

    @rule(pages=KEYS, ek=EXTRA_KEYS)
    def match(self, pages, ek):
        self._match(self._key(pages), ek)

    @rule(which=st.integers(0, 100), cut=CUTS, more=EMPTY_OR_KEYS)
    def lock(self, which, cut, more):
        self._lock_near_seen(which, cut, more)

    @precondition(lambda self: self.locks)
    @rule(which=st.integers(0, 100))
    def unlock(self, which):
        _, _, receipt, _ = self.locks.pop(which % len(self.locks))
        self.tree.dec_lock_ref(receipt)

    @precondition(lambda self: len(self.pages) >= 6)
    @rule(n=st.integers(1, 8))
    def evict_full(self, n):
        self._evict_full(n * self.page_size)

    @precondition(lambda self: not self.locks and len(self.pages) >= 12)
    @rule()
    def reset(self):
        """``reset`` frees every device page and every state, and nothing else."""
        self.alloc.take()
        self.state_slots.take()
        self.tree.reset()
        freed = sorted(self.alloc.take())
        assert freed == sorted(s for v in self.pages.values() if v is not None for s in v)
        assert sorted(self.state_slots.take()) == sorted(self.states.values())
        self.pages.clear()
        self.states.clear()
        self.recency.clear()

    # -- invariant -------------------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self):
        if hasattr(self, "tree"):
            self.tree.check_invariants()
            self._check_model(self._covered())
