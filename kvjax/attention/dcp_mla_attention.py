"""Write-then-attend for absorbed MLA over a latent pool striped over decode-context-parallel ranks.

The latent pool (``MLAKVPool`` with ``context_axis``) holds, on each device of the ``"dcp"`` mesh
axis, its rank's rows of every striped page (``kvjax.alloc.dcp``); the latent is not split over
``"tp"`` (one shared row per token), the query heads are. One layer runs inside one
``jax.shard_map``, as ``kvjax.attention.dcp_attention`` does for K/V: each rank writes the rows
it owns (the others go to its trash page), attends every query over its stripe with the causal
mask on global positions (``logits = (q_latent . c_kv + q_rope . k_pe) * sm_scale``, values the
``c_kv`` part of the row, dequantised by the layer's scale), and the partials are merged exactly
over ``"dcp"`` with their log-sum-exp (``kvjax.attention.dcp_merge``). jnp, compiled by XLA on
TPU (the MLA Pallas kernel returns no log-sum-exp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.alloc.dcp import DCPStripe
from kvjax.attention.dcp_merge import merge_over_axis, partial_softmax
from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.sharding import check_heads_divide
from kvjax.pools import MLAKVPool, dtypes
from kvjax.pools.base import route_to_trash
from kvjax.pools.mla import scatter_rows
from pallas_kernels import _ragged_attention as ra

__all__ = ["dcp_mla_attention", "striped_partial_mla_attention"]


def striped_partial_mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    rank: jax.Array | int,
    dcp: int,
    sm_scale: float,
    kv_scale: jax.Array | float = 1.0,
    token_batch: int = 8,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA of a ragged batch over one DCP rank's stripe of the latent rows.

    Args:
        q_latent: ``[T, heads, kv_lora_rank]``; q_rope: ``[T, heads, qk_rope_head_dim]``.
        kv_pages: the rank's rows of one layer, ``[pages + 1, page_size, row_padded]`` (logical
            dtype; ``page_size``: rows per rank and page).
        kv_lens, page_indices, cu_q_lens, num_seqs: the batch's metadata in global terms (whole
            sequences, striped page ids).
        rank, dcp: this rank along the DCP axis, and the number of ranks.
        sm_scale: the model's logit scale; kv_scale: the layer's fp8 scale.

    Returns:
        ``(out [T, heads, kv_lora_rank], lse [T, heads])`` float32: the normalised output over
        the rows this rank sees (0 where none) and the log-sum-exp of their logits (``-inf``).
    """
    total, heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    num_pool_pages, rows, row_padded = kv_pages.shape
    local_len = page_indices.shape[1] * rows
    tokens = ra.token_rows(
        kv_lens, page_indices, cu_q_lens, num_seqs, total=total, num_pool_pages=num_pool_pages, page_size=rows * dcp
    )
    kv_len_of = jnp.clip(kv_lens.astype(jnp.int32), 0, local_len * dcp)
    key_pos = jnp.arange(local_len, dtype=jnp.int32) * dcp + jnp.asarray(rank, jnp.int32)  # global positions
    q32 = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32)
    dequant = jnp.asarray(kv_scale, jnp.float32)

    def attend(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qt, seq, pos, is_live = xs  # [H, latent + rope], scalars
        keys = kv_pages[tokens.safe_pages[seq]].reshape(local_len, row_padded)[:, : latent + rope]
        keys = keys.astype(jnp.float32) * dequant
        logits = jnp.einsum("hd,ld->hl", qt, keys) * sm_scale
        visible = (key_pos <= pos) & (key_pos < kv_len_of[seq]) & jnp.repeat(tokens.page_ok[seq], rows) & is_live
        probs, lse = partial_softmax(logits, visible)
        return probs @ jnp.where(visible[:, None], keys[:, :latent], 0.0), lse

    if total == 0:
        return jnp.zeros(q_latent.shape, jnp.float32), jnp.full((total, heads), -jnp.inf, jnp.float32)
    return jax.lax.map(attend, (q32, tokens.seq, tokens.pos, tokens.live), batch_size=min(token_batch, total))


def dcp_mla_attention(
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
    """``mla_attention`` for a latent pool striped over DCP ranks (module docstring); same
    arguments and result. Query heads are split over the mesh's ``"tp"`` axis."""
    mesh = mesh if mesh is not None else pool.mesh
    axis = pool.context_axis
    if mesh is None or axis is None:
        raise ValueError(f"MLA layer {layer_id}'s pool is not striped over a mesh's DCP axis; use mla_attention")
    from kvjax.build import KV_HEAD_MESH_AXIS as heads_axis

    meta = meta.as_device_arrays()
    index = pool.layer_index(layer_id)
    dcp = int(mesh.shape[axis])
    stripe = DCPStripe(pool.page_size // dcp, dcp)
    scale = pool.scale[index]
    row = jnp.concatenate([jnp.asarray(c_kv, jnp.float32), jnp.asarray(k_pe, jnp.float32)], axis=1)
    packed = pool._quantise(row, scale)
    slots = route_to_trash(meta.out_loc, pool.num_slots)
    check_heads_divide(f"MLA layer {layer_id}'s query", q_latent.shape[1], mesh, heads_axis)

    def layer_step(
        layer: jax.Array,
        packed: jax.Array,
        slots: jax.Array,
        q_latent: jax.Array,
        q_rope: jax.Array,
        kv_lens: jax.Array,
        table: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
        scale: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        rank = jax.lax.axis_index(axis)
        mine = jnp.where(stripe.owner(slots) == rank, stripe.local_slot(slots), 0)  # others: the trash page
        layer = scatter_rows(layer, packed, mine)
        out, lse = striped_partial_mla_attention(
            q_latent,
            q_rope,
            dtypes.from_storage(layer, pool.logical_dtype),
            kv_lens,
            table,
            cu_q_lens,
            num_seqs,
            rank=rank,
            dcp=dcp,
            sm_scale=sm_scale,
            kv_scale=scale,
        )
        return layer, merge_over_axis(out, lse, axis).astype(q_latent.dtype)

    layer_spec = P(None, axis, None)
    heads = P(None, heads_axis, None)
    specs = (layer_spec, P(), P(), heads, heads, P(), P(), P(), P(), P())
    run = jax.shard_map(layer_step, mesh=mesh, in_specs=specs, out_specs=(layer_spec, heads), check_vma=False)
    args = (pool.kv[index], packed, slots, q_latent, q_rope, meta.kv_lens, meta.page_indices, meta.cu_q_lens)
    layer, out = run(*args, meta.num_seqs, scale)
    return out, pool.with_layer(index, layer)
