"""`attend`: one layer's write-then-attend, with the pool and the function picked from the layer's kind.

The kind of a layer is read from the pools, not from the model: the pool that lists the layer
decides, and its cache kind's ``attention`` function runs (``AttentionKind.attention``,
``kvjax.attention.kinds``, found through the kind's ``pool`` entry and ``pool_type``; in the kinds'
order, so a kind registered outside kvjax is dispatched the same way):

==========================================  ===========================================================
pool holding ``layer_id`` (kind)            what ``attend`` does
==========================================  ===========================================================
``pools.swa`` (``SWAKVPool``, swa),         writes at ``meta.swa.out_loc``, reads ``meta.swa.page_indices``
sliding layer                               in the SWA sub-pool, with ``sliding_window`` (required)
``pools.swa``, full layer                   writes at ``meta.out_loc``, reads ``meta.page_indices`` in the
                                            full sub-pool, no window
``pools.kv`` (``MHAKVPool``, full)          MHA/GQA/MQA at ``meta.out_loc`` / ``meta.page_indices``, with
                                            ``sliding_window`` if given (a sliding layer of a model served
                                            with one full-size pool: ``disable_hybrid_swa_memory``)
``pools.kv`` (``MLAKVPool``, mla)           absorbed MLA: ``q = (q_latent, q_rope)``, ``k = c_kv``,
                                            ``v = k_pe`` (``attend_mla``)
``pools.recurrent`` (recurrent)             not attention: use ``recurrent_step``
==========================================  ===========================================================

Every call returns ``(out, pools)`` with the layer's pool replaced (under ``jax.jit`` with the pools
donated, the write is in place). With a ``mesh`` (or pools created over one) the Pallas kernel
runs per device inside ``jax.shard_map``: query heads and the pool's KV heads sharded over the
mesh's ``"tp"`` axis, the metadata replicated; without one it is the single-device path.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from kvjax.attention.kinds import ATTENTION_KINDS, AttentionKind
from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.options import AttentionOptions
from kvjax.errors import InvalidSlotError
from kvjax.pools import CachePools, MLAKVPool

__all__ = ["attend", "attend_mla", "pool_layers"]


def pool_layers(pool: Any) -> tuple[int, ...]:
    """The global layer ids a pool holds (any kvjax pool; empty for a pool without layers): the
    ``layers`` of the cache kind whose ``pool_type`` it is, else its ``layer_ids`` or its
    consecutive layers."""
    for kind in ATTENTION_KINDS:
        if kind.layers is not None and kind.pool_type is not None and kind.owns(pool):
            return kind.layers(pool)
    ids = getattr(pool, "layer_ids", None)
    if ids is not None:
        return tuple(ids)
    start, count = getattr(pool, "start_layer", 0), getattr(pool, "num_layers", 0)
    return tuple(range(start, start + count))


def _holder(pools: CachePools, layer_id: int) -> tuple[AttentionKind, str] | None:
    """The cache kind and the ``pools`` entry that hold ``layer_id`` (the kinds' order), or None."""
    for kind in ATTENTION_KINDS:
        name = kind.pool
        if name is None or name not in pools:
            continue
        pool = pools[name]
        if not kind.owns(pool):
            continue
        layers = kind.layers(pool) if kind.layers is not None else pool_layers(pool)
        if layer_id in layers:
            return kind, name
    return None


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
    options = AttentionOptions(
        sm_scale=sm_scale, soft_cap=soft_cap, sinks=sinks, sliding_window=sliding_window, mesh=mesh
    )
    held = _holder(pools, layer_id)
    if held is None:
        raise _missing_layer(pools, layer_id)
    kind, name = held
    if kind.attention is None:
        message = kind.not_attention or f"layer_id={{layer_id}} is in pools.{name}, of a kind without attention"
        raise InvalidSlotError(message.format(layer_id=layer_id))
    out, pool = kind.attention(pools[name], layer_id, q, k, v, meta, **options)
    return out, pools.replace(**{name: pool})


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
    return attend(pools, layer_id, (q_latent, q_rope), c_kv, k_pe, meta, sm_scale=sm_scale, mesh=mesh)
