"""`attend`: one layer's write-then-attend, with the pool and the kernel picked from the layer's kind.

The kind of a layer is read from the pools, not from the model: the pool that lists the layer
decides.

==========================================  ===========================================================
pool holding ``layer_id``                   what ``attend`` does
==========================================  ===========================================================
``pools.swa`` (``SWAKVPool``), sliding      writes at ``meta.swa.out_loc``, reads ``meta.swa.page_indices``
layer                                       in the SWA sub-pool, with ``sliding_window`` (required)
``pools.swa``, full layer                   writes at ``meta.out_loc``, reads ``meta.page_indices`` in the
                                            full sub-pool, no window
``pools.kv`` (``MHAKVPool``)                MHA/GQA/MQA at ``meta.out_loc`` / ``meta.page_indices``, with
                                            ``sliding_window`` if given (a sliding layer of a model served
                                            with one full-size pool: ``disable_hybrid_swa_memory``)
``pools.kv`` (``MLAKVPool``)                absorbed MLA: ``q = (q_latent, q_rope)``, ``k = c_kv``,
                                            ``v = k_pe`` (``attend_mla``)
``pools.recurrent``                         not attention: use ``recurrent_step``
==========================================  ===========================================================

Every call returns ``(out, pools)`` with the layer's pool replaced (under ``jax.jit`` with the pools
donated, the write is in place). With a ``mesh`` (or pools created over one) the Pallas kernel
runs per device inside ``jax.shard_map``: query heads and the pool's KV heads sharded over the
mesh's ``"tp"`` axis, the metadata replicated; without one it is the single-device path.
"""

from __future__ import annotations

from typing import Any, TypedDict

import jax
from jax.sharding import Mesh

from kvjax.attention.hybrid_swa_attention import hybrid_swa_attention
from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.mla_attention import mla_attention
from kvjax.attention.paged_attention import paged_attention
from kvjax.errors import InvalidSlotError
from kvjax.pools import CachePools, MHAKVPool, MLAKVPool, SWAKVPool

__all__ = ["attend", "attend_mla", "pool_layers"]


def pool_layers(pool: Any) -> tuple[int, ...]:
    """The global layer ids a pool holds (any kvjax pool; empty for a pool without layers)."""
    if isinstance(pool, SWAKVPool):
        return tuple(sorted((*pool.full_layer_ids, *pool.swa_layer_ids)))
    ids = getattr(pool, "layer_ids", None)
    if ids is not None:
        return tuple(ids)
    start, count = getattr(pool, "start_layer", 0), getattr(pool, "num_layers", 0)
    return tuple(range(start, start + count))


class _PagedOptions(TypedDict):
    """The keyword options ``attend`` passes unchanged to the MHA and hybrid SWA kernels."""

    sm_scale: float | None
    soft_cap: float | None
    sinks: jax.Array | None
    sliding_window: int | None
    mesh: Mesh | None


def _missing_layer(pools: CachePools, layer_id: int) -> InvalidSlotError:
    held = "; ".join(f"{name}: {list(pool_layers(pools[name]))}" for name in pools)
    return InvalidSlotError(f"layer_id={layer_id} is in no attention pool (layers per pool: {held})")


def attend(
    pools: CachePools,
    layer_id: int,
    q: jax.Array | tuple[jax.Array, jax.Array],
    k: jax.Array,
    v: jax.Array,
    meta: AttentionMetadata,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    sliding_window: int | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, CachePools]:
    """Write layer ``layer_id``'s K/V of the batch into its pool, then attend (module docstring).

    Args:
        pools: the cache's pools (``KVCache.pools``, or your own ``CachePools``).
        layer_id: the model's global layer id (a Python int: the kind is chosen at trace time).
        q: ``[T, heads, head_dim]`` (rotary embedding applied), or for MLA the pair
            ``(q_latent [T, heads, kv_lora_rank], q_rope [T, heads, qk_rope_head_dim])``.
        k: ``[T, kv_heads, head_dim]``; for MLA ``c_kv [T, kv_lora_rank]``.
        v: ``[T, kv_heads, v_head_dim]``; for MLA ``k_pe [T, qk_rope_head_dim]``.
        meta: the batch's ``AttentionMetadata`` (``meta.swa`` set for a hybrid SWA pool's
            sliding layers).
        sm_scale: logit scale (default ``1 / sqrt(head_dim)``; required for MLA).
        soft_cap: logit soft cap (``soft_cap * tanh(logits / soft_cap)``), or None.
        sinks: float32 ``[heads]`` attention-sink logits, or None.
        sliding_window: the layer's window in tokens, or None for full attention. A hybrid SWA
            pool decides from its own layer lists: required for its sliding layers, ignored for
            its full ones.
        mesh: run the kernel per device over this mesh (default: the pool's own ``mesh``).

    Returns:
        ``(out, pools)``: ``out`` ``[T, heads, head_dim]`` in q's dtype (MLA: ``[T, heads,
        kv_lora_rank]``, the latent output before ``W_UV``), padding tokens 0; ``pools`` with
        the layer's pool replaced.

    Raises:
        InvalidSlotError: no attention pool holds ``layer_id`` (the message lists each pool's
            layers), or it is a recurrent layer (use ``recurrent_step``).
        ValueError: inputs that do not fit the layer's kind (named in the message).
    """
    options = _PagedOptions(sm_scale=sm_scale, soft_cap=soft_cap, sinks=sinks, sliding_window=sliding_window, mesh=mesh)
    if "swa" in pools and layer_id in pools.swa.layers_mapping:
        out, swa = hybrid_swa_attention(pools.swa, layer_id, _single(q, layer_id), k, v, meta, **options)
        return out, pools.replace(swa=swa)
    kv = pools.kv if "kv" in pools else None
    if isinstance(kv, MLAKVPool) and layer_id in pool_layers(kv):
        if not isinstance(q, tuple) or len(q) != 2:
            raise ValueError(
                f"layer {layer_id} is an MLA layer: pass q=(q_latent [T, heads, kv_lora_rank], "
                "q_rope [T, heads, qk_rope_head_dim]), k=c_kv, v=k_pe"
            )
        if sm_scale is None:
            raise ValueError(f"layer {layer_id} is an MLA layer: pass the model's sm_scale")
        if soft_cap is not None or sinks is not None or sliding_window is not None:
            raise ValueError(f"layer {layer_id} is an MLA layer: soft_cap, sinks and sliding_window do not apply")
        return attend_mla(pools, layer_id, q[0], q[1], k, v, meta, sm_scale=sm_scale, mesh=mesh)
    if isinstance(kv, MHAKVPool) and layer_id in pool_layers(kv):
        out, kv = paged_attention(kv, layer_id, _single(q, layer_id), k, v, meta, **options)
        return out, pools.replace(kv=kv)
    if "recurrent" in pools and layer_id in pool_layers(pools.recurrent):
        raise InvalidSlotError(
            f"layer_id={layer_id} is a recurrent layer (pools.recurrent): run it with recurrent_step, not attend"
        )
    raise _missing_layer(pools, layer_id)


def attend_mla(
    pools: CachePools,
    layer_id: int,
    q_latent: jax.Array,
    q_rope: jax.Array,
    c_kv: jax.Array,
    k_pe: jax.Array,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, CachePools]:
    """Absorbed MLA over ``pools.kv`` (an ``MLAKVPool``): shapes as ``mla_attention``.

    Returns:
        ``(latent_out [T, heads, kv_lora_rank], pools with pools.kv written)``.

    Raises:
        InvalidSlotError: ``pools.kv`` is not a latent pool holding ``layer_id``.
    """
    kv = pools.kv if "kv" in pools else None
    if not isinstance(kv, MLAKVPool) or layer_id not in pool_layers(kv):
        raise _missing_layer(pools, layer_id)
    out, kv = mla_attention(kv, layer_id, q_latent, q_rope, c_kv, k_pe, meta, sm_scale=sm_scale, mesh=mesh)
    return out, pools.replace(kv=kv)


def _single(q: Any, layer_id: int) -> jax.Array:
    if isinstance(q, tuple):
        raise ValueError(f"layer {layer_id} is not an MLA layer: pass q as one array [T, heads, head_dim]")
    return q
