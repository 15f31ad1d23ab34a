"""`StateSlotAllocator`: hands out recurrent-state slots (SGLang's ``MambaPool`` free list), on the host.

A recurrent-state pool (``kvjax.pools.recurrent``) has ``size + 1`` slots per layer; slot 0 is the
padding slot (padded batch rows read and write it) and is never handed out. Slots ``1..size``
are handed out FIFO, as SGLang's ``free_slots = arange(1, size + 1)`` list: ``alloc`` takes from
the head, ``free`` appends at the tail.

The allocator is the owner of slot liveness: a slot is *live* from ``alloc`` to ``free``. Device
ops cannot tell a live slot from a free one, so every caller that forks into or out of a slot asks
:meth:`check_live` first (``kvjax.pools.recurrent.fork_live_slots`` does).

Invariants (``check_invariants``):
* ``available_size() + live slots == size``;
* ``_is_free[s]`` is True exactly for the slots of the free list (slot 0 is never free).

Every call that raises leaves the allocator unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvjax.alloc.base import FifoFreeList, as_index_array, format_ids
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError

__all__ = ["StateSlotAllocator"]


class StateSlotAllocator:
    """Recurrent-state slots ``1..size`` (slot 0 reserved), FIFO.

    Args:
        size: allocatable state slots (SGLang's ``mamba_size``; the pool holds ``size + 1``).
    """

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ConfigError("mamba_size", size, "use a non-negative integer number of state slots")
        self.size = int(size)
        self._free = FifoFreeList(self.size)
        self._is_free = np.zeros(self.size + 1, bool)
        self.clear()

    def available_size(self) -> int:
        """Free state slots."""
        return len(self._free)

    def used_size(self) -> int:
        """Live state slots (held by requests or by the tree)."""
        return self.size - len(self._free)

    @property
    def free_slots(self) -> np.ndarray:
        """The free list, head (next to be handed out) first. A copy: O(free slots)."""
        return self._free.to_array()

    def clear(self) -> None:
        """Every slot free again, ``1..size`` in order (device contents are left as they are)."""
        self._free.set(np.arange(1, self.size + 1, dtype=np.int32))
        self._is_free[:] = True
        self._is_free[0] = False

    def alloc(self, need_size: int = 1) -> np.ndarray | None:
        """``need_size`` slots from the head of the free list (int32), or None (unchanged) if too few.

        Unlike SGLang's ``MambaPool.alloc`` this does not zero the slots' state (device state
        belongs to the pool): zero them with ``RecurrentStatePool.zero_slots`` or start the
        request from no initial state.
        """
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)) or need_size < 0:
            raise InvalidSlotError(
                f"StateSlotAllocator.alloc: need_size must be a non-negative integer, got {need_size!r}"
            )
        if need_size > len(self._free):
            return None
        slots = self._free.take(int(need_size))
        self._is_free[slots] = False
        return slots

    def _checked(self, slots: Any, what: str) -> np.ndarray:
        ids = as_index_array(slots, what)
        bad = (ids < 1) | (ids > self.size)
        if bad.any():
            raise InvalidSlotError(
                f"{what}: state slots outside [1, {self.size}]: {format_ids(ids[bad])} "
                "(slot 0 is the padding slot; pass slots this allocator handed out)"
            )
        return ids

    def free(self, slots: Any) -> None:
        """Return live slots to the tail of the free list, in the given order.

        Raises (allocator unchanged): ``InvalidSlotError`` for slot 0 or a slot outside
        ``[1, size]``; ``DoubleFreeError`` for a slot already free or given twice.
        """
        if type(slots) is list and len(slots) == 1 and type(slots[0]) is int:
            s = slots[0]  # the tree's one-checkpoint frees: no numpy validation round trip
            if 1 <= s <= self.size and not self._is_free[s]:
                self._is_free[s] = True
                self._free.give(np.array(slots, np.int32))
                return
        ids = self._checked(slots, "StateSlotAllocator.free")
        if ids.size == 0:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            raise DoubleFreeError(
                f"StateSlotAllocator.free: state slots given more than once: {format_ids(uniq[counts > 1])}"
            )
        bad = self._is_free[ids]
        if bad.any():
            raise DoubleFreeError(
                f"StateSlotAllocator.free: state slots already free (double free): {format_ids(ids[bad])}"
            )
        self._is_free[ids] = True
        self._free.give(ids.astype(np.int32))

    def is_live_slot(self, slot: int) -> bool:
        """Whether the one slot ``slot`` is live (O(1), no numpy conversion)."""
        return 1 <= slot <= self.size and not self._is_free[slot]

    def is_live(self, slots: Any) -> np.ndarray:
        """Per slot: handed out and not freed since (bool array; out-of-range slots are False)."""
        ids = as_index_array(slots, "StateSlotAllocator.is_live")
        ok = (ids >= 1) & (ids <= self.size)
        live = np.zeros(ids.shape, bool)
        live[ok] = ~self._is_free[ids[ok]]
        return live

    def check_live(self, slots: Any, what: str) -> np.ndarray:
        """Raise ``InvalidSlotError`` naming the slots of ``slots`` that are not live (free, 0 or
        out of range); return them as int64 numpy. For callers about to read or write them."""
        ids = self._checked(slots, what)
        dead = self._is_free[ids]
        if dead.any():
            raise InvalidSlotError(
                f"{what}: state slots {format_ids(ids[dead])} are free; only slots handed out by alloc "
                "(and not freed since) hold a state"
            )
        return ids

    def check_invariants(self) -> None:
        """Raise AssertionError when the free list and the bitmap disagree (O(size))."""
        free = self._free.to_array()
        counts = np.bincount(free, minlength=self.size + 1)
        if (counts > 1).any():
            raise AssertionError(f"StateSlotAllocator: slots listed twice: {format_ids(np.flatnonzero(counts > 1))}")
        if counts[0]:
            raise AssertionError("StateSlotAllocator: slot 0 is on the free list")
        if not np.array_equal(counts.astype(bool), self._is_free):
            raise AssertionError("StateSlotAllocator: free bitmap disagrees with the free list")

    def __repr__(self) -> str:
        return f"StateSlotAllocator(size={self.size}, available={self.available_size()})"
