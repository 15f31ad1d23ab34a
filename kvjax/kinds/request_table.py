"""The request table (``"req_to_token"``, host memory): every plan has one; the request -> token
slot table of SGLang's ``ReqToTokenPool``. Kinds that keep per-request state wrap it
(``CacheKind.request_table``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.plan import CachePlan

POOL = PoolKind("request_table", "host", "the request -> token-slot table", "kvjax.req_pool:create_pool")


def uses(plan: CachePlan) -> bool:
    return True


KIND = CacheKind(name="request_table", pool_kinds=(POOL,), uses=uses)
