"""Step 8 of the planner: the buffers to allocate, asked of each pool kind's layout (pure).

Every pool is tagged with its kind from ``kvjax.pools.registry`` (``built`` says whether kvjax can
build it today). KV pools hold one trash page, recurrent state one padding slot; the request
table and the host tier live in host memory.
"""

from __future__ import annotations

import dataclasses

from kvjax.plan.records import HostTier, ModelKind, Sizes, Target
from kvjax.pools.mla_layout import MLALayout
from kvjax.pools.pool_plan import PoolPlan
from kvjax.pools.registry import is_built

REQ_TO_TOKEN_ITEMSIZE = 4  # int32 slot ids


def plan_pools(kind: ModelKind, target: Target, sizes: Sizes, host: HostTier) -> tuple[PoolPlan, ...]:
    """The ``PoolPlan`` s of this rank, device pools first."""
    stage = sizes.stage
    ps = sizes.alloc_page_size
    attention = target.attention
    pools: list[PoolPlan] = []
    if isinstance(attention, MLALayout):
        layer_ids = tuple(sorted(stage.full + stage.swa))
        if layer_ids:
            pools += attention.pool_plans(num_pages=sizes.num_pages, layer_ids=layer_ids, built=is_built("mla"))
    elif kind.is_hybrid_swa:
        if stage.full:
            full_pages = (sizes.full_tokens_per_layer or 0) // ps
            # Built with kv_swa as one SWAKVPool by the "swa" kind (the full part of the pair).
            pools.append(
                attention.pool_plan("kv_full", "swa", num_pages=full_pages, layer_ids=stage.full, built=is_built("swa"))
            )
        swa_pages = (sizes.swa_tokens_per_layer or 0) // ps
        pools.append(
            attention.pool_plan("kv_swa", "swa", num_pages=swa_pages, layer_ids=stage.swa, built=is_built("swa"))
        )
    elif stage.kv_layers:
        pools.append(
            attention.pool_plan("kv", "mha", num_pages=sizes.num_pages, layer_ids=stage.full, built=is_built("mha"))
        )
    if target.recurrent is not None and stage.recurrent:
        pools += target.recurrent.pool_plans(
            num_slots=sizes.max_mamba_cache_size or 0, layer_ids=stage.recurrent, built=is_built("recurrent")
        )
    rows, width = sizes.max_running_requests, sizes.req_to_token_width
    pools.append(
        PoolPlan(
            "req_to_token",
            "request_table",
            (rows, width),
            "int32",
            1,
            rows * width * REQ_TO_TOKEN_ITEMSIZE,
            memory="host",
            built=is_built("request_table"),
        )
    )
    if host.host_pool_tokens and pools[0].memory == "device" and pools[0].layer_ids:
        if kind.is_hybrid_swa and sizes.stage.full and sizes.stage.swa:
            # SGLang builds one host pool per device pool; host slot ids are shared (one to one).
            pools.append(_host_tier_pool(target, sizes, host.host_pool_tokens, "host_kv", sizes.stage.full))
            pools.append(_host_tier_pool(target, sizes, host.host_pool_tokens, SWA_HOST_POOL_NAME, sizes.stage.swa))
        else:
            layer_ids = tuple(sorted(sizes.stage.full + sizes.stage.swa))
            pools.append(_host_tier_pool(target, sizes, host.host_pool_tokens, "host_kv", layer_ids))
    return tuple(pools)


SWA_HOST_POOL_NAME = "host_kv_swa"


def _host_tier_pool(target: Target, sizes: Sizes, host_tokens: int, name: str, layer_ids: tuple[int, ...]) -> PoolPlan:
    """A host KV pool: the attention layout over ``layer_ids`` in host memory."""
    num_pages = host_tokens // sizes.alloc_page_size - 1
    attention = target.attention
    if isinstance(attention, MLALayout):
        device = attention.pool_plans(num_pages=num_pages, layer_ids=layer_ids, built=False)[0]
    else:
        device = attention.pool_plan(name, "host_tier", num_pages=num_pages, layer_ids=layer_ids)
    return dataclasses.replace(device, name=name, kind="host_tier", memory="host", built=is_built("host_tier"))
