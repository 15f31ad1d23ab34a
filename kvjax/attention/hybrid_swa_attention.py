"""Write-then-attend for a layer of a hybrid sliding-window pool (``SWAKVPool``: a full pool for the
full-attention layers, a smaller SWA pool for the sliding ones).

The layer's kind comes from the pool (``full_layer_ids`` / ``swa_layer_ids``):

* a full layer writes at ``meta.out_loc`` and reads ``meta.page_indices`` in the full pool, and
  sees every earlier key;
* a sliding layer writes at ``meta.swa.out_loc`` and reads ``meta.swa.page_indices`` in the SWA
  pool (its own slots, translated from the request table by the metadata builder), and sees keys
  in ``(p - sliding_window, p]``. A pure sliding-window model (no full pool) is the same, its SWA
  metadata holding the request table's slots as they are.

Sub-pools striped over decode-context-parallel ranks (``context_axis``) go through
``paged_attention``'s DCP path with the same slots and page table (the allocator's striped ones;
the SWA pairing keeps each token's owner rank): each rank writes its own tokens' rows, attends
them with the window masked on global positions, and the ranks' partials merge by log-sum-exp.
"""

from __future__ import annotations

from typing import Any, Unpack

import jax

from kvjax.attention.metadata import AttentionMetadata
from kvjax.attention.options import AttentionOptions
from kvjax.attention.paged_attention import paged_attention, single_query
from kvjax.pools import SWAKVPool

__all__ = ["hybrid_swa_attention", "swa_pool_layers"]


def hybrid_swa_attention(
    pool: SWAKVPool,
    layer_id: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    meta: AttentionMetadata,
    **options: Unpack[AttentionOptions],
) -> tuple[jax.Array, SWAKVPool]:
    """Write layer ``layer_id``'s ``k, v`` into its sub-pool, then attend ``q`` (shapes and the
    options as ``paged_attention``).

    Args:
        options: ``AttentionOptions``; ``sliding_window`` is the window of a sliding layer
            (required there, and only applied there: a full layer of the pool attends over all
            keys whatever is passed).

    Returns:
        ``(out [T, heads, head_dim], the pool with the layer's sub-pool written)``.

    Raises:
        InvalidSlotError: ``layer_id`` is in neither sub-pool (the message lists both).
        ValueError: a sliding layer without ``sliding_window`` or without ``meta.swa``.
    """
    q = single_query(q, layer_id)
    sliding = pool.is_swa_layer(layer_id)
    sub, index = pool.sub_pool(layer_id)
    local_id = index + sub.start_layer
    if not sliding:
        every_key = options.copy()
        every_key.pop("sliding_window", None)  # a full layer of the pool sees every earlier key
        out, sub = paged_attention(sub, local_id, q, k, v, meta, **every_key)
        return out, pool.replace(full=sub)
    if options.get("sliding_window") is None:
        raise ValueError(
            f"layer {layer_id} is a sliding-window layer of the SWA pool (sliding layers "
            f"{list(pool.swa_layer_ids)}); pass its sliding_window"
        )
    swa = meta.require_swa()
    out, sub = paged_attention(
        sub, local_id, q, k, v, meta, out_loc=swa.out_loc, page_indices=swa.page_indices, **options
    )
    return out, pool.replace(swa=sub)


def swa_pool_layers(pool: Any) -> tuple[int, ...]:
    """The global layer ids of both sides of an ``SWAKVPool``."""
    return tuple(sorted((*pool.full_layer_ids, *pool.swa_layer_ids)))
