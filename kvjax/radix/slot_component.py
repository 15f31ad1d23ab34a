"""`NodeSlotComponent`: the base of tree components that keep one state slot on a node.

A recurrent-state checkpoint (:class:`~kvjax.radix.mamba_component.MambaComponent`, SGLang
0.5.23's MAMBA component) is such a component: a node may hold one slot of a state pool (the
state after the node's last token), and a prefix is reusable only up to the deepest node holding
one. The rules every such component shares live here:

* **data**: a :class:`NodeSlot` (``slot``, ``lock_ref``) in ``node.comp[name]``; absent = this
  component's tombstone on the node (the node keeps its FULL KV).
* **own recency**: an LRU over the nodes holding a slot (least recent first); the subclass
  decides which events refresh it.
* **match**: ends at the deepest matched node holding a slot (:meth:`_end_at_deepest_holder`).
* **locks**: the node itself, when it holds a slot; the receipt part is the node (None: nothing
  locked), so a lock taken on a tombstone never unlocks a slot given to the node later.
* **deletion**: a node leaving the tree frees its slot (``on_delete``; never a locked one).
* **sizes**, in slots: ``evictable + protected`` = the nodes holding a slot, ``protected`` = those
  locked. A node never holds more locks on its slot than on its FULL part.

The subclass frees slots (where they go back is its own) and decides eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvjax.radix.component import ComponentSizes, TreeComponent
from kvjax.radix.invariants import TreeInvariantError

if TYPE_CHECKING:
    from kvjax.radix.match import ComponentMatchResult
    from kvjax.radix.node import TreeNode

__all__ = ["NodeSlot", "NodeSlotComponent"]


class NodeSlot:
    """A slot held on a node, and how many locks hold it (>= 0)."""

    __slots__ = ("slot", "lock_ref")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.lock_ref = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(slot={self.slot}, lock_ref={self.lock_ref})"


class NodeSlotComponent(TreeComponent):
    """See the module docstring. ``held`` names a slot in error messages (``"checkpoint"``)."""

    held: str = "slot"

    def __init__(self) -> None:
        self._lru: OrderedDict[TreeNode, None] = OrderedDict()  # least recent first
        self._evictable = 0
        self._protected = 0

    # -- data -------------------------------------------------------------------------------------

    def _hold(self, node: TreeNode, data: NodeSlot) -> None:
        """Give ``node`` (holding no slot) ``data``: the most recent, unlocked holder."""
        self.set_data(node, data)
        self._lru[node] = None
        self._evictable += 1

    def _forget(self, node: TreeNode) -> None:
        """Take the unlocked slot off ``node`` (a tombstone now); the caller frees the slot."""
        del self._lru[node]
        self.set_data(node, None)
        self._evictable -= 1

    def _drop(self, node: TreeNode, data: NodeSlot) -> None:
        """Free the unlocked slot ``data`` of ``node``: :meth:`_forget` it, and the slot goes back
        to where the subclass takes slots from."""
        raise NotImplementedError

    def _forget_all(self) -> list[int]:
        """Forget every slot in the tree (at reset); returns them, least recent first, to free."""
        slots = [self.data(n).slot for n in self._lru]
        self._lru.clear()
        self._evictable = self._protected = 0
        return slots

    # -- match ------------------------------------------------------------------------------------

    def _end_at_deepest_holder(self, result: ComponentMatchResult) -> TreeNode:
        """Shorten ``result`` to its deepest node holding a slot; returns that node (the root
        when none does)."""
        root = self.tree.root
        node = result.last_node
        while node is not root and self.data(node) is None:
            node = node.parent
        if node is not result.last_node:
            result.shorten_to(node, root)
        return node

    # -- locks ------------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> Any:
        data = self.data(node)
        if data is None:
            return None
        data.lock_ref += 1
        if data.lock_ref == 1:
            self._evictable -= 1
            self._protected += 1
        return node

    def unlock(self, node: TreeNode, part: Any) -> None:
        if part is None:
            return
        data = self.data(part)
        if data is None or data.lock_ref <= 0:
            raise TreeInvariantError(f"{self.name}: unlocking node {part.id}, whose {self.held} is not locked")
        data.lock_ref -= 1
        if data.lock_ref == 0:
            self._evictable += 1
            self._protected -= 1

    # -- deletion ---------------------------------------------------------------------------------

    def on_delete(self, node: TreeNode) -> int:
        data = self.data(node)
        if data is None:
            return 0
        if data.lock_ref:
            raise TreeInvariantError(f"{self.name}: node {node.id} deleted while its {self.held} is locked")
        self._drop(node, data)
        return 1

    # -- sizes and checks -------------------------------------------------------------------------

    def sizes(self) -> ComponentSizes:
        return ComponentSizes(self._evictable, self._protected)

    def lru_order(self) -> list[TreeNode]:
        """The nodes holding a slot, least recently used first."""
        return list(self._lru)

    def check_invariants(self) -> None:
        self._check_holders()

    def _check_holders(self) -> set[TreeNode]:
        """Check the LRU, the sizes and the locks against the nodes holding a slot; returns them."""
        holders = {n for n in self.tree.nodes() if self.data(n) is not None}
        if holders != set(self._lru):
            raise TreeInvariantError(f"{self.name}: the LRU and the nodes holding a {self.held} differ")
        locked = sum(1 for n in holders if self.data(n).lock_ref)
        if (self._evictable, self._protected) != (len(holders) - locked, locked):
            raise TreeInvariantError(
                f"{self.name}: sizes {self._evictable}/{self._protected}, tree {len(holders) - locked}/{locked}"
            )
        for n in holders:
            if self.data(n).lock_ref > n.lock_ref:
                raise TreeInvariantError(f"{self.name}: node {n.id} locked more for its {self.held} than for FULL")
        return holders
