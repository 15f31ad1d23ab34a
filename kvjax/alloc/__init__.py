"""Host-side KV slot allocators (numpy): SGLang's token and paged allocators.

``make_allocator(size, page_size)`` picks :class:`TokenToKVPoolAllocator` for page size 1
and :class:`PagedTokenToKVPoolAllocator` otherwise; :class:`SWATokenToKVPoolAllocator`
pairs two of them for hybrid sliding-window models.
"""

from __future__ import annotations

from kvjax.alloc.base import AllocatorState, BaseTokenToKVPoolAllocator
from kvjax.alloc.paged import PagedTokenToKVPoolAllocator
from kvjax.alloc.swa import SWAAllocatorState, SWATokenToKVPoolAllocator
from kvjax.alloc.token import TokenToKVPoolAllocator

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "SWAAllocatorState",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "make_allocator",
]


def make_allocator(size: int, page_size: int, *, need_sort: bool = False) -> BaseTokenToKVPoolAllocator:
    """The allocator SGLang uses for ``page_size``: token (FIFO) for 1, paged (LIFO) above.

    Args:
        size: token slots to manage (rounded down to whole pages).
        page_size: slots per page (>= 1).
        need_sort: keep frees in a release list merged sorted on demand (PD disaggregation).
    """
    if page_size == 1:
        return TokenToKVPoolAllocator(size, need_sort=need_sort)
    return PagedTokenToKVPoolAllocator(size, page_size, need_sort=need_sort)
