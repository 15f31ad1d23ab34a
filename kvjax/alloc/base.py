"""Common machinery of the host-side KV slot allocators.

Units and ids
-------------
* A *slot* (token slot, "loc" in SGLang) is an index into the KV pool's token axis.
* A *page* holds ``page_size`` consecutive slots: slot ``page * page_size + offset``.
* Pages ``1..num_pages`` are allocatable; page 0 (slots ``0..page_size-1``) is the trash
  page, where padded tokens write. It is never handed out and can never be freed.

Invariants (checked by :meth:`BaseTokenToKVPoolAllocator.check_invariants`)
------------------------------------------------------------------------
* ``available_size() + used_size() == size`` (all in tokens), where pages buffered by an
  open free group still count as used.
* Every page is in exactly one of: the free list, the release list (``need_sort``), the
  open free group's buffer, or in use.
* ``_is_free[page]`` is True exactly for the pages of the free and release lists, and
  ``_is_pending[page]`` exactly for those of the open free group; so a double free is
  found in O(len(indices)) without scanning the lists.

Every public call that raises leaves the allocator unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "FifoFreeList",
    "LifoFreeList",
]

_INT32_MAX = np.iinfo(np.int32).max
# Id dtypes ``free`` validates without converting them first.
_NATIVE_IDS = (np.dtype(np.int32), np.dtype(np.int64))
_SHOWN_IDS = 8
# What to do about an unaligned ``alloc`` size or segment start (the error's last words).
ALLOC_FIX = "use alloc_extend for unaligned requests"
SEGMENT_FIX = "a segment starts on a page boundary"


def format_ids(ids: np.ndarray) -> str:
    """``[a, b, ...] (N ids)``: the first few ids and the count, for error messages."""
    ids = np.asarray(ids).ravel()
    head = ", ".join(str(int(i)) for i in ids[:_SHOWN_IDS])
    more = ", ..." if ids.size > _SHOWN_IDS else ""
    return f"[{head}{more}] ({ids.size} id{'s' if ids.size != 1 else ''})"


def as_index_array(values: Any, what: str) -> np.ndarray:
    """``values`` (list, numpy or jax array, scalar) as a 1-D int64 numpy array.

    Raises InvalidSlotError when the values are not integers.
    """
    arr = np.asarray(values)
    if arr.dtype == object:
        try:
            arr = arr.astype(np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise InvalidSlotError(f"{what}: expected integer ids, got {values!r}") from e
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidSlotError(f"{what}: expected integer ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).ravel()


def page_aligned_count(what: str, name: str, value: Any, page_size: int, fix: str) -> int:
    """``value`` as an ``int`` when it is a non-negative integer and a multiple of ``page_size``.

    Raises InvalidSlotError naming ``what`` (the call), ``name`` (the argument), the value and
    ``fix`` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidSlotError(f"{what}: {name} must be a non-negative integer, got {value!r}")
    if value % page_size:
        raise InvalidSlotError(
            f"{what}: {name}={value} is not page aligned (not a multiple of page_size={page_size}); {fix}"
        )
    return int(value)


def extend_lengths(
    prefix_lens: Any, seq_lens: Any, last_loc: Any, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``(prefix_lens, seq_lens, last_loc)`` of an ``alloc_extend`` as int64 arrays, one entry
    per request with ``0 <= prefix_len <= seq_len`` (InvalidSlotError naming the request otherwise;
    ``last_loc`` is checked against the allocator's pages by the allocator)."""
    prefix = as_index_array(prefix_lens, f"{what} prefix_lens")
    seq = as_index_array(seq_lens, f"{what} seq_lens")
    last = as_index_array(last_loc, f"{what} last_loc")
    if not (prefix.size == seq.size == last.size):
        raise InvalidSlotError(
            f"{what}: prefix_lens, seq_lens and last_loc must have one entry per request, "
            f"got {prefix.size}, {seq.size}, {last.size}"
        )
    bad = (prefix < 0) | (seq < prefix)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidSlotError(
            f"{what}: request {i} has prefix_len={int(prefix[i])}, seq_len={int(seq[i])}; "
            "need 0 <= prefix_len <= seq_len"
        )
    return prefix, seq, last


def decode_lengths(seq_lens: Any, last_loc: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``(seq_lens, last_loc)`` of an ``alloc_decode`` as int64 arrays, one entry per request
    with ``seq_len >= 1`` (InvalidSlotError naming the request otherwise)."""
    seq = as_index_array(seq_lens, f"{what} seq_lens")
    last = as_index_array(last_loc, f"{what} last_loc")
    if seq.size != last.size:
        raise InvalidSlotError(
            f"{what}: seq_lens and last_loc must have one entry per request, got {seq.size}, {last.size}"
        )
    bad = seq < 1
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidSlotError(f"{what}: request {i} has seq_len={int(seq[i])}; need seq_len >= 1")
    return seq, last


class FifoFreeList:
    """A queue of int32 ids in a ring buffer: take from the head, append at the tail.

    ``take(k)`` and ``append(ids)`` cost O(k) / O(len(ids)), never O(capacity).
    Holds at most ``capacity`` ids.
    """

    def __init__(self, capacity: int) -> None:
        self._buf = np.zeros(max(capacity, 1), np.int32)
        self._head = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _span(self, start: int, n: int) -> np.ndarray:
        cap = self._buf.size
        start %= cap
        if start + n <= cap:
            return self._buf[start : start + n].copy()
        return np.concatenate([self._buf[start:], self._buf[: start + n - cap]])

    def take(self, k: int) -> np.ndarray:
        """Remove and return the first ``k`` ids (caller checked ``k <= len(self)``)."""
        out = self._span(self._head, k)
        self._head = (self._head + k) % self._buf.size
        self._len -= k
        return out

    def give(self, ids: np.ndarray) -> None:
        """Append ``ids`` at the tail, in the given order."""
        n = ids.size
        cap = self._buf.size
        tail = (self._head + self._len) % cap
        first = min(n, cap - tail)
        self._buf[tail : tail + first] = ids[:first]
        self._buf[: n - first] = ids[first:]
        self._len += n

    def to_array(self) -> np.ndarray:
        """The ids head first (a copy)."""
        return self._span(self._head, self._len)

    def set(self, ids: np.ndarray) -> None:
        """Replace the content by ``ids`` (head first)."""
        self._buf[: ids.size] = ids
        self._head = 0
        self._len = ids.size


class LifoFreeList:
    """A stack of int32 ids: take from the head, *prepend* given ids before the head.

    The head is stored at the end of the buffer, so both ends cost O(k).
    ``give(ids)`` puts ``ids[0]`` at the head, as SGLang's ``cat((ids, free_pages))``.
    """

    def __init__(self, capacity: int) -> None:
        self._buf = np.zeros(max(capacity, 1), np.int32)
        self._top = 0

    def __len__(self) -> int:
        return self._top

    def take(self, k: int) -> np.ndarray:
        """Remove and return the first ``k`` ids (caller checked ``k <= len(self)``)."""
        out = self._buf[self._top - k : self._top][::-1].copy()
        self._top -= k
        return out

    def give(self, ids: np.ndarray) -> None:
        """Prepend ``ids`` (``ids[0]`` becomes the head)."""
        n = ids.size
        self._buf[self._top : self._top + n] = ids[::-1]
        self._top += n

    def to_array(self) -> np.ndarray:
        """The ids head first (a copy)."""
        return self._buf[: self._top][::-1].copy()

    def set(self, ids: np.ndarray) -> None:
        """Replace the content by ``ids`` (head first)."""
        self._buf[: ids.size] = ids[::-1]
        self._top = ids.size


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot from :meth:`BaseTokenToKVPoolAllocator.backup_state` (read-only arrays).

    ``free_pages`` and ``release_pages`` are head first; ``is_free`` is the page bitmap.
    """

    page_size: int
    num_pages: int
    free_pages: np.ndarray
    release_pages: np.ndarray
    is_free: np.ndarray


class BaseTokenToKVPoolAllocator:
    """Hands out and takes back KV slots, a page at a time, on the host (numpy).

    Subclasses choose the free-list discipline: :class:`~kvjax.alloc.TokenToKVPoolAllocator`
    (page_size 1, FIFO reuse) and :class:`~kvjax.alloc.PagedTokenToKVPoolAllocator` (LIFO
    reuse of pages). Returned slot ids are int32 numpy arrays.

    Attributes:
        page_size: slots per page.
        num_pages: allocatable pages (ids ``1..num_pages``).
        size: allocatable slots, ``num_pages * page_size``.
        need_sort: frees go to a release list that is merged into the free list, sorted,
            only when an allocation needs more pages than the free list holds (SGLang's
            PD-disaggregation mode: sorted pages make transfers contiguous).

    Unlike SGLang, which validates frees only in a debug mode, every free is checked: ids
    out of range, slots of the trash page, ids already free, and (token allocator) the same
    id twice in one call raise InvalidSlotError / DoubleFreeError, naming the ids.
    """

    _free_list_cls: type[FifoFreeList] | type[LifoFreeList]

    def __init__(self, size: int, page_size: int, *, need_sort: bool = False) -> None:
        if type(self) is BaseTokenToKVPoolAllocator:
            raise TypeError("BaseTokenToKVPoolAllocator is abstract: use make_allocator(size, page_size)")
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ConfigError("page_size", page_size, "use a positive integer number of slots per page")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ConfigError("size", size, "use a non-negative integer number of token slots")
        page_size = int(page_size)
        num_pages = int(size) // page_size
        if (num_pages + 1) * page_size - 1 > _INT32_MAX:
            raise ConfigError("size", size, f"slot ids must fit int32: use at most {_INT32_MAX // page_size - 1} pages")
        self.page_size = page_size
        self.num_pages = num_pages
        self.size = num_pages * page_size
        self.need_sort = bool(need_sort)
        self._num_slots = (num_pages + 1) * page_size  # trash page included
        self._free = self._free_list_cls(num_pages)
        self._release = self._free_list_cls(num_pages)
        self._is_free = np.zeros(num_pages + 1, bool)
        self._is_pending = np.zeros(num_pages + 1, bool)
        # Pages the prefix tree holds (``hold_for_tree``): ``free`` refuses them; the tree
        # releases them with ``free_from_tree``. ``_tree_held_pages`` counts them (0: no check).
        self._tree_held = np.zeros(num_pages + 1, bool)
        self._tree_held_pages = 0
        # Scratch for O(n) duplicate detection; only entries just written are ever read.
        self._scratch = np.zeros(num_pages + 1, np.int32)
        self._offsets = np.arange(page_size, dtype=np.int32)
        # log2(page_size) when it is a power of two (slot -> page is then a shift), else -1.
        self._page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        self._arange = np.arange(0, dtype=np.int32)
        self._group: list[np.ndarray] | None = None
        # Segment frees buffered by an open group, in call order (paged allocator only).
        self._group_segments: list[np.ndarray] = []
        self._num_used = 0
        self.clear()

    # ------------------------------------------------------------------ sizes

    def available_size(self) -> int:
        """Allocatable tokens now: free plus release pages, times ``page_size``."""
        return (len(self._free) + len(self._release)) * self.page_size

    def used_size(self) -> int:
        """Tokens handed out and not yet returned (open free-group frees still count)."""
        return self._num_used * self.page_size

    @property
    def free_pages(self) -> np.ndarray:
        """The free list, head (next to be handed out) first. A copy: O(free pages)."""
        return self._free.to_array()

    @property
    def release_pages(self) -> np.ndarray:
        """Pages freed under ``need_sort`` and not yet merged, in SGLang's order. A copy."""
        return self._release.to_array()

    @property
    def free_mask(self) -> np.ndarray:
        """``[num_pages + 1]`` bool: True for the pages of the free and release lists (page 0,
        the trash page, is never free). A copy."""
        return self._is_free.copy()

    @property
    def pending_mask(self) -> np.ndarray:
        """``[num_pages + 1]`` bool: True for the pages freed inside the open free group (they
        return to the free list at :meth:`free_group_end`). A copy."""
        return self._is_pending.copy()

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Free everything: free list ``1..num_pages`` in order, release list and group empty."""
        self._free.set(np.arange(1, self.num_pages + 1, dtype=np.int32))
        self._release.set(np.zeros(0, np.int32))
        self._is_free[:] = True
        self._is_free[0] = False
        self._is_pending[:] = False
        self._tree_held[:] = False
        self._tree_held_pages = 0
        self._group = None
        self._group_segments = []
        self._num_used = 0

    def merge_and_sort_free(self) -> None:
        """Move the release list into the free list and sort it ascending."""
        if len(self._release) == 0:
            return
        merged = np.concatenate([self._free.to_array(), self._release.to_array()])
        merged.sort()
        self._free.set(merged)
        self._release.set(np.zeros(0, np.int32))

    def backup_state(self) -> AllocatorState:
        """Snapshot the free lists and bitmap (copies: O(num_pages) time and memory).

        Frees buffered by an open free group are not part of the snapshot: those pages are
        still in use until the group ends.
        """

        def frozen(a: np.ndarray) -> np.ndarray:
            a.flags.writeable = False
            return a

        return AllocatorState(
            page_size=self.page_size,
            num_pages=self.num_pages,
            free_pages=frozen(self._free.to_array()),
            release_pages=frozen(self._release.to_array()),
            is_free=frozen(self._is_free.copy()),
        )

    def restore_state(self, state: AllocatorState) -> None:
        """Return to a snapshot from :meth:`backup_state` (speculative-decoding rollback).

        Raises:
            RuntimeError: a free group is open (its buffered pages would be freed twice).
            InvalidSlotError: the snapshot comes from an allocator of another shape.
        """
        if not isinstance(state, AllocatorState):
            raise InvalidSlotError(f"restore_state: expected an AllocatorState, got {type(state).__name__}")
        if (state.page_size, state.num_pages) != (self.page_size, self.num_pages):
            raise InvalidSlotError(
                f"restore_state: snapshot of page_size={state.page_size}, num_pages={state.num_pages} "
                f"given to an allocator of page_size={self.page_size}, num_pages={self.num_pages}"
            )
        if self._group is not None:
            raise RuntimeError("restore_state inside a free group: call free_group_end() first")
        self._free.set(state.free_pages)
        self._release.set(state.release_pages)
        np.copyto(self._is_free, state.is_free)
        self._num_used = self.num_pages - len(self._free) - len(self._release)

    # ------------------------------------------------------------------ alloc

    def _take_pages(self, k: int, merge_estimate: int | None = None) -> np.ndarray | None:
        """``k`` pages from the head of the free list, or None when fewer are free.

        Under ``need_sort``, SGLang 0.5.23's timing: the release list is merged into the free list
        (sorted) first whenever ``merge_estimate`` (default ``k``; the callers' estimates are in
        :meth:`alloc_extend` and :meth:`alloc_decode`) exceeds the free list, even when the call
        then returns None: the merge moves no page in or out of use, only their order.
        """
        estimate = k if merge_estimate is None else merge_estimate
        if self.need_sort and estimate > len(self._free):
            self.merge_and_sort_free()
        if k > len(self._free):
            return None
        pages = self._free.take(k)
        self._is_free[pages] = False
        self._num_used += k
        return pages

    def _expand(self, pages: np.ndarray) -> np.ndarray:
        """All slots of ``pages``, page by page (int32)."""
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._offsets).ravel()

    def alloc(self, need_size: int) -> np.ndarray | None:
        """``need_size`` slots (int32, page by page from the head of the free list), or None.

        Returns None, handing out nothing, when fewer slots are available (under ``need_sort`` the
        release list is merged first, as SGLang 0.5.23 does).

        Raises:
            InvalidSlotError: ``need_size`` negative, or not a multiple of ``page_size``.
        """
        need = page_aligned_count("alloc", "need_size", need_size, self.page_size, ALLOC_FIX)
        pages = self._take_pages(need // self.page_size)
        if pages is None:
            return None
        return self._expand(pages)

    def _check_last_loc(self, prefix: np.ndarray, last_loc: np.ndarray, what: str) -> None:
        """Validate ``last_loc`` against ``prefix`` (lengths in tokens), per request."""
        ps = self.page_size
        # One combined test on the hot path; the detailed checks below only name the culprit.
        page = last_loc // ps
        in_use = ~(self._is_free.take(page, mode="clip") | self._is_pending.take(page, mode="clip"))
        ok = np.where(
            prefix == 0,
            last_loc == -1,
            (last_loc >= ps) & (last_loc < self._num_slots) & ((last_loc + 1) % ps == prefix % ps) & in_use,
        )
        if ok.all():
            return
        empty = prefix == 0
        bad = empty & (last_loc != -1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidSlotError(
                f"{what}: request {i} has an empty prefix, so last_loc must be -1, got {int(last_loc[i])}"
            )
        has = ~empty
        bad = has & ((last_loc < ps) | (last_loc >= self._num_slots))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidSlotError(
                f"{what}: request {i} has last_loc={int(last_loc[i])}, outside the allocatable "
                f"slots [{ps}, {self._num_slots})"
            )
        bad = has & ((last_loc + 1) % ps != prefix % ps)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidSlotError(
                f"{what}: request {i}: (last_loc + 1) % page_size = {(int(last_loc[i]) + 1) % ps} but "
                f"prefix_len % page_size = {int(prefix[i]) % ps} (prefix_len={int(prefix[i])}, "
                f"last_loc={int(last_loc[i])}, page_size={ps})"
            )
        pages = last_loc[has] // ps
        bad_pages = self._is_free[pages] | self._is_pending[pages]
        if bad_pages.any():
            i = int(np.flatnonzero(has)[np.flatnonzero(bad_pages)[0]])
            raise InvalidSlotError(
                f"{what}: request {i} has last_loc={int(last_loc[i])} on page {int(last_loc[i]) // ps}, "
                "which is free: its prefix was freed"
            )

    def alloc_extend(
        self,
        prefix_lens: Any,
        seq_lens: Any,
        last_loc: Any,
        extend_num_tokens: int | None = None,
    ) -> np.ndarray | None:
        """Slots for ``seq_lens - prefix_lens`` new tokens per request, concatenated (int32).

        Semantics of SGLang's ``alloc_extend`` (its ``alloc_extend_naive`` reference), per
        request, in request order:

        1. keep filling the request's last partial page from ``last_loc + 1``;
        2. then whole new pages;
        3. then one new partial page.

        A request needs ``ceil(seq/ps) - ceil(prefix/ps)`` new pages, taken from the head of
        the free list in request order. A request whose tokens all fit its old partial page
        takes no page (the triton kernel's behaviour; SGLang's Python reference overwrites
        them in that case).

        Args:
            prefix_lens: tokens already cached per request (int, ``[B]``).
            seq_lens: tokens after the extend (``>= prefix_lens``).
            last_loc: slot of each request's last prefix token; -1 for an empty prefix.
            extend_num_tokens: optional cross-check of ``sum(seq_lens - prefix_lens)``.

        Returns:
            The slots, or None, handing out nothing, when too few pages are free. Under
            ``need_sort`` the release list is merged first whenever SGLang 0.5.23's estimate
            ``extend_tokens // page_size + batch + 1`` exceeds the free list, even if the call then
            returns None; at page size 1 (SGLang: ``alloc(extend_tokens)``) only when the tokens
            themselves exceed it.

        Raises:
            InvalidSlotError: shapes differ, lengths are negative or decreasing, or
                ``last_loc`` is inconsistent: not -1 for an empty prefix, out of range, on a
                free page, or ``(last_loc + 1) % ps != prefix_len % ps``. Names the request.

        On the token allocator (page_size 1) SGLang raises NotImplementedError; kvjax
        supports it for uniformity: the result is the next ``sum(extend)`` free slots.
        """
        prefix, seq, last = extend_lengths(prefix_lens, seq_lens, last_loc, "alloc_extend")
        ext = seq - prefix
        total = int(ext.sum())
        if extend_num_tokens is not None and int(extend_num_tokens) != total:
            raise InvalidSlotError(
                f"alloc_extend: extend_num_tokens={extend_num_tokens} but sum(seq_lens - prefix_lens)={total}"
            )
        self._check_last_loc(prefix, last, "alloc_extend")
        ps = self.page_size
        if ps == 1:
            # SGLang's page-1 extend is ``alloc(total)``: it merges only when total exceeds the free list.
            return self._take_pages(total)
        estimate = total // ps + prefix.size + 1  # SGLang 0.5.23's paged merge trigger
        return self._extend_paged(prefix, seq, last, ext, total, estimate)

    def _extend_paged(
        self, prefix: np.ndarray, seq: np.ndarray, last: np.ndarray, ext: np.ndarray, total: int, estimate: int
    ) -> np.ndarray | None:
        # Each request's new tokens run over its "rows": its old partial page (if the extend
        # reaches into it), then its new pages. Within a row the slots are consecutive, so the
        # output is per-row base + token index: O(tokens) with no per-request Python work.
        ps = self.page_size
        pre_pages = -(-prefix // ps)
        n_new = -(-seq // ps) - pre_pages
        pages = self._take_pages(int(n_new.sum()), estimate)
        if pages is None:
            return None
        if total == 0:
            return np.zeros(0, np.int32)
        has_old = np.minimum(seq, pre_pages * ps) > prefix
        n_rows = n_new + has_old
        row_end = np.cumsum(n_rows)
        if has_old.any():
            is_old = np.zeros(int(row_end[-1]), bool)
            is_old[(row_end - n_rows)[has_old]] = True
            rows = np.empty(is_old.size, np.int32)
            rows[is_old] = (last[has_old] + 1) // ps
            rows[~is_old] = pages
        else:
            rows = pages
        live = ext > 0
        row_end = row_end[live]
        first_row = row_end - n_rows[live]
        last_row = row_end - 1
        lo = (prefix[live] % ps).astype(np.int32)  # first used offset in a request's first row
        tail = (ps - 1 - (seq[live] - 1) % ps).astype(np.int32)  # unused offsets of its last row
        count = np.full(rows.size, ps, np.int32)  # used slots per row
        count[first_row] -= lo
        count[last_row] -= tail
        # Output token j of row r holds slot rows[r] * ps + lo_r + (j - row_start_r): one repeat
        # of a per-row base plus a shared arange, both vectorised over tokens (measured faster
        # than a running sum over the tokens).
        row_start = np.cumsum(count, dtype=np.int32)
        row_start -= count
        base = rows * np.int32(ps) - row_start
        base[first_row] += lo
        out = np.repeat(base, count)
        out += self._token_arange(total)
        return out

    def _token_arange(self, n: int) -> np.ndarray:
        """``arange(n)`` as int32, from a buffer kept across calls (grown by doubling)."""
        if self._arange.size < n:
            self._arange = np.arange(max(n, 2 * self._arange.size), dtype=np.int32)
        return self._arange[:n]

    def alloc_decode(self, seq_lens: Any, last_loc: Any) -> np.ndarray | None:
        """One slot per request for its new token at position ``seq_len - 1`` (int32, ``[B]``).

        A request whose new token starts a page (``(seq_len - 1) % ps == 0``) gets a fresh
        page from the head of the free list (in request order) and slot ``page * ps``; the
        others get ``last_loc + 1``. Equivalent to ``alloc_extend(seq_lens - 1, seq_lens,
        last_loc)``, with the same validation.

        Returns None, handing out nothing, when too few pages are free. Under ``need_sort`` the
        release list is merged first whenever the batch size exceeds the free list (SGLang 0.5.23),
        even if the call then returns None.
        On the token allocator SGLang raises NotImplementedError; kvjax supports it.
        """
        seq, last = decode_lengths(seq_lens, last_loc, "alloc_decode")
        self._check_last_loc(seq - 1, last, "alloc_decode")
        ps = self.page_size
        new_page = (seq - 1) % ps == 0
        pages = self._take_pages(int(np.count_nonzero(new_page)), seq.size)
        if pages is None:
            return None
        out = (last + 1).astype(np.int32)
        out[new_page] = pages * ps
        return out

    # ------------------------------------------------------------------ free

    def _pages_to_free(self, idx: np.ndarray) -> np.ndarray:
        """Validated page ids for token ids ``idx`` (non-empty); raises, changing nothing."""
        raise NotImplementedError

    def _validate_slots(self, idx: np.ndarray) -> np.ndarray:
        """Range and trash-page checks; returns the page of each id.

        One test on the hot path: every id is valid iff ``page_size <= min`` and ``max <
        num_slots`` (``argmin`` / ``argmax``: plain array methods, no temporary array, several
        times cheaper than ``min()`` / ``any()``, which go through Python-level wrappers).
        Only a failure runs the detailed checks, which name the culprits.
        """
        ps = self.page_size
        if idx.item(idx.argmin()) < ps or idx.item(idx.argmax()) >= self._num_slots:
            bad = (idx < 0) | (idx >= self._num_slots)
            if bad.any():
                raise InvalidSlotError(f"free: ids out of range [0, {self._num_slots}): {format_ids(idx[bad])}")
            raise InvalidSlotError(
                f"free: ids of the trash page 0 (slots 0..{ps - 1}) are never allocated: {format_ids(idx[idx < ps])}"
            )
        if ps == 1:
            return idx
        if self._page_shift >= 0:
            return idx >> self._page_shift
        return idx // ps

    def _check_not_free(self, pages: np.ndarray) -> None:
        """Raise DoubleFreeError if any of the (distinct) ``pages`` is free or pending: two
        bitmap gathers, O(len(pages)), never a scan of the free lists."""
        bad = self._is_free.take(pages)
        bad |= self._is_pending.take(pages)
        if np.count_nonzero(bad):
            what = "slots" if self.page_size == 1 else "pages"
            raise DoubleFreeError(f"free: {what} already free (double free): {format_ids(pages[bad])}")
        if self._tree_held_pages:
            held = self._tree_held.take(pages)
            if np.count_nonzero(held):
                what = "slots" if self.page_size == 1 else "pages"
                raise InvalidSlotError(
                    f"free: {what} {format_ids(pages[held])} hold a cached prefix of the tree (tree_cache): the tree "
                    "frees them itself (evict, or cache_finished_req of the request that inserted them); free only "
                    "slots you allocated and did not insert"
                )

    # ------------------------------------------------------------------ slots the tree holds

    def hold_for_tree(self, slots: Any) -> None:
        """The prefix tree now holds ``slots`` (a node's device value: whole pages, in use):
        :meth:`free` and :meth:`free_segment` refuse them until the tree releases them with
        :meth:`free_from_tree`. Called by the tree, never by a request's owner."""
        pages = self._distinct_pages(_ids(slots, "hold_for_tree"))
        if pages.size:
            self._tree_held_pages += pages.size - int(np.count_nonzero(self._tree_held.take(pages)))
            self._tree_held[pages] = True

    def free_from_tree(self, slots: Any, *, segment: bool = True) -> None:
        """The tree frees ``slots`` it holds (an evicted node's value, or everything at reset):
        they stop being held and are freed, as one row segment (``segment``) or a plain free.
        Atomic: when the free raises, the pages are held again and nothing changed."""
        idx = _ids(slots, "free_from_tree")
        if idx.size == 0:
            return
        pages = self._distinct_pages(idx)
        held = pages[self._tree_held.take(pages)]
        self._tree_held[held] = False
        self._tree_held_pages -= held.size
        try:
            if segment:
                self.free_segment(idx, start_pos=0)
            else:
                self.free(idx)
        except BaseException:
            self._tree_held[held] = True
            self._tree_held_pages += held.size
            raise

    def _distinct_pages(self, idx: np.ndarray) -> np.ndarray:
        """The distinct pages of a tree's slot ids ``idx`` (range-checked). A tree's values are
        whole pages in row order (page-aligned edges, each page's slots together: the tree's
        invariants), so the first id of every ``page_size`` names each page once: O(pages), one
        contiguous array. Input of another length takes the general O(n) path."""
        ps = self.page_size
        if ps > 1 and idx.size % ps == 0:
            firsts = np.ascontiguousarray(idx[::ps])
            return self._validate_slots(firsts) if firsts.size else firsts
        pages = self._validate_slots(idx) if idx.size else idx
        return pages[self._one_of_each(pages)] if pages.size > 1 else pages

    @property
    def tree_held_mask(self) -> np.ndarray:
        """``[num_pages + 1]`` bool: the pages the prefix tree holds (:meth:`hold_for_tree`). A copy."""
        return self._tree_held.copy()

    def _one_of_each(self, pages: np.ndarray) -> np.ndarray:
        """Mask of exactly one occurrence of each distinct page of ``pages`` (O(n))."""
        pos = self._token_arange(pages.size)
        self._scratch[pages] = pos
        return self._scratch[pages] == pos

    def _has_duplicates(self, pages: np.ndarray) -> np.ndarray:
        """Mask of the entries of ``pages`` that repeat an earlier-or-later entry (O(n))."""
        pos = self._token_arange(pages.size)
        self._scratch[pages] = pos
        # Whichever position won the write, every other position of a repeated page differs.
        return self._scratch[pages] != pos

    def free(self, free_index: Any) -> None:
        """Return slots. Token allocator: appended to the free list (FIFO). Paged: the
        distinct pages of the ids, ascending, prepended (LIFO); several ids of one page free
        it once, and an id frees its whole page.

        With ``need_sort`` the pages go to the release list instead; inside a free group
        they are checked now and returned at :meth:`free_group_end`. Empty input is a no-op.

        Raises:
            InvalidSlotError: ids out of range or on the trash page.
            DoubleFreeError: ids already free (or pending in the open group), or, on the
                token allocator, the same id twice in this call.
        """
        if type(free_index) is np.ndarray and free_index.ndim == 1 and free_index.dtype in _NATIVE_IDS:
            idx = free_index  # int32 / int64 ids as they are (the usual input): no conversion pass
        else:
            idx = as_index_array(free_index, "free")
        if idx.size:
            self._hand_back(self._pages_to_free(idx), segment=False)

    def free_segment(self, free_index: Any, *, start_pos: int) -> None:
        """Return one segment of a request's row: ``free_index`` are the slots of row positions
        ``[start_pos, start_pos + len(free_index))``, in row order (a tree node's value, the tail
        of a finished request, a retracted request's own part). SGLang 0.5.23's ``free_segment``,
        which its tree and request lifecycle free through.

        Token allocator: the same as :meth:`free`. Paged: the segment's pages are returned **in
        row order** (first appearance), not sorted: prepended so that the segment's first page
        is reused first; under ``need_sort`` they go to the release list (sorted at the merge).
        Inside a free group they are checked now and, at :meth:`free_group_end`, prepended after
        the group's plain frees (so they are reused first), as SGLang's ``free_page_ids`` group.
        ``start_pos`` must be page aligned (the segment starts a page; its end may fall inside
        one, whose whole page is freed). Empty input is a no-op.

        Raises (allocator unchanged):
            InvalidSlotError: ``start_pos`` negative or not page aligned; ids out of range or on
                the trash page.
            DoubleFreeError: ids already free (or pending in the open group); a page that
                appears in two separate runs of the segment (paged), or an id given twice
                (token allocator).
        """
        start_pos = page_aligned_count("free_segment", "start_pos", start_pos, self.page_size, SEGMENT_FIX)
        idx = as_index_array(free_index, "free_segment")
        if idx.size:
            self._hand_back(self._segment_pages(idx), segment=True)

    def _segment_pages(self, idx: np.ndarray) -> np.ndarray:
        """Validated page ids of a segment's token ids (non-empty), in row order; raises,
        changing nothing. The token allocator's are its ``free`` pages (in the given order)."""
        return self._pages_to_free(idx)

    def _buffer_segment(self, pages: np.ndarray) -> None:
        """Buffer a segment's validated pages in the open group: for the token allocator, like
        any free (SGLang's token ``free_segment`` is its ``free``)."""
        assert self._group is not None
        self._group.append(pages)

    def _hand_back(self, pages: np.ndarray, *, segment: bool) -> None:
        """Return validated, distinct ``pages`` now; inside a free group, mark them pending and
        buffer them until :meth:`free_group_end` (a segment's with :meth:`_buffer_segment`)."""
        if self._group is None:
            self._release_pages(pages)
            return
        self._is_pending[pages] = True
        if segment:
            self._buffer_segment(pages)
        else:
            self._group.append(pages)

    def _release_pages(self, pages: np.ndarray) -> None:
        """Return validated, distinct pages to the free (or release) list."""
        self._is_free[pages] = True
        self._num_used -= pages.size
        (self._release if self.need_sort else self._free).give(pages)

    def free_group_begin(self) -> None:
        """Start buffering frees until :meth:`free_group_end` (checked at ``free()`` time).

        Raises RuntimeError when a group is already open (groups do not nest).
        """
        if self._group is not None:
            raise RuntimeError("free_group_begin: a free group is already open; groups do not nest")
        self._group = []

    def free_group_end(self) -> None:
        """Return every page freed since :meth:`free_group_begin`, in one free.

        Raises RuntimeError when no group is open.
        """
        if self._group is None:
            raise RuntimeError("free_group_end without free_group_begin")
        group, self._group = self._group, None
        segments, self._group_segments = self._group_segments, []
        if group:
            pages = self._group_pages(group)
            self._is_pending[pages] = False
            self._release_pages(pages)
        if segments:
            # After the plain frees, so the segments' pages end up first (SGLang's group order).
            pages = np.concatenate(segments)
            self._is_pending[pages] = False
            self._release_pages(pages)

    def _group_pages(self, group: list[np.ndarray]) -> np.ndarray:
        """The pages of a group's buffered frees, in the order one ``free`` would return them."""
        return np.concatenate(group)

    # ------------------------------------------------------------------ with a tree cache

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> int:
        """Evict from ``tree_cache`` until ``num_tokens`` can be allocated (what the scheduler asks
        before allocating); returns the tokens evicted. Nothing when they are free already."""
        missing = int(num_tokens) - self.available_size()
        return int(tree_cache.evict(missing)) if missing > 0 else 0

    def leak_free(self, tree_cache: Any) -> bool:
        """With no request holding KV: ``available + evictable + protected == size`` (every slot
        is free or held by the tree)."""
        cached = tree_cache.evictable_size() + tree_cache.protected_size()
        return self.available_size() + cached == self.size

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError if the counters, lists and bitmaps disagree. O(num_pages)."""

        def fail(msg: str) -> None:
            raise AssertionError(f"{type(self).__name__}: {msg}")

        free = self._free.to_array()
        release = self._release.to_array()
        buffered = (self._group or []) + self._group_segments
        pending = np.concatenate(buffered) if buffered else np.zeros(0, np.int32)
        listed = np.concatenate([free, release, pending]).astype(np.int64)
        if listed.size and (listed.min() < 1 or listed.max() > self.num_pages):
            fail(f"page ids outside 1..{self.num_pages} in the free lists")
        counts = np.bincount(listed, minlength=self.num_pages + 1)
        if (counts > 1).any():
            fail(f"pages listed twice: {format_ids(np.flatnonzero(counts > 1))}")
        expect_free = np.zeros(self.num_pages + 1, bool)
        expect_free[free] = True
        expect_free[release] = True
        if not np.array_equal(expect_free, self._is_free):
            fail("free bitmap disagrees with the free and release lists")
        expect_pending = np.zeros(self.num_pages + 1, bool)
        expect_pending[pending] = True
        if not np.array_equal(expect_pending, self._is_pending):
            fail("pending bitmap disagrees with the open free group")
        if self._num_used != self.num_pages - free.size - release.size:
            fail(f"used counter {self._num_used} != pages not free {self.num_pages - free.size - release.size}")
        if self.available_size() + self.used_size() != self.size:
            fail(f"available {self.available_size()} + used {self.used_size()} != size {self.size}")
        if int(np.count_nonzero(self._tree_held)) != self._tree_held_pages:
            fail(f"tree-held counter {self._tree_held_pages} != pages marked {int(np.count_nonzero(self._tree_held))}")
        held_free = self._tree_held & (self._is_free | self._is_pending)
        if held_free.any():
            fail(f"pages held by the tree are free or pending: {format_ids(np.flatnonzero(held_free))}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()}, need_sort={self.need_sort})"
        )


def _ids(ids: Any, what: str) -> np.ndarray:
    """``ids`` as a 1-D integer array: a native int32 / int64 array as it is (the tree's node
    values: no conversion pass), anything else through ``as_index_array``."""
    if type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype in _NATIVE_IDS:
        return ids
    return as_index_array(ids, what)
