"""The paged allocator: free pages in a LIFO stack."""

from __future__ import annotations

import numpy as np

from kvjax.alloc.base import BaseTokenToKVPoolAllocator, LifoFreeList, format_ids
from kvjax.errors import DoubleFreeError

__all__ = ["PagedTokenToKVPoolAllocator"]


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Page allocator: pages ``1..size // page_size``; page 0 (the trash page) never handed out.

    ``alloc(n)`` needs ``n % page_size == 0`` (always checked; SGLang checks it only in a debug
    mode) and returns the slots of the first ``n / page_size`` free pages. ``free`` turns
    slot ids into their distinct pages and prepends them, ascending, to the free list, so the
    pages freed last are reused first (LIFO). Freeing any slot of a page frees the whole page.
    ``free_segment`` (what the tree and the request lifecycle free through) prepends a row
    segment's pages in row order instead, without sorting (SGLang 0.5.23).
    """

    _free_list_cls = LifoFreeList

    def __init__(self, size: int, page_size: int, *, need_sort: bool = False) -> None:
        super().__init__(size, page_size, need_sort=need_sort)

    def _pages_to_free(self, idx: np.ndarray) -> np.ndarray:
        # Validated on pages: ``page_size <= id < num_slots`` iff ``1 <= id // page_size <=
        # num_pages`` (floor division), so the pages' extremes check the ids' range and the
        # trash page, and tell a one-page free (a request's tail) without more work.
        shift = self._page_shift
        pages = idx >> shift if shift >= 0 else idx // self.page_size
        lo = pages.item(pages.argmin())
        hi = pages.item(pages.argmax())
        if lo < 1 or hi > self.num_pages:
            self._validate_slots(idx)  # raises, naming the ids
        pages = pages[:1] if lo == hi else _distinct_ascending(pages)
        self._check_not_free(pages)
        return pages.astype(np.int32)

    def _segment_pages(self, idx: np.ndarray) -> np.ndarray:
        # A segment holds each page in one run of consecutive ids (SGLang takes every
        # page_size-th id); the first id of each run gives the pages in row order, no sort.
        pages = self._validate_slots(idx)
        if pages.size > 1:
            starts = np.empty(pages.size, bool)
            starts[0] = True
            np.not_equal(pages[1:], pages[:-1], out=starts[1:])
            pages = pages[starts]
            dup = self._has_duplicates(pages)
            if dup.any():
                raise DoubleFreeError(
                    "free_segment: pages appear in two separate runs of one segment (a segment lists "
                    f"each page's slots together, in row order): {format_ids(np.unique(pages[dup]))}"
                )
        self._check_not_free(pages)
        return pages.astype(np.int32)

    def _buffer_segment(self, pages: np.ndarray) -> None:
        self._group_segments.append(pages)

    def _group_pages(self, group: list[np.ndarray]) -> np.ndarray:
        return np.sort(np.concatenate(group))


def _distinct_ascending(pages: np.ndarray) -> np.ndarray:
    """``np.unique(pages)`` in O(n) for the usual input, whose pages are already in order (a
    request's row, a node's slots): one difference tells both whether they are sorted and where
    a new page starts. Only unsorted input pays for a sort."""
    if pages.size < 2:
        return pages
    step = pages[1:] - pages[:-1]
    if step.item(step.argmin()) < 0:
        pages = np.sort(pages)
        step = pages[1:] - pages[:-1]
    starts = np.empty(pages.size, bool)
    starts[0] = True
    np.not_equal(step, 0, out=starts[1:])
    return pages[starts]
