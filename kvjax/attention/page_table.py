"""`PageTables`: the page tables of a batch's request-table rows, on the host (numpy).

The one place kvjax turns the request table (``req_to_token[row, position]``: the KV slot of each
token of each running request) into the page tables the attention kernels read. Row ``r``'s page
``j`` is the page of its token at position ``j * page_size`` (the first token of the page; a
request's tokens fill its pages in order, so one token names the page). A sliding-window pool's
table is the same walk with each slot translated into that pool first (``translate``).

Cost: one fancy-index gather of ``rows x pages_per_seq`` slots, a division and a mask (numpy,
no Python loop over requests), into an array of the step's fixed shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["PageTables", "SlotTranslation"]

SlotTranslation = Callable[[np.ndarray], np.ndarray]
"""Maps request-table slots (any shape, int) to another pool's slots of the same shape (e.g. the
SWA allocator's full->SWA mapping)."""


class PageTables:
    """Page tables of rows of one request table (see the module docstring).

    Args:
        req_to_token_pool: the request table (``req_to_token``: int32 ``[rows, max_context_len]``
            numpy, read at each call; ``max_context_len``: its width in tokens).
        page_size: tokens per page (>= 1).

    Attributes:
        pages_per_seq: columns of every table: ``ceil(max_context_len / page_size)``.
    """

    def __init__(self, req_to_token_pool: Any, page_size: int) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        width = int(req_to_token_pool.max_context_len)
        self.rows = req_to_token_pool
        self.page_size = int(page_size)
        self.pages_per_seq = -(-width // self.page_size)
        # The position of each page's first token (clamped into the table for a ragged last page),
        # and each column's page index, as ``[1, pages_per_seq]`` rows that broadcast over the rows.
        self._page_columns = np.minimum(np.arange(self.pages_per_seq) * self.page_size, width - 1)[None, :]
        self._column_ids = np.arange(self.pages_per_seq)[None, :]

    def build(
        self,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        max_seqs: int,
        translate: SlotTranslation | None = None,
    ) -> np.ndarray:
        """The page table of ``rows`` at KV lengths ``seq_lens``, padded to ``max_seqs`` rows.

        Args:
            rows: int ``[n]``: request-table rows, in batch order (``n <= max_seqs``).
            seq_lens: int ``[n]``: each row's KV length in tokens (pages past
                ``ceil(seq_len / page_size)`` are 0).
            max_seqs: rows of the result (the step's padded row count).
            translate: maps request-table slots to the target pool's slots; None: the request
                table's own pool.

        Returns:
            int32 ``[max_seqs, pages_per_seq]`` page ids; rows ``n:`` are 0.
        """
        n = len(rows)
        table = np.zeros((max_seqs, self.pages_per_seq), np.int32)
        slots = self.rows.req_to_token[np.asarray(rows)[:, None], self._page_columns]
        if translate is not None:
            slots = translate(slots)
        pages = slots // self.page_size
        n_pages = -(-np.asarray(seq_lens) // self.page_size)
        pages[self._column_ids >= n_pages[:, None]] = 0
        table[:n] = pages
        return table
