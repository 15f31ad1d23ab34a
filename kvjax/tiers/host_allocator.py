"""`HostSlotAllocator`: the free list of the host KV tier (SGLang's ``HostKVCache.alloc/free``).

Host slots are ``page * page_size + offset`` for pages ``0 .. num_pages - 1``: unlike a device
pool there is **no reserved page** (SGLang's host pool has no trash slot). Allocation hands out
whole pages, oldest-freed first (FIFO, as SGLang concatenates freed ids at the end of its free
list). Bookkeeping is numpy: a free-page queue and a bitmap, so validation is O(ids).

Invariant: ``available_size() + used_size() == size``. A call that raises leaves the allocator
unchanged; ``alloc`` returns None (and changes nothing) when too few pages are free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax.alloc.base import FifoFreeList, as_index_array, format_ids
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError


class HostSlotAllocator:
    """Whole-page allocation over ``size`` host slots (``size`` a multiple of ``page_size``).

    Args:
        size: host token slots (SGLang's host pool ``size``), > 0 and a page multiple.
        page_size: tokens per page (>= 1).
    """

    def __init__(self, size: int, page_size: int = 1) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ConfigError("page_size", page_size, "use an integer >= 1")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0 or size % page_size:
            raise ConfigError("host pool size", size, f"use a positive multiple of page_size={page_size}")
        self.size = int(size)
        self.page_size = int(page_size)
        self.num_pages = self.size // self.page_size
        self._free = FifoFreeList(self.num_pages)
        self._free.give(np.arange(self.num_pages, dtype=np.int32))
        self._is_free = np.ones(self.num_pages, dtype=bool)

    def available_size(self) -> int:
        """Free host slots (tokens)."""
        return len(self._free) * self.page_size

    def used_size(self) -> int:
        """Allocated host slots (tokens)."""
        return self.size - self.available_size()

    @property
    def free_pages(self) -> np.ndarray:
        """The free pages, next to be handed out first. A copy: O(free pages)."""
        return self._free.to_array()

    def alloc(self, need_size: int) -> np.ndarray | None:
        """``need_size`` host slots (int32, whole pages in allocation order), or None when short.

        Raises ValueError (nothing changed) unless ``need_size`` is a non-negative page multiple.
        """
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)) or need_size < 0:
            raise ValueError(f"alloc: need_size={need_size!r} must be an integer >= 0")
        if need_size % self.page_size:
            raise ValueError(f"alloc: need_size={need_size} is not a multiple of page_size={self.page_size}")
        k = int(need_size) // self.page_size
        if k > len(self._free):
            return None
        pages = self._free.take(k)
        self._is_free[pages] = False
        return self.pages_to_slots(pages)

    def pages_to_slots(self, pages: np.ndarray) -> np.ndarray:
        """Slot ids of whole ``pages`` (int32, page by page)."""
        ps = self.page_size
        pages = np.asarray(pages, dtype=np.int32)
        if ps == 1:
            return pages.copy()
        return (pages[:, None] * ps + np.arange(ps, dtype=np.int32)[None, :]).reshape(-1)

    def slots_to_pages(self, slots: Any, what: str = "slots") -> np.ndarray:
        """The pages of ``slots``, which must be whole pages in order (int32). Raises
        InvalidSlotError naming the ids otherwise (out of range, or not whole pages)."""
        idx = as_index_array(slots, what)
        ps = self.page_size
        if ps == 1:
            self._check_range(idx, what)
            return idx.astype(np.int32)
        if idx.size % ps:
            self._check_range(idx, what)
            raise InvalidSlotError(f"{what}: {idx.size} ids are not whole pages of {ps}: {format_ids(idx)}")
        rows = idx.reshape(-1, ps)
        pages = rows[:, 0] // ps
        # Whole pages in order with every first slot in range: then every slot is in range.
        if pages.size and (rows[0, 0] < 0 or pages.min() < 0 or pages.max() >= self.num_pages):
            self._check_range(idx, what)
        if not np.array_equal(rows, pages[:, None] * ps + np.arange(ps)):
            self._check_range(idx, what)
            raise InvalidSlotError(f"{what}: ids are not whole pages of {ps} in order: {format_ids(idx)}")
        return pages.astype(np.int32)

    def _check_range(self, idx: np.ndarray, what: str) -> None:
        bad = (idx < 0) | (idx >= self.size)
        if bad.any():
            raise InvalidSlotError(f"{what}: host slot ids out of range [0, {self.size}): {format_ids(idx[bad])}")

    def free(self, free_index: Any) -> None:
        """Return host slots; every id frees its whole page (several ids of a page free it once).

        Raises (nothing changed): InvalidSlotError for ids out of range or not integers;
        DoubleFreeError for ids whose page is already free.
        """
        idx = as_index_array(free_index, "free")
        if idx.size == 0:
            return
        self._check_range(idx, "free")
        pages = idx // self.page_size
        _, first = np.unique(pages, return_index=True)
        pages = pages[np.sort(first)]  # distinct, in the order given (SGLang appends in order)
        bad = self._is_free[pages]
        if bad.any():
            raise DoubleFreeError(f"free: host pages already free (double free): {format_ids(pages[bad])}")
        self._is_free[pages] = True
        self._free.give(pages.astype(np.int32))

    def is_allocated(self, slots: Any) -> bool:
        """Whether every id is an allocated host slot."""
        idx = as_index_array(slots, "slots")
        if idx.size == 0:
            return True
        if ((idx < 0) | (idx >= self.size)).any():
            return False
        return not bool(self._is_free[idx // self.page_size].any())

    def clear(self) -> None:
        """Free everything."""
        self._free = FifoFreeList(self.num_pages)
        self._free.give(np.arange(self.num_pages, dtype=np.int32))
        self._is_free[:] = True

    def check_invariants(self) -> None:
        """``available + used == size``; the free queue and the bitmap agree."""
        queued = self._free.to_array()
        if np.unique(queued).size != queued.size:
            raise AssertionError("host allocator: a page is queued twice")
        if int(self._is_free.sum()) != queued.size or not self._is_free[queued].all():
            raise AssertionError("host allocator: the free queue and the bitmap differ")
