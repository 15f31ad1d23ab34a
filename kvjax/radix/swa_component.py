"""The sliding-window (SWA) tree component: SGLang 0.5.23's ``SWAComponent`` on the core's hooks.

Hybrid models interleave full-attention layers (KV for every token) with sliding-window layers
(KV only for the last ``W`` tokens). A tree node's ``value`` holds full-pool slot ids (FULL, the
core's); its SWA slots are the allocator's ``mapping[value]`` (``SWATokenToKVPoolAllocator``).
This component keeps, per node, whether the node still has its SWA slots:

* data: :class:`SWANodeData` (its SWA lock count and the lock-boundary mark) in
  ``node.comp["swa"]``; absent = an **SWA tombstone** (FULL KV kept, SWA slots freed). Only FULL
  decides whether a node survives, so leaves can be tombstones too (0.5.23).
* own recency: an LRU over the nodes with SWA data (:class:`~kvjax.radix.recency.RecencyList`,
  oldest first). A match or insert refreshes only the nodes within ``W + page_size`` tokens above
  the node it ended at (parents older than children); a split leaves the suffix where it was and
  puts the new upper half just older than it (0.5.23's ``insert_after``).
* match: ends at the deepest matched node with no tombstone above it, or with at least ``W`` live
  SWA tokens after the last tombstone on its path (``finalize_match``).
* lock: FULL locks to the root (core); SWA only the trailing segment covering ``W`` tokens, up to
  and including the node where the coverage reaches ``W``, which carries a boundary mark the
  release stops at (the receipt part, :class:`SWALockPart`; a split moves the mark to the upper
  half). :meth:`release_swa_lock` (``dec_swa_lock_only``) moves the segment from protected to
  evictable early, frees nothing, and only when the segment ended below the root.
* insert: new leaves are capped: a leaf longer than ``ceil_to_page(W)`` is split so its last node
  is exactly one page-aligned window. With an SWA-evicted prefix (payload, ``swa_evicted_seqlen``
  = ``e``), new nodes before ``e`` are tombstones (split at ``e``); an insert over a tombstone
  after ``e`` revives it from the incoming slots (when FULL is locked by another request, the node
  keeps its full slots and takes the incoming SWA slots instead).
* eviction (``evict({"swa": m})``): the SWA LRU from the least recent, skipping SWA-locked nodes:
  an FULL-evictable leaf is deleted outright (FULL KV too, via ``tree.delete_leaf``); anything else
  (internal node, leaf whose FULL part is locked) becomes a tombstone (``free_swa``).

Sizes: ``ComponentSizes(evictable, protected)`` in SWA tokens. Invariants (``check_invariants``):
the LRU holds exactly the nodes with data; the counters equal the tree's; an SWA lock never
exceeds the FULL lock on a node; with an allocator, live nodes' slots are all paired and
tombstones' slots all unpaired. For the SWA pool, ``swa_available + evictable + protected +
held by running requests == size_swa``.

The lock walk counts tombstones too (0.5.23): their positions count towards ``W`` and they take a
lock count (kept aside, ``_tomb_locks``, since a tombstone has no data), so a tombstone revived
under a lock (an insert over it while a checkpointed request's segment covers it) comes back
SWA-protected, and the release walks the same segment.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix.component import ComponentSizes, TreeComponent
from kvjax.radix.invariants import TreeInvariantError
from kvjax.radix.lock import LockError
from kvjax.radix.recency import RecencyList
from kvjax.radix.retention import retained_last

if TYPE_CHECKING:
    from kvjax.alloc.swa import SWATokenToKVPoolAllocator
    from kvjax.radix.match import ComponentMatchResult
    from kvjax.radix.node import TreeNode

__all__ = ["SWAComponent", "SWAInsertPayload", "SWALockPart", "SWANodeData"]

_uuids = itertools.count(1)


class SWANodeData:
    """What the SWA component keeps on a live node: its SWA lock count and, when some lock's
    SWA segment ends here, that boundary's mark (``uuid``)."""

    __slots__ = ("lock_ref", "uuid")

    def __init__(self) -> None:
        self.lock_ref = 0
        self.uuid: int | None = None


class SWALockPart:
    """The SWA part of a lock receipt.

    Attributes:
        uuid: the mark of the node where the SWA segment ends (None: it reached the root).
        locked: whether the segment locked any node, tombstones included (False: a lock at the root).
        released: True once the SWA part was released (early, or with the whole lock).
    """

    __slots__ = ("uuid", "locked", "released")

    def __init__(self, uuid: int | None, locked: bool) -> None:
        self.uuid = uuid
        self.locked = locked
        self.released = False

    def __repr__(self) -> str:
        return f"SWALockPart(uuid={self.uuid}, locked={self.locked}, released={self.released})"


@dataclass(frozen=True)
class SWAInsertPayload:
    """An insert's SWA payload.

    Attributes:
        evicted: ``swa_evicted_seqlen``: key elements ``[0, evicted)`` of the key have no SWA
            slots any more (page-aligned).
        values: the incoming full slots, or None (standalone simulation).
        base: key position of ``values[0]`` (the lifecycle inserts from its resume point).
        prev_prefix_len: nodes ending at or before this length are the caller's protected prefix
            and are left alone.
    """

    evicted: int
    values: np.ndarray | None = None
    base: int = 0
    prev_prefix_len: int = 0


class SWAComponent(TreeComponent):
    """See the module docstring.

    Args:
        sliding_window_size: ``W``, in key elements (tokens; tokens - 1 with bigram keys), >= 1.
        page_size: the tree's page size.
        allocator: the SWA allocator its slots come from (None: standalone, frees nothing).
    """

    name = "swa"

    def __init__(
        self, sliding_window_size: int, page_size: int, allocator: SWATokenToKVPoolAllocator | None = None
    ) -> None:
        if isinstance(sliding_window_size, bool) or not isinstance(sliding_window_size, (int, np.integer)):
            raise ConfigError("sliding_window_size", sliding_window_size, "use a positive integer number of tokens")
        if sliding_window_size < 1:
            raise ConfigError("sliding_window_size", sliding_window_size, "use a positive integer number of tokens")
        self.sliding_window_size = int(sliding_window_size)
        self.page_size = int(page_size)
        self.window_cap = -(-self.sliding_window_size // self.page_size) * self.page_size  # ceil_to_page(W)
        self.allocator = allocator
        self._lru = RecencyList()  # oldest first
        self._evictable = 0
        self._protected = 0
        # Lock counts and boundary marks of the tombstones inside locked SWA segments (0.5.23
        # locks them too); a revival hands them to the node's data.
        self._tomb_locks: dict[TreeNode, SWANodeData] = {}
        # With a host tier: whether each backed-up node's host copy carries its SWA KV (the node
        # was live when the backup started); empty otherwise.
        self.host_copy_live: dict[TreeNode, bool] = {}

    # ------------------------------------------------------------------ helpers

    def is_tombstone(self, node: TreeNode) -> bool:
        """True when ``node`` (not the root) has no SWA slots."""
        return self.data(node) is None

    def make_live(self, node: TreeNode) -> None:
        """Give ``node`` SWA data (its slots are paired), most recent in the LRU; evictable, or
        protected when it was a tombstone inside a locked segment (it keeps that lock count)."""
        data = self._tomb_locks.pop(node, None)
        if data is None:
            data = SWANodeData()
        self.set_data(node, data)
        self._lru.append(node)
        if data.lock_ref:
            self._protected += node.klen
        else:
            self._evictable += node.klen

    def _drop(self, node: TreeNode, data: SWANodeData) -> int:
        """Forget ``node``'s SWA data (unlocked); returns its tokens. Frees nothing."""
        if data.lock_ref:
            raise TreeInvariantError(f"swa: node {node.id} loses its SWA data while SWA-locked")
        self._lru.remove(node)
        self.set_data(node, None)
        self._evictable -= node.klen
        return node.klen

    def _refresh_window(self, node: TreeNode) -> None:
        """Most recent: ``node`` and its ancestors with SWA data within ``W + page_size`` tokens
        (0.5.23's window-bounded refresh), ancestors older than descendants."""
        root = self.tree.root
        span = self.sliding_window_size + self.page_size
        chain = []
        covered = 0
        while node is not root and covered < span:
            if node.comp is not None and self.name in node.comp:
                chain.append(node)
            covered += node.klen
            node = node.parent
        lru = self._lru
        for n in reversed(chain):
            lru.move_to_end(n)

    def _incoming(self, payload: SWAInsertPayload | None, start: int, end: int) -> np.ndarray | None:
        """The incoming full slots for key positions ``[start, end)``, or None."""
        if payload is None or payload.values is None:
            return None
        return payload.values[start - payload.base : end - payload.base]

    # ------------------------------------------------------------------ insert

    def note_host_copy(self, node: TreeNode) -> None:
        """A host tier started backing ``node`` up: its host copy carries SWA KV iff it is live."""
        self.host_copy_live[node] = self.data(node) is not None

    def on_split(self, parent: TreeNode, child: TreeNode, k: int) -> None:
        host = self.host_copy_live.get(child)
        if host is not None:
            self.host_copy_live[parent] = host
        data = self.data(child)
        if data is None:  # both halves are tombstones
            tomb = self._tomb_locks.get(child)
            if tomb is not None:
                upper = SWANodeData()
                upper.lock_ref = tomb.lock_ref
                upper.uuid, tomb.uuid = tomb.uuid, None
                self._tomb_locks[parent] = upper
            return
        upper = SWANodeData()
        upper.lock_ref = data.lock_ref
        upper.uuid, data.uuid = data.uuid, None  # the segment's top is now the upper half
        self.set_data(parent, upper)
        # 0.5.23: a split does not access the suffix; the upper half sits just older than it.
        self._lru.insert_before(child, parent)

    def on_new_node(self, node: TreeNode, payload: Any) -> None:
        evicted = payload.evicted if payload is not None else 0
        start = node.depth - node.klen
        live = node
        if evicted > start:
            # Positions before ``evicted`` already left the window: a tombstone upper part.
            cut = evicted - start
            if cut >= node.klen:
                raise TreeInvariantError(
                    f"swa: a new leaf [{start}, {node.depth}) lies wholly before swa_evicted_seqlen={evicted}"
                )
            upper = self.tree.split_node(node, cut)
            self._free_stale_swa(upper)
        # Leaf capping: the live part's last node is exactly one page-aligned window.
        capped = None
        if live.klen > self.window_cap:
            capped = self.tree.split_node(live, live.klen - self.window_cap)
        if capped is not None:
            self.make_live(capped)  # the older part first: the window tail is more recent
        self.make_live(live)

    def _free_stale_swa(self, node: TreeNode) -> None:
        """A new tombstone's full slots must hold no SWA slots: free any that still do (the caller
        declared those positions out of the window)."""
        alloc = self.allocator
        if alloc is None or node.value is None:
            return
        value = node.value
        paired = alloc.full_to_swa_index_mapping[value] > 0
        if paired.any():
            alloc.free_swa(value[paired])

    def _tombstone_slots(self, node: TreeNode) -> None:
        """SWA eviction made ``node`` (unlocked) a tombstone: free its SWA slots (FULL keeps the
        full slots)."""
        if self.allocator is not None and node.value is not None:
            self.allocator.free_swa_segment(node.value, start_pos=0)  # row order, as 0.5.23

    def _revive_slots(self, node: TreeNode, incoming: np.ndarray | None) -> None:
        """An insert revives the tombstone ``node`` from the incoming full slots (None:
        standalone): the node takes them, or, when FULL is locked by another request, keeps its
        full slots and takes the incoming SWA slots (the incoming full slots are then a duplicate
        the insert frees, full part only)."""
        alloc = self.allocator
        if alloc is None or incoming is None:
            return
        old = node.value
        assert old is not None, "an insert walks device nodes only"
        if node.lock_ref > 0:
            alloc.move_swa_pairing(incoming, old)
        else:
            node.value = incoming.copy()
            alloc.free_segment(old, start_pos=0)  # a tombstone's full slots: the full part only

    def _check_slots(self, node: TreeNode, live: bool, fail: Any) -> None:
        """Per-node slot invariant: a live node's full slots are all paired with SWA slots, a
        tombstone's none (with an allocator)."""
        alloc = self.allocator
        if alloc is None or node.value is None:
            return
        paired = alloc.full_to_swa_index_mapping[node.value] > 0
        if live and not paired.all():
            fail(f"live node {node.id} has full slots without an SWA slot")
        if not live and paired.any():
            fail(f"tombstone {node.id} still holds SWA slots")

    def on_insert_overlap(self, node: TreeNode, payload: Any, revived: bool) -> None:
        if self.data(node) is not None:
            return
        start = node.depth - node.klen
        end = node.depth
        p: SWAInsertPayload | None = payload
        if p is not None and p.prev_prefix_len >= end:
            return  # the caller's protected prefix
        evicted = p.evicted if p is not None else 0
        if evicted >= end:
            # Wholly out of the window: stays a tombstone; the incoming copy is a duplicate (or,
            # for a host-only node the core just revived, the node's full slots now: unpaired).
            if revived:
                self._free_stale_swa(node)
            return
        if evicted > start:
            upper = self.tree.split_node(node, evicted - start)  # the upper half stays a tombstone
            if revived:
                self._free_stale_swa(upper)
            start = evicted
        if not revived:
            self._revive_slots(node, self._incoming(p, start, end))
        # Revived from a host-only node: the core gave it the incoming full slots, whose SWA pairs
        # are the request's (live past ``evicted``).
        self.make_live(node)

    def commit_insert(self, node: TreeNode, payload: Any) -> Any:
        if node is not self.tree.root:
            self._refresh_window(node)
        return None

    # ------------------------------------------------------------------ match

    def finalize_match(self, result: ComponentMatchResult) -> None:
        root = self.tree.root
        node = result.last_node
        if node is root:
            return
        path = []
        while node is not root:
            path.append(node)
            node = node.parent
        best = root
        since = float("inf")  # live SWA tokens since the last tombstone on the path
        window = self.sliding_window_size
        name = self.name
        for n in reversed(path):
            if n.comp is None or name not in n.comp:
                since = 0
                continue
            since += n.klen
            if since >= window:
                best = n
        if best is not result.last_node:
            result.shorten_to(best, root)
        if best is not root:
            self._refresh_window(best)

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> Any:
        root = self.tree.root
        window = self.sliding_window_size
        covered = 0
        uuid = None
        cur = node
        locked = False
        top = None
        while cur is not root and covered < window:
            data = self.data(cur)
            if data is None:  # a tombstone: locked too, no tokens protected
                data = self._tomb_locks.get(cur)
                if data is None:
                    data = self._tomb_locks[cur] = SWANodeData()
            elif data.lock_ref == 0:
                self._evictable -= cur.klen
                self._protected += cur.klen
            data.lock_ref += 1
            locked = True
            top = data
            covered += cur.klen
            cur = cur.parent
        if top is not None and covered >= window:
            # The segment covers the window: mark its top.
            if top.uuid is None:
                top.uuid = next(_uuids)
            uuid = top.uuid
        return SWALockPart(uuid, locked)

    def _unlock_node(self, node: TreeNode) -> tuple[SWANodeData, int] | None:
        """Take one SWA lock off ``node`` (live, or a tombstone's kept count): its lock data and
        the tokens that became evictable (``node.klen`` when a live node's last lock went, else 0);
        None, changing nothing, when ``node`` holds no SWA lock. A tombstone's kept count goes with
        its last lock unless it marks a segment's top."""
        data = self.data(node)
        live = data is not None
        if data is None:
            data = self._tomb_locks.get(node)
        if data is None or data.lock_ref <= 0:
            return None
        data.lock_ref -= 1
        if data.lock_ref:
            return data, 0
        if live:
            self._protected -= node.klen
            self._evictable += node.klen
            return data, node.klen
        if data.uuid is None:
            del self._tomb_locks[node]
        return data, 0

    def _release(self, node: TreeNode, part: SWALockPart) -> int:
        """Decrement the SWA locks of ``part``'s segment from ``node`` up; returns the tokens
        that became evictable."""
        root = self.tree.root
        cur = node
        freed = 0
        while cur is not root:
            unlocked = self._unlock_node(cur)
            if unlocked is None:
                raise TreeInvariantError(f"swa: node {cur.id} in a locked SWA segment is not SWA-locked")
            data, made_evictable = unlocked
            freed += made_evictable
            if part.uuid is not None and data.uuid == part.uuid:
                break
            cur = cur.parent
        part.released = True
        return freed

    def _release_window(self, node: TreeNode) -> None:
        """Decrement the SWA locks of the nodes covering ``W`` tokens from ``node`` up."""
        root = self.tree.root
        covered = 0
        cur = node
        while cur is not root and covered < self.sliding_window_size:
            if self._unlock_node(cur) is None:
                raise LockError(f"dec_lock_ref: node {cur.id} is not SWA-locked")
            covered += cur.klen
            cur = cur.parent

    def unlock(self, node: TreeNode, part: Any) -> None:
        if part is None:
            # Released by node rather than receipt: the segment a lock on ``node`` covers now.
            self._release_window(node)
            return
        if part.released or not part.locked:
            part.released = True
            return
        self._release(node, part)

    def release_swa_lock(self, node: TreeNode, part: SWALockPart) -> int:
        """0.5.23's ``dec_swa_lock_only``: release the SWA part of a lock early (decode moved past
        the window). Frees nothing: the segment's tokens move from protected to evictable. Only
        when the segment ended at a window boundary below the root; otherwise (or when nothing
        was SWA-locked) nothing happens and 0 is returned. Returns the tokens made evictable.

        Raises LockError (unchanged) when this part was already released.
        """
        if part.released:
            raise LockError(f"dec_swa_lock_only: the SWA part {part!r} was already released")
        if not part.locked or part.uuid is None:
            return 0
        return self._release(node, part)

    # ------------------------------------------------------------------ eviction

    def evict(self, amount: int) -> int:
        tree = self.tree
        candidates = tree.evictable_leaves
        freed = 0
        # The window LRU, nodes retained at the retention clock last (``retention.py``).
        for node in retained_last(self._lru, tree.retention_now):
            if freed >= amount:
                break
            data = self.data(node)
            if data is None or data.lock_ref:
                continue
            if node in candidates and not node.children:
                # An unlocked leaf: deleted outright (its SWA and FULL slots go with it). A device
                # leaf with host-only children (a host tier) stays, as a tombstone.
                freed += self._drop(node, data)
                tree.delete_leaf(node)
            else:
                # Internal, or FULL locked: a tombstone.
                self._tombstone_slots(node)
                freed += self._drop(node, data)
        return freed

    def on_delete(self, node: TreeNode) -> int:
        self.host_copy_live.pop(node, None)
        self._tomb_locks.pop(node, None)
        data = self.data(node)
        if data is None:
            return 0
        # FULL freed the node's slots already; the allocator freed their SWA pairs with them.
        return self._drop(node, data)

    def on_demote(self, node: TreeNode) -> int:
        """FULL evicted ``node``'s device copy (a host tier keeps it host-only): the allocator
        freed its SWA slots with its full slots; forget its SWA data."""
        data = self.data(node)
        return 0 if data is None else self._drop(node, data)

    def on_reset(self) -> None:
        self.host_copy_live.clear()
        self._tomb_locks.clear()
        self._lru.clear()
        self._evictable = self._protected = 0

    # ------------------------------------------------------------------ sizes and checks

    def sizes(self) -> ComponentSizes:
        return ComponentSizes(self._evictable, self._protected)

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise TreeInvariantError(f"swa: {msg}\n{self.tree.pretty_print()}")

        live = {n for n in self.tree.nodes() if self.data(n) is not None}
        if live != set(self._lru):
            fail(f"the LRU ({len(self._lru)} nodes) and the nodes with SWA data ({len(live)}) differ")
        evictable = protected = 0
        for n in self.tree.nodes():
            data = self.data(n)
            self._check_slots(n, data is not None, fail)
            if data is None:
                continue
            if n.value is None:
                fail(f"node {n.id} has SWA data but no device slots")
            if data.lock_ref < 0 or data.lock_ref > n.lock_ref:
                fail(f"node {n.id}: SWA lock {data.lock_ref} outside [0, FULL lock {n.lock_ref}]")
            if n in self._tomb_locks:
                fail(f"live node {n.id} still has a tombstone lock count")
            if data.lock_ref:
                protected += n.klen
            else:
                evictable += n.klen
        if (evictable, protected) != (self._evictable, self._protected):
            fail(f"sizes {self._evictable}/{self._protected}, tree {evictable}/{protected}")
