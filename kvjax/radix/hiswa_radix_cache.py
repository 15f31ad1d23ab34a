"""`HiSWARadixCache`: the hybrid sliding-window tree with a host tier (FULL + SWA + host).

SGLang 0.5.23 (``UnifiedRadixCache`` with FULL and SWA plus ``init_hicache``) builds two host
pools for such a model, one per device pool, and its load-back restores SWA only for the last
window. kvjax does the same on the SWA component and the host component:

* **Host copies.** A backup copies a node's full-layer KV (always) and its sliding-layer KV when
  the node is SWA-live at that moment; the two host pools share host slot ids, one to one (the
  host component allocates them; the transfer engine is ``kvjax.transfers.swa_transfer``). The SWA
  component records which host copies carry SWA (``SWAComponent.host_copy_live``).
* **Device eviction** of a backed-up node demotes it: its full slots (and the SWA slots paired
  with them) are freed, its SWA data forgotten (``SWAComponent.on_demote``).
* **Host hit.** Below the device match, the host-only chain counts up to the deepest node whose
  last ``W`` tokens can hold live SWA once loaded: each node within that window is either on the
  device and SWA-live, or host-only with a host copy that carries SWA (or the window reaches the
  root). ``host_hit_length`` is measured from the (SWA-shortened) device match, so it includes
  device tokens between the SWA match and the chain whose SWA is not live but which the loaded
  window makes matchable again.
* **Load-back** (all or nothing, threshold 10 as for ``HiRadixCache``): device slots are
  allocated in pairs for the whole chain, then the SWA slots of the chain's nodes outside its
  last window are freed before the copy starts (``before_load``), so the copy restores full KV for
  every node and SWA KV only for the window's nodes, which become SWA-live (``after_revive``); the
  others are SWA tombstones.

* **Storage tier** (L3, ``storage=StorageOptions(..., window=WindowStore(...))``: both host pools'
  pages). A landed host copy's full-layer pages are stored, and its sliding-layer pages beside
  them when the host copy carries SWA (:meth:`host_copy_carries_window`). A prefetch brings the
  full pages of the longest stored run whose last window's sliding pages are stored too, and
  those sliding pages: the new host-only node is split at the window (:meth:`adopt_stored_window`),
  the lower node's host copy carries SWA, the upper one is an SWA tombstone; the host hit then
  loads it back like any host copy (rules: ``kvjax.radix.storage_window``). A storage tier
  without the sliding pages' store is refused (NotImplementedError: its prefixes could never be
  served).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.host_component import LOAD_BACK_THRESHOLD, HostMatch, HostTierComponent
from kvjax.radix.match import MatchResult
from kvjax.radix.node import DEVICE, HOST_ONLY, TreeNode
from kvjax.radix.radix_cache import one_token_allocator
from kvjax.radix.swa_radix_cache import SWARadixCache
from kvjax.radix.tiered_tree import make_host_tier

if TYPE_CHECKING:
    from collections.abc import Hashable

    from kvjax.alloc.swa import SWATokenToKVPoolAllocator
    from kvjax.tiers import CopyEngine, HostSlotAllocator

__all__ = ["HiSWARadixCache"]


class HiSWARadixCache(SWARadixCache):
    """Hybrid sliding-window radix cache with a host tier (see the module docstring): a preset of
    :class:`SWARadixCache` with the host component given at construction, wired to the SWA
    component (which host copies carry SWA, the last window of a load-back). The host-tier
    methods are the tree's (``tiered_tree.py``); it is registered as a virtual
    :class:`~kvjax.radix.HiRadixCache`, whose API it offers.

    Args:
        page_size, sliding_window_size, eviction_policy, allocator / token_to_kv_pool_allocator:
            as for :class:`~kvjax.radix.SWARadixCache`.
        host_allocator, host_pool_tokens, copy_engine, write_policy, load_back_threshold: as for
            :class:`~kvjax.radix.HiRadixCache` (the engine copies both pools; default simulated).
        **kwargs: the rest of :class:`~kvjax.radix.SWARadixCache`'s keyword arguments.
    """

    host: HostTierComponent  # never None in this preset
    #: a storage tier needs the sliding layers' store beside the full layers' (``storage_link``)
    storage_window_required = True

    def __init__(
        self,
        page_size: int = 1,
        sliding_window_size: int | None = None,
        eviction_policy: str = "lru",
        *,
        host_allocator: HostSlotAllocator | None = None,
        host_pool_tokens: int | None = None,
        copy_engine: CopyEngine | None = None,
        write_policy: str = "write_through",
        load_back_threshold: int = LOAD_BACK_THRESHOLD,
        allocator: SWATokenToKVPoolAllocator | None = None,
        token_to_kv_pool_allocator: SWATokenToKVPoolAllocator | None = None,
        **kwargs: Any,
    ) -> None:
        alloc = one_token_allocator(allocator, token_to_kv_pool_allocator)
        host, _ = make_host_tier(
            page_size,
            host_allocator=host_allocator,
            host_pool_tokens=host_pool_tokens,
            copy_engine=copy_engine,
            write_policy=write_policy,
            load_back_threshold=load_back_threshold,
            device_allocator=alloc,
        )
        super().__init__(
            page_size,
            sliding_window_size,
            eviction_policy,
            token_to_kv_pool_allocator=alloc,
            host=host,
            **kwargs,
        )
        host.on_backup = self.swa.note_host_copy
        host.before_load = self._unpair_outside_window
        host.after_revive = self._revive_window

    # ------------------------------------------------------------------ the last window

    def _window_nodes(self, node: TreeNode, stop: TreeNode | None = None) -> list[TreeNode]:
        """The nodes covering the last ``W`` key elements ending at ``node`` (bottom first),
        up to the root or, when given, not above ``stop``."""
        out = []
        covered = 0
        root = self.root
        n = node
        while n is not root and covered < self.sliding_window_size:
            out.append(n)
            covered += n.klen
            if n is stop:
                break
            n = n.parent
        return out

    def _window_restorable(self, node: TreeNode) -> bool:
        """Whether the last ``W`` key elements ending at ``node`` hold live SWA after a load-back:
        device nodes SWA-live, host-only nodes with a host copy that carries SWA."""
        swa = self.swa
        for n in self._window_nodes(node):
            if n.residency == HOST_ONLY:
                if not swa.host_copy_live.get(n, False):
                    return False
            elif swa.is_tombstone(n):
                return False
        return True

    def _restored(self, chain: list[TreeNode]) -> set[TreeNode]:
        """The chain's nodes whose SWA a load-back restores: those within its last window whose
        host copy carries SWA."""
        live = self.swa.host_copy_live
        return {n for n in self._window_nodes(chain[-1], stop=chain[0]) if live.get(n, False)}

    def _unpair_outside_window(self, chain: list[TreeNode], slots: np.ndarray) -> None:
        """Before a load-back's copy: free the SWA slots paired with the chain's nodes whose SWA it
        does not restore (outside its last window, or a host copy without SWA)."""
        alloc = self.token_to_kv_pool_allocator
        if alloc is None:
            return
        window = self._restored(chain)
        off = 0
        drop = []
        for n in chain:
            if n not in window:
                drop.append(slots[off : off + n.klen])
            off += n.klen
        if drop:
            alloc.free_swa(np.concatenate(drop))  # type: ignore[attr-defined]

    def _revive_window(self, chain: list[TreeNode]) -> None:
        """After a load-back revived ``chain``: the nodes whose SWA it restored are SWA-live (top
        first, so parents are older in the SWA recency order); the rest stay SWA tombstones."""
        restored = self._restored(chain)
        for n in chain:
            if n in restored:
                self.swa.make_live(n)

    # ------------------------------------------------------------------ the storage tier

    def host_copy_carries_window(self, node: TreeNode) -> bool:
        """Whether ``node``'s host copy holds its sliding layers' KV (it was SWA-live when its
        backup started, or its window came from storage)."""
        return self.swa.host_copy_live.get(node, False)

    def adopt_stored_window(self, leaf: TreeNode, tokens: int) -> None:
        """A storage prefetch wrote the sliding layers' KV of the last ``tokens`` key elements of
        the host-only ``leaf`` (whole pages) into the SWA host pool: split ``leaf`` there; the lower
        node's host copy carries SWA, the upper node's does not (an SWA tombstone)."""
        if leaf.residency != HOST_ONLY or leaf.children or not 0 < tokens <= leaf.klen or tokens % self.page_size:
            raise ValueError(f"adopt_stored_window: {tokens} window tokens for host-only leaf {leaf!r}")
        if tokens < leaf.klen:
            self.split_node(leaf, leaf.klen - tokens)  # ``leaf`` keeps the lower part
        self.swa.host_copy_live[leaf] = True

    # ------------------------------------------------------------------ match

    def match_prefix(self, token_ids: Any, extra_key: Hashable = None) -> MatchResult:
        """:meth:`SWARadixCache.match_prefix`; the host hit is the host-only chain below the device
        nodes of the walk, up to its deepest node whose last window is restorable (see the module
        docstring), measured from the device match."""
        m = super().match_prefix(token_ids, extra_key)
        if "host" not in m.extras:
            return m
        root = self.root
        path = []
        n = m.walk_node
        while n is not root:
            path.append(n)
            n = n.parent
        path.reverse()
        chain = []
        for n in path:
            if n.residency == DEVICE:
                continue
            if n.residency != HOST_ONLY or self.host.data(n) is None:
                break
            chain.append(n)
        best = None
        for n in chain:
            if self._window_restorable(n):
                best = n
        hit = 0 if best is None else best.depth - m.prefix_len
        m.extras["host"] = HostMatch(hit, best if best is not None else m.last_node)
        return m


HiRadixCache.register(HiSWARadixCache)
