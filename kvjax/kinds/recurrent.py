"""The recurrent-state kind (``kv_pool_kind="hybrid_linear"``, the plan's ``is_hybrid_ssm``):
hybrid SSM / linear-attention models.

* pool: every recurrent tensor of the plan, built together as one ``RecurrentStatePool`` under
  ``"recurrent"`` (one slot per live request, slot 0 padding);
* request table: ``HybridReqToTokenPool``, a state slot per request over the plan's
  ``max_mamba_cache_size`` slots;
* tree component ``"mamba"``; serving: ``RecurrentStateExtension`` (state slots at admission,
  the step's slot inputs, checkpoints into the tree);
* the ``cpu_tensor`` retraction backup does not cover the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.plan import CachePlan
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.serve.extension import ServingExtension

POOL = PoolKind(
    "recurrent",
    "device",
    "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
    group_builder="kvjax.pools.recurrent:create_pool_group",
)


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_ssm)


def with_state_slots(table: ReqToTokenPool, plan: CachePlan) -> ReqToTokenPool:
    """The request table with a state slot per request (``HybridReqToTokenPool``) over the
    plan's ``max_mamba_cache_size`` slots."""
    from kvjax.hybrid_req_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(
        table.size,
        table.max_context_len,
        mamba_size=int(plan.max_mamba_cache_size or 0),
        enable_mamba_extra_buffer=plan.enable_mamba_extra_buffer,
    )


def serving_extension(cache: KVCache) -> ServingExtension | None:
    """``RecurrentStateExtension`` when this rank holds recurrent state (a pipeline stage may not)."""
    if POOL.name not in cache.pools:
        return None
    from kvjax.serve.recurrent_extension import RecurrentStateExtension

    return RecurrentStateExtension(cache)


KIND = CacheKind(
    name="recurrent",
    pool_kinds=(POOL,),
    kv_pool_kind="hybrid_linear",
    tree_components=("mamba",),
    attention="kvjax.attention.recurrent_step:recurrent_step",
    uses=uses,
    request_table=with_state_slots,
    serving_extension=serving_extension,
    page_backup=False,
)
