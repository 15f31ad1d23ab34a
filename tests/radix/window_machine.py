"""`WindowTreeMachine`: what the Hypothesis machines over the sliding-window trees share (keys that
mostly reuse earlier ones, the lock and unlock rules) and `window_match_end`, the naive rule of
where a match in such a tree ends."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvjax.radix import LockError

TOKENS = st.integers(1, 3)


class WindowTreeMachine(RuleBasedStateMachine):
    """Shared rules. A subclass's ``@initialize`` sets ``ps`` (page size), ``eagle`` (bigram
    keys), ``tree``, and empty ``receipts`` and ``keys``; its insert rule appends each key."""

    ps: int
    eagle: bool = False
    tree: Any
    receipts: list
    keys: list[list[int]]

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


def window_match_end(tree: Any, path: list[Any]) -> Any:
    """Where a match along ``path`` (the nodes a walk passed, root first) ends in a
    sliding-window tree: the deepest node with no tombstone above it on the path, or with at
    least ``W`` live SWA tokens after the last one; ``tree.root`` when there is none."""
    best, since = tree.root, float("inf")
    for p in path:
        if tree.swa.is_tombstone(p):
            since = 0
            continue
        since += p.klen
        if since >= tree.sliding_window_size:
            best = p
    return best
