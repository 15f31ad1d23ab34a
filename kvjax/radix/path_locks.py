"""Path locks: a request's lock on a node holds the node and every ancestor against eviction.

FULL's scope is the path to the root: each node whose lock count goes 0 -> 1 moves its tokens
from evictable to protected (and leaves the eviction candidates); 1 -> 0 moves them back. Each
component then locks its own scope, and its part goes into the :class:`LockReceipt`.
Invariants (checked in ``invariants.py``): lock counts are never negative, a parent holds at
least the sum of its children's, host-only nodes hold none; an error leaves every count as it
was. Receipts and errors are in ``lock.py``.
"""

from __future__ import annotations

from typing import Any

from kvjax.radix.lock import LockError, LockReceipt
from kvjax.radix.node import HOST_ONLY, TreeNode
from kvjax.radix.walk import TreeWalk


class PathLocks(TreeWalk):
    """The tree layer of lock counts (module docstring)."""

    __slots__ = ()

    def _check_node(self, node: Any, what: str) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: expected a TreeNode or LockReceipt, got {type(node).__name__}")
        if node.owner is not self._owner:
            raise LockError(f"{what}: node {node.id} does not belong to this tree (another tree, or before reset())")
        if node.residency == HOST_ONLY:
            raise LockError(
                f"{what}: node {node.id} is host-only (its device copy was evicted); "
                "lock a device-resident node (the match's last_node), or bring it back first"
            )
        if node.value is None:
            raise LockError(f"{what}: node {node.id} was evicted; lock a node before it can be evicted")

    def inc_lock_ref(self, node: Any) -> LockReceipt:
        """Lock ``node`` and every ancestor (the node itself included) against eviction.

        FULL's scope is the path to the root: each node whose lock count goes 0 -> 1 moves its
        tokens from evictable to protected. Each component then locks its own scope and its
        part goes into the receipt. Returns a receipt for ``dec_lock_ref`` (its ``delta`` is
        SGLang's return value, FULL tokens). Raises :class:`LockError` for a host-only, evicted
        or foreign node.
        """
        root = self.root
        if node is None or node is root:
            return LockReceipt(node, 0, None, self._owner)
        if type(node) is not TreeNode or node.owner is not self._owner or node.value is None:
            self._check_node(node, "inc_lock_ref")  # raises the precise error
        leaves = self._leaves
        delta = 0
        n = node
        while n is not root:
            if n.lock_ref == 0:
                delta -= n.klen
                leaves.discard(n)
            n.lock_ref += 1
            n = n.parent
        self._evictable += delta
        self._protected -= delta
        parts = tuple(c.lock(node) for c in self._extra) if self._extra else None
        return LockReceipt(node, delta, parts, self._owner)

    def dec_lock_ref(self, node_or_receipt: Any) -> int:
        """Release a lock taken by ``inc_lock_ref`` (pass its receipt, or the node).

        Returns the tokens that became evictable. Raises :class:`LockError` — leaving the
        tree unchanged — for a receipt released twice, a node not locked (unlock below zero),
        an evicted node, or a node of another tree or of a tree generation before ``reset``.
        """
        receipt = None
        parts = None
        x = node_or_receipt
        if isinstance(x, LockReceipt):
            if x.released:
                raise LockError(f"dec_lock_ref: {x!r} was already released")
            if x.node is not None and x.node is not self.root and x.owner is not self._owner:
                raise LockError(f"dec_lock_ref: {x!r} belongs to another tree or to one before reset()")
            receipt, parts, x = x, x.parts, x.node
        root = self.root
        if x is None or x is root:
            if receipt is not None:
                receipt.released = True
            return 0
        if type(x) is not TreeNode or x.owner is not self._owner or x.value is None:
            self._check_node(x, "dec_lock_ref")  # raises the precise error
        # One pass; on an unlock below zero the decrements made so far are undone before
        # raising, so an error leaves every count as it was.
        delta = 0
        n = x
        while n is not root:
            lr = n.lock_ref
            if lr <= 0:
                u = x
                while u is not n:
                    u.lock_ref += 1
                    u = u.parent
                where = "" if n is x else f" (ancestor {n.id} of node {x.id})"
                raise LockError(f"dec_lock_ref: node {n.id}{where} is not locked (lock_ref would go below zero)")
            n.lock_ref = lr - 1
            if lr == 1:
                delta += n.klen
            n = n.parent
        # Only x can become an evictable leaf: every ancestor has x as a device child.
        if x.lock_ref == 0 and (not x.children or (self._host_only and not self._has_device_child(x))):
            self._leaves.add(x)
            self._evq.defer_push(x)
        self._evictable += delta
        self._protected -= delta
        if self._extra:
            for i, c in enumerate(self._extra):
                c.unlock(x, parts[i] if parts else None)
        if receipt is not None:
            receipt.released = True
        return delta

    def _move_lock(self, old: Any, new_node: TreeNode) -> LockReceipt:
        """Move a request's lock from ``old`` (receipt or node) to ``new_node``.

        When the old node is an ancestor-or-self of ``new_node`` (always so in the request
        lifecycle) only the nodes in between are touched: O(new nodes), not O(depth).
        """
        if isinstance(old, LockReceipt):
            if old.released:
                raise LockError(f"the request's lock {old!r} was already released")
            old_node = old.node
        else:
            old_node = old
        if old_node is None:
            old_node = self.root
        if old_node is not self.root:
            self._check_node(old_node, "move lock")
            if old_node.lock_ref <= 0:
                raise LockError(f"the request's last node {old_node.id} is not locked")
        if new_node is old_node:
            if isinstance(old, LockReceipt):
                return old
            return LockReceipt(new_node, 0, None, self._owner)
        if self._extra:
            new = self.inc_lock_ref(new_node)
            self.dec_lock_ref(old)
            return new
        path = []
        root = self.root
        n = new_node
        while n is not old_node and n is not root:
            path.append(n)
            n = n.parent
        if n is not old_node:  # not an ancestor: lock the new path, then release the old one
            new = self.inc_lock_ref(new_node)
            self.dec_lock_ref(old)
            return new
        delta = 0
        leaves = self._leaves
        for n in path:
            if n.lock_ref == 0:
                delta -= n.klen
                leaves.discard(n)
            n.lock_ref += 1
        self._evictable += delta
        self._protected -= delta
        if isinstance(old, LockReceipt):
            old.released = True
        return LockReceipt(new_node, delta, None, self._owner)
