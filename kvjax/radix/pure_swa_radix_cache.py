"""`PureSWARadixCache`: the prefix cache of models whose every layer is sliding-window.

SGLang builds ``PureSWARadixCache`` when a hybrid-SWA plan has no full-attention layers
(``full_tokens_per_layer == 0``). There is one pool, the SWA pool, handed out by a plain token or
paged allocator; a request only ever reads the KV of its last ``W`` tokens. The tree keeps the
*keys* of whole prefixes (a match must still agree token by token from the root) but KV only
where some future query can see it.

kvjax builds it on the SWA component (``swa_component.py``) with one change of representation:

* a node's ``value`` holds real SWA slot ids while it is live, and **zeros** (the trash slot)
  once it is a tombstone. There is no full pool to keep a tombstone's slots in, and keeping freed
  ids would read stale KV and free them twice once the allocator hands them out again (SGLang
  bug #31486: the pure-SWA tree re-inserted KV already evicted from the window). Zeros are
  never freed (FULL's frees go through :class:`_SkipTrashFrees`), a match hands them out as the
  trash page (never read: out of the window), and a row that points at them reads nothing live.
* a request's positions ``[cache_protected_len, swa_evicted_seqlen)``, freed by its decode, are
  zeroed in its row before any lifecycle insert or free, so the tree never takes (or frees) an
  id it no longer owns; ``insert(..., swa_evicted_seqlen=e)`` stores zeros for ``[0, e)``: the
  caller freed those slots.
* sizes, ``evict`` and the accounting answer for the SWA pool: ``evictable_size()`` /
  ``protected_size()`` / ``total_size()`` are SWA tokens (``available + evictable + protected +
  held by requests == size``). FULL's counters (``evictable_size("full")``) count key tokens,
  tombstones included, which hold no KV.
* ``evict(num_tokens)`` is SWA eviction (the least recent live node first: an unlocked leaf is
  deleted, anything else becomes a tombstone), after which tombstone leaves no request locks are
  deleted (they hold nothing, and nothing below them can be matched).

Everything else (match ending where ``W`` live tokens follow the last tombstone, window-limited
SWA locks and ``dec_swa_lock_only``, leaf capping at one page-aligned window, revival of a
tombstone by a later insert) is :class:`~kvjax.radix.swa_radix_cache.SWARadixCache`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix.chunk_cache import request_row
from kvjax.radix.swa_component import SWAComponent
from kvjax.radix.swa_radix_cache import SWARadixCache

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol
    from kvjax.radix.node import TreeNode
    from kvjax.request import Req

__all__ = ["PureSWAComponent", "PureSWARadixCache"]


class _SkipTrashFrees:
    """The SWA pool's allocator as the tree's FULL sees it: ``free`` and ``free_segment`` skip
    slot 0 (a tombstone's positions), everything else is the allocator's."""

    def __init__(self, allocator: AllocatorProtocol) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.size = allocator.size

    def free(self, free_index: Any) -> None:
        ids = np.asarray(free_index)
        live = ids[ids != 0]
        if live.size:
            self.allocator.free(live)

    def free_segment(self, free_index: Any, *, start_pos: int) -> None:
        ids = np.asarray(free_index)
        live = ids[ids != 0]
        if live.size:
            # Zeros lie on whole pages (tombstones, out-of-window positions): what is left is a
            # row segment starting on a page boundary.
            self.allocator.free_segment(live, start_pos=0)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, need_size: int) -> np.ndarray | None:
        return self.allocator.alloc(need_size)

    def alloc_extend(
        self, prefix_lens: Any, seq_lens: Any, last_loc: Any, extend_num_tokens: int | None = None
    ) -> np.ndarray | None:
        return self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)

    def alloc_decode(self, seq_lens: Any, last_loc: Any) -> np.ndarray | None:
        return self.allocator.alloc_decode(seq_lens, last_loc)

    def free_group_begin(self) -> None:
        self.allocator.free_group_begin()

    def free_group_end(self) -> None:
        self.allocator.free_group_end()


class PureSWAComponent(SWAComponent):
    """The SWA component over the only pool: node values are SWA slot ids, zeros on tombstones
    (see the module docstring). ``allocator``: the pool's plain allocator, or None (standalone)."""

    def __init__(self, sliding_window_size: int, page_size: int, allocator: AllocatorProtocol | None = None) -> None:
        super().__init__(sliding_window_size, page_size, None)
        self.pool_allocator = allocator

    def _zero(self, node: TreeNode) -> None:
        if node.value is not None:
            node.value = np.zeros_like(node.value)

    def _free_stale_swa(self, node: TreeNode) -> None:
        # The caller freed these positions' slots (they left the window): the tree keeps none.
        self._zero(node)

    def _tombstone_slots(self, node: TreeNode) -> None:
        if self.pool_allocator is not None and node.value is not None:
            self.pool_allocator.free_segment(node.value, start_pos=0)
        self._zero(node)

    def _revive_slots(self, node: TreeNode, incoming: np.ndarray | None) -> None:
        # A tombstone holds nothing: it takes the incoming slots (synthesized ones standalone).
        # Requests locking it hold zeros for these positions and never read them (out of their
        # window), so taking new slots under their lock is safe.
        node.value = incoming.copy() if incoming is not None else self.tree.synthesize_slots(node.klen)

    def _check_slots(self, node: TreeNode, live: bool, fail: Any) -> None:
        value = node.value
        if value is None:
            return
        if live and not (value != 0).all():
            fail(f"live node {node.id} holds the trash slot")
        if not live and value.any():
            fail(f"tombstone {node.id} still holds slots {value[value != 0][:8].tolist()}")

    def evict(self, amount: int) -> int:
        freed = super().evict(amount)
        self.prune_tombstone_leaves()
        return freed

    def prune_tombstone_leaves(self) -> int:
        """Delete the unlocked leaves that are tombstones (iteratively: a parent may become one);
        they hold no KV and nothing below them can be matched. Returns the nodes deleted."""
        tree = self.tree
        deleted = 0
        while True:
            dead = [n for n in tree.evictable_leaves if self.data(n) is None]
            if not dead:
                return deleted
            for node in dead:
                tree.delete_leaf(node)
                deleted += 1


class PureSWARadixCache(SWARadixCache):
    """Radix prefix cache for models whose every layer is sliding-window (see the module docstring).

    Args:
        page_size: tokens per page (the allocator's).
        sliding_window_size: the window ``W`` in tokens (>= 1).
        eviction_policy: FULL's policy for the key structure (the SWA pool is evicted in its own
            LRU order).
        allocator: the SWA pool's token or paged allocator, or None for a standalone tree.
        token_to_kv_pool_allocator: SGLang's name for ``allocator`` (give one of them).
        **kwargs: the rest of :class:`~kvjax.radix.RadixCache`'s keyword arguments
            (``req_to_token_pool``, ``is_eagle``, ``enable_kv_cache_events``, ...).
    """

    trash_in_values = True

    def _check_allocator(self, alloc: Any, page_size: int) -> None:
        if alloc is None:
            return
        if hasattr(alloc, "free_swa"):
            raise ConfigError(
                "allocator",
                type(alloc).__name__,
                "a pure-SWA tree takes the SWA pool's plain allocator (an SWATokenToKVPoolAllocator "
                "pairs full slots: use SWARadixCache)",
            )
        if int(alloc.page_size) != int(page_size):
            raise ConfigError(
                "page_size", page_size, f"use the allocator's page size ({alloc.page_size}) for the tree too"
            )

    def _make_swa_component(self, window: int, page_size: int, alloc: Any) -> SWAComponent:
        return PureSWAComponent(window, page_size, alloc)

    def _full_allocator(self, alloc: Any) -> Any:
        return None if alloc is None else _SkipTrashFrees(alloc)

    def _keep_evicted_slots(self, values: np.ndarray, evicted: int) -> np.ndarray:
        """``insert(..., swa_evicted_seqlen=e)``: the caller already freed the slots of positions
        ``[0, e)``, so the tree stores zeros there (tombstones) and neither keeps nor frees those
        ids. Incoming slots of already-cached positions in ``[max(prev_prefix_len, e), cached)``
        that the tree does not take are freed by the insert, as :meth:`SWARadixCache.insert` does."""
        kept = np.array(values, dtype=np.int32)
        kept[:evicted] = 0
        return kept

    # ------------------------------------------------------------------ lifecycle

    def _forget_evicted(self, req: Req) -> None:
        """Zero the request's row over ``[cache_protected_len, swa_evicted_seqlen)``: its decode
        freed those slots, so no lifecycle insert or free may see their ids (SGLang #31486)."""
        e = int(getattr(req, "swa_evicted_seqlen", 0))
        cpl = req.cache_protected_len
        if e > cpl:
            row = request_row(self.req_to_token_pool, req, "caching")
            if row[cpl:e].any():
                self._write_row(req, cpl, np.zeros(e - cpl, np.int32))

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """:meth:`SWARadixCache.cache_finished_req`; positions the request's decode freed are
        neither cached nor freed again."""
        if not self.disable:
            self._forget_evicted(req)
        super().cache_finished_req(req, is_insert)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """:meth:`SWARadixCache.cache_unfinished_req`; positions the request's decode (or an
        earlier chunk's window freeing) freed are stored as tombstones."""
        if not self.disable:
            self._forget_evicted(req)
        super().cache_unfinished_req(req, chunked)

    # ------------------------------------------------------------------ eviction and sizes

    def evict(self, num_tokens: Any = 0, swa_num_tokens: int = 0) -> Any:
        """SWA eviction of ``num_tokens + swa_num_tokens`` tokens (one pool), then the unlocked
        tombstone leaves are deleted; returns the SWA tokens freed. A mapping
        (``evict({"swa": n})``) returns the per-component dict.

        Raises (unchanged): ValueError for negative or non-integer amounts.
        """
        if isinstance(num_tokens, Mapping):
            return super().evict(num_tokens)
        for what, amount in (("num_tokens", num_tokens), ("swa_num_tokens", swa_num_tokens)):
            if isinstance(amount, bool) or not isinstance(amount, (int, np.integer)) or amount < 0:
                raise ValueError(f"evict: {what} must be an integer >= 0, got {amount!r}")
        return super().evict({"swa": int(num_tokens) + int(swa_num_tokens)})["swa"]

    def evictable_size(self, component: str = "swa") -> int:
        """Unlocked cached tokens of the SWA pool (``"full"``: key tokens, tombstones included)."""
        return super().evictable_size(component)

    def protected_size(self, component: str = "swa") -> int:
        """Locked cached tokens of the SWA pool (``"full"``: key tokens, tombstones included)."""
        return super().protected_size(component)

    def total_size(self, component: str | None = "swa") -> Any:
        """Cached tokens of the SWA pool (``None``: ``(key tokens, SWA tokens)``)."""
        return super().total_size(component)
