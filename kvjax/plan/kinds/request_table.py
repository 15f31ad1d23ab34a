"""The request table's planning (``"req_to_token"``, host memory): every plan has one, the
request -> token-slot table of SGLang's ``ReqToTokenPool``, ``max_running_requests`` rows of
``req_to_token_width`` int32 slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.names import REQUEST_TABLE
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.records import Sizes, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind("request_table", "host", "the request -> token-slot table")
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


KIND = PlannerKind(
    name=REQUEST_TABLE,
    pool_kinds=(POOL,),
    uses=uses,
    applies=applies,
    state_pools=state_pools,
    speculative_rollback=True,
)
