"""`SWAServing`: what a hybrid sliding-window cache adds to the serving loop (``ServingExtension``).

* Step inputs (``step_metadata`` -> ``AttentionMetadata.swa``, an ``SWAMetadata``): the sliding
  layers read and write the SWA pool, so each step gets, translated on the host through the
  allocator's full→SWA mapping by ``kvjax.attention.swa_metadata`` (numpy, O(tokens + pages),
  fixed shapes):

  - ``out_loc``: int32 ``[T]`` (the step's token bucket), the SWA slot of each new token
    (0, the trash page, for padding);
  - ``page_indices``: int32 ``[max_seqs, pages_per_seq]``, each row's SWA page table. Pages
    whose SWA slots were freed (out of the window) are 0, which the attention kernel never reads.

* Window freeing (SGLang's ``free_swa_out_of_window_slots``): before each decode step, and after
  each prefill chunk for the chunk's requests, every such request frees the SWA slots of its own
  positions that no future query can see, ``[swa_evicted_seqlen, page_floor(kv_len - margin))``
  with ``margin = max(W, page_size)`` for a radix tree (the tree's last inserted page keeps live
  SWA) or ``W`` for a chunk cache, starting at ``cache_protected_len`` (the tree's prefix is not
  the request's to free), and records the new ``swa_evicted_seqlen``, which the tree receives
  when the request is cached. Once the request's locked prefix is wholly out of the window, the
  lock's SWA part is released early (``dec_swa_lock_only``), so the tree may evict that SWA. A
  long decode therefore holds at most about one window of SWA slots per request.

* Pure SWA (every layer sliding: one pool under a plain allocator, ``PureSWARadixCache`` or
  ``PureSWAChunkCache``): the request table holds SWA slots, so the step inputs are the slots and
  pages themselves, and window freeing ``free`` s the slots and zeroes the row there (the trash
  slot: the page table then reads nothing freed, and the tree never takes an id it no longer owns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.alloc.swa import SWATokenToKVPoolAllocator
from kvjax.attention import PageTables, SWAMetadata, swa_metadata
from kvjax.plan.kinds.swa import is_pure_swa
from kvjax.radix.swa_component import SWALockPart
from kvjax.radix.swa_radix_cache import SWARadixCache
from kvjax.serve.extension import ServingExtension, StepBatch

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.serve.serving_req import ServingReq

__all__ = ["SWAServing", "swa_leak_free", "swa_margin"]


def swa_margin(window: int, page_size: int, tree: Any) -> int:
    """Tokens behind a request's KV end whose SWA slots window freeing keeps: ``max(W, page_size)``
    under a radix tree (its last inserted page keeps live SWA), ``W`` under a chunk cache."""
    return max(window, page_size) if isinstance(tree, SWARadixCache) else window


def swa_leak_free(alloc: SWATokenToKVPoolAllocator, tree: Any) -> bool:
    """``available + evictable + protected == capacity`` on the full side and on the SWA side (a
    chunk cache holds nothing: both sides wholly available): ``alloc.leak_free(tree)``."""
    return alloc.leak_free(tree)


class SWAServing(ServingExtension):
    """The serving hooks of a hybrid-SWA cache (see the module docstring).

    Args:
        cache: a built cache whose allocator is an ``SWATokenToKVPoolAllocator``, or a pure
            sliding-window cache (``pure``: its plain allocator hands out SWA slots).
    """

    def __init__(self, cache: KVCache) -> None:
        alloc = cache.token_to_kv_pool_allocator
        self.pure = is_pure_swa(cache.plan)
        if not self.pure and not isinstance(alloc, SWATokenToKVPoolAllocator):
            raise TypeError(
                f"SWAServing needs an SWATokenToKVPoolAllocator (or a pure sliding-window cache), got "
                f"{type(alloc).__name__}"
            )
        window = cache.sliding_window_size
        if not window:
            raise ValueError("SWAServing needs the plan's sliding_window_size")
        self.alloc: Any = alloc  # SWATokenToKVPoolAllocator, or the pure pool's plain allocator
        self.tree = cache.tree_cache
        self.rows = cache.req_to_token_pool
        self.window = int(window)
        self.page_size = alloc.page_size
        ps = self.page_size
        self.margin = swa_margin(self.window, ps, self.tree)
        self.page_tables = PageTables(self.rows, ps)
        self.freed_swa_tokens = 0  # tokens whose SWA slots window freeing returned (a statistic)

    # --- step inputs ------------------------------------------------------------------------------

    def step_metadata(self, batch: StepBatch) -> SWAMetadata:
        return swa_metadata(
            self.page_tables,
            rows=batch.rows,
            seq_lens=batch.seq_lens,
            slots=batch.slots,
            max_seqs=batch.max_seqs,
            translate=self._to_swa,
        )

    def _to_swa(self, slots: np.ndarray) -> np.ndarray:
        """SWA slots of request-table slots: the mapping (hybrid), or themselves (pure: the table
        holds SWA slots, zeros where the window has passed)."""
        return slots if self.pure else self.alloc.full_to_swa_index_mapping[slots]

    # --- window freeing ---------------------------------------------------------------------------

    def before_decode(self, reqs: Sequence[ServingReq]) -> None:
        self._free_out_of_window(reqs, None)

    def after_step(self, batch: StepBatch) -> None:
        """After a prefill chunk: its requests free what the next chunk's queries cannot see, so a
        prompt longer than the SWA pool still prefills chunk by chunk (before the chunk is cached,
        which then receives ``swa_evicted_seqlen``)."""
        if not batch.is_decode:
            self._free_out_of_window(batch.reqs, np.asarray(batch.seq_lens))

    def _free_out_of_window(self, reqs: Sequence[ServingReq], kv_lens: np.ndarray | None) -> None:
        ps = self.page_size
        for i, req in enumerate(reqs):
            row = req.req_pool_idx
            if row is None:
                continue
            cpl = req.cache_protected_len
            start = max(req.swa_evicted_seqlen, cpl)
            # KV written so far: before this decode step's token, or after this prefill chunk.
            pre_len = req.kv_len() if kv_lens is None else int(kv_lens[i])
            threshold = pre_len - self.margin
            new = max(start, threshold) // ps * ps
            if new > start:
                # Row segments (SGLang's free_swa_out_of_window_slots): pages go back in row order.
                if self.pure:
                    self.alloc.free_segment(self.rows.req_to_token[row, start:new].copy(), start_pos=start)
                    self.rows.write(row, start, np.zeros(new - start, np.int32))
                else:
                    self.alloc.free_swa_segment(self.rows.req_to_token[row, start:new], start_pos=start)
                self.freed_swa_tokens += new - start
            req.swa_evicted_seqlen = max(start, new)
            if threshold >= cpl:
                self._release_prefix_swa_lock(req)

    def _release_prefix_swa_lock(self, req: ServingReq) -> None:
        """The request's locked prefix is out of its window: release the lock's SWA part early."""
        tree = self.tree
        receipt = req.lock_receipt
        if not isinstance(tree, SWARadixCache) or receipt is None or receipt.released or not receipt.parts:
            return
        part: Any = receipt.parts[0]
        if isinstance(part, SWALockPart) and not part.released and part.locked and part.uuid is not None:
            tree.dec_swa_lock_only(receipt)

    def in_lockstep(self, layout: Any, rank: int, shared: dict[str, Any]) -> bool:
        """Lockstep DP runs it per rank as it is: its work (metadata, window freeing) is on the host."""
        return True
