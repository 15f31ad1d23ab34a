"""A test component that uses every hook of the component interface: per-node state slots.

``StateSlotComponent`` ("state") is shaped like SGLang 0.5.23's recurrent-state (Mamba)
component with a host tier's residency folded in, so one component exercises every rule that
the real SWA, Mamba and host-tier components will need (``docs/architecture.md`` maps them):

* data: a node may hold one *state slot* from :class:`StatePool` (the state after the node's
  last token); absent = this component's tombstone;
* insert payload: a donated slot for the insert's end node (``commit_insert``); an end node that
  already holds one keeps it and the donated slot is handed back (the caller frees it);
* overlap: an insert walking over a node refreshes that node's state recency;
* own recency: an LRU over the nodes holding a state (refreshed by inserts walking over them,
  by commits, and by matches that end on them), independent of FULL's;
* match finalisation: a match ends at the deepest device node holding a state; results:
  that slot (to copy on write) and the host-hit length (host-only tokens past the device match);
* lock scope: the node itself (if it holds a state);
* own eviction (``evict({"state": k})``): least recent unlocked states first; on a node with
  children, or whose FULL part is locked, only the slot is freed (tombstone); on a childless
  FULL-unlocked node the node is deleted outright, FULL KV included;
* residency: a node holding a state is kept host-only when FULL evicts its device copy (the
  state plays the host copy).
"""

from __future__ import annotations

from typing import Any

from kvjax.radix import ComponentMatchResult, NodeSlot, NodeSlotComponent, TreeNode


class StatePool:
    """Slots ``0 .. capacity - 1``; records every free in order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity))
        self.freed: list[int] = []

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.capacity:
            raise AssertionError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)
        self.freed.append(slot)

    def take(self) -> list[int]:
        out, self.freed = self.freed, []
        return out


class StateSlotComponent(NodeSlotComponent):
    """See the module docstring. ``pool`` is where state slots come from and go back to. The
    data, LRU, locks, sizes and checks are :class:`NodeSlotComponent`'s."""

    name = "state"
    held = "state"

    def __init__(self, pool: StatePool) -> None:
        super().__init__()
        self.pool = pool

    # -- helpers

    def _touch(self, node: TreeNode) -> None:
        if node in self._lru:
            self._lru.move_to_end(node)

    def _drop(self, node: TreeNode, data: NodeSlot) -> None:
        self._forget(node)
        self.pool.free(data.slot)

    # -- insert

    def on_insert_overlap(self, node: TreeNode, payload: Any, revived: bool) -> None:
        self._touch(node)

    def commit_insert(self, node: TreeNode, payload: Any) -> Any:
        if payload is None:
            return None
        if node is self.tree.root or self.data(node) is not None:
            self._touch(node)
            return payload  # the end node keeps its state: the donated slot goes back
        self._hold(node, NodeSlot(int(payload)))
        return None

    # on_split: the state belongs to the node's end, which stays with ``child`` (the same
    # object); the new parent gets none. Nothing to do.

    # -- match

    def finalize_match(self, result: ComponentMatchResult) -> None:
        root = self.tree.root
        host_hit = result.walk_node.depth - result.prefix_len if result.walk_node is not root else 0
        node = self._end_at_deepest_holder(result)
        data = None if node is root else self.data(node)
        if data is not None:
            self._touch(node)
        result.extras[self.name] = {"slot": None if data is None else data.slot, "host_hit_length": host_hit}

    # -- eviction and residency

    def evict(self, amount: int) -> int:
        freed = 0
        for node in list(self._lru):
            if freed >= amount:
                break
            data = self.data(node)
            if data.lock_ref:
                continue
            self._drop(node, data)
            freed += 1
            if not node.children and not node.lock_ref:
                self.tree.delete_leaf(node)  # a leaf: deleted outright, FULL KV included
        return freed

    def keeps_node(self, node: TreeNode) -> bool:
        return self.data(node) is not None

    def on_reset(self) -> None:
        for slot in self._forget_all():
            self.pool.free(slot)
