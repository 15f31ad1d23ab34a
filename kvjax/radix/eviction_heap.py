"""FULL's eviction candidates and their persistent lazy heap (one object, owned by the tree).

Candidates are the unlocked device leaves (a node without a device child). A leaf that becomes
a candidate (or, under a non-monotone policy, is touched) is queued in ``pending`` and pushed
into the heap only when an eviction needs the heap. Most leaves of a growing cache get a child
or a lock before that and are then never pushed at all: a list append instead of a heap push,
~0.5 µs per insert measured on the multi-turn benchmark. The pushed priority is the one the node
has at the flush, which is at least as recent as the one an immediate push would have recorded,
so the heap stays exact (see ``eviction.py`` for why stale entries of monotone policies are
safe).

Invariants (checked by :meth:`check`): every candidate has a live heap entry (its
``heap_seq`` equals the entry's sequence number) or is queued (``heap_seq == PENDING``); dead
entries are skipped when popped; the heap holds at most ``4 * len(leaves) + 1024`` entries
after a flush and the queue at most ``2 * len(leaves) + 1024`` (both rebuilt past that).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvjax.radix.node import TreeNode

# ``TreeNode.heap_seq`` of a node queued for a heap push; -1: no entry.
PENDING = -2


class EvictionHeap:
    """The candidate set ``leaves``, the heap of ``(priority, seq, node)`` entries and the queue
    of deferred pushes. The tree edits ``leaves`` directly on its hot paths (a set add or
    discard); every heap change goes through these methods.

    Args:
        priority: the policy's priority function (smaller is evicted first).
    """

    __slots__ = ("heap", "leaves", "pending", "priority", "seq")

    def __init__(self, priority: Callable[[TreeNode], Any]) -> None:
        self.priority = priority
        self.leaves: set[TreeNode] = set()
        self.heap: list = []
        self.pending: list[TreeNode] = []
        self.seq = 0

    def clear(self) -> None:
        """Forget every candidate and entry (the set is cleared in place: aliases stay valid)."""
        self.leaves.clear()
        self.heap = []
        self.pending = []
        self.seq = 0

    def defer_push(self, node: TreeNode) -> None:
        """Queue ``node`` for a (re-)push; its older heap entry, if any, is dead from now on."""
        node.heap_seq = PENDING
        pending = self.pending
        pending.append(node)
        if len(pending) > 2 * len(self.leaves) + 1024:
            self.flush()  # bounds the queue on trees that never evict

    def flush(self) -> None:
        """Push every queued node that is still a candidate (once each)."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        leaves = self.leaves
        heap = self.heap
        prio = self.priority
        heappush = heapq.heappush
        seq = self.seq
        for node in pending:
            if node.heap_seq == PENDING and node in leaves:
                seq += 1
                node.heap_seq = seq
                heappush(heap, (prio(node), seq, node))
        self.seq = seq
        if len(self.heap) > 4 * len(leaves) + 1024:
            self.compact()

    def push(self, node: TreeNode) -> None:
        """Push ``node`` now, at its current priority."""
        self.seq += 1
        node.heap_seq = self.seq
        heapq.heappush(self.heap, (self.priority(node), self.seq, node))

    def compact(self) -> None:
        """Drop dead entries: rebuild the heap from the candidates (O(L))."""
        heap = []
        prio = self.priority
        seq = self.seq
        for node in self.leaves:
            seq += 1
            node.heap_seq = seq
            heap.append((prio(node), seq, node))
        heapq.heapify(heap)
        self.seq = seq
        self.heap = heap
        self.pending = []

    def pop_candidate(self) -> TreeNode | None:
        """The candidate with the smallest priority, taken off the heap (None: none left).

        Dead entries are dropped; a stale entry (the node's priority grew since its push, which a
        monotone policy allows) is re-pushed at its true place and the pop goes on. The node
        stays in ``leaves``: the caller evicts it or takes it out.
        """
        heap = self.heap
        leaves = self.leaves
        prio = self.priority
        heappop = heapq.heappop
        while heap:
            p, seq, node = heappop(heap)
            if node.heap_seq != seq or node not in leaves:
                continue  # dead entry: node changed state or was re-pushed since
            if prio(node) != p:
                self.push(node)
                continue
            return node
        return None

    def queue_size(self) -> int:
        """Heap entries plus queued pushes."""
        return len(self.heap) + len(self.pending)

    def missing_entries(self) -> int:
        """Candidates with neither a live heap entry nor a queued push (0 when consistent)."""
        live = {id(n) for _, s, n in self.heap if n.heap_seq == s}
        live.update(id(n) for n in self.pending if n.heap_seq == PENDING)
        return sum(1 for n in self.leaves if id(n) not in live)
