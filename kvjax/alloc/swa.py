"""The hybrid sliding-window allocator: a full-attention allocator and an SWA allocator, paired.

SGLang's ``SWATokenToKVPoolAllocator`` (``allocator/swa.py``). Models that interleave
full-attention and sliding-window layers keep two KV pools: the full pool (``size`` slots) for the
full layers and a smaller SWA pool (``size_swa`` slots) for the sliding layers. Every slot handed
out is a *full* slot id; each one is paired with an SWA slot, and the pairing is kept in
``full_to_swa_index_mapping`` (on the host, numpy int32; :meth:`device_mapping` gives it to the
kernels as a device array). A sliding layer reads and writes ``mapping[full_slot]``.

Units and ids: slots as in :mod:`kvjax.alloc.base`, on each side; page 0 of each pool is its trash
page, and mapping entry 0 means "no SWA slot" (never paired, or its SWA slot was freed). The
mapping has ``size_full + page_size + 1`` entries: one per full slot (trash page included) and a
last entry ``-1``, so that a ``last_loc`` of ``-1`` (empty prefix) translates to ``-1``.

Invariants (:meth:`check_invariants`):

* both sub-allocators keep their own invariants;
* ``mapping[s] != 0`` only for full slots ``s`` in use, and then it is an SWA slot in use with the
  same page offset; every SWA page in use (not pending in an open free group) is the image of
  exactly one full page;
* ``available_size() == min(full_available_size(), swa_available_size())``.

Under decode context parallelism (``kvjax.alloc.dcp``) ``page_size`` is the striped page
(``page_size * dcp`` of one device's rows) on both sides. A token's owner rank is its slot's offset
within the striped page modulo ``dcp``, and the pairing keeps the offset, so a full slot and its
SWA slot lie on the same rank; freeing SWA pages (window, tombstones) frees every rank's rows of
them.

Every public call that raises, or returns None, leaves the allocator unchanged (both sides and the
mapping).

Deviations from SGLang: frees are always validated (SGLang: debug mode only); :meth:`free_swa`
raises on an SWA part already freed (SGLang skips unmapped entries silently, so a second
``free_swa`` goes unnoticed), while :meth:`free` still skips them (the tree frees a tombstoned
node's full slots after its SWA part left); ``alloc`` works at any page size (page-aligned sizes);
an allocation checks both sides' room before taking anything, so under ``need_sort`` a call that
returns None does not merge the release lists (SGLang merges even then: only the order of free
pages differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvjax.alloc.base import (
    ALLOC_FIX,
    SEGMENT_FIX,
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    as_index_array,
    decode_lengths,
    extend_lengths,
    format_ids,
    page_aligned_count,
)
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError

__all__ = ["SWAAllocatorState", "SWATokenToKVPoolAllocator"]


def _same_length_ids(first: Any, second: Any, what: str, names: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """``first`` and ``second`` as int64 id arrays of the same length (the two sides of one
    pairing change). ``names``: what the error calls each side (``("full", "SWA")``).

    Raises InvalidSlotError, naming ``what``, for non-integer ids or different lengths.
    """
    a = as_index_array(first, f"{what} {names[0]}")
    b = as_index_array(second, f"{what} {names[1]}")
    if a.size != b.size:
        raise InvalidSlotError(f"{what}: {a.size} {names[0]} slots but {b.size} {names[1]} slots")
    return a, b


@dataclass(frozen=True)
class SWAAllocatorState:
    """A snapshot from :meth:`SWATokenToKVPoolAllocator.backup_state`: both sides and the mapping."""

    full: AllocatorState
    swa: AllocatorState
    mapping: np.ndarray


class SWATokenToKVPoolAllocator:
    """Full-attention slots, each paired with a sliding-window slot (see the module docstring).

    Args:
        size: full-attention token slots (rounded down to whole pages).
        size_swa: sliding-window token slots (rounded down to whole pages).
        page_size: slots per page on both sides (>= 1): the token allocator (FIFO) for 1, the
            paged allocator (LIFO) above, as :func:`kvjax.alloc.make_allocator` picks.
        need_sort: both sides keep a release list merged sorted on demand (PD disaggregation).

    Attributes:
        full_attn_allocator: the full side (SGLang's name).
        swa_attn_allocator: the SWA side.
        size: ``min(size_full, size_swa)`` (SGLang's ``size``).
        size_full: allocatable full slots; slot ids the tree may hold are ``< size_full + page_size``.
        size_swa: allocatable SWA slots.
    """

    def __init__(self, size: int, size_swa: int, page_size: int = 1, *, need_sort: bool = False) -> None:
        from kvjax.alloc import make_allocator

        self.full_attn_allocator: BaseTokenToKVPoolAllocator = make_allocator(size, page_size, need_sort=need_sort)
        try:
            self.swa_attn_allocator: BaseTokenToKVPoolAllocator = make_allocator(
                size_swa, page_size, need_sort=need_sort
            )
        except ConfigError as e:
            raise ConfigError("size_swa", size_swa, e.fix) from e
        self.page_size = self.full_attn_allocator.page_size
        self.need_sort = bool(need_sort)
        self.size_full = self.full_attn_allocator.size
        self.size_swa = self.swa_attn_allocator.size
        self.size = min(self.size_full, self.size_swa)
        self._num_full_slots = self.size_full + self.page_size  # trash page included
        self._mapping = np.zeros(self._num_full_slots + 1, np.int32)
        self._mapping[-1] = -1
        self._version = 0
        self._device_cache: tuple[int, Any] | None = None

    # ------------------------------------------------------------------ sizes

    def available_size(self) -> int:
        """Tokens that can be allocated now: the smaller side's room."""
        return min(self.full_attn_allocator.available_size(), self.swa_attn_allocator.available_size())

    def full_available_size(self) -> int:
        """Free full-attention token slots."""
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        """Free sliding-window token slots."""
        return self.swa_attn_allocator.available_size()

    def used_size(self) -> int:
        """Full slots handed out and not yet returned (the full side's ``used_size``)."""
        return self.full_attn_allocator.used_size()

    def swa_used_size(self) -> int:
        """SWA slots handed out and not yet returned."""
        return self.swa_attn_allocator.used_size()

    # ------------------------------------------------------------------ the mapping

    @property
    def full_to_swa_index_mapping(self) -> np.ndarray:
        """The full→SWA slot mapping (int32, ``size_full + page_size + 1`` entries, last one -1);
        a read-only view of the live array."""
        view = self._mapping.view()
        view.flags.writeable = False
        return view

    @property
    def mapping_version(self) -> int:
        """Incremented whenever the mapping changes (to know when a device copy is stale)."""
        return self._version

    def device_mapping(self) -> Any:
        """The mapping as a device array (int32), for the pools and kernels; copied to the device
        once per change of the mapping (cached by :attr:`mapping_version`). Imports jax."""
        cached = self._device_cache
        if cached is not None and cached[0] == self._version:
            return cached[1]
        import jax.numpy as jnp

        arr = jnp.asarray(self._mapping)
        self._device_cache = (self._version, arr)
        return arr

    def translate_loc_from_full_to_swa(self, loc: Any) -> np.ndarray:
        """SWA slots of full slots ``loc`` (0 where unpaired; -1 for -1). Raises InvalidSlotError
        for ids outside ``[-1, size_full + page_size)``."""
        idx = as_index_array(loc, "translate_loc_from_full_to_swa")
        self._check_full_range(idx, "translate_loc_from_full_to_swa", allow_minus_one=True)
        return self._mapping[idx]

    def set_full_to_swa_mapping(self, full_slots: Any, swa_slots: Any) -> None:
        """Point full slots at SWA slots (SGLang: HiCache load-back, tombstone recovery). Both
        must be in use on their side, same length and same page offsets; raises InvalidSlotError,
        changing nothing, otherwise."""
        full, swa = _same_length_ids(full_slots, swa_slots, "set_full_to_swa_mapping", ("full", "SWA"))
        if full.size == 0:
            return
        self._check_in_use(self.full_attn_allocator, full, "set_full_to_swa_mapping (full side)")
        self._check_in_use(self.swa_attn_allocator, swa, "set_full_to_swa_mapping (SWA side)")
        ps = self.page_size
        bad = full % ps != swa % ps
        if bad.any():
            raise InvalidSlotError(
                f"set_full_to_swa_mapping: full and SWA slots differ in page offset: full {format_ids(full[bad])}, "
                f"SWA {format_ids(swa[bad])}"
            )
        self._mapping[full] = swa
        self._version += 1

    def move_swa_pairing(self, src_full: Any, dst_full: Any) -> None:
        """Give full slots ``dst_full`` (unpaired: their SWA part was freed) the SWA slots paired
        with ``src_full``, and unpair ``src_full`` (a freshly computed copy of the same tokens),
        so that freeing ``src_full`` afterwards frees only its full part. SGLang's
        ``RecoverSWAWithLockedFull``: a tree node whose full slots are locked by another request
        takes the SWA slots of an insert's duplicate instead of its full slots.

        Raises (unchanged): InvalidSlotError for different lengths or page offsets, slots not in
        use, ``src_full`` not all paired or ``dst_full`` not all unpaired.
        """
        src, dst = _same_length_ids(src_full, dst_full, "move_swa_pairing", ("source", "destination"))
        if src.size == 0:
            return
        full_side = self.full_attn_allocator
        self._check_in_use(full_side, src, "move_swa_pairing (source)")
        self._check_in_use(full_side, dst, "move_swa_pairing (destination)")
        if (src % self.page_size != dst % self.page_size).any():
            raise InvalidSlotError("move_swa_pairing: source and destination slots differ in page offset")
        swa = self._mapping[src]
        if (swa == 0).any():
            raise InvalidSlotError(f"move_swa_pairing: source slots without an SWA slot: {format_ids(src[swa == 0])}")
        taken = self._mapping[dst] != 0
        if taken.any():
            raise InvalidSlotError(f"move_swa_pairing: destination slots already paired: {format_ids(dst[taken])}")
        self._mapping[dst] = swa
        self._mapping[src] = 0
        self._version += 1

    # ------------------------------------------------------------------ state

    def clear(self) -> None:
        """Free everything on both sides and unpair every slot."""
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self._mapping[:-1] = 0
        self._version += 1

    def merge_and_sort_free(self) -> None:
        """Both sides' release lists into their free lists, sorted."""
        self.full_attn_allocator.merge_and_sort_free()
        self.swa_attn_allocator.merge_and_sort_free()

    def backup_state(self) -> SWAAllocatorState:
        """Snapshot both sides and the mapping (O(slots))."""
        mapping = self._mapping.copy()
        mapping.flags.writeable = False
        return SWAAllocatorState(
            self.full_attn_allocator.backup_state(), self.swa_attn_allocator.backup_state(), mapping
        )

    def restore_state(self, state: SWAAllocatorState) -> None:
        """Return to a snapshot from :meth:`backup_state`. Raises (unchanged) for a snapshot of
        another shape or inside a free group."""
        if not isinstance(state, SWAAllocatorState) or state.mapping.shape != self._mapping.shape:
            raise ValueError("restore_state: not a snapshot of this SWA allocator")
        if self.full_attn_allocator._group is not None:
            raise RuntimeError("restore_state inside a free group: call free_group_end() first")
        self.full_attn_allocator.restore_state(state.full)
        self.swa_attn_allocator.restore_state(state.swa)
        np.copyto(self._mapping, state.mapping)
        self._version += 1

    # ------------------------------------------------------------------ checks

    def _check_full_range(self, idx: np.ndarray, what: str, *, allow_minus_one: bool = False) -> None:
        lo = -1 if allow_minus_one else 0
        bad = (idx < lo) | (idx >= self._num_full_slots)
        if bad.any():
            raise InvalidSlotError(
                f"{what}: full slot ids out of range [{lo}, {self._num_full_slots}): {format_ids(idx[bad])}"
            )

    def _check_in_use(self, side: BaseTokenToKVPoolAllocator, idx: np.ndarray, what: str) -> np.ndarray:
        """Distinct pages of ``idx``; raises InvalidSlotError when any is out of range, the trash
        page, free, or pending in an open free group."""
        bad = (idx < 0) | (idx >= side._num_slots)
        if bad.any():
            raise InvalidSlotError(f"{what}: ids out of range [0, {side._num_slots}): {format_ids(idx[bad])}")
        pages = np.unique(idx // side.page_size)
        bad_pages = (pages == 0) | side._is_free[pages] | side._is_pending[pages]
        if bad_pages.any():
            raise InvalidSlotError(
                f"{what}: pages not in use (free, pending or the trash page): {format_ids(pages[bad_pages])}"
            )
        return pages

    # ------------------------------------------------------------------ alloc

    def _room(self, pages: int) -> bool:
        tokens = pages * self.page_size
        return (
            tokens <= self.full_attn_allocator.available_size() and tokens <= self.swa_attn_allocator.available_size()
        )

    def _pair(self, full: np.ndarray, swa: np.ndarray) -> None:
        """Pair newly handed-out full slots with SWA slots, whole pages at a time: a full page
        maps every offset to the same offset of its SWA page, so a later token continuing the
        page (``last_loc + 1``) is paired before it is written."""
        ps = self.page_size
        if ps == 1:
            self._mapping[full] = swa
        elif full.size:
            fp = full // ps
            first = np.ones(fp.size, bool)
            first[1:] = fp[1:] != fp[:-1]
            offsets = np.arange(ps, dtype=np.int32)
            self._mapping[(fp[first][:, None] * ps + offsets).ravel()] = (
                (swa[first] // ps)[:, None] * ps + offsets
            ).ravel()
        self._version += 1

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> int:
        """Evict from ``tree_cache`` until ``num_tokens`` can be allocated on both sides (SGLang's
        allocator-side scheduler hook): FULL eviction for what the full side lacks, SWA eviction for
        what the SWA side still lacks. Returns the full tokens evicted (cascades included)."""
        full_missing = max(0, int(num_tokens) - self.full_available_size())
        swa_missing = max(0, int(num_tokens) - self.swa_available_size())
        if not full_missing and not swa_missing:
            return 0
        counts = tree_cache.evict({"full": full_missing, "swa": swa_missing})
        return int(counts.get("full", 0))

    def alloc(self, need_size: int) -> np.ndarray | None:
        """``need_size`` full slots (a multiple of ``page_size``), each paired with a new SWA slot;
        None, handing out nothing, when either side has too little room.

        Raises:
            InvalidSlotError: ``need_size`` negative or not a multiple of ``page_size``.
        """
        need = page_aligned_count("alloc", "need_size", need_size, self.page_size, ALLOC_FIX)
        if not self._room(need // self.page_size):
            return None
        full = self.full_attn_allocator.alloc(need)
        swa = self.swa_attn_allocator.alloc(need)
        assert full is not None and swa is not None, "room was checked on both sides"
        self._pair(full, swa)
        return full

    def alloc_extend(
        self,
        prefix_lens: Any,
        seq_lens: Any,
        last_loc: Any,
        extend_num_tokens: int | None = None,
    ) -> np.ndarray | None:
        """Full slots for ``seq_lens - prefix_lens`` new tokens per request (the paged allocator's
        ``alloc_extend`` layout, see :class:`~kvjax.alloc.BaseTokenToKVPoolAllocator`), each paired
        with an SWA slot laid out the same way from the SWA side's ``last_loc``
        (``mapping[last_loc]``). None, handing out nothing, when either side lacks pages.

        Raises (unchanged): InvalidSlotError for what the full side's ``alloc_extend`` refuses, and
        for a request continuing a partial page whose SWA slot was freed.
        """
        prefix, seq, last = extend_lengths(prefix_lens, seq_lens, last_loc, "alloc_extend")
        full_call = self.full_attn_allocator.alloc_extend
        return self._alloc_paired(prefix, seq, last, extend_num_tokens, "alloc_extend", full_call)

    def alloc_decode(self, seq_lens: Any, last_loc: Any) -> np.ndarray | None:
        """One full slot per request for its token at position ``seq_len - 1``, paired with an SWA
        slot (``alloc_extend(seq_lens - 1, seq_lens, last_loc)``). None when either side lacks pages."""
        seq, last = decode_lengths(seq_lens, last_loc, "alloc_decode")
        return self._alloc_paired(seq - 1, seq, last, None, "alloc_decode", None)

    def _alloc_paired(
        self,
        prefix: np.ndarray,
        seq: np.ndarray,
        last: np.ndarray,
        extend_num_tokens: int | None,
        what: str,
        full_call: Any,
    ) -> np.ndarray | None:
        """Pair a full and an SWA extend of validated lengths (``extend_lengths``); ``full_call``
        None: the full side's ``alloc_decode``."""
        full_side, swa_side = self.full_attn_allocator, self.swa_attn_allocator
        full_side._check_last_loc(prefix, last, what)  # before the mapping is read at last_loc
        ps = self.page_size
        swa_last = self._mapping[last]
        lost = (prefix > 0) & (swa_last == 0)
        swa_prefix, swa_seq = prefix, seq
        if lost.any():
            partial = lost & (prefix % ps != 0)
            if partial.any():
                i = int(np.flatnonzero(partial)[0])
                raise InvalidSlotError(
                    f"{what}: request {i} continues a partial page (prefix_len={int(prefix[i])}, "
                    f"last_loc={int(last[i])}) whose SWA slot was already freed; free SWA slots only "
                    "on page boundaries behind the window"
                )
            # A page-aligned prefix whose SWA part left the window continues on fresh SWA pages:
            # an empty prefix of seq - prefix tokens takes the same pages, laid out the same way.
            swa_prefix = np.where(lost, 0, prefix)
            swa_seq = np.where(lost, seq - prefix, seq)
            swa_last = np.where(lost, -1, swa_last)
        swa_side._check_last_loc(swa_prefix, swa_last, f"{what} (SWA side)")
        pages = int((-(-seq // ps) - (-(-prefix // ps))).sum())
        if not self._room(pages):
            return None
        if full_call is None:
            full = full_side.alloc_decode(seq, last)
        else:
            full = full_call(prefix, seq, last, extend_num_tokens)
        swa = swa_side.alloc_extend(swa_prefix, swa_seq, swa_last)
        assert full is not None and swa is not None, "room was checked on both sides"
        self._pair(full, swa)
        return full

    # ------------------------------------------------------------------ free

    def _full_pages_slots(self, pages: np.ndarray) -> np.ndarray:
        """Every full slot of ``pages``."""
        ps = self.page_size
        if ps == 1:
            return pages
        return (pages[:, None] * ps + np.arange(ps)).ravel()

    def free(self, free_index: Any) -> None:
        """Return full slots (their whole pages at page size > 1) and the SWA slots paired with
        them; full slots whose SWA part was already freed (:meth:`free_swa`) free only their full
        part. Empty input is a no-op. Inside a free group both sides buffer.

        Raises (unchanged): what the full side's ``free`` raises (ids out of range, on the trash
        page, already free, repeated in one call at page size 1).
        """
        idx = as_index_array(free_index, "free")
        if idx.size == 0:
            return
        full_side = self.full_attn_allocator
        pages = full_side._pages_to_free(idx)  # validates, changes nothing
        slots = self._full_pages_slots(np.unique(pages).astype(np.int64))
        swa = self._mapping[slots]
        live = swa > 0
        full_side.free(idx)
        if live.any():
            self.swa_attn_allocator.free(swa[live])
            self._mapping[slots[live]] = 0
            self._version += 1

    def free_segment(self, free_index: Any, *, start_pos: int) -> None:
        """:meth:`free` for one segment of a request's row (``free_index`` in row order, row
        positions from the page-aligned ``start_pos``): both sides return the segment's pages in
        row order (SGLang's ``free_segment``, what the tree and the request lifecycle free
        through; see ``BaseTokenToKVPoolAllocator.free_segment``). Full slots whose SWA part was
        already freed free only their full part, as in :meth:`free`.

        Raises (unchanged): what the full side's ``free_segment`` raises.
        """
        idx = as_index_array(free_index, "free_segment")
        full_side = self.full_attn_allocator
        if idx.size == 0:
            full_side.free_segment(idx, start_pos=start_pos)  # still checks start_pos
            return
        pages = full_side._segment_pages(idx)  # validates, changes nothing
        slots = self._full_pages_slots(pages.astype(np.int64))
        swa = self._mapping[slots]
        live = swa > 0
        full_side.free_segment(idx, start_pos=start_pos)
        if live.any():
            # A paired full page maps whole onto one SWA page, offsets in order: an SWA segment.
            self.swa_attn_allocator.free_segment(swa[live], start_pos=0)
            self._mapping[slots[live]] = 0
            self._version += 1

    def free_swa_segment(self, free_index: Any, *, start_pos: int) -> None:
        """:meth:`free_swa` for one segment of a request's row (row order, page-aligned
        ``start_pos``): the SWA pages go back in row order (SGLang's ``free_swa_segment``: SWA
        tombstoning in the tree, a request's out-of-window positions).

        Raises (unchanged): InvalidSlotError for a ``start_pos`` not page aligned and what
        :meth:`free_swa` raises.
        """
        idx = as_index_array(free_index, "free_swa_segment")
        start_pos = page_aligned_count("free_swa_segment", "start_pos", start_pos, self.page_size, SEGMENT_FIX)
        if idx.size == 0:
            return
        full_side = self.full_attn_allocator
        self._check_in_use(full_side, idx, "free_swa_segment")
        ps = self.page_size
        if ps == 1:
            slots = idx
        else:
            fp = idx // ps
            starts = np.ones(fp.size, bool)
            starts[1:] = fp[1:] != fp[:-1]
            slots = self._full_pages_slots(fp[starts])
        swa = self._mapping[slots]
        gone = ~(swa > 0).reshape(-1, ps).any(axis=1)
        if gone.any():
            what = "slots" if ps == 1 else "pages"
            raise DoubleFreeError(
                f"free_swa_segment: the SWA part of full {what} {format_ids(slots[::ps][gone] // ps)} was already freed"
            )
        live = swa > 0
        self.swa_attn_allocator.free_segment(swa[live], start_pos=0)
        self._mapping[slots] = 0
        self._version += 1

    def free_swa(self, free_index: Any) -> None:
        """Free the SWA slots paired with full slots ``free_index`` (their whole full pages at page
        size > 1) and unpair them; the full slots stay allocated. For tokens that left the window
        (decode-time freeing) and SWA tombstones in the tree. Empty input is a no-op.

        Raises (unchanged): InvalidSlotError for ids out of range or full pages not in use;
        DoubleFreeError for full pages whose SWA part was already freed (naming them).
        """
        idx = as_index_array(free_index, "free_swa")
        if idx.size == 0:
            return
        pages = self._check_in_use(self.full_attn_allocator, idx, "free_swa")
        slots = self._full_pages_slots(pages.astype(np.int64))
        swa = self._mapping[slots]
        ps = self.page_size
        # A page is paired through the slots written so far (a partial last page maps only those).
        gone = ~(swa > 0).reshape(-1, ps).any(axis=1)
        if gone.any():
            what = "slots" if ps == 1 else "pages"
            raise DoubleFreeError(f"free_swa: the SWA part of full {what} {format_ids(pages[gone])} was already freed")
        swa = swa[swa > 0]
        self.swa_attn_allocator.free(swa)
        self._mapping[slots] = 0
        self._version += 1

    def free_group_begin(self) -> None:
        """Start buffering frees on both sides (groups do not nest: RuntimeError)."""
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        """Return every page freed since :meth:`free_group_begin`, on both sides."""
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()

    def leak_free(self, tree_cache: Any) -> bool:
        """With no request holding KV: ``available + evictable + protected == capacity`` on the
        full side and on the SWA side (a chunk cache holds nothing: both sides wholly available)."""
        full_cached = tree_cache.evictable_size() + tree_cache.protected_size()
        swa_sizes = getattr(tree_cache, "swa_evictable_size", None)
        swa_cached = swa_sizes() + tree_cache.swa_protected_size() if swa_sizes is not None else 0
        return (
            self.full_available_size() + full_cached == self.size_full
            and self.swa_available_size() + swa_cached == self.size_swa
        )

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError when the sides or the mapping disagree (O(slots))."""

        def fail(msg: str) -> None:
            raise AssertionError(f"SWATokenToKVPoolAllocator: {msg}")

        full_side, swa_side = self.full_attn_allocator, self.swa_attn_allocator
        full_side.check_invariants()
        swa_side.check_invariants()
        ps = self.page_size
        m = self._mapping
        if m[-1] != -1:
            fail("the mapping's last entry is not -1")
        body = m[:-1]
        mapped = np.flatnonzero(body)
        full_pages = mapped // ps
        in_use = ~(full_side._is_free | full_side._is_pending)
        in_use[0] = False
        if not in_use[full_pages].all():
            fail(f"mapped full slots not in use: {format_ids(mapped[~in_use[full_pages]])}")
        swa = body[mapped].astype(np.int64)
        if (swa < ps).any() or (swa >= swa_side._num_slots).any():
            fail("mapping points outside the SWA pool's allocatable slots")
        if not np.array_equal(swa % ps, mapped % ps):
            fail("a full slot and its SWA slot differ in page offset")
        if np.unique(swa).size != swa.size:
            fail("two full slots share an SWA slot")
        swa_in_use = ~(swa_side._is_free | swa_side._is_pending)
        swa_in_use[0] = False
        if not swa_in_use[swa // ps].all():
            fail("mapped SWA slots not in use")
        if ps > 1:
            per_page = np.bincount(full_pages, minlength=full_side.num_pages + 1)
            if ((per_page != 0) & (per_page != ps)).any():
                fail("a full page is partly paired (pages pair whole)")
            # Every mapped slot of a full page maps into one SWA page.
            pairs = np.unique(full_pages.astype(np.int64) * (swa_side.num_pages + 1) + swa // ps)
            if pairs.size != np.unique(full_pages).size or pairs.size != np.unique(swa // ps).size:
                fail("a full page is paired with several SWA pages, or an SWA page with several full pages")
        if np.unique(swa // ps).size != int(np.count_nonzero(swa_in_use)):
            fail(
                f"{int(np.count_nonzero(swa_in_use))} SWA pages in use but {np.unique(swa // ps).size} paired "
                "(an SWA page leaked)"
            )

    def __repr__(self) -> str:
        return (
            f"SWATokenToKVPoolAllocator(size_full={self.size_full}, size_swa={self.size_swa}, "
            f"page_size={self.page_size}, full_available={self.full_available_size()}, "
            f"swa_available={self.swa_available_size()})"
        )
