"""The MLA kind's planning (``kv_pool_kind="mla"``): the latent KV pool ``"kv"`` (and, for DSA
models, the indexer keys ``"index_k"``).

It applies to a model with MLA layers (SGLang's ``is_mla``) and plans the latent pools over every
per-token attention layer of the stage (a latent layout has no separate sliding pool); the latent
row is replicated on every attention-TP rank, so tensor parallelism does not split it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.names import MLA
from kvjax.plan.kinds.planner_kind import PlannerKind, PoolKind

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.layout.mla import MLALayout
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.kinds.choices import AttentionChoice
    from kvjax.plan.records import Sizes, Target
    from kvjax.spec import ModelSpec

POOL = PoolKind("mla", "device", "the MLA latent KV pool (kv_pool_kind='mla', with the DSA indexer keys)")


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return spec.is_mla


def model_flags(spec: ModelSpec) -> dict[str, Any]:
    return {"is_mla": True}


def attention_layout(spec: ModelSpec, config: CacheConfig, platform: str, kv_dtype: str) -> AttentionChoice:
    """The latent row (and, for DSA, the indexer keys): one latent "head", replicated on every
    attention-TP rank."""
    from kvjax.layout.mla import MLALayout
    from kvjax.plan.kinds.choices import AttentionChoice

    assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None  # ModelSpec checks it
    mla = MLALayout.for_platform(
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        page_size=config.page_size,  # one device's rows of a page (x dcp_size striped)
        dtype=kv_dtype,
        platform=platform,
        index_head_dim=spec.index_head_dim if spec.is_dsa else None,
    )
    per_layer = mla.bytes_per_token_per_layer + mla.indexer_bytes_per_token_per_layer
    return AttentionChoice(mla, 1, config.attn_tp_size, mla.row_padded, per_layer, mla.padding())


def layout_pool(layout: MLALayout, name: str, num_pages: int, layer_ids: tuple[int, ...]) -> PoolPlan:
    """The latent pool alone (no indexer keys), called ``name``."""
    import dataclasses

    return dataclasses.replace(layout.pool_plans(num_pages=num_pages, layer_ids=layer_ids, built=True)[0], name=name)


def attention_pools(target: Target, sizes: Sizes) -> tuple[PoolPlan, ...]:
    """The latent pool (and the DSA indexer keys) over the stage's attention layers."""
    from kvjax.layout.mla import MLALayout

    layer_ids = tuple(sorted(sizes.stage.full + sizes.stage.swa))
    if not layer_ids:
        return ()
    assert isinstance(target.attention, MLALayout)  # decided with this kind (plan.target)
    return target.attention.pool_plans(num_pages=sizes.num_pages, layer_ids=layer_ids, built=POOL.built)


def no_host_pool_backup(sizes: Sizes) -> bool:
    """SGLang's ``resolve_decode_retraction_backup`` never defaults to ``host_pool`` for MLA."""
    return False


KIND = PlannerKind(
    name=MLA,
    pool_kinds=(POOL,),
    kv_pool_kind="mla",
    # a latent row per token slot: freeing a rejected draft token's slot rolls it back, as for MHA
    speculative_rollback=True,
    tree_components=("full",),
    applies=applies,
    model_flags=model_flags,
    kv_pool_priority=1,
    attention_layout=attention_layout,
    splits_kv_heads=False,
    layer_kind="mla",
    layout_pool=layout_pool,
    attention_pools=attention_pools,
    supports_host_pool_backup=no_host_pool_backup,
)
