"""The tree core's whole-tree check (tests and debugging; O(tree)).

``check_core_invariants(tree)`` is what ``RadixTree.check_full_invariants`` runs; components
check their own data in their ``check_invariants``. It reads the layers' fields: it is the
tree's own check, not a component.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvjax.radix.keys import decode_tokens
from kvjax.radix.node import DELETED, DEVICE

if TYPE_CHECKING:
    from kvjax.radix.tree_state import TreeState


class TreeInvariantError(RuntimeError):
    """``sanity_check`` found the tree inconsistent (a bug, never bad input)."""


def check_core_invariants(tree: TreeState) -> None:
    """Walk the whole tree and check the core's and FULL's invariants (O(tree)).

    Checks: parent/child links and child keys, page-aligned edges with one slot per key
    element on device nodes, depths, residency (device nodes root-closed; host-only nodes
    unlocked, slot-less, and childless only while a component keeps them), lock counts
    (never negative; a parent holds at least its children's), the evictable-leaf set, both
    size counters, the host-only count, and that no slot id is cached twice.
    """
    ps, ex = tree.page_size, tree._ex

    def fail(msg: str) -> None:
        raise TreeInvariantError(f"check_invariants: {msg}\n{tree.pretty_print()}")

    evictable = protected = host_only = 0
    leaves = set()
    vals: list[np.ndarray] = []
    stack = [tree.root]
    while stack:
        node = stack.pop()
        child_locks = 0
        device_children = 0
        for ck, child in node.children.items():
            if child.parent is not node:
                fail(f"node {child.id} has a wrong parent")
            if child.owner is not tree._owner or child.residency == DELETED:
                fail(f"node {child.id} is deleted or stale but still linked")
            if child.key is None and child.klist is None:
                if child.kshare is None:
                    fail(f"node {child.id} has no key")
                elif len(child.kshare) - child.kshare_from != child.klen + ex:
                    fail(f"node {child.id}: its shared key list holds {len(child.kshare) - child.kshare_from} tokens")
            elif child.kshare is not None:
                fail(f"node {child.id} keeps a shared key list beside its own key")
            if child.key is not None and child.klist is not None and decode_tokens(child.key) != list(child.klist):
                fail(f"node {child.id}: its two key forms differ")
            if ck != tree._child_key(node, child) or child.ckey != ck:
                fail(f"node {child.id} is filed under a wrong child key")
            if child.klen <= 0 or child.klen % ps:
                fail(f"node {child.id}: klen {child.klen}, page {ps}")
            if child.residency == DEVICE:
                if child.value is None or len(child.value) != child.klen:
                    fail(f"node {child.id}: device node with {child.value!r} slots for klen {child.klen}")
                if node is not tree.root and node.residency != DEVICE:
                    fail(f"node {child.id}: device node under host-only node {node.id}")
                device_children += 1
            else:
                host_only += 1
                if child.value is not None or child.lock_ref:
                    fail(f"node {child.id}: host-only node with slots or locks")
                if not child.children and not any(c.keeps_node(child) for c in tree._extra):
                    fail(f"node {child.id}: childless host-only node that no component keeps")
            if len(child.token_ids()) != child.klen + ex:
                fail(f"node {child.id}: {len(child.token_ids())} key tokens for klen {child.klen}")
            if child.depth != node.depth + child.klen:
                fail(f"node {child.id}: depth {child.depth} != {node.depth} + {child.klen}")
            if node is not tree.root and child.extra_key != node.extra_key:
                fail(f"node {child.id}: namespace differs from its parent's")
            if ex and node is not tree.root and node.token_ids()[-1] != child.token_ids()[0]:
                fail(f"node {child.id}: bigram edge does not overlap its parent's last token")
            if child.lock_ref < 0:
                fail(f"node {child.id}: lock_ref {child.lock_ref} < 0")
            if tree._events is not None and (child.hashes is None or len(child.hashes) != child.klen // ps):
                got = None if child.hashes is None else len(child.hashes)
                fail(f"node {child.id}: {got} page hashes for {child.klen // ps} pages")
            child_locks += child.lock_ref
            if child.residency == DEVICE:
                if child.lock_ref:
                    protected += child.klen
                else:
                    evictable += child.klen
                if child.value is not None:
                    vals.append(child.value)
            stack.append(child)
        if node is not tree.root and node.residency == DEVICE and not node.lock_ref and not device_children:
            leaves.add(node)
        if node.clash is not None and tree._simple_ck:
            fail(f"node {node.id}: first tokens clash at page size 1")
        if node is not tree.root and node.lock_ref < child_locks:
            fail(f"node {node.id}: lock_ref {node.lock_ref} < its children's {child_locks}")
    if evictable != tree._evictable or protected != tree._protected:
        fail(
            f"counters evictable={tree._evictable} protected={tree._protected}, "
            f"tree has evictable={evictable} protected={protected}"
        )
    if host_only != tree._host_only:
        fail(f"host-only count {tree._host_only}, tree has {host_only}")
    if leaves != tree._leaves:
        fail(f"evictable-leaf set differs: {len(tree._leaves)} tracked, {len(leaves)} in the tree")
    if tree._evq.missing_entries():
        fail("an evictable leaf has no live heap entry and is not queued for one")
    if vals:
        allv = np.concatenate(vals)
        if tree.trash_in_values:
            allv = allv[allv != 0]  # tombstones of a pure-SWA tree hold the trash slot
        if np.unique(allv).size != allv.size:
            fail("a slot id is cached in two places")
