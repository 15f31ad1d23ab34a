"""`HybridReqToTokenPool`: the request table of hybrid SSM models, with a recurrent-state slot per
request (SGLang's ``HybridReqToTokenPool``), on the host in numpy.

A request gets a row and a state slot when admitted (:meth:`alloc_reqs`) and gives the slot back
when done (:meth:`free_mamba_cache`; the row with :meth:`free_req` / ``free``). A request that
already has a slot (the tree forked a checkpoint into one at its match, or it is a chunked
request being re-admitted) keeps it.

**Extra buffer** (``enable_mamba_extra_buffer``, SGLang's "mamba cache v2"): each request also
holds ``mamba_ping_pong_size`` ping-pong slots where the model tracks its state at checkpoint
positions (page boundaries), so a prefix can be cached at a page boundary while the running
state moves on; this is what lets ``page_size`` exceed 1. The slot with the last tracked state
(``req.mamba_last_track_idx``) is the one donated to the tree; the other is freed.

Slot ownership: every live state slot is held by exactly one of a running request (its
``mamba_pool_idx`` or ping-pong slots) or the tree (a checkpoint). With the state allocator:
``available + held by requests + held by the tree == mamba_size`` (``check_invariants`` checks
the requests' part against the table).

Differences from SGLang: ``alloc_reqs`` returns None and changes nothing when rows or state slots
run out (SGLang asserts "increase --mamba-full-memory-ratio"), so a scheduler can evict and retry.
Slots are not zeroed at allocation (device state belongs to the pool): a request without a
forked checkpoint starts from no initial state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.alloc.base import format_ids
from kvjax.alloc.state_slots import StateSlotAllocator
from kvjax.errors import ConfigError, InvalidSlotError
from kvjax.req_pool import ReqToTokenPool

if TYPE_CHECKING:
    from kvjax.request import Req

__all__ = ["HybridReqToTokenPool"]


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows plus recurrent-state slots.

    Args:
        size: request rows.
        max_context_len: tokens per row.
        mamba_size: allocatable state slots (a new :class:`StateSlotAllocator`), or
        mamba_allocator: an existing one (shared with a tree).
        enable_mamba_extra_buffer: ping-pong tracking slots per request (see module docstring).
        mamba_ping_pong_size: ping-pong slots per request with the extra buffer (SGLang: 2 with
            the overlap scheduler, 1 without; kvjax's plan sets 2 aside).

    Attributes:
        mamba_allocator: the state-slot allocator (owner of slot liveness).
        req_index_to_mamba_index_mapping: int32 ``[size]``, the state slot of each row's request
            (0 for none).
        req_index_to_mamba_ping_pong_track_buffer_mapping: int32 ``[size, mamba_ping_pong_size]``
            with the extra buffer, else None.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        *,
        mamba_size: int | None = None,
        mamba_allocator: StateSlotAllocator | None = None,
        enable_mamba_extra_buffer: bool = False,
        mamba_ping_pong_size: int = 2,
    ) -> None:
        if (mamba_size is None) == (mamba_allocator is None):
            raise ConfigError("mamba_size", mamba_size, "give exactly one of mamba_size and mamba_allocator")
        if mamba_ping_pong_size not in (1, 2):
            raise ConfigError("mamba_ping_pong_size", mamba_ping_pong_size, "use 1 or 2")
        super().__init__(size, max_context_len)
        self.mamba_allocator = (
            mamba_allocator if mamba_allocator is not None else StateSlotAllocator(int(mamba_size or 0))
        )
        self.enable_mamba_extra_buffer = bool(enable_mamba_extra_buffer)
        self.mamba_ping_pong_size = int(mamba_ping_pong_size)
        self.req_index_to_mamba_index_mapping = np.zeros(self.size, np.int32)
        self.req_index_to_mamba_ping_pong_track_buffer_mapping = (
            np.zeros((self.size, self.mamba_ping_pong_size), np.int32) if self.enable_mamba_extra_buffer else None
        )

    @property
    def mamba_pool_size(self) -> int:
        return self.mamba_allocator.size

    # --- admission ------------------------------------------------------------------------------

    def state_slots_needed(self, reqs: Sequence[Req]) -> int:
        """The state slots ``alloc_reqs(reqs)`` takes: one per request without a slot, plus
        ``mamba_ping_pong_size`` per request without ping-pong slots when the extra buffer is on."""
        n = sum(1 for r in reqs if r.mamba_pool_idx is None)
        if self.enable_mamba_extra_buffer:
            n += self.mamba_ping_pong_size * sum(1 for r in reqs if r.mamba_ping_pong_track_buffer is None)
        return n

    def alloc_reqs(self, reqs: Sequence[Req]) -> list[int] | None:
        """Give each request a row (unless it has one), a state slot (unless it has one) and, with
        the extra buffer, its ping-pong slots (once per request). All or nothing: None, with
        nothing changed, when rows or state slots are short (``state_slots_needed`` of them).
        Returns the rows, in order."""
        need_rows = [r for r in reqs if r.req_pool_idx is None]
        need_slot = [r for r in reqs if r.mamba_pool_idx is None]
        need_pp = [r for r in reqs if self.enable_mamba_extra_buffer and r.mamba_ping_pong_track_buffer is None]
        n_states = self.state_slots_needed(reqs)
        if len(need_rows) > self.available_size() or n_states > self.mamba_allocator.available_size():
            return None
        for r in reqs:
            if r.mamba_pool_idx is not None:
                self.mamba_allocator.check_live([r.mamba_pool_idx], f"request {r.rid!r} mamba_pool_idx")
        rows = self.alloc(len(need_rows))
        slots = self.mamba_allocator.alloc(n_states)
        assert rows is not None and slots is not None
        for r, row in zip(need_rows, rows, strict=True):
            r.req_pool_idx = int(row)
        k = 0
        for r in need_slot:
            r.mamba_pool_idx = int(slots[k])
            k += 1
        for r in need_pp:
            r.mamba_ping_pong_track_buffer = slots[k : k + self.mamba_ping_pong_size].copy()
            k += self.mamba_ping_pong_size
        for r in reqs:
            row = int(r.req_pool_idx)  # type: ignore[arg-type]
            self.req_index_to_mamba_index_mapping[row] = int(r.mamba_pool_idx)  # type: ignore[arg-type]
            table = self.req_index_to_mamba_ping_pong_track_buffer_mapping
            if table is not None and r.mamba_ping_pong_track_buffer is not None:
                table[row] = r.mamba_ping_pong_track_buffer
        return [int(r.req_pool_idx) for r in reqs]  # type: ignore[arg-type]

    # --- release --------------------------------------------------------------------------------

    def free_mamba_cache(self, req: Req, mamba_ping_pong_track_buffer_to_keep: int | None = None) -> None:
        """Free the request's state slot and its ping-pong slots, except the ping-pong slot at index
        ``mamba_ping_pong_track_buffer_to_keep`` (donated to the tree). Clears the request's fields.

        Raises ``InvalidSlotError`` (nothing freed) for a keep index outside the ping-pong slots,
        ``DoubleFreeError`` for a slot already free.
        """
        free: list[int] = []
        if req.mamba_pool_idx is not None:
            free.append(int(req.mamba_pool_idx))
        pp = req.mamba_ping_pong_track_buffer
        if pp is not None:
            keep = mamba_ping_pong_track_buffer_to_keep
            if keep is not None and not 0 <= keep < pp.size:
                raise InvalidSlotError(
                    f"free_mamba_cache: keep index {keep} outside the request's {pp.size} ping-pong slots"
                )
            free += [int(s) for i, s in enumerate(pp) if i != keep]
        self.mamba_allocator.free(np.asarray(free, np.int64))
        if req.req_pool_idx is not None and 0 <= int(req.req_pool_idx) < self.size:
            self.req_index_to_mamba_index_mapping[int(req.req_pool_idx)] = 0
            table = self.req_index_to_mamba_ping_pong_track_buffer_mapping
            if table is not None:
                table[int(req.req_pool_idx)] = 0
        req.mamba_pool_idx = None
        req.mamba_ping_pong_track_buffer = None
        req.mamba_last_track_idx = None
        req.mamba_last_track_seqlen = None

    def detach_mamba_slot(self, req: Req) -> int:
        """The request's state slot now belongs to someone else (the tree took it as a checkpoint):
        clear it from the request and the table without freeing it. Returns the slot."""
        if req.mamba_pool_idx is None:
            raise InvalidSlotError(f"detach_mamba_slot: request {req.rid!r} holds no state slot")
        slot = int(req.mamba_pool_idx)
        if req.req_pool_idx is not None and 0 <= int(req.req_pool_idx) < self.size:
            self.req_index_to_mamba_index_mapping[int(req.req_pool_idx)] = 0
        req.mamba_pool_idx = None
        return slot

    def free_req(self, req: Req) -> None:
        """Free the request's row (not its state slots: :meth:`free_mamba_cache` does) and clear
        ``req.req_pool_idx``."""
        if req.req_pool_idx is None:
            raise InvalidSlotError(f"free_req: request {req.rid!r} holds no row")
        self.free([int(req.req_pool_idx)])
        req.req_pool_idx = None

    # --- lookups --------------------------------------------------------------------------------

    def get_mamba_indices(self, rows: Any) -> np.ndarray:
        """The state slots of the requests in ``rows`` (int32; 0 for a row without one)."""
        ids = np.asarray(rows, np.int64).ravel()
        bad = (ids < 0) | (ids >= self.size)
        if bad.any():
            raise InvalidSlotError(f"get_mamba_indices: rows out of range [0, {self.size}): {format_ids(ids[bad])}")
        return self.req_index_to_mamba_index_mapping[ids]

    def get_mamba_ping_pong_other_idx(self, idx: int) -> int:
        """The other ping-pong index (the same one when there is a single slot)."""
        return (int(idx) + 1) % self.mamba_ping_pong_size

    def get_mamba_ping_pong_keep_idx(self, req: Req) -> int | None:
        """Index of the ping-pong slot holding the request's last tracked state (None: none tracked)."""
        return req.mamba_last_track_idx

    def donate_mamba_ping_pong_slot(self, req: Req, new_slot: int) -> int:
        """Hand the ping-pong slot with the last tracked state to the caller (the tree) and put
        ``new_slot`` (live, freshly allocated) in its place. Returns the donated slot."""
        pp = req.mamba_ping_pong_track_buffer
        keep = req.mamba_last_track_idx
        if pp is None or keep is None:
            raise InvalidSlotError(f"donate_mamba_ping_pong_slot: request {req.rid!r} has no tracked state to donate")
        self.mamba_allocator.check_live([new_slot], "donate_mamba_ping_pong_slot new_slot")
        donated = int(pp[keep])
        pp[keep] = int(new_slot)
        table = self.req_index_to_mamba_ping_pong_track_buffer_mapping
        if table is not None and req.req_pool_idx is not None:
            table[int(req.req_pool_idx)] = pp
        return donated

    def check_invariants(self) -> None:
        """The row table (base class) and the state allocator (O(size))."""
        super().check_invariants()
        self.mamba_allocator.check_invariants()
        used = self.req_index_to_mamba_index_mapping[~self._is_free]
        if used.size and not self.mamba_allocator.is_live(used[used > 0]).all():
            raise AssertionError("HybridReqToTokenPool: a running row maps to a free state slot")

    def __repr__(self) -> str:
        return (
            f"HybridReqToTokenPool(size={self.size}, max_context_len={self.max_context_len}, "
            f"available={self.available_size()}, mamba={self.mamba_allocator!r}, "
            f"extra_buffer={self.enable_mamba_extra_buffer})"
        )
