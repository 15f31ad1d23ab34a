"""The draft model's view of the cache's pools: its pool ``"kv_draft"`` seen as ``"kv"``.

The draft model (STANDALONE: a smaller model of the target's family) is an ordinary serving model
whose attention layers read and write ``pools.kv``. Its own pool is the cache's ``"kv_draft"``
(``kvjax.plan.draft``: the target's pages and page size, layer ids ``0 .. n - 1``), so the draft's
forward runs on ``draft_view(pools)`` and its updated pool goes back with ``with_draft``. One slot
id addresses the same token in both pools.
"""

from __future__ import annotations

from typing import Any

from kvjax.plan.draft import DRAFT_POOL_NAME
from kvjax.pools import CachePools

__all__ = ["draft_view", "with_draft"]


def draft_view(pools: CachePools) -> CachePools:
    """The pools a draft forward takes: only the draft's, under the name ``"kv"``."""
    return CachePools(kv=pools[DRAFT_POOL_NAME])


def with_draft(pools: CachePools, draft_pool: Any) -> CachePools:
    """``pools`` with the draft's pool replaced by ``draft_pool`` (a draft forward's ``kv``)."""
    return pools.replace(**{DRAFT_POOL_NAME: draft_pool})
