"""Paged attention of one layer of a sliding-window model (full and sliding layers) over its pools.

A family whose layers are sliding-window or full (``gemma3``, ``gpt_oss``) keeps K/V in one of two
layouts:

* the hybrid-SWA pools ``pools.swa`` (an ``SWAKVPool``: a full pool for the full layers and a
  smaller SWA pool for the sliding ones). Full layers write at ``meta.out_loc`` and read
  ``meta.page_indices``; sliding layers write at ``meta.extras["swa_out_loc"]`` and read
  ``meta.extras["swa_page_indices"]`` (the SWA pool's slots and pages, translated by the
  scheduler's ``SWAServing``);
* with ``disable_hybrid_swa_memory``, one full-size pool ``pools.kv`` for every layer, all of them
  writing at ``meta.out_loc`` and reading ``meta.page_indices`` (sliding layers with their window),
  as SGLang serves Gemma 3.

``swa_paged_attention`` picks the layer's pool, slots and page table, writes the batch's K/V and
attends; ``swa_trace_state`` builds the smallest hybrid pools of a model (for tracing weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.pools import CachePools, MHAKVPool, SWAKVPool
from kvjax.serve.layers import BatchMetadata
from kvjax.serve.model_config import ModelConfig
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

__all__ = ["swa_paged_attention", "swa_trace_state"]


def swa_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pools: CachePools,
    meta: BatchMetadata,
    layer_id: int,
    *,
    sliding: bool,
    sliding_window: int,
    sm_scale: float,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, CachePools]:
    """Write layer ``layer_id``'s ``k, v: [T, kv_heads, head_dim]`` into its pool (module
    docstring), then attend ``q: [T, heads, head_dim]`` over each sequence's pages.

    ``sliding``: whether the layer is a sliding-window one (it then sees keys in
    ``(p - sliding_window, p]``; a full layer sees all); ``sm_scale``, ``soft_cap`` and ``sinks``
    (float32 ``[heads]`` logits, or None) go to ``ragged_paged_attention`` unchanged. Returns
    ``([T, heads, head_dim] in q's dtype, pools with the layer's pool replaced)``.
    """
    hybrid = "swa" in pools
    if hybrid:
        pool: SWAKVPool = pools.swa
        sub, index = pool.sub_pool(layer_id)
    else:  # disable_hybrid_swa_memory: one full-size pool for every layer
        sub, index = pools.kv, layer_id - pools.kv.start_layer
    if hybrid and sliding:
        loc, table = meta.extras["swa_out_loc"], meta.extras["swa_page_indices"]
    else:
        loc, table = meta.out_loc, meta.page_indices
    sub = sub.set_kv_buffer(index + sub.start_layer, loc, k, v)
    out = ragged_paged_attention(
        q,
        sub.kv_buffer(index + sub.start_layer),
        meta.kv_lens,
        table,
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window if sliding else None,
        soft_cap=soft_cap,
        k_scale=sub.k_scale[index],
        v_scale=sub.v_scale[index],
        sinks=sinks,
    )
    if not hybrid:
        return out, pools.replace(kv=sub)
    pool = pool.replace(swa=sub) if sliding else pool.replace(full=sub)
    return out, pools.replace(swa=pool)


def swa_trace_state(config: ModelConfig, sliding: Sequence[bool]) -> tuple[CachePools, dict[str, Any]]:
    """One-page full and SWA pools of the model's shape (``sliding``: per layer, whether it is a
    sliding-window layer), and the sliding layers' one-token extras."""
    full_ids = tuple(i for i, s in enumerate(sliding) if not s)
    swa_ids = tuple(i for i, s in enumerate(sliding) if s)

    def mha(layers: int) -> MHAKVPool:
        return MHAKVPool.create(
            num_pages=1,
            page_size=1,
            num_layers=max(layers, 1),
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            v_head_dim=config.head_dim,
            dtype=config.dtype,
        )

    pool = SWAKVPool(
        full=mha(len(full_ids)) if full_ids else None,
        swa=mha(len(swa_ids)),
        full_layer_ids=full_ids,
        swa_layer_ids=swa_ids,
    )
    extras = {"swa_out_loc": jnp.zeros((1,), jnp.int32), "swa_page_indices": jnp.zeros((1, 1), jnp.int32)}
    return CachePools(swa=pool), extras
