"""`FutureUses`: when each cached page will next be asked for, read from the whole trace ahead.

The offline optimum (``belady.py``) evicts the leaf whose next use is farthest in the future. A
leaf is evicted whole, and a later request can reuse it only from its first page on, so a leaf's
next use is its first page's: the next request whose match covers that page. Token ids are
prefix-unique (``trace.py``), so the page is named by its last token ``t`` alone, and a request
covers it when ``t`` is in its prompt at a position below its *matchable length*:
``(input_length - 1)`` rounded down to a page (the serving loop matches at most all but the last
prompt token, in whole pages). Output tokens are never in a prompt: their next use is never.

The index holds, per block id, the requests whose prompts hold it, ascending (one CSR table,
O(block accesses) memory); ``next_use(t, after)`` scans it from ``after`` on, skipping the few
requests whose matchable length stops inside ``t``'s block.
"""

from __future__ import annotations

import bisect

import numpy as np

from kvjax.replay.trace import Trace

__all__ = ["NEVER", "FutureUses"]

NEVER = 2**62
"""The next use of a page no later request asks for."""


class FutureUses:
    """Next-use times (request indices in trace order) of pages, for one page size.

    Args:
        trace: the trace that will be replayed (in its order).
        page_size: the tree's page size (tokens, >= 1).
    """

    def __init__(self, trace: Trace, page_size: int) -> None:
        self.block_size = trace.block_size
        self.output_base = trace.output_base
        self.matchable = np.array([(r.input_length - 1) // page_size * page_size for r in trace.requests], np.int64)
        self.block_position = trace.block_position
        counts = [int(r.blocks.shape[0]) for r in trace.requests]
        blocks = np.concatenate([r.blocks for r in trace.requests]) if counts else np.empty(0, np.int64)
        owners = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        order = np.lexsort((owners, blocks))
        self._blocks_sorted = blocks[order]
        self._owners_sorted = owners[order].tolist()
        changes = np.r_[True, self._blocks_sorted[1:] != self._blocks_sorted[:-1]] if counts else np.empty(0, bool)
        self._span: dict[int, tuple[int, int]] = {}
        edges = np.flatnonzero(changes).tolist() + [len(order)]
        for k in range(len(edges) - 1):
            self._span[int(self._blocks_sorted[edges[k]])] = (int(edges[k]), int(edges[k + 1]))

    def next_use(self, token: int, after: int) -> int:
        """The first request index ``> after`` whose match would cover the page ending at prompt
        token ``token``; `NEVER` when none does (and for output tokens)."""
        if token >= self.output_base:
            return NEVER
        b = self.block_size
        block, offset = divmod(token, b)
        span = self._span.get(block)
        if span is None:
            return NEVER
        position = self.block_position[block] * b + offset
        lo, hi = span
        owners = self._owners_sorted
        i = bisect.bisect_right(owners, after, lo, hi)
        matchable = self.matchable
        while i < hi:
            r = owners[i]
            if position < matchable[r]:
                return r
            i += 1
        return NEVER
