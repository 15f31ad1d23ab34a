"""The host tier kind's planning (HiCache: ``enable_hierarchical_cache``, or the ``host_pool``
retraction backup): host pools of the device KV (``"host_kv"``; a kind with a pool pair plans
one per side, ``PlannerKind.host_pools``), in the attention layout, sized for the host's pages."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvjax.kinds.names import HOST_TIER
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.records import Sizes

POOL = PoolKind("host_tier", "host", "the host-memory tier (HiCache: enable_hierarchical_cache or host_pool backup)")
HOST_KV = "host_kv"  # the host pool of the device KV (one per side for a pool pair: a kind names the other)


def host_pool_plan(device: PoolPlan, name: str) -> PoolPlan:
    """``device`` (a device pool's plan, sized for the host's pages) as the host tier's pool ``name``."""
    return dataclasses.replace(device, name=name, kind=POOL.name, memory="host", built=POOL.built)


def host_kv_pool(layout: Any, num_pages: int, name: str, layer_ids: tuple[int, ...]) -> PoolPlan:
    """The host pool ``name`` of ``num_pages`` pages (+ the trash page) over ``layer_ids``, in the
    attention ``layout`` (a latent layout: its latent row, without indexer keys)."""
    from kvjax.layout.mla import MLALayout

    if isinstance(layout, MLALayout):
        device = layout.pool_plans(num_pages=num_pages, layer_ids=layer_ids, built=False)[0]
    else:
        device = layout.pool_plan(name, POOL.name, num_pages=num_pages, layer_ids=layer_ids)
    return host_pool_plan(device, name)


def with_every_head_shard(pool: PoolPlan, shards: int) -> PoolPlan:
    """Host pool ``pool`` (planned from one rank's layout) holding ``shards`` distinct KV-head
    shards (``attn_tp_size // kv_head_replicas``: the ranks' heads, each distinct head once;
    ``kvjax.tiers.head_shards``), so its bytes are that many times one rank's. A row without a
    head axis (MLA's latent, replicated over the ranks) is kept once."""
    if shards <= 1 or len(pool.shape) != 4:
        return pool
    pages, rows, heads, dim = pool.shape
    return dataclasses.replace(
        pool,
        shape=(pages, rows, heads * shards, dim),
        nbytes=pool.nbytes * shards,
        bytes_per_token=pool.bytes_per_token * shards,
    )


def host_pages(sizes: Sizes, host_tokens: int) -> int:
    """Pages of a host pool of ``host_tokens`` tokens, less its trash page."""
    return host_tokens // sizes.alloc_page_size - 1


KIND = PlannerKind(name=HOST_TIER, pool_kinds=(POOL,), speculative_rollback=True)
