"""`SWAChunkCache` and `PureSWAChunkCache`: the radix-disabled caches of sliding-window models.

SGLang's ``chunk_cache.py``: nothing is shared; the lifecycle only hands a request its own slots
back between chunks and frees them at the end.

* :class:`SWAChunkCache` (hybrid models): the allocator is an ``SWATokenToKVPoolAllocator``; at
  finish ``free_segment`` returns the request's full slots and the SWA slots still paired with them
  (those its decode already freed with ``free_swa_segment`` are skipped by the allocator).
* :class:`PureSWAChunkCache` (every layer sliding): the only pool is the SWA pool, handed out by a
  plain allocator; decode frees out-of-window slots with ``free`` and records
  ``req.swa_evicted_seqlen``; at finish only ``[max(cache_protected_len, swa_evicted_seqlen),
  kv_len)`` is freed, so nothing is freed twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.errors import ConfigError
from kvjax.radix.chunk_cache import ChunkCache, free_row_segment, request_row
from kvjax.radix.swa_radix_cache import check_swa_allocator

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.request import Req

__all__ = ["PureSWAChunkCache", "SWAChunkCache"]


class _WindowChunkCache(ChunkCache):
    """What both sliding-window chunk caches share: the window ``W`` (a positive number of
    tokens, ConfigError otherwise), ``chunked_prefill_size`` (kept for parity with SGLang) and
    the end of a finished request's lifecycle."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPoolProtocol | None = None,
        token_to_kv_pool_allocator: AllocatorProtocol | None = None,
        page_size: int = 1,
        *,
        sliding_window_size: int | None = None,
        chunked_prefill_size: int | None = None,
        **_: Any,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        w = sliding_window_size
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError(
                "sliding_window_size", w, "give the model's sliding window as a positive number of tokens"
            )
        self.sliding_window_size: int = w
        self.chunked_prefill_size = chunked_prefill_size

    def supports_swa(self) -> bool:
        return True

    @staticmethod
    def _finished(req: Req) -> None:
        """The request holds nothing of the cache any more (its slots were just freed)."""
        req.last_node = None
        req.lock_receipt = None
        req.swa_evicted_seqlen = 0


class SWAChunkCache(_WindowChunkCache):
    """No prefix sharing for a hybrid sliding-window model (see the module docstring).

    Args:
        req_to_token_pool: the request → token-slot table.
        token_to_kv_pool_allocator: an ``SWATokenToKVPoolAllocator`` (ConfigError otherwise).
        page_size: its page size.
        sliding_window_size: the window ``W`` in tokens.
        chunked_prefill_size: kept for parity with SGLang.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPoolProtocol | None = None,
        token_to_kv_pool_allocator: Any = None,
        page_size: int = 1,
        *,
        sliding_window_size: int | None = None,
        chunked_prefill_size: int | None = None,
        **_: Any,
    ) -> None:
        check_swa_allocator(token_to_kv_pool_allocator, page_size)
        super().__init__(
            req_to_token_pool,
            token_to_kv_pool_allocator,
            page_size,
            sliding_window_size=sliding_window_size,
            chunked_prefill_size=chunked_prefill_size,
        )

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Free ``[cache_protected_len, kv_len)`` (full and still-paired SWA slots) as row segments:
        the part before ``swa_evicted_seqlen`` (full only) first, then the rest (0.5.23's
        ``free_kv_row_segments``)."""
        row = request_row(self.req_to_token_pool, req, "cache_finished_req")
        cpl, end = req.cache_protected_len, req.kv_len()
        cut = min(max(int(getattr(req, "swa_evicted_seqlen", 0)), cpl), end)
        alloc = self.token_to_kv_pool_allocator
        free_row_segment(alloc, row[cpl:cut].copy(), cpl)
        free_row_segment(alloc, row[cut:end].copy(), cut)
        self._finished(req)


class PureSWAChunkCache(_WindowChunkCache):
    """No prefix sharing for a model whose every layer is sliding (see the module docstring).

    Args:
        req_to_token_pool: the request → token-slot table.
        token_to_kv_pool_allocator: the SWA pool's token or paged allocator.
        page_size: its page size.
        sliding_window_size: the window ``W`` in tokens.
    """

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Free ``[max(cache_protected_len, swa_evicted_seqlen), kv_len)``: decode freed the rest."""
        row = request_row(self.req_to_token_pool, req, "cache_finished_req")
        start = max(req.cache_protected_len, int(getattr(req, "swa_evicted_seqlen", 0)))
        free_row_segment(self.token_to_kv_pool_allocator, row[start : req.kv_len()].copy(), start)
        self._finished(req)
