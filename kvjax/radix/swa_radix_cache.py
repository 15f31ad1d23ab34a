"""`SWARadixCache`: the prefix cache of hybrid sliding-window models (FULL + SWA components).

SGLang 0.5.23 builds it as ``UnifiedRadixCache`` with the FULL and SWA components; the rules are
in ``swa_component.py`` and ``docs/architecture.md`` ("Tree components"). Standalone (simulation,
``allocator=None``) or over an :class:`~kvjax.alloc.SWATokenToKVPoolAllocator` whose full slot ids
the nodes hold (their SWA slots are the allocator's mapping).

Differences from the full-KV :class:`RadixCache` contract, as SGLang's SWA cache has them:

* ``insert`` frees the incoming duplicates itself (slots of positions ``[prev_prefix_len,
  already cached)`` that differ from the tree's), since a tombstone revived by the insert takes
  the incoming slots (or their SWA part) and only the tree knows which; the caller frees nothing.
* ``insert(..., swa_evicted_seqlen=e)``: the key's first ``e`` positions have no SWA slots any
  more (the request freed them while decoding); new nodes there are tombstones.
* sizes per component: ``full_evictable_size`` / ``swa_evictable_size`` / ``full_protected_size``
  / ``swa_protected_size``; ``total_size()`` is ``(full, swa)``. Unlike SGLang, ``evictable_size()``
  and ``protected_size()`` still answer for FULL (the scheduler's accounting reads them).
* ``dec_swa_lock_only(receipt)`` releases a lock's SWA part early (0.5.23: frees nothing).
* ``evict(num_tokens=0, swa_num_tokens=0)`` returns ``(full evicted, swa evicted)``, cascades
  included (a FULL eviction frees SWA slots too; an SWA eviction of a leaf frees FULL slots).

The request lifecycle (``cache_unfinished_req``, ``cache_finished_req``, ``match_and_lock``) is
RadixCache's, with the request's ``swa_evicted_seqlen`` as the SWA payload.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix.chunk_cache import request_row
from kvjax.radix.component import TreeComponent
from kvjax.radix.eviction import EvictionPolicy
from kvjax.radix.keys import as_slot_array
from kvjax.radix.lock import LockError, LockReceipt
from kvjax.radix.radix_cache import RadixCache, one_token_allocator
from kvjax.radix.swa_component import SWAComponent, SWAInsertPayload, SWALockPart

if TYPE_CHECKING:
    from kvjax.alloc.swa import SWATokenToKVPoolAllocator
    from kvjax.radix.node import TreeNode
    from kvjax.request import Req

__all__ = ["SWARadixCache"]


def check_swa_allocator(allocator: Any, page_size: int) -> None:
    """Raise ConfigError unless ``allocator`` is None or an SWA allocator with ``page_size``."""
    if allocator is None:
        return
    if not hasattr(allocator, "free_swa") or not hasattr(allocator, "full_to_swa_index_mapping"):
        raise ConfigError(
            "allocator", type(allocator).__name__, "the SWA caches need an SWATokenToKVPoolAllocator (or None)"
        )
    if int(allocator.page_size) != int(page_size):
        raise ConfigError(
            "page_size", page_size, f"use the allocator's page size ({allocator.page_size}) for the tree too"
        )


class SWARadixCache(RadixCache):
    """Radix prefix cache for hybrid sliding-window models.

    Args:
        page_size: tokens per page (the allocator's).
        sliding_window_size: the window ``W`` in tokens (>= 1).
        eviction_policy: FULL's policy (``lru`` default; see :class:`RadixCache`); SWA keeps
            its own LRU.
        allocator: an ``SWATokenToKVPoolAllocator``, or None for a standalone tree.
        token_to_kv_pool_allocator: SGLang's name for ``allocator`` (give one of them).
        components: further components after SWA.
        **kwargs: the rest of :class:`RadixCache`'s keyword arguments (``req_to_token_pool``,
            ``is_eagle``, ``enable_kv_cache_events``, ``event_sink``, ``enable_metrics``,
            ``hash_seed``, ``eviction_policy_config``, ``disable``), and ``host``: the host tier
            component (``HiSWARadixCache`` builds it), attached last.
    """

    def __init__(
        self,
        page_size: int = 1,
        sliding_window_size: int | None = None,
        eviction_policy: str | EvictionPolicy = "lru",
        *,
        allocator: SWATokenToKVPoolAllocator | None = None,
        token_to_kv_pool_allocator: SWATokenToKVPoolAllocator | None = None,
        components: Sequence[TreeComponent] = (),
        **kwargs: Any,
    ) -> None:
        alloc = one_token_allocator(allocator, token_to_kv_pool_allocator)
        if sliding_window_size is None:
            raise ConfigError("sliding_window_size", None, "give the model's sliding window in tokens")
        self._check_allocator(alloc, page_size)
        self.swa = self._make_swa_component(
            sliding_window_size, int(page_size) if isinstance(page_size, int) else 1, alloc
        )
        super().__init__(
            page_size,
            eviction_policy,
            token_to_kv_pool_allocator=self._full_allocator(alloc),
            components=(self.swa, *components),
            **kwargs,
        )
        self.swa.page_size = self.page_size
        self.swa.window_cap = -(-self.swa.sliding_window_size // self.page_size) * self.page_size
        self.sliding_window_size = self.swa.sliding_window_size
        if alloc is not None and hasattr(alloc, "size_full"):
            self._slot_limit = int(alloc.size_full) + int(alloc.page_size)  # the tree holds full slot ids

    # The seams a variant over other pools (``PureSWARadixCache``) overrides.

    def _check_allocator(self, alloc: Any, page_size: int) -> None:
        check_swa_allocator(alloc, page_size)

    def _make_swa_component(self, window: int, page_size: int, alloc: Any) -> SWAComponent:
        return SWAComponent(window, page_size, alloc)

    def _full_allocator(self, alloc: Any) -> Any:
        """The allocator FULL frees node values into."""
        return alloc

    def _keep_evicted_slots(self, values: np.ndarray, evicted: int) -> np.ndarray:
        """The incoming slots an insert caches for key positions ``[0, evicted)``, whose SWA part
        the request already freed: here the full slot ids, as given (int32, one per token)."""
        return values

    def supports_swa(self) -> bool:
        return True

    # ------------------------------------------------------------------ insert

    def _check_evicted(self, swa_evicted_seqlen: Any, n: int, what: str) -> int:
        e = swa_evicted_seqlen
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 0:
            raise ValueError(f"{what}: swa_evicted_seqlen must be an integer >= 0, got {e!r}")
        e = int(e)
        if e % self.page_size:
            raise ValueError(
                f"{what}: swa_evicted_seqlen={e} is not page aligned (page_size={self.page_size}); "
                "free SWA slots by whole pages"
            )
        if e and e >= n:
            raise ValueError(
                f"{what}: swa_evicted_seqlen={e} reaches the end of the key ({n} page-aligned positions): "
                "at least the key's last page must still hold SWA slots"
            )
        return e

    def insert(  # type: ignore[override]
        self,
        token_ids: Any,
        indices: Any = None,
        extra_key: Hashable = None,
        priority: int = 0,
        *,
        swa_evicted_seqlen: int = 0,
        prev_prefix_len: int = 0,
        chunked: bool = False,
        inserted_len: int = 0,
        donate_key: bool = False,
        retention_seconds: float | None = None,
    ) -> int:
        """Cache ``token_ids`` → ``indices`` (full slot ids); returns the length already cached.

        With an allocator, the incoming slots of already-cached positions from
        ``prev_prefix_len`` on that the tree does not take are freed here (full and SWA part; a
        part already freed is skipped), as SGLang's SWA cache does: the caller frees nothing.
        ``swa_evicted_seqlen``: positions ``[0, e)`` of the key hold no SWA slots (page aligned,
        0 or below the page-aligned key length); new nodes there are tombstones and tombstones
        there stay. ``donate_key``: as :meth:`RadixCache.insert`.

        Raises (tree unchanged): ValueError for a bad ``swa_evicted_seqlen`` or
        ``prev_prefix_len``, and what :meth:`RadixCache.insert` raises.
        """
        if type(token_ids) is not list and not isinstance(token_ids, np.ndarray):
            token_ids = list(token_ids)
        n_tok = len(token_ids) if type(token_ids) is list else int(token_ids.shape[0])
        n = self._key_len(n_tok)
        e = self._check_evicted(swa_evicted_seqlen, n, "insert")
        if isinstance(prev_prefix_len, bool) or not isinstance(prev_prefix_len, (int, np.integer)):
            raise ValueError(f"insert: prev_prefix_len must be an integer, got {prev_prefix_len!r}")
        if not 0 <= int(prev_prefix_len) <= max(n, 0):
            raise ValueError(f"insert: prev_prefix_len={prev_prefix_len} outside [0, {n}]")
        values = None if indices is None else as_slot_array(indices, n_tok, self._slot_limit)
        if values is not None and e:
            values = self._keep_evicted_slots(values, e)
        payload = SWAInsertPayload(e, values, 0, int(prev_prefix_len))
        if values is not None:
            self._walk_dups = (int(prev_prefix_len), e)
        try:
            return super().insert(
                token_ids,
                values if values is not None else indices,
                extra_key,
                priority,
                chunked=chunked,
                inserted_len=inserted_len,
                payloads={"swa": payload},
                donate_key=donate_key,
                retention_seconds=retention_seconds,
            )
        finally:
            self._walk_dups = None

    _dups_in_walk = True

    def _overlap(
        self,
        parent: TreeNode,
        node: TreeNode,
        values: np.ndarray | None,
        off: int,
        k: int,
        payloads: Mapping[str, Any] | None,
    ) -> None:
        """The walk over ``node`` (``k`` positions ending at ``node.depth``, incoming
        ``values[off:off + k]``): the components first (an SWA revival frees the tombstone's old
        full slots), then the caller's duplicates there, as SGLang 0.5.23's walk emits them per
        node. When SWA split the node at the caller's eviction edge (``node`` is then the lower
        part), the lower part's duplicates (incoming full slots of a tombstone revived under a
        FULL lock) go first, then the upper part's."""
        super()._overlap(parent, node, values, off, k, payloads)
        w = self._walk_dups
        if w is None or values is None or self._full.allocator is None:
            return
        lo, evicted = w
        end = node.depth
        start = end - k
        if max(start, lo) >= end:
            return
        cut = node.depth - node.klen  # > start when SWA split the walked node
        if cut > start:
            self._free_span_duplicates(node.value, values, off + cut - start, max(cut, lo), cut, evicted)
            upper = node.parent
            assert upper is not None and upper.depth - upper.klen == start, "SWA splits a walked node once"
            self._free_span_duplicates(upper.value, values, off, max(start, lo), start, evicted)
        else:
            self._free_span_duplicates(node.value, values, off, max(start, lo), start, evicted)

    def _free_span_duplicates(self, tree: Any, values: np.ndarray, off: int, a: int, first: int, evicted: int) -> None:
        """Free the incoming ``values[off + a - first : off + len(tree)]`` (positions ``[a,
        first + len(tree))``) where they differ from the tree's slots ``tree`` (positions from
        ``first``), as one row segment."""
        if tree is None:
            return
        end = first + len(tree)
        if a >= end:
            return
        mine = values[off + a - first : off + end - first]
        differ = mine != tree[a - first :]
        if differ.any():
            self._free_row_segment(mine if differ.all() else mine[differ], a, evicted)

    def _row_evicted(self, req: Req) -> int:
        return int(getattr(req, "swa_evicted_seqlen", 0))

    def _free_row_segment(self, slots: np.ndarray, start: int, evicted: int) -> None:
        """One row segment; when it straddles ``evicted`` (positions before it hold no SWA slots),
        the out-of-window part goes first, then the rest (0.5.23's ``free_kv_row_segments`` and
        duplicate frees: full-only segments, then full + SWA), each in row order."""
        cut = evicted - start
        if 0 < cut < slots.size:
            super()._free_row_segment(slots[:cut], start, evicted)
            super()._free_row_segment(slots[cut:], evicted, evicted)
        else:
            super()._free_row_segment(slots, start, evicted)

    def prepare_for_caching_req(self, req: Req, key_len: int, is_finished: bool) -> tuple[int, dict[str, Any] | None]:
        """0.5.23's ``prepare_for_caching_req``: the SWA payload of the lifecycle insert is the
        request's ``swa_evicted_seqlen``, its row (the incoming slots, by key position) and its
        protected prefix. The cacheable length is kept.

        Raises ValueError (nothing changed) for a ``swa_evicted_seqlen`` not page aligned or
        reaching the end of the key.
        """
        e = getattr(req, "swa_evicted_seqlen", 0)
        if e <= req.cache_protected_len:
            e = 0  # the request freed none of its own positions: its protected prefix is the tree's
        e = self._check_evicted(e, key_len, f"caching request {req.rid!r}")
        row = request_row(self.req_to_token_pool, req, "caching")
        return key_len, {"swa": SWAInsertPayload(e, row, 0, req.cache_protected_len)}

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """:meth:`RadixCache.cache_finished_req` with the request's ``swa_evicted_seqlen`` as the
        SWA payload; afterwards the request holds no KV, so ``swa_evicted_seqlen`` is reset to 0."""
        super().cache_finished_req(req, is_insert)
        req.swa_evicted_seqlen = 0

    # ------------------------------------------------------------------ locks and eviction

    def _swa_part(self, receipt: Any, what: str) -> SWALockPart | None:
        """The receipt's SWA part; None for a lock of this tree that locked no SWA (its match
        ended at the root)."""
        if not isinstance(receipt, LockReceipt):
            raise TypeError(f"{what}: expected the LockReceipt of inc_lock_ref, got {type(receipt).__name__}")
        if receipt.owner is not self._owner:
            raise LockError(f"{what}: {receipt!r} is a lock of another tree; give the receipt this tree returned")
        if receipt.released:
            raise LockError(f"{what}: {receipt!r} was already released; release the SWA part before dec_lock_ref")
        parts = receipt.parts
        if not parts:
            return None
        part = parts[self._extra.index(self.swa)]
        assert isinstance(part, SWALockPart)
        return part

    def dec_swa_lock_only(self, receipt: LockReceipt) -> int:
        """Release the SWA part of a lock early (0.5.23: ``dec_swa_lock_only`` /
        ``release_swa_prefix_lock``, once decode has moved past the window): its tokens move from
        SWA-protected to SWA-evictable, nothing is freed; the later ``dec_lock_ref(receipt)``
        releases FULL only. Applies only when the lock's SWA segment ended at a window boundary;
        otherwise returns 0 and changes nothing. Returns the SWA tokens made evictable.

        As SGLang's ``release_swa`` (its scheduler calls it for every decode request past the
        window), a lock that holds no SWA (a match that ended at the root) and a second call for
        the same lock do nothing and return 0.

        Raises (unchanged): LockError for a receipt already released by ``dec_lock_ref`` (SGLang
        asserts there) or one of another tree; TypeError for a non-receipt.
        """
        part = self._swa_part(receipt, "dec_swa_lock_only")
        if part is None or part.released:
            return 0
        return self.swa.release_swa_lock(receipt.node, part)

    release_swa_prefix_lock = dec_swa_lock_only

    def evict(self, num_tokens: Any = 0, swa_num_tokens: int = 0) -> Any:
        """``evict(num_tokens=0, swa_num_tokens=0)``: FULL eviction, then SWA eviction of what the
        FULL cascade left of ``swa_num_tokens``; returns ``(full evicted, swa evicted)``, cascades
        included. A mapping (``evict({"full": n, "swa": m})``) returns the per-component dict.

        Raises (unchanged): ValueError for negative or non-integer amounts.
        """
        if isinstance(num_tokens, Mapping):
            return super().evict(num_tokens)
        counts = super().evict({"full": num_tokens, "swa": swa_num_tokens})
        return counts["full"], counts["swa"]

    # ------------------------------------------------------------------ sizes

    def full_evictable_size(self) -> int:
        return self.evictable_size("full")

    def swa_evictable_size(self) -> int:
        return self.evictable_size("swa")

    def full_protected_size(self) -> int:
        return self.protected_size("full")

    def swa_protected_size(self) -> int:
        return self.protected_size("swa")

    def total_size(self, component: str | None = None) -> Any:
        """``(full tokens, swa tokens)`` cached (SGLang), or one component's total when named."""
        if component is None:
            return super().total_size("full"), super().total_size("swa")
        return super().total_size(component)
