"""The request table (``"req_to_token"``, host memory): every plan has one; the request -> token
slot table of SGLang's ``ReqToTokenPool``. Kinds that keep per-request state wrap it
(``CacheKind.request_table``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan import CachePlan
    from kvjax.plan.records import Sizes, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind("request_table", "host", "the request -> token-slot table", "kvjax.req_pool:create_pool")


POOL_NAME = "req_to_token"
ITEMSIZE = 4  # int32 slot ids


def uses(plan: CachePlan) -> bool:
    return True


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return True


def state_pools(target: Target, sizes: Sizes) -> tuple[PoolPlan, ...]:
    """The table: ``max_running_requests`` rows of ``req_to_token_width`` int32 slots, on the host."""
    from kvjax.layout.pool_plan import PoolPlan

    rows, width = sizes.max_running_requests, sizes.req_to_token_width
    return (
        PoolPlan(
            POOL_NAME, POOL.name, (rows, width), "int32", 1, rows * width * ITEMSIZE, memory="host", built=POOL.built
        ),
    )


KIND = CacheKind(name="request_table", pool_kinds=(POOL,), uses=uses, applies=applies, state_pools=state_pools)
