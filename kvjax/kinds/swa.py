"""The sliding-window kind (``kv_pool_kind="swa"``, the plan's ``is_hybrid_swa``).

* pools: ``"kv_full"`` (full layers) and ``"kv_swa"`` (sliding layers), built together as one
  ``SWAKVPool`` under ``"swa"``; pure SWA (every layer sliding) has only ``"kv_swa"``;
* allocator: hybrid, ``SWATokenToKVPoolAllocator`` (each full slot paired with an SWA slot);
  pure, the plain allocator handing out SWA slots;
* tree components ``"full"`` and ``"swa"`` (pure: ``"swa"``), chosen by the planner;
* serving: ``SWAServing`` (the SWA page table and slots of each step, window freeing); a pure
  cache holds about one window of KV per request, so long requests are not refused for the
  pool's size;
* host tier: one host pool per side (``"host_kv"``, ``"host_kv_swa"``) and
  ``SWAPageTransferEngine`` moving both;
* the ``cpu_tensor`` retraction backup does not cover the pair.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.kinds.host_tier import TransferContext
    from kvjax.plan import CachePlan
    from kvjax.serve.extension import ServingExtension

POOL = PoolKind(
    "swa",
    "device",
    "the hybrid sliding-window pools (kv_pool_kind='swa': full + SWA pools and the SWA allocator)",
    group_builder="kvjax.pools.swa:create_pool_group",
)


def is_pure_swa(plan: CachePlan) -> bool:
    """Every layer sliding: one SWA pool under a plain allocator (no full-attention tokens)."""
    return bool(plan.is_hybrid_swa and not plan.full_tokens_per_layer)


def uses(plan: CachePlan) -> bool:
    return bool(plan.is_hybrid_swa)


def allocator(plan: CachePlan) -> Any:
    """Hybrid: the paired ``SWATokenToKVPoolAllocator``; pure: None (the plain allocator)."""
    if is_pure_swa(plan):
        return None
    from kvjax.alloc import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(
        int(plan.full_tokens_per_layer or 0),
        plan.swa_tokens_per_layer or 0,
        plan.alloc_page_size,
        need_sort=plan.need_sort,
    )


def serving_extension(cache: KVCache) -> ServingExtension:
    from kvjax.serve.swa_extension import SWAServing

    return SWAServing(cache)


def transfer_engine(context: TransferContext) -> Any:
    """The engine moving both sides' pages, when the host tier has the SWA side's pool."""
    from kvjax.plan.pool_plans import SWA_HOST_POOL_NAME

    swa_host_pool = context.host_pools.get(SWA_HOST_POOL_NAME)
    if swa_host_pool is None:
        return None
    from kvjax.tiers.swa_transfer import SWAPageTransferEngine

    return SWAPageTransferEngine(
        context.pending, context.host_pool, swa_host_pool, context.allocator, pool_name=POOL.name
    )


KIND = CacheKind(
    name="swa",
    pool_kinds=(POOL,),
    kv_pool_kind="swa",
    tree_components=("full", "swa"),
    attention="kvjax.attention.hybrid_swa_attention:hybrid_swa_attention",
    uses=uses,
    allocator=allocator,
    serving_extension=serving_extension,
    transfer_engine=transfer_engine,
    windowed_request_kv=is_pure_swa,
    page_backup=False,
)
