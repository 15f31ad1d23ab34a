"""Decode context parallelism (DCP): where each token slot lives when KV is striped over ranks.

SGLang's ``allocator/dcp.py``: under DCP of ``dcp`` ranks, logical token ``i`` of a request lives
on rank ``i % dcp`` at local row ``i // dcp``, so a request's KV is spread evenly over the ranks
instead of being replicated on each. The allocator hands out *striped pages* of
``page_size * dcp`` slots (``alloc_page_size``) over ``size * dcp`` slots, where ``page_size``
and ``size`` are one rank's; the tree's page equals the allocator's.

A slot ``s`` (the allocator's id, as in ``req_to_token``) is ``page * (page_size * dcp) + offset``.
Paged allocation keeps ``offset == position % (page_size * dcp)`` for every token of a request,
so the owner is a function of the slot alone:

* owner rank: ``offset % dcp`` (``== position % dcp``);
* local page: ``page`` (the same page id on every rank: one page table serves all of them);
* local row within the page: ``offset // dcp`` (``0 .. page_size - 1``);
* local slot: ``page * page_size + offset // dcp``.

Each rank's pool is ``[pages + 1, page_size, ...]`` (page 0 is the trash page on every rank). The
global array is ``[pages + 1, page_size * dcp, ...]`` with the page's rows rank-major
(``rank * page_size + local row``) and that axis sharded over the ``"dcp"`` mesh axis, so a
device holds exactly its rank's rows. The functions here are integer arithmetic on numpy or jax
arrays alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvjax.alloc.base import BaseTokenToKVPoolAllocator

__all__ = ["DCPStripe", "make_dcp_allocator"]


@dataclass(frozen=True)
class DCPStripe:
    """The stripe of ``dcp`` ranks with ``page_size`` rows per rank and page (module docstring).

    Invariants: ``page_size >= 1``, ``dcp >= 1``; every rank holds ``page_size`` rows of every
    striped page of ``page_size * dcp`` slots.
    """

    page_size: int
    dcp: int

    def __post_init__(self) -> None:
        for name in ("page_size", "dcp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DCPStripe.{name} must be a positive integer, got {value!r}")

    @property
    def alloc_page_size(self) -> int:
        """Slots per striped page (the allocator's and the tree's page): ``page_size * dcp``."""
        return self.page_size * self.dcp

    def owner(self, slot: Any) -> Any:
        """The rank holding each slot: ``slot % dcp`` (elementwise)."""
        return slot % self.dcp

    def local_slot(self, slot: Any) -> Any:
        """Each slot's slot in its owner's pool: ``page * page_size + (slot % alloc_page) // dcp``."""
        big = self.alloc_page_size
        return (slot // big) * self.page_size + (slot % big) // self.dcp

    def page_row(self, offset: Any) -> Any:
        """The row of each slot offset within a striped page (``0 .. alloc_page_size - 1``) among
        the page's rows, rank-major: ``owner * page_size + offset // dcp``. The global array's
        page and the host tier's page (``kvjax.tiers.head_shards``) keep a page's rows in this order."""
        return self.owner(offset) * self.page_size + offset // self.dcp

    def global_row(self, slot: Any) -> Any:
        """Each slot's row in the global (unsharded) array viewed as ``[slots, ...]``: page-major,
        then rank-major within the page (``page * alloc_page + page_row(offset)``)."""
        big = self.alloc_page_size
        return (slot // big) * big + self.page_row(slot % big)

    def rank_tokens(self, kv_len: Any, rank: Any) -> Any:
        """How many of a request's first ``kv_len`` tokens rank ``rank`` holds:
        ``ceil((kv_len - rank) / dcp)``, at least 0."""
        held = (kv_len - rank + self.dcp - 1) // self.dcp
        return held * (held > 0)


def make_dcp_allocator(
    size_per_rank: int, page_size: int, dcp: int, *, need_sort: bool = False
) -> BaseTokenToKVPoolAllocator:
    """The allocator of a striped pool: pages of ``page_size * dcp`` slots over
    ``size_per_rank * dcp`` slots (SGLang's DCP sizing). ``size_per_rank`` is rounded down to
    whole pages of ``page_size``; ``ValueError`` for a size below one page."""
    from kvjax.alloc import make_allocator

    stripe = DCPStripe(page_size, dcp)
    if size_per_rank < page_size:
        raise ValueError(f"size_per_rank={size_per_rank} holds no page of {page_size} tokens per rank")
    pages = size_per_rank // page_size
    return make_allocator(pages * stripe.alloc_page_size, stripe.alloc_page_size, need_sort=need_sort)
