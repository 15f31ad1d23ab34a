"""The full-attention kind's planning (``kv_pool_kind="mha"``): the paged K/V pool ``"kv"`` of
MHA/GQA layers.

Every model needs it (``applies``), at the lowest priority: a kind of a higher ``kv_pool_priority``
that applies names the KV pool kind and plans the attention pools instead. It plans ``"kv"`` over
every per-token attention layer of the stage, and the tree's ``"full"`` component.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.names import FULL
from kvjax.layout.mha import MHALayout, kv_heads_per_rank
from kvjax.plan.kinds.choices import AttentionChoice
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.records import Sizes, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind("mha", "device", "the full-attention paged K/V pool")
POOL_NAME = "kv"  # the plan's and the cache's name of the pool


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return True


def attention_layout(spec: ModelSpec, config: CacheConfig, platform: str, kv_dtype: str) -> AttentionChoice:
    """The paged K/V layout with the model's KV heads split over the attention-TP ranks as SGLang
    splits them (each replicated when the ranks outnumber the heads)."""
    attn_tp = config.attn_tp_size
    heads, replicas = kv_heads_per_rank(spec.num_kv_heads, attn_tp)
    mha = MHALayout.for_platform(
        num_kv_heads=heads,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        page_size=config.page_size,  # one device's rows of a page (x dcp_size striped)
        dtype=kv_dtype,
        platform=platform,
    )
    padding = mha.padding()
    if replicas > 1:
        padding += (f"{spec.num_kv_heads} KV heads over {attn_tp} ranks: each head replicated {replicas}x",)
    return AttentionChoice(mha, heads, replicas, mha.head_dim_padded, mha.bytes_per_token_per_layer, padding)


def layout_pool(layout: MHALayout, name: str, num_pages: int, layer_ids: tuple[int, ...]) -> PoolPlan:
    """One paged K/V pool ``name`` of ``num_pages`` pages (+ the trash page) over ``layer_ids``."""
    return layout.pool_plan(name, POOL.name, num_pages=num_pages, layer_ids=layer_ids, built=POOL.built)


def attention_pools(target: Target, sizes: Sizes) -> tuple[PoolPlan, ...]:
    """``"kv"`` over the stage's attention layers (none without one)."""

    stage = sizes.stage
    if not stage.kv_layers:
        return ()
    assert isinstance(target.attention, MHALayout)  # a latent layout is the MLA kind's
    return (layout_pool(target.attention, POOL_NAME, sizes.num_pages, stage.full),)


KIND = PlannerKind(
    name=FULL,
    pool_kinds=(POOL,),
    kv_pool_kind="mha",
    speculative_rollback=True,
    tree_components=("full",),
    applies=applies,
    attention_layout=attention_layout,
    layer_kind="full_attention",
    layout_pool=layout_pool,
    attention_pools=attention_pools,
)
