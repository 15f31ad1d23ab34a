"""`MambaComponent`: recurrent-state checkpoints on tree nodes (SGLang 0.5.23's MAMBA component).

A node may carry a *checkpoint*: one state slot of the recurrent-state pool holding the model's
recurrent state after the node's last token. A recurrent model can only resume from such a state,
so a prefix is reusable only up to the deepest checkpoint on its path. The rules, each on its hook
(``docs/architecture.md``, "Tree components", MAMBA):

* **data**: ``MambaData(slot, lock_ref)`` in ``node.comp["mamba"]``; absent = a state tombstone
  (the node keeps its FULL KV).
* **match** (``finalize_match``): the match ends at the deepest matched node carrying a
  checkpoint; ``full_kv_hit_length`` keeps the FULL-only length. ``extras["mamba"]`` is a
  :class:`MambaMatch`: the checkpoint slot to copy on write, and the branching length (the FULL
  hit rounded down to the checkpoint grid, when it lies past the checkpoint).
* **own recency**: an LRU over the nodes carrying a checkpoint, refreshed only where 0.5.23
  refreshes it: a match that ends on the node, and an insert that commits a checkpoint on it
  (new, revived, or already there). An insert walking over a node does not refresh it, and a
  split does not either.
* **locks** (``lock`` / ``unlock``): the node itself only, when it holds a checkpoint; the receipt
  part records it, so a lock taken on a tombstone never unlocks a state given later.
* **insert** (``commit_insert``): the payload is the donated slot for the insert's end node. A
  node without a checkpoint takes it (then ``mamba_max_states_per_path`` trims the path); a node
  that already has one keeps its own and the donated slot is handed back (the insert result):
  the caller frees it.
* **eviction** (``evict(k)``): least recent unlocked checkpoints first; a childless, FULL-unlocked
  node is deleted outright (FULL KV included, through ``tree.delete_leaf``); any other only frees
  its slot (a state tombstone). FULL eviction of a leaf frees its checkpoint too (``on_delete``).
* **per-path cap** (``mamba_max_states_per_path``, -1: none): after a checkpoint is committed on a
  node, while the root-to-node path holds more than the cap, the shallowest eligible checkpoint
  is freed: not the node itself, not locked, and on a node with exactly one child. A soft cap.
* **page size**: above 1 the state at a page boundary exists only with the extra buffer (the
  model tracks it into a ping-pong slot); without it the constructor refuses (SGLang asserts).

Slots come from and go back to a :class:`~kvjax.alloc.state_slots.StateSlotAllocator` (None for a
simulation tree that frees nothing). Sizes are in states: ``evictable + protected`` = checkpoints
in the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.errors import ConfigError
from kvjax.radix.invariants import TreeInvariantError
from kvjax.radix.retention import retained_last
from kvjax.radix.slot_component import NodeSlot, NodeSlotComponent

if TYPE_CHECKING:
    from kvjax.alloc.state_slots import StateSlotAllocator
    from kvjax.radix.match import ComponentMatchResult
    from kvjax.radix.node import TreeNode

__all__ = ["MambaComponent", "MambaData", "MambaMatch"]


class MambaData(NodeSlot):
    """A checkpoint on a node: its state slot and how many locks hold it."""

    __slots__ = ()


@dataclass(frozen=True)
class MambaMatch:
    """``MatchResult.extras["mamba"]``.

    Attributes:
        slot: the checkpoint slot of the match's last node (the state to fork into the request's
            slot), or None when the match is empty.
        branching_seqlen: SGLang's ``mamba_branching_seqlen``: the FULL-only hit rounded down to
            the checkpoint grid, when that lies past the checkpoint (a request that runs from the
            checkpoint to there could donate a new checkpoint at the branch point); else None.
    """

    slot: int | None
    branching_seqlen: int | None


class MambaComponent(NodeSlotComponent):
    """See the module docstring; the data, LRU, locks and sizes are :class:`NodeSlotComponent`'s.

    Args:
        allocator: where checkpoint slots are freed (None: free nothing, simulation).
        page_size: the tree's page size (> 1 needs ``enable_mamba_extra_buffer``).
        enable_mamba_extra_buffer: the request table tracks states at page boundaries.
        mamba_max_states_per_path: checkpoints kept per root-to-leaf path after an insert (-1: all).
        mamba_cache_chunk_size: the checkpoint grid of ``branching_seqlen`` (default: the page size).
    """

    name = "mamba"
    held = "checkpoint"

    def __init__(
        self,
        allocator: StateSlotAllocator | None = None,
        *,
        page_size: int = 1,
        enable_mamba_extra_buffer: bool = False,
        mamba_max_states_per_path: int = -1,
        mamba_cache_chunk_size: int | None = None,
    ) -> None:
        if page_size > 1 and not enable_mamba_extra_buffer:
            raise ConfigError(
                "page_size",
                page_size,
                "a recurrent-state tree needs page_size=1 unless enable_mamba_extra_buffer is set "
                "(the state at a page boundary exists only in the extra buffer's tracking slots)",
            )
        cap = mamba_max_states_per_path
        if isinstance(cap, bool) or not isinstance(cap, int) or cap == 0 or cap < -1:
            raise ConfigError("mamba_max_states_per_path", cap, "use -1 (no cap) or a positive integer")
        super().__init__()
        self.allocator = allocator
        self.page_size = int(page_size)
        self.enable_mamba_extra_buffer = bool(enable_mamba_extra_buffer)
        self.mamba_max_states_per_path = int(cap)
        grid = mamba_cache_chunk_size or page_size
        self.checkpoint_grid = max(int(grid), 1)
        self._held: dict[int, TreeNode] = {}  # checkpoint slot -> its node
        self.num_evicted = 0  # checkpoints freed by eviction (own, FULL cascade, per-path cap)

    # -- helpers ----------------------------------------------------------------------------------

    def _free_slot(self, slot: int) -> None:
        if self.allocator is not None:
            self.allocator.free([slot])

    def _drop(self, node: TreeNode, data: NodeSlot) -> None:
        """Free an unlocked checkpoint (counted in ``num_evicted``): out of the LRU and the sizes,
        slot to the allocator."""
        del self._held[data.slot]
        self._forget(node)
        self._free_slot(data.slot)
        self.num_evicted += 1

    def slot_of(self, node: TreeNode) -> int | None:
        """The checkpoint slot on ``node`` (None: a state tombstone, or the root)."""
        data = self.data(node)
        return None if data is None else data.slot

    def holds_slot(self, slot: int) -> bool:
        """Whether ``slot`` is a checkpoint in this tree (O(1))."""
        return slot in self._held

    # -- insert -----------------------------------------------------------------------------------

    def commit_insert(self, node: TreeNode, payload: Any) -> Any:
        if payload is None:
            return None
        slot = int(payload)
        if node is self.tree.root:
            return slot  # an empty key: nowhere to keep it
        data = self.data(node)
        if data is not None:
            self._lru.move_to_end(node)
            return slot  # the node keeps its checkpoint; the caller frees the donated slot
        self._hold(node, MambaData(slot))
        self._held[slot] = node
        if self.mamba_max_states_per_path > 0:
            self._trim_path(node)
        return None

    def attach_checkpoint(self, node: TreeNode, slot: int) -> None:
        """Give ``node`` (which must have no checkpoint) the checkpoint ``slot``.

        Raises ValueError (nothing changed) when the node already has one or is the root.
        """
        if node is self.tree.root:
            raise ValueError("attach_checkpoint: the root cannot hold a checkpoint")
        if self.data(node) is not None:
            raise ValueError(
                f"attach_checkpoint: node {node.id} already has a checkpoint (slot {self.data(node).slot}); "
                "free the new slot instead, or insert (which keeps the existing one and hands the slot back)"
            )
        self.commit_insert(node, slot)

    def _trim_path(self, tail: TreeNode) -> None:
        """``mamba_max_states_per_path``: free the shallowest eligible checkpoints of the path."""
        holders = []
        node = tail
        root = self.tree.root
        while node is not root:
            if self.data(node) is not None:
                holders.append(node)
            node = node.parent
        excess = len(holders) - self.mamba_max_states_per_path
        for node in reversed(holders):  # shallowest first
            if excess <= 0:
                break
            data = self.data(node)
            if node is tail or data.lock_ref or len(node.children) != 1:
                continue
            self._drop(node, data)
            excess -= 1

    # -- match ------------------------------------------------------------------------------------

    def finalize_match(self, result: ComponentMatchResult) -> None:
        node = self._end_at_deepest_holder(result)
        slot = None
        if node is not self.tree.root:
            self._lru.move_to_end(node)
            slot = self.data(node).slot
        grid = self.checkpoint_grid
        aligned = result.full_kv_hit_length // grid * grid
        branching = aligned if aligned > result.prefix_len else None
        result.extras[self.name] = MambaMatch(slot, branching)

    # -- eviction ---------------------------------------------------------------------------------

    def evict(self, amount: int) -> int:
        freed = 0
        # Least recent first, checkpoints of nodes retained at the retention clock last
        # (``retention.py``); a node whose checkpoint a deletion dropped meanwhile is skipped.
        for node in retained_last(self._lru, self.tree.retention_now):
            if freed >= amount:
                break
            data = self.data(node)
            if data is None or data.lock_ref:
                continue
            self._drop(node, data)
            freed += 1
            if not node.children and not node.lock_ref:
                self.tree.delete_leaf(node)  # a leaf goes, FULL KV included
        return freed

    def on_reset(self) -> None:
        slots = self._forget_all()
        self._held.clear()
        if self.allocator is not None and slots:
            self.allocator.free(slots)

    # -- sizes and checks -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        holders = self._check_holders()
        slots = [self.data(n).slot for n in holders]
        if len(set(slots)) != len(slots) or set(slots) != set(self._held):
            raise TreeInvariantError("mamba: a state slot is a checkpoint on two nodes, or the slot index is stale")
        if self.allocator is not None and slots and not self.allocator.is_live(slots).all():
            raise TreeInvariantError("mamba: a checkpoint slot is free in the allocator")
