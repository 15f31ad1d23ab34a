"""Write-then-attend over one paged K/V pool (``MHAKVPool``): MHA, GQA and MQA, with optional
sliding window, logit soft cap and attention sinks.

The batch's K/V are written at their slots first, so each query sees its own token and every
earlier one of its sequence through the page table; then ragged paged attention
(``pallas_kernels.ragged_paged_attention``: the Pallas kernel on TPU, the jnp reference
elsewhere) attends causally, softmax in float32. An fp8 pool is dequantised inside attention with
the layer's scales. Over a mesh the kernel runs per device on its KV heads (``sharding``); a pool striped over
decode-context-parallel ranks goes to ``dcp_attention``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.attention.dcp_attention import dcp_paged_attention
from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.query_checks import check_query
from kvjax.attention.sharding import check_heads_divide, expand_kv_heads, head_axis, pool_mesh, sharded_over_heads
from kvjax.pools import MHAKVPool
from kvjax.pools.base import check_slots, check_traced_ids
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

__all__ = ["paged_attention", "single_query"]


def single_query(q: Any, layer_id: int) -> jax.Array:
    """``q`` when it is one array; ``ValueError`` for the MLA pair ``(q_latent, q_rope)``."""
    if isinstance(q, tuple):
        raise ValueError(f"layer {layer_id} is not an MLA layer: pass q as one array [T, heads, head_dim]")
    return q


def paged_attention(
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
    """Write layer ``layer_id``'s K/V into ``pool`` at their slots, then attend.

    Args:
        pool: the pool holding the layer (``pool.layer_index(layer_id)``; global layer ids).
        layer_id: the model's layer id.
        q: ``[T, heads, head_dim]`` in the compute dtype (rotary embedding applied).
        k: ``[T, kv_heads, head_dim]``; ``heads`` is a multiple of ``kv_heads``. Over a mesh, a pool
            with more heads (KV heads replicated over more ranks than the model has) gets each
            head repeated (``sharding.expand_kv_heads``).
        v: ``[T, kv_heads, v_head_dim]``.
        meta: the batch's metadata (``kv_lens``, ``cu_q_lens``, ``num_seqs``).
        out_loc: int32 ``[T]`` slots to write (default ``meta.out_loc``).
        page_indices: int32 ``[S, pages_per_seq]`` page table to read (default ``meta.page_indices``).
        sm_scale: logit scale (default ``1 / sqrt(head_dim)``).
        soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``; None: no cap.
        sinks: float32 ``[heads]`` attention-sink logits (gpt-oss), or None.
        sliding_window: a query at position ``p`` sees keys in ``(p - sliding_window, p]``; None:
            all earlier keys.
        mesh: run the kernel per device over this mesh (default: the pool's ``mesh``).

    Returns:
        ``(out [T, heads, head_dim] in q's dtype, the pool with the layer written)``; padding
        tokens' outputs are 0.
    """
    q = single_query(q, layer_id)
    check_query("q", q, layer_id, pool.head_dim, tokens=k.shape[0])
    if q.shape[1] % max(k.shape[1], 1):
        raise ValueError(
            f"layer {layer_id}: q has {q.shape[1]} heads and k {k.shape[1]}; the query heads must be a multiple "
            "of the KV heads (grouped-query attention)"
        )
    if pool.context_axis is not None:  # striped over DCP ranks: each attends its stripe, merged by LSE
        return dcp_paged_attention(
            pool,
            layer_id,
            q,
            k,
            v,
            meta,
            out_loc=out_loc,
            page_indices=page_indices,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sinks=sinks,
            sliding_window=sliding_window,
            mesh=mesh,
        )
    meta = meta.as_device_arrays()
    loc = meta.out_loc if out_loc is None else jnp.asarray(out_loc)
    table = meta.page_indices if page_indices is None else jnp.asarray(page_indices)
    check_slots(table, pool.num_pages + 1, name="page_indices (page ids)")
    if meta.checked:
        check_traced_ids(loc, pool.num_slots, "out_loc (slot ids)")
        check_traced_ids(table, pool.num_pages + 1, "page_indices (page ids)")
    mesh = pool_mesh(pool, mesh)
    if mesh is not None:  # heads replicated over more ranks than the model has: repeat them
        k = expand_kv_heads(k, pool.num_kv_heads, f"layer {layer_id}'s k")
        v = expand_kv_heads(v, pool.num_kv_heads, f"layer {layer_id}'s v")
    pool = pool.set_kv_buffer(layer_id, loc, k, v)
    index = pool.layer_index(layer_id)

    def attend(
        q: jax.Array,
        kv: jax.Array,
        kv_lens: jax.Array,
        table: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
        k_scale: jax.Array,
        v_scale: jax.Array,
        *sink: jax.Array,
    ) -> jax.Array:
        return ragged_paged_attention(
            q,
            kv,
            kv_lens,
            table,
            cu_q_lens,
            num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sink[0] if sink else None,
        )

    args = [q, pool.kv_buffer(layer_id), meta.kv_lens, table, meta.cu_q_lens, meta.num_seqs]
    args += [pool.k_scale[index], pool.v_scale[index], *([] if sinks is None else [sinks])]
    if mesh is None:
        return attend(*args), pool
    axis = head_axis(pool)
    check_heads_divide(f"layer {layer_id}'s KV", pool.num_kv_heads, mesh, axis)
    check_heads_divide(f"layer {layer_id}'s query", q.shape[1], mesh, axis)
    specs: tuple[P, ...] = (P(None, axis, None), P(None, None, axis, None), P(), P(), P(), P(), P(), P())
    specs += (P(axis),) if sinks is not None else ()
    return sharded_over_heads(attend, mesh, specs, P(None, axis, None))(*args), pool
