"""Typed seams between the host-side parts of a KV cache: allocator, request table, tree cache.

The scheduler, the tree caches and the build talk to each other only through these
``Protocol`` s, so any implementation with the same methods plugs in (a test double, a
standalone simulation, a future SWA allocator). They are structural (``typing.Protocol``,
``runtime_checkable`` so ``isinstance`` checks the method names), and this module imports
neither jax nor numpy at run time: it is safe for the jax-free layers (plan, radix, alloc).

Units: *slots* are KV token-slot ids (``page * page_size + offset``, page 0 the trash page);
sizes are in tokens unless a name says pages or rows. Slot arrays are int32 numpy arrays.

Invariants an implementation keeps (each class repeats its own):

* allocator: ``available_size() + used tokens == size``; a call that returns ``None`` or raises
  leaves it unchanged;
* request table: ``available_size() + rows in use == size``;
* tree cache: ``evictable_size() + protected_size() == total_size()`` for the full-attention
  component, and every slot it holds is a slot the allocator handed out and has not taken back.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "AllocatorProtocol",
    "MatchResultProtocol",
    "ReqToTokenPoolProtocol",
    "TreeCacheProtocol",
]


@runtime_checkable
class AllocatorProtocol(Protocol):
    """What the tree cache and the scheduler call on a token/page allocator (SGLang's
    ``token_to_kv_pool_allocator``).

    Attributes:
        page_size: slots per page (>= 1).
        size: allocatable slots (the trash page excluded), a multiple of ``page_size``.
    """

    page_size: int
    size: int

    def available_size(self) -> int:
        """Slots that can be handed out now (tokens)."""
        ...

    def alloc(self, need_size: int) -> np.ndarray | None:
        """``need_size`` slots (a multiple of ``page_size``), or ``None`` when too few are free."""
        ...

    def alloc_extend(
        self,
        prefix_lens: Any,
        seq_lens: Any,
        last_loc: Any,
        extend_num_tokens: int | None = None,
    ) -> np.ndarray | None:
        """Slots for ``seq_lens - prefix_lens`` new tokens per request (concatenated), continuing
        each request's last partial page from ``last_loc + 1``; ``None`` when too few pages."""
        ...

    def alloc_decode(self, seq_lens: Any, last_loc: Any) -> np.ndarray | None:
        """One slot per request for its token at position ``seq_len - 1``; ``None`` when too few pages."""
        ...

    def free(self, free_index: Any) -> None:
        """Return slots (paged: their whole pages). Double frees and trash-page ids raise."""
        ...

    def free_segment(self, free_index: Any, *, start_pos: int) -> None:
        """Return the slots of one segment of a request's row (row positions from the page-aligned
        ``start_pos``, in row order); paged: their pages in row order, unsorted. What the tree and
        the request lifecycle free through (SGLang 0.5.23). Same errors as :meth:`free`."""
        ...

    def free_group_begin(self) -> None:
        """Buffer frees until :meth:`free_group_end` returns them in one call."""
        ...

    def free_group_end(self) -> None:
        """Return the frees buffered since :meth:`free_group_begin`."""
        ...

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> int:
        """Evict from ``tree_cache`` until ``num_tokens`` can be allocated; the tokens evicted."""
        ...

    def leak_free(self, tree_cache: Any) -> bool:
        """With no request holding KV: every slot is free or held by ``tree_cache``."""
        ...


@runtime_checkable
class ReqToTokenPoolProtocol(Protocol):
    """The request → token-slot table (SGLang's ``ReqToTokenPool``).

    Attributes:
        size: request rows.
        max_context_len: token positions per row.
        req_to_token: int32 ``[size, max_context_len]``; row ``r`` lists the slots of the tokens
            of the request holding row ``r``, position by position.
    """

    size: int
    max_context_len: int
    req_to_token: np.ndarray

    def available_size(self) -> int:
        """Free request rows."""
        ...

    def alloc(self, need_size: int) -> list[int] | None:
        """``need_size`` rows, or ``None`` when too few are free."""
        ...

    def free(self, free_index: Any) -> None:
        """Return rows (double frees raise)."""
        ...

    def write(self, req_idx: int, start: int, values: Any) -> None:
        """``req_to_token[req_idx, start : start + len(values)] = values``."""
        ...

    def clear(self) -> None:
        """Free every row."""
        ...


@runtime_checkable
class MatchResultProtocol(Protocol):
    """What ``match_prefix`` returns: the matched slots and the node to lock."""

    last_node: Any
    prefix_len: int

    @property
    def indices(self) -> np.ndarray:
        """int32 slots of the matched prefix, ``prefix_len`` of them."""
        ...


@runtime_checkable
class TreeCacheProtocol(Protocol):
    """What the scheduler calls on a prefix cache (radix tree, chunk cache, disabled tree).

    ``inc_lock_ref`` returns a receipt; ``dec_lock_ref`` takes that receipt (or the node) and
    releases exactly what was locked. ``evict(n)`` frees at least ``n`` tokens into the
    allocator when that many are evictable and returns the tokens evicted.
    ``req`` arguments are request records (``kvjax.request.Req`` or any object with its fields).
    """

    def match_prefix(self, token_ids: Any, extra_key: Hashable = None) -> MatchResultProtocol:
        """The longest cached, page-aligned prefix of ``token_ids`` in namespace ``extra_key``."""
        ...

    def insert(self, token_ids: Any, indices: Any = None, extra_key: Any = None, priority: int = 0) -> int:
        """Insert a key with its slots; returns the length that was already cached."""
        ...

    def inc_lock_ref(self, node: Any) -> Any:
        """Protect ``node`` and its ancestors from eviction; returns a lock receipt."""
        ...

    def dec_lock_ref(self, node_or_receipt: Any) -> int:
        """Release a lock taken by :meth:`inc_lock_ref`; returns the change in evictable tokens."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked entries (policy order) until ``num_tokens`` are freed; returns tokens evicted."""
        ...

    def evictable_size(self) -> int:
        """Cached tokens no request locks (tokens)."""
        ...

    def protected_size(self) -> int:
        """Cached tokens some request locks (tokens)."""
        ...

    def total_size(self) -> int:
        """All cached tokens (tokens)."""
        ...

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """A finished request: insert its KV (unless ``is_insert`` is False), free its duplicates
        and its row's unused slots, release its lock."""
        ...

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """A running request (chunked prefill): insert its KV so far and keep it locked."""
        ...

    def reset(self) -> None:
        """Drop every entry (slots go back to the allocator)."""
        ...
