"""`HiMambaComponent`: recurrent-state checkpoints with host copies (SGLang 0.5.23's MAMBA component
under ``init_hicache``: ``host_value`` beside ``value``).

The device rules are :class:`~kvjax.radix.mamba_component.MambaComponent`'s; on top, a checkpoint
may have a *host copy*: one slot of the host state pool holding the same state. A node then holds
a device checkpoint, a host copy, both, or neither. The rules (``sglang-0.5.23-hybrid-trees.md``;
``unified_cache/components/mamba.py``):

* **backup** (``backup_state``): a node's device checkpoint is copied when the host tier backs the
  node up (its KV backup starts: ``HostTierComponent.on_backup``, ancestors first under
  write-through) and, later, when a checkpoint is committed on a node whose KV is already backed
  up (SGLang's incremental component backup: ``needs_incremental_backup``). Only a checkpoint
  without a host copy is copied. The node is locked until the copy lands (:meth:`writing_check`);
  a copy that fails or finds no host slot (after host state eviction) leaves the node without
  one. Before a copy starts, ``before_backup`` records the state copies the tree still queues
  (a checkpoint donated by ``cache_unfinished_req`` is such a copy), so the copy reads them.
* **device eviction** of a checkpoint frees only the device slot; a host copy stays (SGLang's
  ``evict_component`` puts the node into its host LRU). On a leaf the node goes too as FULL
  evicts it: demoted when its KV has a host copy (``keeps_node``), deleted otherwise. FULL's
  demotion of a node (``on_demote``) frees its device checkpoint the same way.
* **host eviction** (:meth:`evict_host_states`, run when a backup finds the host state pool full):
  host copies of nodes without a device checkpoint, least recently they lost it first; a host
  copy being read by a load-back in preparation is skipped. Only the host copy is freed.
* **split**: a checkpoint is the state after a node's last token, so device checkpoint and host
  copy stay on the lower part (the same node object), as SGLang's ``redistribute_on_node_split``.
* **deletion** frees the host copy with the device checkpoint.
* **storage** (with the tree's storage tier): a landed host copy is handed to ``on_state_landed``
  (the storage link stores it under the node's last page hash), and a checkpoint that came back
  from storage becomes a host-only node's host copy (:meth:`adopt_host_copy`).
* **load** (:meth:`attach_loaded`): a load-back gives a node whose checkpoint is only on the host
  a new device slot (the host copy is kept); the node is locked until the copy lands
  (:meth:`loading_check`).

Where kvjax differs: host eviction frees the host copy only (a host tombstone) also on a host-only
leaf, whose KV the host tier evicts on its own (SGLang evicts such a leaf atomically, every
component's host data with it). Sizes of the host copies are in states:
``host_allocator.available_size() + len(host copies) == host_allocator.size``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvjax.radix.component import ComponentSizes
from kvjax.radix.invariants import TreeInvariantError
from kvjax.radix.mamba_component import MambaComponent, MambaData
from kvjax.radix.retention import retained_last
from kvjax.tiers.copy_engine import CopyEngine, CopyError, TransferStatus

if TYPE_CHECKING:
    from kvjax.alloc.state_slots import StateSlotAllocator
    from kvjax.radix.lock import LockReceipt
    from kvjax.radix.node import TreeNode
    from kvjax.radix.slot_component import NodeSlot
    from kvjax.tiers.host_allocator import HostSlotAllocator

__all__ = ["HiMambaComponent"]


class _StateTransfer:
    """A started state copy: its engine handle, the node, and the lock it holds on the node."""

    __slots__ = ("handle", "node", "receipt")

    def __init__(self, handle: Any, node: TreeNode, receipt: LockReceipt) -> None:
        self.handle = handle
        self.node = node
        self.receipt = receipt


class HiMambaComponent(MambaComponent):
    """See the module docstring.

    Args:
        allocator, page_size, enable_mamba_extra_buffer, mamba_max_states_per_path,
            mamba_cache_chunk_size: as for :class:`MambaComponent`.
        host_allocator: the host state pool's slot allocator (page size 1).
        engine: the state copy engine (``kvjax.transfers.state_transfer.StateTransferEngine``,
            or a simulated one).
    """

    def __init__(
        self,
        allocator: StateSlotAllocator | None,
        *,
        host_allocator: HostSlotAllocator,
        engine: CopyEngine,
        **options: Any,
    ) -> None:
        if host_allocator.page_size != 1:
            raise ValueError(f"host state allocator page size {host_allocator.page_size}: use 1 (one slot per state)")
        super().__init__(allocator, **options)
        self.host_allocator = host_allocator
        self.engine = engine
        self.host_slot: dict[TreeNode, int] = {}  # host copies, landed or being written
        self._host_only: OrderedDict[TreeNode, None] = OrderedDict()  # landed, no device checkpoint; LRU
        self._writes: list[_StateTransfer] = []
        self._loads: list[_StateTransfer] = []
        self._writing: set[TreeNode] = set()
        self._guarded: set[TreeNode] = set()  # host copies a load-back in preparation reads
        # Called before a state copy starts: record the state copies the tree still queues.
        self.before_backup: Callable[[], None] | None = None
        # Whether a node's KV has a host copy (the host tier's data), for incremental backups.
        self.kv_backed_up: Callable[[TreeNode], bool] = lambda node: False
        # Called with each node whose checkpoint's host copy just landed (a storage tier stores it).
        self.on_state_landed: Callable[[TreeNode], None] | None = None
        self.backups = 0  # state copies landed
        self.failed_backups = 0
        self.skipped_backups = 0  # host state pool full even after host eviction
        self.loads = 0
        self.host_evicted = 0

    # -- host copies ------------------------------------------------------------------------------

    def landed_host_slot(self, node: TreeNode) -> int | None:
        """The host slot of ``node``'s landed host copy (None: none, or still being written)."""
        if node in self._writing:
            return None
        return self.host_slot.get(node)

    def host_only_states(self) -> int:
        """Nodes whose checkpoint is on the host only (a load-back can bring it to the device)."""
        return len(self._host_only)

    def _free_host(self, node: TreeNode) -> None:
        slot = self.host_slot.pop(node)
        self._host_only.pop(node, None)
        self.host_allocator.free(np.asarray([slot], np.int32))

    def _alloc_host(self) -> int | None:
        got = self.host_allocator.alloc(1)
        if got is None:
            self.evict_host_states(1)
            got = self.host_allocator.alloc(1)
        return None if got is None else int(got[0])

    def evict_host_states(self, num: int) -> int:
        """Free up to ``num`` host copies of checkpoints no longer on the device, least recently
        they left it first (those of nodes retained at the retention clock last), skipping those a
        load-back in preparation reads; returns how many."""
        freed = 0
        for node in retained_last(self._host_only, self.tree.retention_now):  # retained nodes' copies last
            if freed >= num:
                break
            if node in self._guarded:
                continue
            self._free_host(node)
            freed += 1
        self.host_evicted += freed
        return freed

    def adopt_host_copy(self, node: TreeNode) -> int | None:
        """A new host slot (host copies of states no longer on the device evicted when none is
        free) that is now ``node``'s landed host copy, its checkpoint on the host only; the caller
        writes the state into it at once. None (nothing changed) when ``node`` has a checkpoint or
        a host copy already, or no slot can be freed."""
        if node in self.host_slot or self.data(node) is not None:
            return None
        hslot = self._alloc_host()
        if hslot is None:
            self.skipped_backups += 1
            return None
        self.host_slot[node] = hslot
        self._host_only[node] = None
        return hslot

    def protect(self, node: TreeNode, on: bool) -> None:
        """Keep (``on``) or stop keeping ``node``'s host copy out of host eviction."""
        if on:
            self._guarded.add(node)
        else:
            self._guarded.discard(node)

    # -- backup -----------------------------------------------------------------------------------

    def backup_state(self, node: TreeNode) -> bool:
        """Start copying ``node``'s device checkpoint to a new host slot (module docstring);
        returns whether it has a host copy (landed or being written) afterwards."""
        if node in self.host_slot:
            return True
        data = self.data(node)
        if data is None:
            return False
        hslot = self._alloc_host()
        if hslot is None:
            self.skipped_backups += 1
            return False
        if self.before_backup is not None:
            self.before_backup()
        try:
            handle = self.engine.start_backup(np.asarray([data.slot]), np.asarray([hslot], np.int32))
        except CopyError:
            self.host_allocator.free(np.asarray([hslot], np.int32))
            self.failed_backups += 1
            return False
        self.host_slot[node] = hslot
        self._writing.add(node)
        self._writes.append(_StateTransfer(handle, node, self.tree.inc_lock_ref(node)))
        return True

    def writing_check(self, wait: bool = False) -> int:
        """Complete the state copies to the host that landed (a failed one frees its host slot);
        unlock their nodes. Returns how many completed."""
        still = []
        done = 0
        for t in self._writes:
            status = self.engine.poll(t.handle, wait)
            if status is TransferStatus.PENDING:
                still.append(t)
                continue
            done += 1
            self._writing.discard(t.node)
            if status is TransferStatus.DONE:
                self.backups += 1
                if self.on_state_landed is not None:
                    self.on_state_landed(t.node)
            else:
                self.failed_backups += 1
                self._free_host(t.node)
            self.tree.dec_lock_ref(t.receipt)
        self._writes = still
        return done

    def loading_check(self, wait: bool = False) -> int:
        """Complete the state loads that landed; unlock their nodes. Returns how many."""
        still = []
        done = 0
        for t in self._loads:
            status = self.engine.poll(t.handle, wait)
            if status is TransferStatus.PENDING:
                still.append(t)
                continue
            if status is TransferStatus.FAILED:
                raise RuntimeError("a started state load failed; the copy engine broke its contract")
            done += 1
            self.tree.dec_lock_ref(t.receipt)
        self._loads = still
        return done

    @property
    def pending_transfers(self) -> int:
        return len(self._writes) + len(self._loads)

    def cancel_all(self) -> None:
        """Cancel every state copy in flight (a tree reset): backups never land (their host slots
        are freed), loads stop being waited for; their locks are released."""
        for t in self._writes:
            self.engine.cancel(t.handle)
            self._writing.discard(t.node)
            self._free_host(t.node)
            self.tree.dec_lock_ref(t.receipt)
        for t in self._loads:
            self.tree.dec_lock_ref(t.receipt)
        self._writes, self._loads = [], []

    # -- load -------------------------------------------------------------------------------------

    def start_load(self, node: TreeNode, slot: int) -> None:
        """Copy ``node``'s host copy into device slot ``slot`` (allocated by the caller) and make it
        the node's device checkpoint; the node is locked until the copy lands. Raises CopyError
        (nothing changed) when the copy cannot start."""
        hslot = self.landed_host_slot(node)
        if hslot is None or self.data(node) is not None:
            raise CopyError(f"node {node.id} has no checkpoint on the host only")
        handle = self.engine.start_load(np.asarray([hslot], np.int32), np.asarray([slot]))
        self._hold(node, MambaData(slot))
        self._held[slot] = node
        self._loads.append(_StateTransfer(handle, node, self.tree.inc_lock_ref(node)))
        self.loads += 1

    # -- hooks ------------------------------------------------------------------------------------

    def commit_insert(self, node: TreeNode, payload: Any) -> Any:
        out = super().commit_insert(node, payload)
        if self.data(node) is not None and node not in self.host_slot and self.kv_backed_up(node):
            self.backup_state(node)  # the incremental backup of a backed-up node's new checkpoint
        return out

    def _hold(self, node: TreeNode, data: NodeSlot) -> None:
        super()._hold(node, data)
        self._host_only.pop(node, None)  # on the device again: its host copy is not host-only

    def _drop(self, node: TreeNode, data: NodeSlot) -> None:
        super()._drop(node, data)
        if node in self.host_slot and node not in self._writing:
            self._host_only[node] = None  # most recent: it just left the device

    def evict(self, amount: int) -> int:
        tree = self.tree
        leaves = tree.evictable_leaves
        freed = 0
        # Least recent first, checkpoints of nodes retained at the retention clock last (as MAMBA).
        for node in retained_last(self._lru, tree.retention_now):
            if freed >= amount:
                break
            data = self.data(node)
            if data is None or data.lock_ref:
                continue
            self._drop(node, data)
            freed += 1
            if node.children or node.lock_ref:
                continue  # internal (or FULL locked): a state tombstone, its host copy kept
            if node in leaves and self.kv_backed_up(node):
                # FULL's eviction of this leaf: demoted (its KV has a host copy), as SGLang's
                # _evict_device_leaf; the core counts its FULL tokens in the tracker here.
                core = cast(Any, tree)
                tokens = node.klen
                core._evict_device_leaf(node)
                if core._tracker is not None:
                    core._tracker["full"] += tokens
                core.stats.evicted_tokens += tokens
                core.stats.num_evictions += 1
            else:
                tree.delete_leaf(node)
        return freed

    def on_demote(self, node: TreeNode) -> int:
        data = self.data(node)
        if data is None:
            return 0
        self._drop(node, data)
        return 1

    def on_delete(self, node: TreeNode) -> int:
        freed = super().on_delete(node)
        if node in self.host_slot:
            if node in self._writing:
                raise TreeInvariantError(f"himamba: node {node.id} deleted while its state backup is pending")
            self._free_host(node)
        self._guarded.discard(node)
        return freed

    def on_reset(self) -> None:
        super().on_reset()
        for node in list(self.host_slot):
            self._free_host(node)
        self._writing.clear()
        self._guarded.clear()

    # -- sizes and checks -------------------------------------------------------------------------

    def host_sizes(self) -> ComponentSizes:
        """Host copies in states: evictable (checkpoint on the host only, not protected) and the rest."""
        evictable = sum(1 for n in self._host_only if n not in self._guarded)
        return ComponentSizes(evictable, len(self.host_slot) - evictable)

    def check_invariants(self) -> None:
        super().check_invariants()
        nodes = set(self.tree.nodes())
        if any(n not in nodes for n in self.host_slot):
            raise TreeInvariantError("himamba: a host copy is held by a node that left the tree")
        slots = list(self.host_slot.values())
        if len(set(slots)) != len(slots):
            raise TreeInvariantError("himamba: a host state slot is held twice")
        if slots and not self.host_allocator.is_allocated(np.asarray(slots, np.int32)):
            raise TreeInvariantError("himamba: a node holds a free host state slot")
        if self.host_allocator.available_size() + len(slots) != self.host_allocator.size:
            raise TreeInvariantError(
                f"himamba: host states available {self.host_allocator.available_size()} + held {len(slots)} != "
                f"capacity {self.host_allocator.size}"
            )
        expect = {n for n in self.host_slot if n not in self._writing and self.data(n) is None}
        if set(self._host_only) != expect:
            raise TreeInvariantError("himamba: the host-only checkpoints and the host LRU differ")
        for t in self._writes:
            if not t.node.lock_ref or t.node not in self._writing:
                raise TreeInvariantError(f"himamba: node {t.node.id} has a pending state backup but is not locked")
