"""Stateful property test: `RadixCache` against a naive model of what it must have cached.

Hypothesis drives insert / match / lock / unlock / evict / reset and the request lifecycle
(start, decode, `cache_unfinished_req`, `cache_finished_req` with and without insert) in random
orders. The reference model is a dictionary from every cached page-aligned prefix
``(extra_key, key elements[:k * page_size])`` to the slot ids of its last page (key elements
are the tokens, or with EAGLE the bigrams ``(t[i], t[i + 1])``). From it follows, without
looking inside the tree:

* what ``match_prefix`` must return (the longest prefix whose every page is cached, and those
  slots, in order);
* what ``insert`` must return (the part already cached) and which slots the tree keeps;
* what the tree must free, and only that: a request's duplicates and unaligned tail, the pages
  of evicted prefixes, everything on ``reset``; never a page a lock or a request still needs;
* ``protected_size()``: the tokens of the union of every locked prefix;
* errors: unlocking an unlocked node, releasing a receipt twice, bad slot ids -- each raises
  and changes nothing.

After every step: ``sanity_check()``, ``evictable + protected == total``, ``total`` equal to
the model, and with an allocator ``available + total + held by live requests == capacity``.

Vocabularies are tiny (pages drawn from a palette of four, two of which share their first half)
so prefixes collide, nodes split, and partial pages must not match.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvjax.radix import RadixCache
from kvjax.req_pool import ReqToTokenPool
from kvjax.request import Req
from tests.radix._helpers import RecordingAllocator, machine_settings

MAX_LIVE_REQUESTS = 4


def rows_of(req: Req) -> int:
    """The request's row (every live request of the machine has one)."""
    assert req.req_pool_idx is not None
    return req.req_pool_idx


MAX_PAGES_PER_KEY = 6

# A page of tokens is drawn from this palette. At page size 16, pages 0 and 1 share their first
# 8 tokens, so a key that diverges inside a page must stop matching at the page before.
PALETTE: dict[int, list[tuple[int, ...]]] = {
    1: [(0,), (1,), (2,), (3,)],
    16: [(0,) * 16, (0,) * 8 + (1,) * 8, (1,) * 16, (2, 3) * 8],
}
# Slots the allocator holds, per page size: small enough that eviction happens often.
CAPACITY_TOKENS = {1: 48, 16: 24 * 16}

KEY_PARTS = st.tuples(
    st.lists(st.integers(0, 3), max_size=MAX_PAGES_PER_KEY),  # whole pages from the palette
    st.integers(0, 3),  # which palette page the unaligned tail is cut from
    st.integers(0, 15),  # tail length (taken modulo the page size)
)
EXTRA_KEYS = st.sampled_from([None, None, "lora-a"])
PRIORITIES = st.integers(0, 3)

SETTINGS = machine_settings(30)


# ---------------------------------------------------------------------------------------------
# The reference model.


class PrefixModel:
    """``(extra_key, page-aligned prefix of key elements) -> slots of its last page``."""

    def __init__(self, page_size: int):
        self.ps = page_size
        self.pages: dict[tuple, tuple[int, ...]] = {}

    def match(self, extra_key, elems) -> tuple[int, list[int]]:
        ps, length = self.ps, 0
        slots: list[int] = []
        for end in range(ps, len(elems) // ps * ps + 1, ps):
            page = self.pages.get((extra_key, tuple(elems[:end])))
            if page is None:
                break
            slots.extend(page)
            length = end
        return length, slots

    def insert(self, extra_key, elems, values) -> int:
        """Adds the pages not cached yet; returns the length that was already cached."""
        assert len(elems) % self.ps == 0
        length, _ = self.match(extra_key, elems)
        for end in range(length + self.ps, len(elems) + 1, self.ps):
            self.pages[(extra_key, tuple(elems[:end]))] = tuple(int(v) for v in values[end - self.ps : end])
        return length

    def tokens(self) -> int:
        return len(self.pages) * self.ps

    def covered(self, locked_prefixes) -> set:
        out = set()
        for extra_key, prefix in locked_prefixes:
            for end in range(self.ps, len(prefix) + 1, self.ps):
                out.add((extra_key, tuple(prefix[:end])))
        return out

    def page_of_entry(self) -> dict[int, tuple]:
        return {v[0] // self.ps: k for k, v in self.pages.items()}


class _Live:
    """A request the machine has started and not finished."""

    def __init__(self, req, extra_key, prompt, n_kv):
        self.req = req
        self.extra_key = extra_key
        self.tokens = list(prompt)  # prompt, then generated tokens
        self.n_kv = n_kv  # leading tokens whose KV slot is in the request's row


# ---------------------------------------------------------------------------------------------


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"
    with_pools = True
    is_eagle = False

    @initialize()
    def setup(self):
        ps = self.page_size
        self.ex = 1 if self.is_eagle else 0
        self.model = PrefixModel(ps)
        self.locks: list[tuple] = []  # (extra_key, locked prefix of elements, node, receipt)
        self.released: list = []  # receipts already handed back
        self.live: list[_Live] = []
        self.held = 0  # slots allocated to live requests and not (yet) owned by the tree
        self.next_page = 1  # standalone mode: fresh page ids for inserted values
        self.rid = 0
        kwargs: dict[str, Any] = {"page_size": ps, "eviction_policy": self.policy}
        if self.is_eagle:
            kwargs["is_eagle"] = True
        if self.with_pools:
            size = CAPACITY_TOKENS[ps]
            self.alloc = RecordingAllocator(size, ps)
            width = (MAX_PAGES_PER_KEY + 1) * ps * 3
            rows = MAX_LIVE_REQUESTS + 1
            self.req_pool = ReqToTokenPool(rows, width)
            self.capacity = self.alloc.available_size()
            kwargs.update(token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.req_pool)
        else:
            self.alloc = self.req_pool = None  # type: ignore[assignment]  # standalone: no pools
        self.tree = RadixCache(**kwargs)

    # -- helpers --------------------------------------------------------------------------------

    def _key(self, parts) -> list[int]:
        pages, tail_page, tail_len = parts
        palette = PALETTE[self.page_size]
        key = [t for p in pages for t in palette[p]]
        return key + list(palette[tail_page][: tail_len % self.page_size])

    def _elems(self, tokens) -> list:
        """Key elements of ``tokens``: the tokens, or their bigrams with EAGLE."""
        tokens = list(tokens)
        return list(zip(tokens, tokens[1:], strict=False)) if self.is_eagle else tokens

    def _aligned_len(self, n_tokens: int) -> int:
        """Key elements the tree caches for ``n_tokens`` tokens."""
        n = max(0, n_tokens - self.ex)
        return n - n % self.page_size

    def _pages(self, slots) -> Counter:
        """The distinct pages of ``slots``, each counted once."""
        return Counter({int(s) // self.page_size for s in np.asarray(slots).reshape(-1)})

    def _freed_pages(self) -> Counter:
        """Pages the tree freed since the last look, each ``free`` call counting a page once
        (several slots of one page free it once); a slot twice in one call is an error."""
        out: Counter = Counter()
        for slots in self.alloc.take_calls():
            assert len(slots) == len(set(slots)), f"one free() call names a slot twice: {sorted(slots)}"
            out.update({s // self.page_size for s in slots})
        return out

    def _sizes(self) -> tuple[int, int, int]:
        return (self.tree.evictable_size(), self.tree.protected_size(), self.tree.total_size())

    def _fresh_values(self, n_tokens: int) -> np.ndarray | None:
        """Page-structured slot ids for ``n_tokens`` (a multiple of the page size)."""
        ps = self.page_size
        if self.alloc is None:
            pages = np.arange(self.next_page, self.next_page + n_tokens // ps)
            self.next_page += n_tokens // ps
            return (pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
        if n_tokens == 0:
            return np.zeros(0, np.int32)
        short = n_tokens - self.alloc.available_size()
        if short > 0:
            self._evict_and_sync(short)
        got = self.alloc.alloc(n_tokens)
        if got is None:
            return None
        got = np.asarray(got).reshape(-1)
        assert len(got) == n_tokens, (len(got), n_tokens)
        assert 0 not in set((got // ps).tolist()), f"allocator handed out the trash page: {got}"
        heads = got[::ps]
        assert (got == (heads[:, None] + np.arange(ps)).reshape(-1)).all() and (heads % ps == 0).all()
        return got.astype(np.int32)

    def _match(self, key, extra_key):
        """``match_prefix`` checked against the model; returns (result, matched length)."""
        m = self.tree.match_prefix(key, extra_key=extra_key)
        length, slots = self.model.match(extra_key, self._elems(key))
        assert m.prefix_len == length, (m.prefix_len, length, extra_key, key)
        assert isinstance(m.indices, np.ndarray) and m.indices.dtype == np.int32, m.indices
        assert m.indices.tolist() == slots, (m.indices.tolist(), slots)
        return m, length

    def _locked_prefixes(self):
        out = [(ek, prefix) for ek, prefix, _, _ in self.locks]
        for lv in self.live:
            out.append((lv.extra_key, tuple(self._elems(lv.tokens)[: lv.req.cache_protected_len])))
        return out

    def _evict_and_sync(self, num_tokens: int) -> int:
        evictable = self.tree.evictable_size()
        protected_pages = self.model.covered(self._locked_prefixes())
        evicted = self.tree.evict(num_tokens)
        assert evicted >= min(num_tokens, evictable), (evicted, num_tokens, evictable)
        assert evicted <= evictable, (evicted, evictable)
        assert self.tree.evictable_size() == evictable - evicted
        if self.alloc is not None:
            freed = self._freed_pages()
            assert all(c == 1 for c in freed.values()), f"page freed twice by one eviction: {freed}"
            owner = self.model.page_of_entry()
            gone = []
            for page in freed:
                assert page in owner, f"evict freed page {page}, which no cached prefix holds"
                gone.append(owner[page])
            for entry in gone:
                assert entry not in protected_pages, f"evict freed a locked prefix: {entry}"
                del self.model.pages[entry]
            assert len(gone) * self.page_size == evicted, (len(gone), evicted)
        else:
            assert self._resync_by_matching() == evicted
        # What is left stays prefix-closed: eviction only ever removes leaves.
        for ek, prefix in self.model.pages:
            if len(prefix) > self.page_size:
                assert (ek, prefix[: -self.page_size]) in self.model.pages, ("orphan", ek, prefix)
        return evicted

    def _resync_by_matching(self) -> int:
        """Standalone trees free nothing: find what is still cached by matching every entry."""
        ps, before = self.page_size, self.model.tokens()
        for ek, prefix in sorted(self.model.pages, key=lambda k: len(k[1])):
            if (ek, prefix) not in self.model.pages:
                continue
            tokens = [e[0] for e in prefix] + [prefix[-1][1]] if self.is_eagle else list(prefix)
            m = self.tree.match_prefix(tokens, extra_key=ek)
            for end in range(m.prefix_len + ps, len(prefix) + 1, ps):
                self.model.pages.pop((ek, prefix[:end]), None)
        return before - self.model.tokens()

    def _req_row(self, lv) -> np.ndarray:
        return self.req_pool.req_to_token[lv.req.req_pool_idx]

    def _req_held(self, lv) -> int:
        ps = self.page_size
        return -(-lv.n_kv // ps) * ps - lv.req.cache_protected_len

    # -- plain tree operations -------------------------------------------------------------------

    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS)
    def match(self, parts, extra_key):
        self._match(self._key(parts), extra_key)

    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS, priority=PRIORITIES, fresh=st.booleans())
    def insert(self, parts, extra_key, priority, fresh):
        """Insert a key whose elements are page-aligned. ``fresh``: all its slots are new and
        the caller frees the duplicates; otherwise the caller matched first and passes the
        tree's own slots for the cached part."""
        tokens = self._key(parts)
        n = self._aligned_len(len(tokens))
        tokens = tokens[: n + self.ex] if n else []
        if fresh:
            prefix_len, prefix = 0, np.zeros(0, np.int32)
            new = self._fresh_values(n)
        else:
            m, prefix_len = self._match(tokens, extra_key)
            prefix = m.indices
            # Hold the matched prefix while allocating: making room may evict, and an
            # unlocked prefix could be evicted and its slots handed out again.
            self.locks.append((extra_key, tuple(self._elems(tokens)[:prefix_len]), m.last_node, None))
            self.tree.inc_lock_ref(m.last_node)
            new = self._fresh_values(n - prefix_len)
            self.locks.pop()
            self.tree.dec_lock_ref(m.last_node)
        if new is None:
            return
        values = np.concatenate([prefix, new]).astype(np.int32)
        # One slot per token: with EAGLE the last token's slot is not cached (reuse a slot the
        # caller holds anyway, so it stays in range).
        passed = np.concatenate([values, values[-1:]]) if self.is_eagle and n else values
        expected = self.model.insert(extra_key, self._elems(tokens), values)
        got = self.tree.insert(tokens, passed, extra_key=extra_key, priority=priority)
        assert got == expected, (got, expected, tokens)
        if self.alloc is not None:
            assert not self.alloc.take(), "insert freed slots: duplicates are the caller's"
            if fresh and got:
                self.alloc.free(values[:got])
                self.alloc.take()

    @precondition(lambda self: self.with_pools)
    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS, how=st.sampled_from(["short", "negative", "float", "huge"]))
    def insert_bad_indices_raises(self, parts, extra_key, how):
        tokens = self._key(parts)
        if self._aligned_len(len(tokens)) == 0:
            return
        n = len(tokens)
        bad = {
            "short": np.full(n - 1, self.page_size, np.int32),
            "negative": np.full(n, -1, np.int32),
            "float": np.full(n, float(self.page_size)),
            "huge": np.full(n, self.capacity + 10 * self.page_size, np.int64),
        }[how]
        sizes = self._sizes()
        with pytest.raises(ValueError):  # kvjax.InvalidSlotError is a ValueError
            self.tree.insert(tokens, bad, extra_key=extra_key)
        assert self._sizes() == sizes and not self.alloc.take()

    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS)
    def lock(self, parts, extra_key):
        key = self._key(parts)
        m, length = self._match(key, extra_key)
        receipt = self.tree.inc_lock_ref(m.last_node)
        self.locks.append((extra_key, tuple(self._elems(key)[:length]), m.last_node, receipt))

    @precondition(lambda self: self.locks)
    @rule(which=st.integers(0, 10**6), by_receipt=st.booleans())
    def unlock(self, which, by_receipt):
        _, _, node, receipt = self.locks.pop(which % len(self.locks))
        if by_receipt:
            self.tree.dec_lock_ref(receipt)
            self.released.append(receipt)
        else:
            self.tree.dec_lock_ref(node)

    @precondition(lambda self: self.released)
    @rule(which=st.integers(0, 10**6))
    def release_receipt_twice_raises(self, which):
        receipt = self.released[which % len(self.released)]
        sizes = self._sizes()
        with pytest.raises(RuntimeError):
            self.tree.dec_lock_ref(receipt)
        assert self._sizes() == sizes

    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS)
    def unlock_unlocked_node_raises(self, parts, extra_key):
        key = self._key(parts)
        m, length = self._match(key, extra_key)
        prefix = (extra_key, tuple(self._elems(key)[:length]))
        if length == 0 or prefix in self.model.covered(self._locked_prefixes()):
            return
        sizes = self._sizes()
        with pytest.raises((ValueError, RuntimeError)):
            self.tree.dec_lock_ref(m.last_node)
        assert self._sizes() == sizes

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens):
        self._evict_and_sync(num_tokens * self.page_size // 4 if self.page_size > 1 else num_tokens)

    @precondition(lambda self: not self.locks and not self.live)
    @rule()
    def reset(self):
        pages = Counter(v[0] // self.page_size for v in self.model.pages.values())
        self.tree.reset()
        if self.alloc is not None:
            assert self._freed_pages() == pages, "reset must free exactly the cached pages"
        self.model.pages.clear()
        self.released.clear()  # receipts of an earlier tree generation

    @rule()
    def match_every_cached_prefix(self):
        for ek, prefix in list(self.model.pages):
            tokens = [e[0] for e in prefix] + [prefix[-1][1]] if self.is_eagle else list(prefix)
            self._match(tokens, ek)

    # -- request lifecycle (needs the request pool and allocator) --------------------------------

    def _give_kv(self, lv, k: int) -> bool:
        """Gives the next ``k`` tokens KV slots: the rest of the last page, then new pages."""
        ps, n = self.page_size, lv.n_kv
        room = -(-n // ps) * ps - n
        fresh = self._fresh_values(-(-max(0, k - room) // ps) * ps)
        if fresh is None:
            return False
        row = self._req_row(lv)
        head: list[int] = []
        if room:
            base = int(row[n // ps * ps])
            head = [base + (n + i) % ps for i in range(min(room, k))]
        slots = np.concatenate([np.asarray(head, np.int32), fresh]).astype(np.int32)
        self.req_pool.write(int(rows_of(lv.req)), n, slots[:k])
        self.held += len(fresh)
        lv.n_kv += k
        return True

    @precondition(lambda self: self.with_pools and len(self.live) < MAX_LIVE_REQUESTS)
    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS, priority=PRIORITIES)
    def start_request(self, parts, extra_key, priority):
        self._start(self._key(parts), extra_key, priority)

    @precondition(lambda self: self.with_pools and len(self.live) <= MAX_LIVE_REQUESTS - 2)
    @rule(parts=KEY_PARTS, extra_key=EXTRA_KEYS, priority=PRIORITIES)
    def start_twin_requests(self, parts, extra_key, priority):
        """Two requests with one prompt, both started before either is cached: both compute
        the uncached part, so whichever is cached second holds duplicates."""
        prompt = self._key(parts)
        self._start(prompt, extra_key, priority)
        self._start(prompt, extra_key, priority)

    def _start(self, prompt, extra_key, priority):
        """What a scheduler does: match, lock, take a row, compute KV for the rest."""
        if not prompt:
            return
        m, length = self._match(prompt, extra_key)
        self.tree.inc_lock_ref(m.last_node)
        rows = self.req_pool.alloc(1)
        assert rows is not None, "request pool sized for MAX_LIVE_REQUESTS"
        self.rid += 1
        req = Req(
            rid=f"r{self.rid}",
            origin_input_ids=list(prompt),
            output_ids=[],
            req_pool_idx=int(rows[0]),
            prefix_indices=m.indices,
            last_node=m.last_node,
            cache_protected_len=length,
            extra_key=extra_key,
            priority=priority,
        )
        lv = _Live(req, extra_key, prompt, length)
        self.live.append(lv)  # its lock is counted from here on
        self.req_pool.write(rows_of(req), 0, m.indices)
        if not self._give_kv(lv, len(prompt) - length):
            self.live.pop()
            self.tree.dec_lock_ref(m.last_node)
            self.req_pool.free(rows_of(req))
            return
        req.kv_committed_len = lv.n_kv

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 10**6), page=st.integers(0, 3), n=st.integers(1, 20))
    def decode(self, which, page, n):
        lv = self.live[which % len(self.live)]
        if lv.n_kv + n > self.req_pool.req_to_token.shape[1]:
            return
        palette = PALETTE[self.page_size]
        new = [palette[(page + i // self.page_size) % 4][i % self.page_size] for i in range(n)]
        if self._give_kv(lv, n):
            lv.tokens.extend(new)
            lv.req.output_ids.extend(new)
            lv.req.kv_committed_len = lv.n_kv

    def _insert_into_model(self, lv, aligned: int) -> tuple[int, Counter]:
        """Inserts the request's cached elements into the model; returns (already cached
        length, pages the tree must free as the request's duplicates)."""
        row = self._req_row(lv).copy()
        cpl = lv.req.cache_protected_len
        elems = self._elems(lv.tokens[: lv.n_kv])[:aligned]
        expected_prefix = self.model.insert(lv.extra_key, elems, row[:aligned])
        assert expected_prefix >= cpl
        return expected_prefix, self._pages(row[cpl:expected_prefix])

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 10**6))
    def cache_unfinished(self, which):
        lv = self.live[which % len(self.live)]
        n = lv.n_kv
        aligned = self._aligned_len(n)
        row_before = self._req_row(lv)[:n].copy()
        held_before = self._req_held(lv)
        _, dup_pages = self._insert_into_model(lv, aligned)
        lv.req.fill_ids = list(lv.tokens[:n])
        self.tree.cache_unfinished_req(lv.req)
        assert self._freed_pages() == dup_pages, "cache_unfinished_req freed the wrong slots"
        row = self._req_row(lv)[:n]
        _, tree_slots = self.model.match(lv.extra_key, self._elems(lv.tokens[:n])[:aligned])
        assert row[:aligned].tolist() == tree_slots, "req_to_token not pointed at the tree's slots"
        assert (row[aligned:] == row_before[aligned:]).all(), "the unaligned tail was rewritten"
        assert lv.req.cache_protected_len == aligned, (lv.req.cache_protected_len, aligned)
        assert np.asarray(lv.req.prefix_indices).tolist() == row.tolist(), "prefix_indices != row"
        self.held -= held_before - self._req_held(lv)

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 10**6), is_insert=st.sampled_from([True, True, True, False]))
    def cache_finished(self, which, is_insert):
        lv = self.live.pop(which % len(self.live))
        n = lv.n_kv
        aligned = self._aligned_len(n)
        row = self._req_row(lv)
        held_before = self._req_held(lv)
        tail_pages = self._pages(row[aligned:n])
        if is_insert:
            _, own_pages = self._insert_into_model(lv, aligned)
        else:  # nothing new cached: the request frees every slot it owns
            own_pages = self._pages(row[lv.req.cache_protected_len : aligned])
        self.tree.cache_finished_req(lv.req, is_insert=is_insert)
        assert self._freed_pages() == own_pages + tail_pages, "cache_finished_req freed the wrong slots"
        self.req_pool.free(lv.req.req_pool_idx)
        self.held -= held_before

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def sizes_add_up(self):
        if not hasattr(self, "tree"):
            return
        tree = self.tree
        tree.sanity_check()
        total = tree.total_size()
        assert tree.evictable_size() + tree.protected_size() == total
        assert total == self.model.tokens(), (total, self.model.tokens())
        covered = self.model.covered(self._locked_prefixes())
        assert tree.protected_size() == len(covered) * self.page_size, (
            tree.protected_size(),
            len(covered) * self.page_size,
        )
        if self.alloc is not None:
            assert self.alloc.available_size() + total + self.held == self.capacity, (
                self.alloc.available_size(),
                total,
                self.held,
                self.capacity,
            )
        slots = [s for page in self.model.pages.values() for s in page]
        assert len(slots) == len(set(slots)), "two cached prefixes share a slot"


# (page_size, policy, with request pool + allocator, EAGLE bigram keys)
CASES = [
    (1, "lru", True, False),
    (16, "lru", True, False),
    (1, "lfu", True, False),
    (16, "fifo", True, False),
    (16, "priority", True, False),
    (1, "priority", True, False),
    (16, "slru", True, False),
    (1, "mru", False, False),
    (16, "lru", False, False),
    (1, "lru", True, True),
    (16, "filo", True, True),
]


@pytest.mark.parametrize(("page_size", "policy", "with_pools", "is_eagle"), CASES)
def test_radix_cache_matches_model(page_size, policy, with_pools, is_eagle):
    name = f"Radix_p{page_size}_{policy}_{'pools' if with_pools else 'standalone'}{'_eagle' if is_eagle else ''}"
    machine: Any = type(
        name,
        (RadixMachine,),
        {"page_size": page_size, "policy": policy, "with_pools": with_pools, "is_eagle": is_eagle},
    )
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
