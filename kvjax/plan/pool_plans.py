"""Step 8 of the planner: the buffers to allocate, asked of the cache kinds the model needs (pure).

* attention pools: asked of the kinds in descending ``kv_pool_priority``; the first that answers
  (``PlannerKind.attention_pools`` not None) plans them, with the pool kind's layout;
* further pools (the request table, recurrent state): every kind's ``state_pools``, in registry
  order;
* the host tier, when it is attached: the first kind's (descending priority) own host pools
  (``host_pools``: one per side of the sliding-window pair), else one host pool of the attention
  layout over every KV layer (``kinds.host_tier.host_kv_pool``). A host page is the tree's page:
  under decode context parallelism a device pool holds one rank's ``page_size`` rows of each
  striped page, and the host page all ``page_size * dcp_size`` of them, once
  (``kvjax.tiers.head_shards``).

Device pools come first. KV pools hold one trash page, recurrent state one padding slot; the
request table and the host tier live in host memory. No kind is named here.
"""

from __future__ import annotations

import dataclasses

from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.kinds.host_tier import HOST_KV, host_kv_pool, host_pages, with_every_head_shard
from kvjax.plan.kinds.planner_kind import PlannerKind
from kvjax.plan.kinds.planning import by_priority, kinds_named
from kvjax.plan.records import HostTier, ModelKind, Sizes, Target


def plan_pools(kind: ModelKind, target: Target, sizes: Sizes, host: HostTier) -> tuple[PoolPlan, ...]:
    """The ``PoolPlan`` s of this rank, device pools first."""
    kinds = kinds_named(kind.cache_kinds)
    pools = list(_attention_pools(kinds, target, sizes))
    for cache_kind in kinds:
        if cache_kind.state_pools is not None:
            pools += cache_kind.state_pools(target, sizes)
    pools = [p for p in pools if p.memory == "device"] + [p for p in pools if p.memory != "device"]
    if host.host_pool_tokens and pools[0].memory == "device" and pools[0].layer_ids:
        host_pools = _host_pools(kinds, target, sizes, host.host_pool_tokens)
        pools += [_every_head_shard(_striped_host_page(p, sizes), target) for p in host_pools]
        for cache_kind in kinds:  # host copies of per-request state (recurrent checkpoints)
            if cache_kind.host_state_pools is not None:
                pools += cache_kind.host_state_pools(target, sizes, host)
    return tuple(pools)


def _every_head_shard(pool: PoolPlan, target: Target) -> PoolPlan:
    """``pool`` (a host pool planned from one rank's layout) holding every distinct KV head once:
    the device pool's heads split over ``attn_tp_size`` ranks, ``kv_head_replicas`` of them per
    head, make ``attn_tp_size // kv_head_replicas`` distinct shards (``with_every_head_shard``)."""
    return with_every_head_shard(pool, max(1, target.attn_tp_size // target.kv_head_replicas))


def _striped_host_page(pool: PoolPlan, sizes: Sizes) -> PoolPlan:
    """``pool`` with pages of the tree's ``alloc_page_size`` rows: under DCP every rank's rows of a
    striped page (the device pools hold one rank's), its bytes scaled with them; unchanged otherwise."""
    pages, rows, *row = pool.shape
    striped = sizes.alloc_page_size
    if rows == striped:
        return pool
    return dataclasses.replace(pool, shape=(pages, striped, *row), nbytes=pool.nbytes * striped // rows)


def _attention_pools(kinds: tuple[PlannerKind, ...], target: Target, sizes: Sizes) -> tuple[PoolPlan, ...]:
    """The attention pools of the first kind (descending priority) that plans them; none else."""
    for cache_kind in by_priority(kinds):
        if cache_kind.attention_pools is not None:
            planned = cache_kind.attention_pools(target, sizes)
            if planned is not None:
                return planned
    return ()


def _host_pools(kinds: tuple[PlannerKind, ...], target: Target, sizes: Sizes, host_tokens: int) -> tuple[PoolPlan, ...]:
    """The host tier's pools: the first a kind plans (descending priority), else one host pool
    over every KV layer."""
    for cache_kind in by_priority(kinds):
        if cache_kind.host_pools is not None:
            own = cache_kind.host_pools(target, sizes, host_tokens)
            if own is not None:
                return own
    layer_ids = tuple(sorted(sizes.stage.full + sizes.stage.swa))
    return (host_kv_pool(target.attention, host_pages(sizes, host_tokens), HOST_KV, layer_ids),)
