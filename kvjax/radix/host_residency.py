"""Host residency: nodes whose device copy is gone but that a component keeps (a host copy, a
recurrent-state checkpoint of a child), and the moves between residencies.

A device node's eviction (``_evict_device_leaf``) demotes it to host-only when a component keeps
it or it has host-only children, and deletes it otherwise; deletion cascades up through
childless host-only ancestors no component keeps (``_after_child_change``). An insert over a
host-only node (``_revive``) or a component's load-back (``revive_node``) makes it device-resident
again. Invariants (checked in ``invariants.py``): a host-only node holds no slots and no lock, has
no device descendant, and stays only while it has children or a component keeps it;
``_host_only`` counts such nodes, and the walks take their slow path only while it is non-zero.
"""

from __future__ import annotations

import numpy as np

from kvjax.radix.events import BlockRemoved
from kvjax.radix.keys import INT32
from kvjax.radix.lock import LockError
from kvjax.radix.node import DELETED, DEVICE, HOST_ONLY, TreeNode
from kvjax.radix.tree_state import TreeState


class HostResidency(TreeState):
    """The tree layer that moves nodes between device, host-only and deleted (module docstring)."""

    __slots__ = ()

    def _has_device_child(self, node: TreeNode) -> bool:
        """Whether ``node`` has a device-resident child (any child, while no node is host-only)."""
        if not self._host_only:
            return bool(node.children)
        return any(c.value is not None for c in node.children.values())

    def _revive(self, parent: TreeNode, node: TreeNode, values: np.ndarray | None, off: int, k: int) -> None:
        """Make the host-only ``node`` (``k`` key elements, ``values[off:off + k]`` incoming)
        device-resident again, keeping what components hold on it (a host copy)."""
        if values is None:
            v = np.arange(self._sim_next, self._sim_next + k, dtype=INT32)
            self._sim_next += k
        else:
            v = values[off : off + k].copy()
            if self._full.tracks:  # an allocator that refuses others' frees of the tree's slots
                self._full.hold(v)
        node.value = v
        node.residency = DEVICE
        self._host_only -= 1
        self._evictable += k  # host-only nodes are never locked
        leaves = self._leaves
        leaves.discard(parent)  # it has a device child now
        if node.lock_ref == 0 and not self._has_device_child(node):
            leaves.add(node)
            self._evq.defer_push(node)
        if self._events is not None:
            self._emit_stored(node)

    def synthesize_slots(self, n: int) -> np.ndarray:
        """``n`` fresh slot ids as a simulation insert would synthesize them (a tree without an
        allocator); for components that bring nodes back in simulation."""
        v = np.arange(self._sim_next, self._sim_next + n, dtype=INT32)
        self._sim_next += n
        return v

    def revive_node(self, node: TreeNode, values: np.ndarray) -> None:
        """Make the host-only ``node`` device-resident from ``values`` (its ``klen`` slot ids),
        for a component that brought its data back (a host tier's load-back). Its parent must
        be device-resident (or the root): revive a host-only chain from the top. Calls no
        hook; the component keeps its data on the node.

        Raises (tree unchanged): ValueError for a node that is not host-only in this tree, a
        host-only parent, or a wrong number of slots.
        """
        if not isinstance(node, TreeNode) or node.owner is not self._owner or node.residency != HOST_ONLY:
            raise ValueError(f"revive_node: {node!r} is not a host-only node of this tree")
        parent = node.parent
        if parent is not self.root and parent.residency != DEVICE:
            raise ValueError(f"revive_node: node {node.id}'s parent {parent.id} is host-only; revive it first")
        v = np.asarray(values)
        if v.shape != (node.klen,):
            raise ValueError(f"revive_node: {v.shape} slot ids for node {node.id} of {node.klen} key elements")
        self._revive(parent, node, v.astype(INT32), 0, node.klen)

    def _drop_device_copy(self, node: TreeNode) -> None:
        """Free a device node's slots (FULL) and take it out of FULL's sizes and candidates."""
        if node.lock_ref:
            raise LockError(f"node {node.id} is locked; a locked node's device copy cannot be dropped")
        self._full.free(node.value)  # first: a refused free leaves the node as it was
        self._leaves.discard(node)
        self._evictable -= node.klen
        node.value = None
        node.heap_seq = -1
        if self._events is not None:
            self._events.emit(BlockRemoved(block_hashes=list(node.hashes or ())))

    def _evict_device_leaf(self, node: TreeNode) -> None:
        """FULL eviction of one candidate leaf, with components: demote or delete, cascade."""
        parent = node.parent
        # Every component is asked (a host tier backs the node up in ``keeps_node`` under
        # write-back, even when host-only children would keep it anyway).
        kept = [c.keeps_node(node) for c in self._extra]
        keep = bool(node.children) or any(kept)
        self._drop_device_copy(node)
        if keep:
            node.residency = HOST_ONLY
            self._host_only += 1
            tracker = self._tracker
            for c in self._extra:
                freed = c.on_demote(node)
                if tracker is not None and freed:
                    tracker[c.name] += freed
        else:
            self._detach(node)
        self._after_child_change(parent)

    def _detach(self, node: TreeNode) -> None:
        """Take a childless node (device copy already gone) out of the tree; components free
        their data on it (counted as cascade in an ``evict({...})`` call)."""
        parent = node.parent
        del parent.children[node.ckey]
        if node.residency == HOST_ONLY:
            self._host_only -= 1
        node.residency = DELETED
        tracker = self._tracker
        for c in self._extra:
            freed = c.on_delete(node)
            if tracker is not None and freed:
                tracker[c.name] += freed

    def _after_child_change(self, parent: TreeNode) -> None:
        """A child of ``parent`` was deleted or demoted: delete childless host-only ancestors no
        component keeps (iteratively), or make a device parent an eviction candidate."""
        root = self.root
        while parent is not root:
            if parent.residency == HOST_ONLY:
                if parent.children or any(c.keeps_node(parent) for c in self._extra):
                    return
                grand = parent.parent
                self._detach(parent)
                parent = grand
                continue
            if parent.lock_ref == 0 and not self._has_device_child(parent) and parent not in self._leaves:
                self._leaves.add(parent)
                self._evq.push(parent)
            return

    def delete_leaf(self, node: TreeNode) -> None:
        """Delete a childless, FULL-unlocked node outright (for components' own eviction: e.g.
        Mamba state eviction on a leaf, SWA eviction of an unlocked leaf).

        Its device slots, if any, are freed (counted as ``full`` in an ``evict({...})`` call),
        every component's ``on_delete`` frees its data (the calling component clears its own
        first), and the ancestors cascade as in FULL eviction.

        Raises (tree unchanged): LockError for a node that is locked, has children, or is not
        in this tree.
        """
        if not isinstance(node, TreeNode) or node.owner is not self._owner or node.residency == DELETED:
            raise LockError(f"delete_leaf: {node!r} is not a node of this tree")
        if node is self.root or node.children or node.lock_ref:
            raise LockError(f"delete_leaf: node {node.id} is the root, has children or is locked")
        parent = node.parent
        if node.value is not None:
            tokens = node.klen
            self._drop_device_copy(node)
            if self._tracker is not None:
                self._tracker[self._full.name] += tokens
            self.stats.evicted_tokens += tokens
            self.stats.num_evictions += 1
        self._detach(node)
        self._after_child_change(parent)
