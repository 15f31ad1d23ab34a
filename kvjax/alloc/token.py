"""The page_size-1 allocator: free slots in a FIFO queue."""

from __future__ import annotations

import numpy as np

from kvjax.alloc.base import BaseTokenToKVPoolAllocator, FifoFreeList, format_ids
from kvjax.errors import DoubleFreeError

__all__ = ["TokenToKVPoolAllocator"]


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Slot allocator with ``page_size == 1``: slots ``1..size``, slot 0 never handed out.

    ``alloc(n)`` takes the first ``n`` free slots; ``free`` appends slots at the end of the
    free list in the given order, so freed slots are reused last (FIFO). With ``need_sort``
    frees go to the release list, merged and sorted when an allocation needs them.

    Deviation from SGLang: ``alloc_extend`` and ``alloc_decode`` work here (SGLang's base
    raises NotImplementedError for this class): with one slot per page every new token
    simply takes the next free slot, so callers need not special-case page size 1.
    """

    _free_list_cls = FifoFreeList

    def __init__(self, size: int, *, need_sort: bool = False) -> None:
        super().__init__(size, 1, need_sort=need_sort)

    def _pages_to_free(self, idx: np.ndarray) -> np.ndarray:
        pages = self._validate_slots(idx)
        dup = self._has_duplicates(pages)
        if np.count_nonzero(dup):
            raise DoubleFreeError(f"free: slots given more than once in one call: {format_ids(np.unique(pages[dup]))}")
        self._check_not_free(pages)
        return pages.astype(np.int32)
