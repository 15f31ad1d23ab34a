"""The MLA kind (``kv_pool_kind="mla"``): the latent KV pool ``"kv"`` (and, for DSA models, the
indexer keys ``"index_k"``). Allocator, request table and tree component are the defaults.

It applies to a model with MLA layers (SGLang's ``is_mla``) and plans the latent pools over every
per-token attention layer of the stage (a latent layout has no separate sliding pool). ``attend``
runs the DeepSeek-V2 family's absorbed form (``attend_latent``) for a layer of an ``MLAKVPool``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Unpack

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    import jax

    from kvjax.attention.metadata import AttentionMetadata
    from kvjax.attention.options import AttentionOptions
    from kvjax.config import CacheConfig
    from kvjax.kinds.planning import AttentionChoice
    from kvjax.layout.mla import MLALayout
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan.records import Sizes, Target
    from kvjax.pools import MLAKVPool
    from kvjax.spec import ModelSpec

POOL = PoolKind(
    "mla",
    "device",
    "the MLA latent KV pool (kv_pool_kind='mla', with the DSA indexer keys)",
    "kvjax.pools.mla:create_pool",
)


def applies(spec: ModelSpec, config: CacheConfig) -> bool:
    return spec.is_mla


def model_flags(spec: ModelSpec) -> dict[str, Any]:
    return {"is_mla": True}


def attention_layout(spec: ModelSpec, config: CacheConfig, platform: str, kv_dtype: str) -> AttentionChoice:
    """The latent row (and, for DSA, the indexer keys): one latent "head", replicated on every
    attention-TP rank."""
    from kvjax.kinds.planning import AttentionChoice
    from kvjax.layout.mla import MLALayout

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


def attend_latent(
    pool: MLAKVPool,
    layer_id: int,
    q: Any,
    k: jax.Array,
    v: jax.Array,
    meta: AttentionMetadata,
    **options: Unpack[AttentionOptions],
) -> tuple[jax.Array, MLAKVPool]:
    """``attend``'s uniform signature over ``mla_attention``: ``q = (q_latent, q_rope)``,
    ``k = c_kv``, ``v = k_pe``; ``sm_scale`` required; soft cap, sinks and window refused."""
    from kvjax.attention.mla_attention import mla_attention

    if not isinstance(q, tuple) or len(q) != 2:
        raise ValueError(
            f"layer {layer_id} is an MLA layer: pass q=(q_latent [T, heads, kv_lora_rank], "
            "q_rope [T, heads, qk_rope_head_dim]), k=c_kv, v=k_pe"
        )
    sm_scale = options.get("sm_scale")
    if sm_scale is None:
        raise ValueError(f"layer {layer_id} is an MLA layer: pass the model's sm_scale")
    if any(options.get(name) is not None for name in ("soft_cap", "sinks", "sliding_window")):
        raise ValueError(f"layer {layer_id} is an MLA layer: soft_cap, sinks and sliding_window do not apply")
    return mla_attention(pool, layer_id, q[0], q[1], k, v, meta, sm_scale=sm_scale, mesh=options.get("mesh"))


KIND = CacheKind(
    name="mla",
    pool_kinds=(POOL,),
    kv_pool_kind="mla",
    tree_components=("full",),
    attention=f"{__name__}:attend_latent",
    attention_pool="kv",
    pool_type="kvjax.pools.mla:MLAKVPool",
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
