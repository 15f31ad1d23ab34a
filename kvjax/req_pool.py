"""The request → token-slot table (SGLang's ``ReqToTokenPool``), on the host in numpy.

Row ``r`` of ``req_to_token`` lists, position by position, the KV slot ids of the tokens of
the request that holds row ``r``. Rows are handed out and taken back through a FIFO free list;
unlike the KV allocators, row 0 is an ordinary row here, as in SGLang.

Invariants:
* ``available_size() + (rows in use) == size``; ``_is_free[r]`` is True exactly for the rows
  of the free list.
* Every call that raises leaves the pool unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.alloc.base import FifoFreeList, as_index_array, format_ids
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError

if TYPE_CHECKING:
    import jax

    from kvjax.layout.build_context import BuildContext
    from kvjax.layout.pool_plan import PoolPlan

__all__ = ["ReqToTokenPool", "create_pool"]


class ReqToTokenPool:
    """Maps request rows to the KV slots of their tokens.

    Attributes:
        size: number of request rows (the maximum number of running requests).
        max_context_len: tokens per row.
        req_to_token: int32 numpy array ``[size, max_context_len]``, zero-initialised.
    """

    def __init__(self, size: int, max_context_len: int) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ConfigError("size", size, "use a non-negative integer number of request rows")
        if (
            isinstance(max_context_len, bool)
            or not isinstance(max_context_len, (int, np.integer))
            or max_context_len < 1
        ):
            raise ConfigError("max_context_len", max_context_len, "use a positive integer number of tokens")
        self.size = int(size)
        self.max_context_len = int(max_context_len)
        self.req_to_token = np.zeros((self.size, self.max_context_len), np.int32)
        self._free = FifoFreeList(self.size)
        self._is_free = np.ones(self.size, bool)
        self.clear()

    def available_size(self) -> int:
        """Free request rows."""
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        """The free rows, next to be handed out first (a copy)."""
        return self._free.to_array().tolist()

    def clear(self) -> None:
        """Free every row (free list ``0..size-1`` in order). The table is left as it is."""
        self._free.set(np.arange(self.size, dtype=np.int32))
        self._is_free[:] = True

    def alloc(self, need_size: int) -> list[int] | None:
        """``need_size`` rows from the head of the free list, or None (unchanged) if too few.

        Raises InvalidSlotError when ``need_size`` is negative.
        """
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)) or need_size < 0:
            raise InvalidSlotError(f"ReqToTokenPool.alloc: need_size must be a non-negative integer, got {need_size!r}")
        if need_size > len(self._free):
            return None
        rows = self._free.take(int(need_size))
        self._is_free[rows] = False
        return rows.tolist()

    def free(self, free_index: int | Sequence[int] | np.ndarray) -> None:
        """Return rows to the end of the free list (FIFO), in the given order.

        Raises:
            InvalidSlotError: a row outside ``[0, size)``.
            DoubleFreeError: a row already free, or given twice.
        """
        rows = as_index_array(free_index, "ReqToTokenPool.free")
        if rows.size == 0:
            return
        bad = (rows < 0) | (rows >= self.size)
        if bad.any():
            raise InvalidSlotError(f"ReqToTokenPool.free: rows out of range [0, {self.size}): {format_ids(rows[bad])}")
        uniq, counts = np.unique(rows, return_counts=True)
        if (counts > 1).any():
            raise DoubleFreeError(f"ReqToTokenPool.free: rows given more than once: {format_ids(uniq[counts > 1])}")
        bad = self._is_free[rows]
        if bad.any():
            raise DoubleFreeError(f"ReqToTokenPool.free: rows already free (double free): {format_ids(rows[bad])}")
        self._is_free[rows] = True
        self._free.give(rows.astype(np.int32))

    def _check_rows(self, rows: np.ndarray, what: str) -> None:
        bad = (rows < 0) | (rows >= self.size)
        if bad.any():
            raise InvalidSlotError(f"{what}: request rows out of range [0, {self.size}): {format_ids(rows[bad])}")
        bad = self._is_free[rows]
        if bad.any():
            raise InvalidSlotError(f"{what}: request rows not allocated: {format_ids(rows[bad])}")

    def write(self, req_idx: int, start: int, values: Any) -> None:
        """Set ``req_to_token[req_idx, start : start + len(values)] = values`` (slot ids).

        Raises InvalidSlotError for a free or out-of-range row, a negative ``start``, or a
        write past ``max_context_len``; the message names the request and the length.
        """
        row = int(req_idx)
        self._check_rows(np.array([row]), "ReqToTokenPool.write")
        vals = as_index_array(values, "ReqToTokenPool.write values")
        start = int(start)
        if start < 0 or start + vals.size > self.max_context_len:
            raise InvalidSlotError(
                f"ReqToTokenPool.write: request row {row}: positions [{start}, {start + vals.size}) "
                f"({vals.size} tokens) do not fit max_context_len={self.max_context_len}"
            )
        if vals.size and (vals.min() < 0 or vals.max() > np.iinfo(np.int32).max):
            raise InvalidSlotError(f"ReqToTokenPool.write: request row {row}: slot ids must be in int32 range and >= 0")
        self.req_to_token[row, start : start + vals.size] = vals

    def read(self, req_idx: int, start: int, end: int) -> np.ndarray:
        """A copy of ``req_to_token[req_idx, start:end]`` (int32)."""
        row = int(req_idx)
        if not 0 <= row < self.size:
            raise InvalidSlotError(f"ReqToTokenPool.read: request row {row} out of range [0, {self.size})")
        start, end = int(start), int(end)
        if not 0 <= start <= end <= self.max_context_len:
            raise InvalidSlotError(
                f"ReqToTokenPool.read: request row {row}: range [{start}, {end}) outside "
                f"[0, max_context_len={self.max_context_len}]"
            )
        return self.req_to_token[row, start:end].copy()

    def page_table_numpy(
        self, req_indices: Any, seq_lens: Any, page_size: int, max_pages: int | None = None
    ) -> np.ndarray:
        """Host version of :meth:`page_table` (int32 numpy)."""
        rows = as_index_array(req_indices, "page_table req_indices")
        lens = as_index_array(seq_lens, "page_table seq_lens")
        if rows.size != lens.size:
            raise InvalidSlotError(
                f"page_table: one seq_len per request needed, got {rows.size} rows and {lens.size} lengths"
            )
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise InvalidSlotError(f"page_table: page_size must be a positive integer, got {page_size!r}")
        self._check_rows(rows, "page_table")
        bad = (lens < 0) | (lens > self.max_context_len)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidSlotError(
                f"page_table: request {i} (row {int(rows[i])}) has seq_len={int(lens[i])} outside "
                f"[0, max_context_len={self.max_context_len}]"
            )
        n_pages = -(-lens // page_size)
        need = int(n_pages.max()) if n_pages.size else 0
        if max_pages is None:
            max_pages = need
        elif isinstance(max_pages, bool) or not isinstance(max_pages, (int, np.integer)) or max_pages < 0:
            raise InvalidSlotError(f"page_table: max_pages must be a non-negative integer, got {max_pages!r}")
        elif need > max_pages:
            i = int(np.argmax(n_pages))
            raise InvalidSlotError(
                f"page_table: request {i} (row {int(rows[i])}) needs {need} pages, more than max_pages={max_pages}"
            )
        cols = np.arange(max_pages) * page_size
        # Columns past a request's pages are masked below; clamp them to stay inside the row.
        table = self.req_to_token[rows[:, None], np.minimum(cols, self.max_context_len - 1)[None, :]]
        table //= page_size
        table[np.arange(max_pages)[None, :] >= n_pages[:, None]] = 0
        return table

    def page_table(self, req_indices: Any, seq_lens: Any, page_size: int, max_pages: int | None = None) -> jax.Array:
        """Page ids per request for paged attention: int32 ``[B, max_pages]`` on device.

        Entry ``[b, j]`` is ``req_to_token[req_indices[b], j * page_size] // page_size`` for
        ``j < ceil(seq_lens[b] / page_size)``, and 0 (the trash page) after. ``max_pages``
        defaults to the batch's largest page count. Built in numpy and transferred once.

        Raises InvalidSlotError for free or out-of-range rows, lengths outside
        ``[0, max_context_len]``, or a request needing more than ``max_pages`` pages.
        """
        import jax.numpy as jnp  # the table is host state; only this device copy needs jax

        return jnp.asarray(self.page_table_numpy(req_indices, seq_lens, page_size, max_pages))

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and the bitmap disagree. O(size)."""
        free = self._free.to_array()
        counts = np.bincount(free, minlength=self.size)
        if (counts > 1).any():
            raise AssertionError(f"ReqToTokenPool: rows listed twice: {format_ids(np.flatnonzero(counts > 1))}")
        if not np.array_equal(counts.astype(bool), self._is_free):
            raise AssertionError("ReqToTokenPool: free bitmap disagrees with the free list")

    def __repr__(self) -> str:
        return (
            f"ReqToTokenPool(size={self.size}, max_context_len={self.max_context_len}, "
            f"available={self.available_size()})"
        )


def create_pool(pool: PoolPlan, context: BuildContext) -> ReqToTokenPool:
    """The pool kind registry's builder for ``"request_table"``: ``pool.shape`` is ``(rows, width)``."""
    rows, width = pool.shape
    return ReqToTokenPool(rows, width)
