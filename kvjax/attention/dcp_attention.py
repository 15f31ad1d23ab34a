"""Write-then-attend over a paged K/V pool striped over decode-context-parallel (DCP) ranks.

Under DCP the mesh is ``("tp", "dcp")`` of the TP group's devices (``kvjax.mesh_check``). The pool
(``MHAKVPool`` with ``context_axis``) holds, on each device, its ``"tp"`` rank's KV heads
(replicated when the heads are fewer than the ``"tp"`` ranks) and its ``"dcp"`` rank's rows of
every striped page (``kvjax.alloc.dcp``: token ``i`` of a request on rank ``i % dcp`` at local row
``(i % (page_size * dcp)) // dcp`` of the same page id). The query heads are split over both axes
jointly, tp-major. One layer runs inside one ``jax.shard_map`` over the mesh (the batch's K/V
over ``"tp"``, the metadata replicated; ``kvjax.attention.dcp_striped_layer``):

1. write: each rank writes the tokens it owns at their local slots; the others go to the trash
   page (dropped), so every token is stored once, on its owner;
2. gather: the query heads of the rank's KV heads, all-gathered over ``"dcp"``;
3. attend: each rank attends those heads over its own stripe (``striped_partial_attention``), with
   the causal and sliding-window masks on the keys' *global* positions (local key ``l`` of rank
   ``r`` is position ``l * dcp + r``); it returns the normalised partial output and its
   log-sum-exp;
4. merge: the partials are merged exactly over ``"dcp"`` (``kvjax.attention.dcp_merge``: one
   ``pmax`` and two reduce-scatters), each rank keeping its own heads' slice.

Sliding windows are served (the mask is on global positions); attention sinks join the merge once.
The partial attention is the ragged paged attention Pallas kernel over the rank's rows
(``key_stride``/``key_offset``: local key ``l`` at global position ``l * dcp + rank``), returning
its log-sum-exp (``pallas_kernels.ragged_paged_attention.ragged_paged_attention_with_lse``):
compiled on TPU, its jnp reference elsewhere.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.attention.dcp_striped_layer import check_query_heads, run_striped_layer
from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.sharding import check_heads_divide, expand_kv_heads
from kvjax.pools import MHAKVPool
from pallas_kernels._engine import Interpret
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_with_lse

__all__ = ["dcp_paged_attention", "striped_partial_attention"]


def striped_partial_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    rank: jax.Array | int,
    dcp: int,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | float = 1.0,
    v_scale: jax.Array | float = 1.0,
    interpret: Interpret = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of a ragged batch over one DCP rank's stripe of the keys: the ragged paged
    attention kernel over the rank's rows (``ragged_paged_attention_with_lse`` with
    ``key_stride=dcp``, ``key_offset=rank``: compiled Pallas on TPU, its jnp reference elsewhere,
    an interpreter when ``interpret`` asks).

    Args:
        q: ``[T, heads, head_dim]`` (compute dtype).
        kv_pages: the rank's rows of one layer, ``[pages + 1, page_size, 2 * kv_heads, dim_padded]``
            in the logical dtype (``page_size``: rows per rank and page).
        kv_lens, page_indices, cu_q_lens, num_seqs: the batch's metadata in *global* terms: KV
            lengths in tokens of the whole sequence and the page table of striped pages (the same
            page ids on every rank).
        rank: this rank's index along the DCP axis (traced inside ``shard_map``).
        dcp: the number of DCP ranks.
        sm_scale, sliding_window, soft_cap: as ``ragged_paged_attention`` (window on global
            positions).
        k_scale, v_scale: the layer's fp8 scales (attention runs on ``k * k_scale``).

    Returns:
        ``(out, lse)``: float32 ``[T, heads, head_dim]``, the softmax-normalised output over the
        keys this rank sees (0 where it sees none, padding tokens included), and float32
        ``[T, heads]``, the log-sum-exp of those logits (``-inf`` where none).
    """
    out, lse = ragged_paged_attention_with_lse(
        q.astype(jnp.float32),  # the kernel multiplies in the pool's compute dtype; the partial stays f32
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        key_stride=dcp,
        key_offset=rank,
        interpret=interpret,
    )
    return out, lse


def dcp_paged_attention(
    pool: MHAKVPool,
    layer_id: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    meta: AttentionMetadata,
    *,
    out_loc: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    sliding_window: int | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, MHAKVPool]:
    """``paged_attention`` for a pool striped over DCP ranks (module docstring); same arguments
    and result. ``out_loc`` and the page table are the allocator's (striped) slots and pages."""
    mesh = mesh if mesh is not None else pool.mesh
    axis, heads_axis = pool.context_axis, pool.kv_head_axis
    if mesh is None or axis is None or heads_axis is None:
        raise ValueError(f"layer {layer_id}'s pool is not striped over a mesh's DCP axis; use paged_attention")
    meta = meta.as_device_arrays()
    loc = meta.out_loc if out_loc is None else jnp.asarray(out_loc)
    table = meta.page_indices if page_indices is None else jnp.asarray(page_indices)
    index = pool.layer_index(layer_id)
    dcp = int(mesh.shape[axis])
    k = expand_kv_heads(k, pool.num_kv_heads, f"layer {layer_id}'s k")
    v = expand_kv_heads(v, pool.num_kv_heads, f"layer {layer_id}'s v")
    packed = pool._pack(jnp.asarray(k), jnp.asarray(v), pool.k_scale[index], pool.v_scale[index], loc.shape[0])
    check_heads_divide(f"layer {layer_id}'s KV", pool.num_kv_heads, mesh, heads_axis)
    check_query_heads(f"layer {layer_id}'s query", q.shape[1], mesh, axis)

    attend_stripe = partial(
        striped_partial_attention, dcp=dcp, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    metadata = (meta.kv_lens, table, meta.cu_q_lens, meta.num_seqs)
    scales = {"k_scale": pool.k_scale[index], "v_scale": pool.v_scale[index]}
    sink = None if sinks is None else (jnp.asarray(sinks, jnp.float32), P(heads_axis))
    return run_striped_layer(pool, index, mesh, attend_stripe, packed, loc, (q,), metadata, scales, sink)
