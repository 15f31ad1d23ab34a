"""Write-then-attend for absorbed MLA over a latent pool striped over decode-context-parallel ranks.

Under DCP the mesh is ``("tp", "dcp")`` of the TP group's devices (``kvjax.mesh_check``). The
latent pool (``MLAKVPool`` with ``context_axis``) holds, on each device, its ``"dcp"`` rank's rows
of every striped page (``kvjax.alloc.dcp``); the latent is one shared row per token, replicated
over ``"tp"`` (the latent TP would replicate on every rank is what DCP stripes). The query heads
are split over both axes jointly. One layer runs inside one ``jax.shard_map``, as
``kvjax.attention.dcp_attention`` does for K/V: each rank writes the rows it owns (the others go
to its trash page), gathers its ``"tp"`` rank's query heads over ``"dcp"``, attends them over its
stripe with the causal mask on global positions (``logits = (q_latent . c_kv + q_rope . k_pe) *
sm_scale``, values the ``c_kv`` part of the row, dequantised by the layer's scale), and the
partials are merged exactly over ``"dcp"`` with their log-sum-exp, each rank keeping its own
heads (``kvjax.attention.dcp_merge``). The partial attention is the MLA ragged paged attention
Pallas kernel over the rank's rows, returning its log-sum-exp
(``pallas_kernels.mla_ragged_paged_attention.mla_ragged_paged_attention_with_lse``): compiled on
TPU, its jnp reference elsewhere.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kvjax.attention.dcp_striped_layer import check_query_heads, run_striped_layer
from kvjax.attention.metadata import AttentionMetadata
from kvjax.pools import MLAKVPool
from pallas_kernels._engine import Interpret
from pallas_kernels.mla_ragged_paged_attention import mla_ragged_paged_attention_with_lse

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
    interpret: Interpret = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA of a ragged batch over one DCP rank's stripe of the latent rows: the MLA
    ragged paged attention kernel over the rank's rows (``mla_ragged_paged_attention_with_lse``
    with ``key_stride=dcp``, ``key_offset=rank``: compiled Pallas on TPU, its jnp reference
    elsewhere, an interpreter when ``interpret`` asks).

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
    out, lse = mla_ragged_paged_attention_with_lse(
        q_latent.astype(jnp.float32),  # the kernel multiplies in the pool's compute dtype; the partial stays f32
        q_rope.astype(jnp.float32),
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        kv_scale=kv_scale,
        key_stride=dcp,
        key_offset=rank,
        interpret=interpret,
    )
    return out, lse


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
    arguments and result. Query heads are split over the mesh's ``("tp", "dcp")`` axes jointly."""
    mesh = mesh if mesh is not None else pool.mesh
    axis = pool.context_axis
    if mesh is None or axis is None:
        raise ValueError(f"MLA layer {layer_id}'s pool is not striped over a mesh's DCP axis; use mla_attention")
    meta = meta.as_device_arrays()
    index = pool.layer_index(layer_id)
    dcp = int(mesh.shape[axis])
    scale = pool.scale[index]
    row = jnp.concatenate([jnp.asarray(c_kv, jnp.float32), jnp.asarray(k_pe, jnp.float32)], axis=1)
    packed = pool._quantise(row, scale)
    check_query_heads(f"MLA layer {layer_id}'s query", q_latent.shape[1], mesh, axis)

    attend_stripe = partial(striped_partial_mla_attention, dcp=dcp, sm_scale=sm_scale)
    metadata = (meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs)
    return run_striped_layer(
        pool, index, mesh, attend_stripe, packed, meta.out_loc, (q_latent, q_rope), metadata, {"kv_scale": scale}
    )
