"""`WindowTreeMachine`: what the Hypothesis machines over the sliding-window trees share: keys that
mostly reuse earlier ones, the insert, match, lock, unlock and early SWA release rules, and the
naive rule of where a match in such a tree ends."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvjax.radix import LockError

TOKENS = st.integers(1, 3)


class WindowTreeMachine(RuleBasedStateMachine):
    """Shared rules. A subclass's ``@initialize`` builds its allocator and tree and calls
    ``_start``; it says how the tree makes room (``_make_room``) and how a request's decode frees
    its slots that left the window (``_free_out_of_window``)."""

    ps: int
    eagle: bool = False
    alloc: Any
    tree: Any
    receipts: list
    keys: list[list[int]]

    def _start(self, ps: int, alloc: Any, tree: Any, eagle: bool = False) -> None:
        """A run over ``tree`` (page size ``ps``, bigram keys when ``eagle``) and its allocator
        ``alloc``: no locks held, no keys inserted yet."""
        self.ps = ps
        self.eagle = eagle
        self.alloc = alloc
        self.tree = tree
        self.receipts = []
        self.keys = []

    def key(self, data: st.DataObject, pages_max: int = 6) -> list[int]:
        """A fresh random key, or (mostly) a page-aligned prefix or extension of an earlier one;
        with bigram keys one more token."""
        ps, ex = self.ps, (1 if self.eagle else 0)
        reuse = bool(self.keys) and data.draw(st.integers(0, 3)) > 0
        if reuse:
            old: list[int] = self.keys[data.draw(st.integers(0, len(self.keys) - 1))]
            pages = data.draw(st.integers(1, pages_max))
            body = old[: pages * ps] + data.draw(st.lists(TOKENS, min_size=pages * ps, max_size=pages * ps))
            body = body[: pages * ps]
        else:
            pages = data.draw(st.integers(1, pages_max))
            body = data.draw(st.lists(TOKENS, min_size=pages * ps, max_size=pages * ps))
        return body + data.draw(st.lists(TOKENS, min_size=ex, max_size=ex))

    def _make_room(self, n: int) -> None:
        """Evict so that ``n`` more slots may be allocated."""
        raise NotImplementedError

    def _free_out_of_window(self, slots: np.ndarray) -> None:
        """Free what decode frees of ``slots``, positions that left the window."""
        raise NotImplementedError

    def naive_match(self, key: list[int]) -> tuple[int, Any]:
        """Where a match of ``key`` ends by the rule written out naively: walk the tree by whole
        children (the page-aligned part of the key; bigram keys compare one token more), then take
        the deepest walked node with no tombstone above it on the path, or with at least ``W``
        live SWA tokens after the last one. Returns (its depth, it); (0, root) when none."""
        tree = self.tree
        ex = 1 if self.eagle else 0
        n = len(key) - ex
        n -= n % self.ps
        node, pos, path = tree.root, 0, []
        while pos < n:
            nxt = None
            for child in node.children.values():
                k = child.klen
                if child.token_ids()[: k + ex] == key[pos : pos + k + ex] and pos + k <= n:
                    nxt = child
            if nxt is None:
                break
            path.append(nxt)
            pos += nxt.klen
            node = nxt
        best, since = tree.root, float("inf")
        for p in path:
            if tree.swa.is_tombstone(p):
                since = 0
                continue
            since += p.klen
            if since >= tree.sliding_window_size:
                best = p
        return (0 if best is tree.root else best.depth), best

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        """Insert a key with fresh slots; sometimes the caller's decode already freed a
        page-aligned head of them (``swa_evicted_seqlen``)."""
        key = self.key(data)
        n = len(key) - (1 if self.eagle else 0)  # key elements, page-aligned
        slots = self.alloc.alloc(n)
        if slots is None:
            self._make_room(n)
            slots = self.alloc.alloc(n)
            if slots is None:
                return
        e = data.draw(st.integers(0, (n - 1) // self.ps)) * self.ps if data.draw(st.booleans()) else 0
        if e:
            self._free_out_of_window(slots[:e])
        # One slot per token; a bigram key's last token has none cached (the trash slot).
        indices = np.concatenate([slots, np.zeros(len(key) - n, np.int32)])
        self.tree.insert(key, indices, swa_evicted_seqlen=e)
        self.keys.append(key)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        key = self.key(data)
        self._check_match(key, self.tree.match_prefix(key))

    def _check_match(self, key: list[int], m: Any) -> None:
        """Check ``m``, the tree's match of ``key``, against :meth:`naive_match`."""
        raise NotImplementedError

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        m = self.tree.match_prefix(self.key(data))
        if m.prefix_len:
            self.receipts.append(self.tree.inc_lock_ref(m.last_node))

    @precondition(lambda self: self.receipts)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        r = self.receipts.pop(data.draw(st.integers(0, len(self.receipts) - 1)))
        self.tree.dec_lock_ref(r)
        with pytest.raises(LockError):
            self.tree.dec_lock_ref(r)

    @precondition(lambda self: self.receipts)
    @rule(data=st.data())
    def release_swa_early(self, data: st.DataObject) -> None:
        """``dec_swa_lock_only``: moves the lock's SWA tokens from protected to evictable; a
        second release does nothing (SGLang's ``release_swa``)."""
        r = self.receipts[data.draw(st.integers(0, len(self.receipts) - 1))]
        if r.parts[0].released:
            before = self.tree.pretty_print(), self.tree.swa_protected_size()
            assert self.tree.dec_swa_lock_only(r) == 0
            assert (self.tree.pretty_print(), self.tree.swa_protected_size()) == before
        else:
            protected = self.tree.swa_protected_size()
            moved = self.tree.dec_swa_lock_only(r)
            assert self.tree.swa_protected_size() == protected - moved
