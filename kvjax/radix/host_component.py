"""`HostTierComponent` ("host"): SGLang 0.5.23's host tier (HiCache L2) on the tree's hooks.

Data on a node: :class:`HostData`, the node's host slot ids (one per key element: its *host
copy*) and the pending backup that is writing them, if any. Absent = not backed up. A node is
then in one of three states: device only (no data), device + host copy (backed up), host-only
(its device copy was evicted; the core's residency).

Rules (``sglang-0.5.23-hybrid-trees.md``, host tier; the hooks that carry them are in
``docs/architecture.md``):

* **write policies.** ``write_through``: a node is backed up when an insert walk creates or
  reaches it (hit threshold 1); ``write_through_selective``: at its second insert hit (threshold
  2; hits counted per insert walk, the component's own counter); ``write_back``: only when FULL
  evicts it (``keeps_node``), synchronously. A write-through backup backs up the node's
  un-backed-up ancestors first, so under write-through a host copy's ancestors have host copies.
* **pending transfers lock their nodes.** A backup takes a FULL lock on its node
  (``tree.inc_lock_ref``) until :meth:`writing_check` sees it land; a load locks the last loaded
  node until :meth:`loading_check`. Locked nodes are never evicted, so pending transfers block
  eviction of their nodes. A split of a pending node shares the transfer between both parts.
* **device eviction** demotes a backed-up leaf (``keeps_node`` True: device slots freed, node kept
  host-only) and deletes one without a host copy.
* **evict_host** (``tree.evict({"host": n})``) frees host-only leaves, least recently used
  first (``node.last_access``); a parent left a childless host-only node becomes a candidate.
  Under ``write_back`` it first reclaims host copies of nodes still on the device (SGLang's
  ``_reclaim_full_host_duplicates``): in the order they became such duplicates (a landed
  write-back backup, a revive by insert, a completed load, a split), two passes, the first
  sparing unlocked device leaves; never a copy a pending load reads or a load-back in
  preparation protects. Under the write-through policies a device node's host copy is never
  freed. Making room for a new backup (and :meth:`alloc_held`) runs the same eviction.
* **match.** ``finalize_match`` reports ``host_hit_length``: the key elements of the host-only
  nodes below the device match that carry a host copy, contiguously from the device match, and
  ``last_host_node``, the deepest of them (the device match's node when there are none). Those
  of the walk's host-only nodes count in ``full_kv_hit_length`` (FULL KV on device or host,
  SGLang's meaning); ``device_kv_hit_length`` keeps the device part.
* **load_back** (all or nothing, at least ``load_back_threshold`` = 10 elements, at most
  ``mem_quota`` when given): device slots for the whole host-only chain, evicting device leaves
  first when short (the chain's device ancestor is locked meanwhile, the chain protected from
  host eviction); the nodes become device-resident (``tree.revive_node``) keeping their host
  copies, and the copy is started. A load that cannot start changes nothing (recompute).
* **insert over a host-only node** counts as already cached and makes it device-resident from the
  incoming slots, keeping the host copy (the core's revive, then ``on_insert_overlap``).

Faults fall back to recompute and lose nothing: a backup that fails (reported at the polling
step) frees its host slots and the node stays device-only; a full host pool (after host eviction)
skips the backup; a load that cannot start leaves the chain host-only.

Where kvjax differs: a node without a host copy can become host-only when it has host-only
children (write-back, or a failed backup above backed-up descendants); it is never part of a
host hit (the loadable chain stops above it) and leaves the tree with its last child. Hit counts
for ``write_through_selective`` are per insert walk (SGLang skips chunked-prefill inserts).

Sizes (host tokens): evictable = host copies of host-only nodes not protected by a load in
progress; protected = host copies of device nodes (pending backups included; under write_back
host eviction may still reclaim the settled ones); held = slots
taken outside the tree (:meth:`alloc_held`: retraction backups). Invariant:
``host_allocator.available_size() + evictable + protected + held == host_allocator.size``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.radix.component import ComponentSizes, TreeComponent
from kvjax.radix.events import BlockRemoved
from kvjax.radix.lock import LockReceipt
from kvjax.radix.node import DEVICE, HOST_ONLY, TreeNode
from kvjax.radix.retention import retention_key
from kvjax.tiers.copy_engine import CopyEngine, CopyError, TransferStatus
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.simulated_copy import SimulatedCopyEngine

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol
    from kvjax.radix.match import ComponentMatchResult

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LOAD_BACK_THRESHOLD = 10
#: The medium of the host tier's KV events (``kvjax.radix.events``).
HOST_MEDIUM = "host"


class HostData:
    """A node's host copy: ``slots`` (int32 host slot ids, one per key element), the pending
    backup writing them (None once landed), the pending load reading them (None when none), how
    many load-backs or prefetches in preparation protect it, and whether a KV event reported it
    (``announced``: its ``BlockStored`` in medium "host" went out; its removal is reported then)."""

    __slots__ = ("slots", "transfer", "loading", "host_ref", "announced")

    def __init__(self, slots: np.ndarray, transfer: PendingTransfer | None = None) -> None:
        self.slots = slots
        self.transfer = transfer
        self.loading: PendingTransfer | None = None
        self.host_ref = 0
        self.announced = False


class PendingTransfer:
    """A started backup or load: its engine handle, the lock it holds and the nodes it covers."""

    __slots__ = ("kind", "handle", "receipt", "nodes")

    def __init__(self, kind: str, handle: Any, receipt: LockReceipt, nodes: list[TreeNode]) -> None:
        self.kind = kind
        self.handle = handle
        self.receipt = receipt
        self.nodes = nodes


@dataclass(frozen=True)
class HostMatch:
    """The host part of a match (``MatchResult.extras["host"]``)."""

    host_hit_length: int
    last_host_node: Any


class HostTierComponent(TreeComponent):
    """See the module docstring.

    Args:
        host_allocator: the host pool's slot allocator (its page size must be the tree's).
        copy_engine: starts and completes copies (default: a :class:`SimulatedCopyEngine`, for a
            tree without device arrays).
        write_policy: one of :data:`WRITE_POLICIES`.
        load_back_threshold: loads of fewer key elements are skipped (SGLang: 10).
        device_allocator: where load-backs take device slots (None: a simulation tree; the
            tree synthesizes slot ids).
    """

    name = "host"

    def __init__(
        self,
        host_allocator: HostSlotAllocator,
        copy_engine: CopyEngine | None = None,
        *,
        write_policy: str = "write_through",
        load_back_threshold: int = LOAD_BACK_THRESHOLD,
        device_allocator: AllocatorProtocol | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy={write_policy!r}: use one of {', '.join(WRITE_POLICIES)}")
        if load_back_threshold < 0:
            raise ValueError(f"load_back_threshold={load_back_threshold}: use an integer >= 0")
        self.host_allocator = host_allocator
        self.device_allocator = device_allocator
        self.engine: CopyEngine = copy_engine if copy_engine is not None else SimulatedCopyEngine()
        self.write_policy = write_policy
        self.write_through_threshold = 1 if write_policy == "write_through" else 2
        self.load_back_threshold = int(load_back_threshold)
        self._holders: set[TreeNode] = set()
        self._hits: dict[TreeNode, int] = {}
        self._writes: list[PendingTransfer] = []
        # write_back: nodes that became device + host copies, in the order they did (SGLang's
        # ``full_host_duplicates``: insertion order, entries left stale until a reclaim walks
        # them or the node leaves the tree); host eviction reclaims them first.
        self._duplicates: dict[TreeNode, None] = {}
        self.reclaimed_duplicates = 0  # host tokens freed from device nodes (write_back)
        self._loads: list[PendingTransfer] = []
        self.failed_backups = 0
        self.skipped_backups = 0  # host pool full even after host eviction
        self.held_tokens = 0  # host slots held outside the tree (retraction backups)
        # Called with each node whose host copy just landed (a storage tier backs it up).
        self.on_backup_landed: Callable[[TreeNode], None] | None = None
        # Hooks of a tree whose other components keep device state the host copy carries (the
        # SWA component): ``on_backup(node)`` when a backup of ``node`` starts (what the copy
        # holds is decided now); ``before_load(chain, slots)`` once a load-back's device slots
        # are allocated, before the copy starts; ``after_revive(chain)`` once the chain is
        # device-resident, before the load locks it.
        self.on_backup: Callable[[TreeNode], None] | None = None
        self.before_load: Callable[[list[TreeNode], np.ndarray], None] | None = None
        self.after_revive: Callable[[list[TreeNode]], None] | None = None

    def attach(self, tree: Any) -> None:
        super().attach(tree)
        if self.host_allocator.page_size != tree.page_size:
            raise ValueError(
                f"host allocator page size {self.host_allocator.page_size} != tree page size {tree.page_size}"
            )

    # -- data helpers ---------------------------------------------------------------------------

    def _set(self, node: TreeNode, data: HostData | None) -> None:
        self.set_data(node, data)
        if data is None:
            self._holders.discard(node)
        else:
            self._holders.add(node)

    def _drop(self, node: TreeNode) -> int:
        """Free ``node``'s host copy; returns the host slots freed. A reported copy's pages are
        reported removed from the host (KV events)."""
        data = self.data(node)
        if data is None:
            return 0
        self._set(node, None)
        self.host_allocator.free(data.slots)
        if data.announced:
            self.tree.emit_event(BlockRemoved(block_hashes=list(node.hashes or ()), medium=HOST_MEDIUM))
        return int(data.slots.size)

    def _announce(self, node: TreeNode) -> None:
        """With KV events on, report ``node``'s landed host copy (``BlockStored`` in medium
        "host"), once: a load-back or a revive keeps the copy and reports nothing more."""
        data = self.data(node)
        if data is None or data.announced or not self.tree.enable_kv_cache_events:
            return
        data.announced = True
        self.tree.emit_event(self.tree.stored_event(node, HOST_MEDIUM))

    # -- write_back: host copies of device nodes ------------------------------------------------

    def _settled_duplicate(self, node: TreeNode) -> bool:
        """``node`` is on the device and holds a landed host copy no transfer uses."""
        data = self.data(node)
        return data is not None and node.value is not None and data.transfer is None and data.loading is None

    def _track_duplicate(self, node: TreeNode) -> None:
        """Under write_back, register ``node`` where it can become a settled duplicate (a landed
        write-back backup, a revive by insert, a completed load, a split); an entry already
        there keeps its place (SGLang's ``setdefault``)."""
        if self.write_policy != "write_back":
            return
        if self._settled_duplicate(node):
            self._duplicates.setdefault(node, None)
        else:
            self._duplicates.pop(node, None)

    def _reclaim_duplicates(self, num_tokens: int) -> int:
        """Free host copies of device nodes, in registration order, until ``num_tokens`` host
        slots are freed (SGLang's ``_reclaim_full_host_duplicates``): a first pass spares the
        unlocked device leaves (the next device eviction would demote them onto that copy), a
        second takes them too. A copy a transfer uses or a load-back protects (``host_ref``) is
        skipped. Returns the host slots freed."""
        freed = 0
        swept: list[TreeNode] = []
        leaves = self.tree.evictable_leaves
        for spare_leaves in (True, False):
            if freed >= num_tokens:
                break
            for node in self._duplicates:
                if freed >= num_tokens:
                    break
                data = self.data(node)
                if data is None or node.value is None:
                    swept.append(node)  # stale: demoted, or its copy is gone
                    continue
                if spare_leaves and node in leaves:
                    continue
                if data.transfer is not None or data.loading is not None or data.host_ref:
                    continue
                freed += self._drop(node)
                swept.append(node)
        for node in swept:
            self._duplicates.pop(node, None)
        self.reclaimed_duplicates += freed
        return freed

    def _alloc_host(self, n: int) -> np.ndarray | None:
        slots = self.host_allocator.alloc(n)
        if slots is None:
            self.evict_host(n - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(n)
        return slots

    def alloc_held(self, n: int) -> np.ndarray | None:
        """``n`` host slots for a holder outside the tree (a retracted request's KV), evicting
        host-only leaves first when short; None when they cannot be made free."""
        slots = self._alloc_host(n)
        if slots is not None:
            self.held_tokens += int(slots.size)
        return slots

    def free_held(self, slots: np.ndarray) -> None:
        """Return slots from :meth:`alloc_held`."""
        self.host_allocator.free(slots)
        self.held_tokens -= int(np.asarray(slots).size)

    def adopt_held(self, node: TreeNode, slots: np.ndarray) -> None:
        """Make held ``slots`` (from :meth:`alloc_held`, already filled) the landed host copy of
        ``node``, a host-only node without one (a storage prefetch's new node)."""
        if self.data(node) is not None or node.residency != HOST_ONLY or slots.size != node.klen:
            raise ValueError(f"adopt_held: node {node.id} is not a host-only node without a host copy of {slots.size}")
        self.held_tokens -= int(slots.size)
        self._set(node, HostData(np.asarray(slots, dtype=np.int32)))
        self._announce(node)

    # -- backups --------------------------------------------------------------------------------

    def _hit(self, node: TreeNode) -> None:
        count = self._hits.get(node, 0) + 1
        self._hits[node] = count
        if count >= self.write_through_threshold and self.data(node) is None and node.value is not None:
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> bool:
        """Start backing up ``node`` (and, first, its device ancestors without a host copy);
        the node stays locked until :meth:`writing_check` sees the copy land. Returns whether
        ``node`` has a host copy (pending or landed) afterwards."""
        root = self.tree.root
        chain = []
        n = node
        while n is not root and self.data(n) is None:
            if n.value is None:
                return False  # a host-only node without a copy: nothing to copy from
            chain.append(n)
            n = n.parent
        return all(self._start_backup(n) for n in reversed(chain))  # stops at the first failure

    def _backup_slots(self, node: TreeNode) -> np.ndarray | None:
        """Host slots for a copy of device node ``node`` (host-only leaves evicted when short);
        None, counted in ``skipped_backups``, when the host pool stays full."""
        slots = self._alloc_host(node.klen)
        if slots is None:
            self.skipped_backups += 1
        return slots

    def _backup_failed(self, slots: np.ndarray) -> bool:
        """A copy that could not start or did not land: its host ``slots`` go back to the pool,
        counted in ``failed_backups``. Returns False (no backup)."""
        self.host_allocator.free(slots)
        self.failed_backups += 1
        return False

    def _launch_backup(self, node: TreeNode) -> tuple[np.ndarray, Any] | None:
        """Start a copy of device node ``node`` to the host: its host slots and the copy's handle
        (``on_backup`` told); None (no backup, counted) when the host pool stays full or the copy
        could not start."""
        assert node.value is not None
        slots = self._backup_slots(node)
        if slots is None:
            return None
        try:
            handle = self.engine.start_backup(node.value, slots)
        except CopyError:
            self._backup_failed(slots)
            return None
        if self.on_backup is not None:
            self.on_backup(node)
        return slots, handle

    def _start_backup(self, node: TreeNode) -> bool:
        launched = self._launch_backup(node)
        if launched is None:
            return False
        slots, handle = launched
        pending = PendingTransfer("backup", handle, self.tree.inc_lock_ref(node), [node])
        self._set(node, HostData(slots, pending))
        self._writes.append(pending)
        return True

    def _backup_now(self, node: TreeNode) -> bool:
        """Write-back: copy ``node`` to the host now and wait for it (FULL is evicting it)."""
        launched = self._launch_backup(node)
        if launched is None:
            return False
        slots, handle = launched
        try:
            status = self.engine.poll(handle, wait=True)
        except CopyError:
            status = TransferStatus.FAILED
        if status is not TransferStatus.DONE:
            return self._backup_failed(slots)
        self._set(node, HostData(slots))
        self._announce(node)
        self._track_duplicate(node)  # stale once the caller demotes it; kept for its place
        if self.on_backup_landed is not None:
            self.on_backup_landed(node)
        return True

    # -- hooks: insert --------------------------------------------------------------------------

    def on_insert_overlap(self, node: TreeNode, payload: Any, revived: bool) -> None:
        if self.write_policy != "write_back":
            self._hit(node)
        elif revived:
            self._track_duplicate(node)

    def on_new_node(self, node: TreeNode, payload: Any) -> None:
        if self.write_policy != "write_back":
            self._hit(node)

    def on_split(self, parent: TreeNode, child: TreeNode, k: int) -> None:
        hits = self._hits.get(child)
        if hits is not None:
            self._hits[parent] = hits
        data = self.data(child)
        if data is None:
            return
        part = HostData(data.slots[:k], data.transfer)
        part.host_ref = data.host_ref
        part.loading = data.loading  # loading_check walks up from the load's last node to it
        part.announced = data.announced  # page hashes are cut at the page boundary too
        data.slots = data.slots[k:]
        if data.transfer is not None:
            data.transfer.nodes.append(parent)
        self._set(parent, part)
        self._track_duplicate(parent)

    # -- hooks: match ---------------------------------------------------------------------------

    def finalize_match(self, result: ComponentMatchResult) -> None:
        root = self.tree.root
        # full_kv_hit_length: the host-only nodes below the device walk that carry a host copy,
        # contiguously (the walk's host-only nodes lie below all its device nodes).
        host_only = []
        n = result.walk_node
        while n is not root and n.value is None:
            host_only.append(n)
            n = n.parent
        on_host = 0
        for n in reversed(host_only):
            if self.data(n) is None:
                break
            on_host += n.klen
        if on_host:
            result.add_host_kv_hit(on_host)
        last = result.last_node
        below = []
        n = result.walk_node
        while n is not last and n is not root:
            below.append(n)
            n = n.parent
        hit = 0
        deepest = last
        for n in reversed(below):
            if self.data(n) is None:
                break
            hit += n.klen
            deepest = n
        result.extras[self.name] = HostMatch(hit, deepest)

    # -- hooks: residency and eviction ----------------------------------------------------------

    def keeps_node(self, node: TreeNode) -> bool:
        if self.data(node) is not None:
            return True
        if self.write_policy == "write_back" and node.value is not None and not node.lock_ref:
            return self._backup_now(node)
        return False

    def on_delete(self, node: TreeNode) -> int:
        self._hits.pop(node, None)
        self._duplicates.pop(node, None)
        data = self.data(node)
        if data is not None and data.transfer is not None:
            raise AssertionError(f"node {node.id} deleted while its backup is pending (it is locked)")
        return self._drop(node)

    def evict(self, amount: int) -> int:
        return self.evict_host(amount)

    def evict_host(self, num_tokens: int) -> int:
        """Free host copies until ``num_tokens`` host slots are freed or none is left; returns
        the host slots freed. Under write_back, host copies of device nodes go first
        (:meth:`_reclaim_duplicates`); then, under every policy, host-only leaves, least
        recently used first, retained ones last (a parent left a childless host-only node joins them). Under the
        write-through policies a device node's host copy is never freed here."""
        if num_tokens <= 0:
            return 0
        freed = self._reclaim_duplicates(num_tokens) if self.write_policy == "write_back" else 0
        if freed >= num_tokens:
            return freed
        # Least recent first; host copies of nodes retained at the retention clock last, the
        # lowest retention priority first (``retention.py``: a demoted node keeps its retention).
        now = self.tree.retention_now
        heap = [(retention_key(n, now), n.last_access, n.id, n) for n in self._holders if self._host_evictable_leaf(n)]
        heapq.heapify(heap)
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[3]
            if not self._host_evictable_leaf(node):
                continue
            parent = node.parent
            freed += self._drop(node)
            self.tree.delete_leaf(node)
            if parent is not self.tree.root and self._host_evictable_leaf(parent):
                heapq.heappush(heap, (retention_key(parent, now), parent.last_access, parent.id, parent))
        return freed

    def _host_evictable_leaf(self, node: TreeNode) -> bool:
        data = self.data(node)
        return (
            data is not None
            and node.residency == HOST_ONLY
            and not node.children
            and not data.host_ref
            and data.transfer is None
        )

    def on_reset(self) -> None:
        for node in list(self._holders):
            self.data(node).announced = False  # the reset's AllBlocksCleared covers the host too
            self._drop(node)
        self._hits.clear()
        self._duplicates.clear()

    # -- polling --------------------------------------------------------------------------------

    def _poll(
        self, transfers: list[PendingTransfer], wait: bool
    ) -> tuple[list[tuple[PendingTransfer, TransferStatus]], list[PendingTransfer]]:
        """Poll ``transfers`` in order (waiting for each with ``wait``): the landed ones with their
        status, and those still pending."""
        landed: list[tuple[PendingTransfer, TransferStatus]] = []
        still = []
        for p in transfers:
            status = self.engine.poll(p.handle, wait)
            if status is TransferStatus.PENDING:
                still.append(p)
            else:
                landed.append((p, status))
        return landed, still

    def writing_check(self, wait: bool = False) -> int:
        """Complete the backups that landed (SGLang's ``writing_check``): unlock their nodes; a
        failed one frees its host slots (the node stays device-only). Returns backups completed."""
        landed, still = self._poll(self._writes, wait)
        for p, status in landed:
            ok = status is TransferStatus.DONE
            if not ok:
                self.failed_backups += 1
            for node in p.nodes:
                data = self.data(node)
                if data is None or data.transfer is not p:
                    continue
                data.transfer = None
                if not ok:
                    self._drop(node)
                    continue
                self._announce(node)
                if self.on_backup_landed is not None:
                    self.on_backup_landed(node)
            self.tree.dec_lock_ref(p.receipt)
        self._writes = still
        return len(landed)

    def loading_check(self, wait: bool = False) -> int:
        """Complete the loads that landed (SGLang's ``loading_check``): unlock their last node.
        Returns loads completed."""
        landed, still = self._poll(self._loads, wait)
        for p, status in landed:
            if status is TransferStatus.FAILED:
                raise RuntimeError("a started load failed; the copy engine broke its contract")
            # Bottom-up from the load's last node, as SGLang's finish_load_back registers them;
            # split parts above it carry the same transfer.
            n = p.nodes[-1]
            root = self.tree.root
            while n is not root:
                data = self.data(n)
                if data is not None and data.loading is p:
                    data.loading = None
                    self._track_duplicate(n)
                n = n.parent
            self.tree.dec_lock_ref(p.receipt)
        self._loads = still
        return len(landed)

    @property
    def pending_backups(self) -> int:
        return len(self._writes)

    @property
    def pending_loads(self) -> int:
        return len(self._loads)

    # -- load back ------------------------------------------------------------------------------

    def loadable_chain(self, node: TreeNode) -> list[TreeNode]:
        """The host-only nodes from the device ancestor of ``node`` down to ``node``, top first;
        empty when ``node`` is device-resident or some node of the chain has no host copy."""
        root = self.tree.root
        chain = []
        n = node
        while n is not root and n.residency == HOST_ONLY:
            if self.data(n) is None:
                return []
            chain.append(n)
            n = n.parent
        chain.reverse()
        return chain

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> int:
        """Bring the host-only chain ending at ``node`` back to the device (see the module
        docstring); returns the key elements loaded (0: nothing changed, recompute instead).

        Raises ValueError (nothing changed) for a node that is not in this tree.
        """
        tree = self.tree
        foreign = not isinstance(node, TreeNode) or node.owner is not tree.root.owner
        if foreign or node.residency not in (DEVICE, HOST_ONLY):
            raise ValueError(f"load_back: {node!r} is not a node of this tree")
        chain = self.loadable_chain(node)
        total = sum(n.klen for n in chain)
        if not chain or total < self.load_back_threshold or (mem_quota is not None and total > mem_quota):
            return 0
        anchor = chain[0].parent
        anchor_lock = tree.inc_lock_ref(anchor)
        datas = [self.data(n) for n in chain]
        for d in datas:
            d.host_ref += 1
        allocator = self.device_allocator
        slots = None
        try:
            if allocator is None:
                slots = tree.synthesize_slots(total)
            else:
                slots = allocator.alloc(total)
                if slots is None:
                    evict_for = getattr(allocator, "evict_to_free_tokens", None)  # paired pools
                    if evict_for is not None:
                        evict_for(tree, total)
                    else:
                        tree.evict(total - allocator.available_size())
                    slots = allocator.alloc(total)
                if slots is None:
                    return 0
            host_slots = np.concatenate([d.slots for d in datas])
            if self.before_load is not None:
                self.before_load(chain, slots)
            try:
                handle = self.engine.start_load(host_slots, slots)
            except CopyError:
                if allocator is not None:
                    allocator.free(slots)
                return 0
            off = 0
            for n in chain:
                tree.revive_node(n, slots[off : off + n.klen])
                off += n.klen
            if self.after_revive is not None:
                self.after_revive(chain)
            pending = PendingTransfer("load", handle, tree.inc_lock_ref(chain[-1]), chain)
            for d in datas:
                d.loading = pending  # its host copy is being read: not reclaimable until landed
            self._loads.append(pending)
            return total
        finally:
            for d in datas:
                d.host_ref -= 1
            tree.dec_lock_ref(anchor_lock)

    # -- sizes and checks -----------------------------------------------------------------------

    def sizes(self) -> ComponentSizes:
        evictable = protected = 0
        for node in self._holders:
            data = self.data(node)
            if node.residency == HOST_ONLY and not data.host_ref:
                evictable += data.slots.size
            else:
                protected += data.slots.size
        return ComponentSizes(evictable, protected)

    def check_invariants(self) -> None:
        from kvjax.radix.invariants import TreeInvariantError

        nodes = set(self.tree.nodes())
        holders = {n for n in nodes if self.data(n) is not None}
        if holders != self._holders:
            raise TreeInvariantError("host: the holder set and the nodes with a host copy differ")
        if any(n not in nodes for n in self._duplicates):
            raise TreeInvariantError("host: a node that left the tree is still registered as a duplicate")
        if self.write_policy == "write_back":
            for n in holders:
                if self._settled_duplicate(n) and n not in self._duplicates:
                    raise TreeInvariantError(f"host: node {n.id} is on device and host but not registered")
        elif self._duplicates:
            raise TreeInvariantError(f"host: {len(self._duplicates)} duplicates registered under {self.write_policy}")
        slots = [self.data(n).slots for n in holders]
        for n in holders:
            data = self.data(n)
            if data.slots.size != n.klen:
                raise TreeInvariantError(f"host: node {n.id} has {data.slots.size} host slots for {n.klen}")
            if data.transfer is not None and (not n.lock_ref or n not in data.transfer.nodes):
                raise TreeInvariantError(f"host: node {n.id} has a pending backup but is not locked by it")
            if data.loading is not None and (not n.lock_ref or n.value is None or data.loading not in self._loads):
                raise TreeInvariantError(f"host: node {n.id} is being loaded but is not a locked device node")
        if slots:
            allv = np.concatenate(slots)
            if np.unique(allv).size != allv.size:
                raise TreeInvariantError("host: a host slot is held twice")
            if not self.host_allocator.is_allocated(allv):
                raise TreeInvariantError("host: a node holds a free host slot")
        s = self.sizes()
        held = self.held_tokens
        if self.host_allocator.available_size() + s.evictable + s.protected + held != self.host_allocator.size:
            raise TreeInvariantError(
                f"host: available {self.host_allocator.available_size()} + evictable {s.evictable} + "
                f"protected {s.protected} + held {held} != capacity {self.host_allocator.size}"
            )
