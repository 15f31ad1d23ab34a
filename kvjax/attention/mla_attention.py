"""Write-then-attend for multi-head latent attention (MLA, DeepSeek-V2/V3) in the absorbed form,
over the latent pool (``MLAKVPool``).

Each token stores one row per layer: its compressed KV ``c_kv [kv_lora_rank]`` and its rotated
shared key ``k_pe [qk_rope_head_dim]``. The model absorbs ``W_UK`` into the query
(``q_latent = q_nope @ W_UK``) and ``W_UV`` into the output, so attention reads the latent rows
directly: ``logits = (q_latent . c_kv + q_rope . k_pe) * sm_scale``, ``out = softmax . c_kv``
(``pallas_kernels.mla_ragged_paged_attention``: the Pallas kernel on TPU, the jnp reference
elsewhere). Over a mesh the latent pool is replicated and the query heads are split; a pool
striped over decode-context-parallel ranks goes to ``dcp_mla_attention``.
"""

from __future__ import annotations

from typing import Any, Unpack

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.attention.dcp_mla_attention import dcp_mla_attention
from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.options import AttentionOptions
from kvjax.attention.query_checks import check_query
from kvjax.attention.sharding import check_heads_divide, head_axis, pool_mesh, sharded_over_heads
from kvjax.pools import MLAKVPool
from kvjax.pools.base import check_slots, check_traced_ids
from pallas_kernels.mla_ragged_paged_attention import mla_ragged_paged_attention

__all__ = ["attend_latent", "mla_attention"]


def mla_attention(
    pool: MLAKVPool,
    layer_id: int,
    q_latent: jax.Array,
    q_rope: jax.Array,
    c_kv: jax.Array,
    k_pe: jax.Array,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, MLAKVPool]:
    """Write the batch's latent rows into layer ``layer_id`` at ``meta.out_loc``, then attend.

    Args:
        pool: the latent pool holding the layer.
        layer_id: the model's layer id.
        q_latent: ``[T, heads, kv_lora_rank]``: the no-rope query with ``W_UK`` absorbed.
        q_rope: ``[T, heads, qk_rope_head_dim]``: the rotated rope query.
        c_kv: ``[T, kv_lora_rank]``: the tokens' compressed KV (normalised).
        k_pe: ``[T, qk_rope_head_dim]``: the tokens' rotated shared rope key.
        meta: the batch's metadata (``out_loc``, ``page_indices``, ``kv_lens``, ...).
        sm_scale: logit scale (the model's, e.g. ``1 / sqrt(qk_nope + qk_rope)`` with YaRN's factor).
        mesh: run the kernel per device, query heads split over the mesh's KV-head axis and the
            pool replicated (default: the pool's ``mesh``, if any).

    Returns:
        ``(latent_out [T, heads, kv_lora_rank] in q_latent's dtype, the pool with the rows
        written)``; multiply by ``W_UV`` for the heads' values.
    """
    check_query("q_latent", q_latent, layer_id, pool.kv_lora_rank)
    check_query("q_rope", q_rope, layer_id, pool.qk_rope_head_dim, tokens=q_latent.shape[0])
    if pool.context_axis is not None:  # striped over DCP ranks: each attends its stripe, merged by LSE
        return dcp_mla_attention(pool, layer_id, q_latent, q_rope, c_kv, k_pe, meta, sm_scale=sm_scale, mesh=mesh)
    meta = meta.as_device_arrays()
    pool = pool.set_mla_kv_buffer(layer_id, meta.out_loc, c_kv, k_pe)
    check_slots(meta.page_indices, pool.num_pages + 1, name="page_indices (page ids)")
    if meta.checked:
        check_traced_ids(meta.out_loc, pool.num_slots, "out_loc (slot ids)")
        check_traced_ids(meta.page_indices, pool.num_pages + 1, "page_indices (page ids)")
    scale = pool.scale[pool.layer_index(layer_id)]
    mesh = pool_mesh(pool, mesh)

    def attend(
        q_latent: jax.Array,
        q_rope: jax.Array,
        kv: jax.Array,
        kv_lens: jax.Array,
        table: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
        kv_scale: jax.Array,
    ) -> jax.Array:
        return mla_ragged_paged_attention(
            q_latent, q_rope, kv, kv_lens, table, cu_q_lens, num_seqs, sm_scale=sm_scale, kv_scale=kv_scale
        )

    args = [q_latent, q_rope, pool.kv_buffer(layer_id), meta.kv_lens, meta.page_indices, meta.cu_q_lens]
    args += [meta.num_seqs, scale]
    if mesh is None:
        return attend(*args), pool
    axis = head_axis(pool)
    check_heads_divide(f"MLA layer {layer_id}'s query", q_latent.shape[1], mesh, axis)
    heads = P(None, axis, None)
    specs = (heads, heads, P(), P(), P(), P(), P(), P())
    return sharded_over_heads(attend, mesh, specs, heads)(*args), pool


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
