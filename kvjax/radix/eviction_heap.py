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

Retention (``retention.py``) splits the candidates in two tiers: a node retained at the clock
``now`` has its live entry in ``retained``, keyed ``(retain_priority, policy priority)``, and an
entry of the same sequence number in ``expiries``, keyed by its ``retain_until``; every other
candidate has its live entry in ``heap``. An eviction pops ``heap`` while it has entries and
``retained`` only when it is empty. A push routes the node by its retention at ``now``. The
tiers' keys move only one way except at expiry: a node gains retention or a higher retention
priority (a stale entry pops too early, and is re-routed then), or loses it when ``now`` reaches
``retain_until`` (its entry would sit too late): :meth:`expire` pops the expiries due, O(log n)
each, before an eviction reads the heaps, re-pushing an entry whose retention was extended
since and moving every lapsed candidate to ``heap``. A retention renewed after it lapsed with a
lower priority re-queues its node (``merge_retention``), so a stale ``retained`` entry never
sits too late either.
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
    """The candidate set ``leaves``, the heap of ``(priority, seq, node)`` entries of unretained
    candidates, the tier of retained ones (``retained`` and ``expiries``, module docstring) and the
    queue of deferred pushes. The tree edits ``leaves`` directly on its hot paths (a set add or
    discard); every heap change goes through these methods.

    Args:
        priority: the policy's priority function (smaller is evicted first).

    Attributes:
        now: the tree's retention clock (seconds; ``retention.py``), set by the tree.
    """

    __slots__ = ("expiries", "heap", "leaves", "now", "pending", "priority", "retained", "seq")

    def __init__(self, priority: Callable[[TreeNode], Any]) -> None:
        self.priority = priority
        self.leaves: set[TreeNode] = set()
        self.heap: list = []
        self.retained: list = []
        self.expiries: list = []
        self.pending: list[TreeNode] = []
        self.seq = 0
        self.now = 0.0

    def clear(self) -> None:
        """Forget every candidate and entry (the set is cleared in place: aliases stay valid).
        The clock stays: it is the serving loop's, not the tree's content."""
        self.leaves.clear()
        self.heap = []
        self.retained = []
        self.expiries = []
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
        now = self.now
        seq = self.seq
        for node in pending:
            if node.heap_seq == PENDING and node in leaves:
                seq += 1
                node.heap_seq = seq
                if node.retain_until > now:
                    self._push_retained(node, seq)
                else:
                    heappush(heap, (prio(node), seq, node))
        self.seq = seq
        if self.queue_size() > 4 * len(leaves) + 1024:
            self.compact()

    def push(self, node: TreeNode) -> None:
        """Push ``node`` now, at its current priority, into its tier at the clock ``now``."""
        self.seq = seq = self.seq + 1
        node.heap_seq = seq
        if node.retain_until > self.now:
            self._push_retained(node, seq)
        else:
            heapq.heappush(self.heap, (self.priority(node), seq, node))

    def _push_retained(self, node: TreeNode, seq: int) -> None:
        """Entries ``seq`` of the retained ``node`` in ``retained`` and in ``expiries``."""
        heapq.heappush(self.retained, ((node.retain_priority, self.priority(node)), seq, node))
        heapq.heappush(self.expiries, (node.retain_until, seq, node))

    def compact(self) -> None:
        """Drop dead entries: rebuild the heaps from the candidates (O(L))."""
        heap = []
        retained = []
        expiries = []
        prio = self.priority
        now = self.now
        seq = self.seq
        for node in self.leaves:
            seq += 1
            node.heap_seq = seq
            if node.retain_until > now:
                retained.append(((node.retain_priority, prio(node)), seq, node))
                expiries.append((node.retain_until, seq, node))
            else:
                heap.append((prio(node), seq, node))
        heapq.heapify(heap)
        heapq.heapify(retained)
        heapq.heapify(expiries)
        self.seq = seq
        self.heap = heap
        self.retained = retained
        self.expiries = expiries
        self.pending = []

    def expire(self) -> None:
        """Move every retained candidate whose retention lapsed (``retain_until <= now``) to the
        unretained heap; an expiry entry of a retention extended since is re-pushed at the new
        expiry. O(log n) per expiry entry due; call before reading the heaps."""
        expiries = self.expiries
        now = self.now
        leaves = self.leaves
        heappop = heapq.heappop
        while expiries and expiries[0][0] <= now:
            _, seq, node = heappop(expiries)
            if node.heap_seq != seq or node not in leaves:
                continue  # dead: the node was re-pushed, evicted or taken out since
            if node.retain_until > now:
                heapq.heappush(expiries, (node.retain_until, seq, node))  # extended: wait for it
            else:
                self.push(node)  # into ``heap``; its ``retained`` entry is dead from now on

    def pop_candidate(self) -> TreeNode | None:
        """The candidate to evict next, taken off its heap (None: none left): the smallest
        priority among the unretained candidates, else the smallest ``(retention priority,
        priority)`` among the retained ones (module docstring).

        Dead entries are dropped; a stale entry (the node's priority grew, or it gained or raised
        a retention, since its push) is re-pushed at its true place and the pop goes on. The node
        stays in ``leaves``: the caller evicts it or takes it out.
        """
        expiries = self.expiries
        if expiries and expiries[0][0] <= self.now:
            self.expire()
        heap = self.heap
        retained = self.retained
        leaves = self.leaves
        prio = self.priority
        now = self.now
        heappop = heapq.heappop
        while True:
            if heap:
                p, seq, node = heappop(heap)
                in_retained = False
            elif retained:
                p, seq, node = heappop(retained)
                in_retained = True
            else:
                return None
            if node.heap_seq != seq or node not in leaves:
                continue  # dead entry: node changed state or was re-pushed since
            if node.retain_until > now:
                if not in_retained or p != (node.retain_priority, prio(node)):
                    self.push(node)
                    continue
            elif in_retained or prio(node) != p:
                self.push(node)
                continue
            return node

    def queue_size(self) -> int:
        """Heap entries (both tiers and the expiries) plus queued pushes."""
        return len(self.heap) + len(self.retained) + len(self.expiries) + len(self.pending)

    def missing_entries(self) -> int:
        """Candidates with neither a live entry in their tier (a retained one with its expiry
        entry too) nor a queued push (0 when consistent)."""
        live = {id(n) for _, s, n in self.heap if n.heap_seq == s}
        live.update(id(n) for n in self.pending if n.heap_seq == PENDING)
        due = {id(n) for _, s, n in self.expiries if n.heap_seq == s}
        live.update(id(n) for _, s, n in self.retained if n.heap_seq == s and id(n) in due)
        return sum(1 for n in self.leaves if id(n) not in live)
