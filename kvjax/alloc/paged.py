"""The paged allocator: free pages in a LIFO stack."""

from __future__ import annotations

import numpy as np

from kvjax.alloc.base import BaseTokenToKVPoolAllocator, LifoFreeList

__all__ = ["PagedTokenToKVPoolAllocator"]


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Page allocator: pages ``1..size // page_size``; page 0 (the trash page) never handed out.

    ``alloc(n)`` needs ``n % page_size == 0`` (always checked; SGLang checks it only in a debug
    mode) and returns the slots of the first ``n / page_size`` free pages. ``free`` turns
    slot ids into their distinct pages and prepends them, ascending, to the free list, so the
    pages freed last are reused first (LIFO). Freeing any slot of a page frees the whole page.
    """

    _free_list_cls = LifoFreeList

    def __init__(self, size: int, page_size: int, *, need_sort: bool = False) -> None:
        super().__init__(size, page_size, need_sort=need_sort)

    def _pages_to_free(self, idx: np.ndarray) -> np.ndarray:
        pages = np.unique(self._validate_slots(idx))
        self._check_not_free(pages)
        return pages.astype(np.int32)

    def _group_pages(self, group: list[np.ndarray]) -> np.ndarray:
        return np.sort(np.concatenate(group))
