"""`HiMambaRadixCache`: the recurrent-state tree with a host tier (FULL + MAMBA + host).

SGLang 0.5.23 (``UnifiedRadixCache`` with FULL and MAMBA plus ``init_hicache``) builds two host
pools for a hybrid recurrent model: the KV host pool (token slots) and ``MambaPoolHost`` (one slot
per state, its own allocator). kvjax does the same: the host component keeps the full-attention
KV's host copies (``host_component.py``), the :class:`~kvjax.radix.himamba_component.HiMambaComponent`
the checkpoints' host copies, and their copies go through two engines (the KV's page engine, the
state engine ``kvjax.transfers.state_transfer``).

* **Backup.** When the host tier backs a node up (write-through: an insert walk reaches or makes
  it, ancestors first), its device checkpoint, if any, is copied too; a checkpoint committed later
  on a backed-up node is copied then (the incremental backup). See the component's docstring.
* **Demotion.** FULL's eviction of a backed-up leaf frees its KV and its device checkpoint; the
  node stays host-only, its host copies (KV and state) kept. Checkpoint eviction on such a leaf
  demotes it the same way; on an internal node it frees the device slot only.
* **Host hit** (``match_prefix``): the device match ends at the deepest device checkpoint (the
  MAMBA rule). Below it, the walk's nodes whose KV is on the device or loadable from the host
  (host-only with a host copy, contiguously) count up to the deepest one whose checkpoint has a
  host copy: ``host_hit_length`` is its depth less the device match, ``last_host_node`` that node.
  A match must end at a node with a state, on the device or on the host. ``branching_seqlen``
  (``extras["mamba"]``) is then measured past that boundary, as 0.5.23's.
* **Load-back** (``init_load_back`` / ``load_back``, all or nothing): a device state slot for the
  node (one unlocked checkpoint evicted when none is free), then the KV of its host-only chain
  (``HostTierComponent.load_back``: device slots, evicting device leaves when short), then the
  state copy into the new slot; the node holds it as its device checkpoint and keeps its host
  copy. Without a state slot or the chain's device slots nothing changes (recompute); a state copy
  that cannot start (the engine refuses its slots) leaves the loaded KV on the device without
  the state, a shorter match and nothing leaked. As in SGLang, a load carrying a
  state is not held back by the load-back threshold (10 tokens): every host hit of this tree ends
  at a state, so the threshold never applies. A request then forks the loaded checkpoint into its
  own state slot (:meth:`fork_into_request`, a queued device copy; SGLang writes the request's
  slot from the host directly).

Device state: every copy is a pending device update (``KVCache.pending``) the owner of the step
applies before its next step; state copies read the device after the tree's queued state copies
(the component's ``before_backup`` records them first).

* **Storage tier** (L3, ``storage=StorageOptions(..., checkpoints=CheckpointStore(...))``: the
  KV pages and the host state pool). A landed KV host copy's pages are stored, and a landed
  checkpoint copy under its node's last page hash. A prefetch brings the KV pages of the longest
  stored run that ends at a stored state, and that state: the new host-only node's checkpoint is
  on the host only (:meth:`adopt_stored_checkpoint`), so the host hit ends there and the load-back
  brings KV and state to the device (rules: ``kvjax.radix.storage_checkpoint``). A storage tier
  without the checkpoints' store is refused (NotImplementedError: its prefixes could never be
  served).

Not built here (refused by name): the ``write_back`` policy (SGLang backs a checkpoint up
synchronously before a device eviction frees it; kvjax's state copies land only when the owner
applies them).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from kvjax.errors import OutOfMemoryError
from kvjax.radix.himamba_component import HiMambaComponent
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.host_component import HostMatch, HostTierComponent
from kvjax.radix.mamba_component import MambaMatch
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.radix.match import MatchResult
from kvjax.radix.node import DEVICE, HOST_ONLY, TreeNode
from kvjax.radix.radix_cache import one_token_allocator
from kvjax.radix.tiered_tree import make_host_tier
from kvjax.tiers.copy_engine import CopyEngine, CopyError
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.simulated_copy import SimulatedCopyEngine

if TYPE_CHECKING:
    from kvjax.alloc.state_slots import StateSlotAllocator
    from kvjax.request import Req

__all__ = ["HiMambaRadixCache"]

#: Host state slots per device state slot when none are given (SGLang's default ``hicache_ratio``).
DEFAULT_STATE_RATIO = 2


class HiMambaRadixCache(MambaRadixCache):
    """Recurrent-state radix cache with a host tier (see the module docstring): a preset of
    :class:`MambaRadixCache` with the host component and the state host copies. Registered as a
    virtual :class:`~kvjax.radix.HiRadixCache`, whose API it offers.

    Args:
        page_size, eviction_policy, allocator / token_to_kv_pool_allocator: as for
            :class:`MambaRadixCache`.
        host_allocator, host_pool_tokens, copy_engine, write_policy: the KV host tier, as for
            :class:`~kvjax.radix.HiRadixCache` (``write_back``: NotImplementedError).
        host_state_slots: the host state pool's slot allocator (page size 1) or its size; None:
            ``2 * device state slots + 1`` (SGLang's sizing at its default ``hicache_ratio``).
        state_engine: the state copies (``StateTransferEngine``; default simulated).
        **kwargs: the rest of :class:`MambaRadixCache`'s keyword arguments.
    """

    host: HostTierComponent  # never None in this preset
    #: a storage tier needs the checkpoints' store beside the KV pages (``storage_link``)
    storage_checkpoints_required = True
    mamba: HiMambaComponent

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str = "lru",
        *,
        host_allocator: HostSlotAllocator | None = None,
        host_pool_tokens: int | None = None,
        copy_engine: CopyEngine | None = None,
        write_policy: str = "write_through",
        host_state_slots: HostSlotAllocator | int | None = None,
        state_engine: CopyEngine | None = None,
        allocator: Any = None,
        token_to_kv_pool_allocator: Any = None,
        **kwargs: Any,
    ) -> None:
        if write_policy == "write_back":
            raise NotImplementedError(
                "hicache_write_policy='write_back' for a recurrent-state model is not built (a checkpoint's host "
                "copy would have to land before its eviction); use write_through or write_through_selective"
            )
        alloc = one_token_allocator(allocator, token_to_kv_pool_allocator)
        host, _ = make_host_tier(
            page_size,
            host_allocator=host_allocator,
            host_pool_tokens=host_pool_tokens,
            copy_engine=copy_engine,
            write_policy=write_policy,
            load_back_threshold=0,  # a load carrying a state ignores the threshold (module docstring)
            device_allocator=alloc,
        )
        self._host_state_slots = host_state_slots
        self._state_engine = state_engine if state_engine is not None else SimulatedCopyEngine()
        super().__init__(page_size, eviction_policy, token_to_kv_pool_allocator=alloc, host=host, **kwargs)
        comp = self.mamba
        host.on_backup = self._on_kv_backup
        comp.kv_backed_up = lambda node: host.data(node) is not None
        if self.storage is not None:
            comp.on_state_landed = self.storage.backup_checkpoint
        record = getattr(self._state_engine, "record_copies", None)
        if record is not None:
            comp.before_backup = lambda: record(self.take_state_copies())

    def _on_kv_backup(self, node: TreeNode) -> None:
        """The host tier started backing ``node``'s KV up: copy its device checkpoint too."""
        self.mamba.backup_state(node)

    def _make_component(self, allocator: StateSlotAllocator | None, **options: Any) -> HiMambaComponent:
        slots = self._host_state_slots
        if not isinstance(slots, HostSlotAllocator):
            if slots is None:
                device = 0 if allocator is None else int(allocator.size)
                slots = DEFAULT_STATE_RATIO * max(device, 1) + 1
            slots = HostSlotAllocator(int(slots), 1)
        return HiMambaComponent(allocator, host_allocator=slots, engine=self._state_engine, **options)

    @property
    def host_state_allocator(self) -> HostSlotAllocator:
        """The host state pool's slot allocator."""
        return self.mamba.host_allocator

    @property
    def host_only_states(self) -> int:
        """Nodes whose checkpoint is on the host only (a host hit can end there)."""
        return self.mamba.host_only_states()

    # ------------------------------------------------------------------ the storage tier

    def landed_checkpoint(self, node: TreeNode) -> int | None:
        """The host state slot of ``node``'s landed checkpoint copy (None: none yet)."""
        return self.mamba.landed_host_slot(node)

    def adopt_stored_checkpoint(self, leaf: TreeNode) -> int | None:
        """A storage prefetch brought the state after the host-only ``leaf``'s last token: a host
        state slot for it (:meth:`HiMambaComponent.adopt_host_copy`), its checkpoint on the host
        only; None when no host state slot can be freed."""
        if leaf.residency != HOST_ONLY:
            raise ValueError(f"adopt_stored_checkpoint: {leaf!r} is not host-only")
        return self.mamba.adopt_host_copy(leaf)

    # ------------------------------------------------------------------ match

    def match_prefix(
        self, token_ids: Any, extra_key: Hashable = None, *, req: Req | None = None, cow_mamba: bool = False
    ) -> MatchResult:
        """:meth:`MambaRadixCache.match_prefix`; the host hit reaches the deepest walked node whose
        checkpoint has a host copy, over nodes whose KV is on the device or loadable (module
        docstring), measured from the device match."""
        m = super().match_prefix(token_ids, extra_key, req=req, cow_mamba=cow_mamba)
        if "host" not in m.extras:
            return m
        root = self.root
        below = []
        n = m.walk_node
        while n is not m.last_node and n is not root:
            below.append(n)
            n = n.parent
        best = None
        comp, host = self.mamba, self.host
        for n in reversed(below):
            if n.residency == HOST_ONLY and host.data(n) is None:
                break  # its KV is nowhere: the chain stops above it
            if comp.data(n) is None and comp.landed_host_slot(n) is not None:
                best = n
        hit = 0 if best is None else best.depth - m.prefix_len
        m.extras["host"] = HostMatch(hit, best if best is not None else m.last_node)
        mm = m.extras.get("mamba")
        if isinstance(mm, MambaMatch):
            # 0.5.23's branching point: over FULL KV on the device or the host (the host component adds
            # the host part after MAMBA's finalize), past the state boundary (device match + host hit).
            grid = comp.checkpoint_grid
            aligned = m.full_kv_hit_length // grid * grid
            m.extras["mamba"] = MambaMatch(mm.slot, aligned if aligned > m.prefix_len + hit else None)
        return m

    # ------------------------------------------------------------------ load back

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> int:
        """Bring ``node``'s checkpoint (on the host only) to the device, with the KV of its
        host-only chain (module docstring); all or nothing. Returns the node's depth (the prefix
        that now ends at a device checkpoint), 0 when nothing changed (recompute instead).

        Raises ValueError (nothing changed) for a node that is not in this tree.
        """
        foreign = not isinstance(node, TreeNode) or node.owner is not self.root.owner
        if foreign or node.residency not in (DEVICE, HOST_ONLY):
            raise ValueError(f"load_back: {node!r} is not a node of this tree")
        comp = self.mamba
        if node is self.root or comp.data(node) is not None or comp.landed_host_slot(node) is None:
            return 0
        chain = self.host.loadable_chain(node) if node.residency == HOST_ONLY else []
        if node.residency == HOST_ONLY and not chain:
            return 0
        total = sum(n.klen for n in chain)
        if mem_quota is not None and total > mem_quota:
            return 0
        anchor = chain[0].parent if chain else node
        anchor_lock = self.inc_lock_ref(anchor)
        comp.protect(node, True)
        slot = None
        try:
            slot = self._state_slot()
            if slot is None:
                return 0
            if chain and not self.host.load_back(node, mem_quota):
                return 0
            try:
                comp.start_load(node, slot)
            except CopyError:
                return 0  # the KV chain is back (device nodes without a state); the state is not
            slot = None
            return node.depth
        finally:
            if slot is not None and self.mamba_allocator is not None:
                self.mamba_allocator.free([slot])
            comp.protect(node, False)
            self.dec_lock_ref(anchor_lock)

    def _state_slot(self) -> int | None:
        """A free device state slot, evicting one unlocked checkpoint when none is; a synthesized id
        without a state allocator (simulation); None when none can be freed."""
        alloc = self.mamba_allocator
        if alloc is None:
            return int(self.synthesize_slots(1)[0]) + 1
        try:
            return self._alloc_state_slot()
        except OutOfMemoryError:
            return None

    def init_load_back(self, match: MatchResult, mem_quota: int | None = None) -> MatchResult:
        """After ``match_prefix``: load its host hit back (any length: it ends at a state) and
        return the match ending at the loaded node; ``match`` itself when nothing was loaded."""
        if getattr(match, "host_hit_length", 0) <= 0:
            return match
        node = match.last_host_node
        if not self.load_back(node, mem_quota):
            return match
        parts = []
        n = node
        while n is not self.root:
            parts.append(n.value)
            n = n.parent
        parts.reverse()
        return MatchResult.from_parts(parts, node, node.depth)

    def fork_into_request(self, req: Req, node: TreeNode) -> None:
        """Queue the copy of ``node``'s device checkpoint into ``req``'s state slot (after a
        load-back moved the request to ``node``); ``req.mamba_cow_src_index`` names it."""
        src = self.mamba.slot_of(node)
        if src is None or req.mamba_pool_idx is None:
            raise ValueError(f"fork_into_request: node {node.id} has no device checkpoint or request has no slot")
        req.mamba_cow_src_index = src
        self.queue_state_copy(src, int(req.mamba_pool_idx))

    # ------------------------------------------------------------------ transfers

    def writing_check(self, wait: bool = False) -> int:
        """Complete landed KV and state backups; returns how many."""
        return super().writing_check(wait) + self.mamba.writing_check(wait)

    def loading_check(self, wait: bool = False) -> int:
        """Complete landed KV and state loads; returns how many."""
        return super().loading_check(wait) + self.mamba.loading_check(wait)

    def check_transfers(self, wait: bool = False) -> int:
        """The polling step: KV transfers (and their storage writes), then state copies. A state
        copy lands only once the owner of the step applied its update: ``wait`` cannot force it."""
        return super().check_transfers(wait) + self.mamba.writing_check(wait) + self.mamba.loading_check(wait)

    def reset(self) -> None:
        """:meth:`TieredTree.reset`, state copies in flight cancelled first (their locks released)."""
        self.mamba.cancel_all()
        super().reset()

    def host_balanced(self) -> bool:
        """Both host pools balanced: KV (``available + evictable + protected + held == size``) and
        states (``available + held == size``)."""
        kv = self.host_allocator
        s = self.sizes()["host"]
        states = self.mamba.host_allocator
        return (
            kv.available_size() + s.evictable + s.protected + self.host.held_tokens == kv.size
            and states.available_size() + len(self.mamba.host_slot) == states.size
        )


HiRadixCache.register(HiMambaRadixCache)
