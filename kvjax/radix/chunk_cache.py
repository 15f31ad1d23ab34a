"""`ChunkCache`: the prefix cache used when the radix cache is disabled.

Nothing is ever shared: ``match_prefix`` returns nothing, ``insert`` caches nothing, locks and
eviction are no-ops. It only carries the request lifecycle: between prefill chunks it hands the
request its own slots back (``prefix_indices``), and at finish it frees them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from kvjax.radix.lock import LockReceipt
from kvjax.radix.match import MatchResult
from kvjax.radix.stats import CacheStats

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.request import Req


def request_row(req_to_token_pool: ReqToTokenPoolProtocol | None, req: Req, what: str) -> np.ndarray:
    """The request's row of ``req_to_token`` (a view)."""
    if req_to_token_pool is None:
        raise ValueError(f"{what}: this cache has no req_to_token_pool; pass one to use the request lifecycle")
    if req.req_pool_idx is None:
        raise ValueError(f"{what}: request {req.rid!r} has no req_pool_idx")
    return req_to_token_pool.req_to_token[req.req_pool_idx]


def free_row_segment(allocator: AllocatorProtocol | None, slots: np.ndarray, start_pos: int) -> None:
    """Free ``slots``, the request row's positions ``[start_pos, start_pos + len(slots))`` (page
    aligned start), as one segment: paged pages go back in row order (SGLang's ``free_segment``).
    No-op for no allocator or an empty array."""
    if allocator is not None and slots.size:
        allocator.free_segment(slots, start_pos=start_pos)


def chunk_finished(
    req_to_token_pool: ReqToTokenPoolProtocol | None, allocator: AllocatorProtocol | None, req: Req
) -> None:
    """Free the request's own slots ``[cache_protected_len, kv_len)``; the protected prefix
    (if a caller set one) is not the request's to free."""
    row = request_row(req_to_token_pool, req, "cache_finished_req")
    cpl = req.cache_protected_len
    free_row_segment(allocator, row[cpl : req.kv_len()].copy(), cpl)
    req.last_node = None
    req.lock_receipt = None


def chunk_unfinished(req_to_token_pool: ReqToTokenPoolProtocol | None, req: Req) -> None:
    """``prefix_indices`` = an int32 copy of the request's slots so far (the row is reused)."""
    row = request_row(req_to_token_pool, req, "cache_unfinished_req")
    req.prefix_indices = np.array(row[: req.fill_len()], dtype=np.int32)


class ChunkCache:
    """No prefix sharing; frees a request's slots when it finishes. Same interface as
    ``RadixCache``.

    Args:
        req_to_token_pool: the request → token-slot table (needed by the lifecycle methods).
        token_to_kv_pool_allocator: where finished requests' slots are freed.
        page_size: kept for interface parity.
    """

    disable = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPoolProtocol | None = None,
        token_to_kv_pool_allocator: AllocatorProtocol | None = None,
        page_size: int = 1,
        **_: Any,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.stats = CacheStats()
        self.force_miss = False

    def is_chunk_cache(self) -> bool:
        return True

    def is_tree_cache(self) -> bool:
        return False

    def reset(self) -> None:
        """Nothing to drop."""

    def match_prefix(self, token_ids: Any, extra_key: Any = None) -> MatchResult:
        """Always empty (int32), with no node."""
        self.stats.num_matches += 1
        return MatchResult(np.empty(0, dtype=np.int32), None)

    def insert(self, token_ids: Any, indices: Any = None, extra_key: Any = None, priority: int = 0) -> int:
        """Caches nothing; returns 0."""
        return 0

    @overload
    def evict(self, num_tokens: int) -> int: ...

    @overload
    def evict(self, num_tokens: Mapping[str, int]) -> dict[str, int]: ...

    def evict(self, num_tokens: int | Mapping[str, int]) -> int | dict[str, int]:
        """Nothing is cached: 0, or ``{"full": 0}`` for per-component amounts."""
        return {"full": 0} if isinstance(num_tokens, Mapping) else 0

    def inc_lock_ref(self, node: Any) -> LockReceipt:
        return LockReceipt(None, 0)

    def dec_lock_ref(self, node_or_receipt: Any) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def pretty_print(self) -> str:
        return ""

    def sanity_check(self) -> None:
        """Nothing to check."""

    def take_events(self) -> list:
        return []

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Free ``req_to_token[row, cache_protected_len : kv_len]``."""
        chunk_finished(self.req_to_token_pool, self.token_to_kv_pool_allocator, req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Set ``req.prefix_indices`` to a copy of ``req_to_token[row, :len(fill_ids)]``."""
        chunk_unfinished(self.req_to_token_pool, req)

    def check_invariants(self) -> None:
        """Nothing to check."""

    # SGLang 0.5.23's names.

    def match_kv_cache(self, req: Req, token_ids: Any = None, *, max_prefix_len: int | None = None) -> MatchResult:
        """No prefix is ever shared: adopts an empty prefix (``cache_protected_len`` 0)."""
        req.prefix_indices = np.empty(0, dtype=np.int32)
        req.last_node = None
        req.lock_receipt = None
        req.cache_protected_len = 0
        req.cached_tokens = 0
        return self.match_prefix(token_ids)

    def checkpoint_kv_cache(self, req: Req) -> None:
        """:meth:`cache_unfinished_req`."""
        self.cache_unfinished_req(req)

    def release_kv_cache(self, req: Req, *, checkpoint: bool) -> None:
        """:meth:`cache_finished_req` (nothing is ever kept)."""
        self.cache_finished_req(req, is_insert=checkpoint)
