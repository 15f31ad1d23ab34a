"""Small ragged batches and pools shared by the ``kvjax.attention`` tests.

The batch: two sequences over pages of 4 tokens. Sequence 0 is a prefill of 5 tokens (slots
4..8: page 1 and the first slot of page 2); sequence 1 continues 2 earlier tokens (slots 12, 13
on page 3) with 2 new ones (slots 14, 15). Three rows (one padding), 8 tokens (1 padding).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttentionMetadata, SWAMetadata, build_attention_metadata
from kvjax.pools import MHAKVPool

PAGE = 4
MAX_SEQS = 3
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
# The layout of the batch's float32 MHA pools (``MHAKVPool.create`` keywords): pages of ``PAGE``
# tokens, ``KV_HEADS`` heads of ``HEAD_DIM``.
POOL_LAYOUT: dict[str, Any] = dict(page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32")
SLOTS = np.array([4, 5, 6, 7, 8, 14, 15], np.int32)
EARLIER = np.array([12, 13], np.int32)  # sequence 1's tokens before this batch


def batch_metadata(swa_offset_pages: int | None = None) -> AttentionMetadata:
    """The batch's metadata (numpy); with ``swa_offset_pages``, an SWA part whose pages are the
    full ones shifted by that many pages (a stand-in for the allocator's full->SWA mapping)."""
    table = np.array([[1, 2], [3, 0]], np.int32)
    _, meta = build_attention_metadata(
        tokens=[np.arange(5), np.arange(2)],
        starts=[0, 2],
        slots=SLOTS,
        page_table=table,
        max_seqs=MAX_SEQS,
    )
    if swa_offset_pages is None:
        return meta
    shift = swa_offset_pages * PAGE
    out_loc = np.where(np.arange(8) < len(SLOTS), meta.out_loc + shift, 0).astype(np.int32)
    pages = np.where(meta.page_indices > 0, meta.page_indices + swa_offset_pages, 0).astype(np.int32)
    return meta.with_parts(SWAMetadata(out_loc=out_loc, page_indices=pages))  # numpy leaves on the host


def mha_pool(num_layers: int = 2, *, pages: int = 8, layer_ids: tuple[int, ...] | None = None) -> MHAKVPool:
    """A float32 pool whose layers already hold sequence 1's earlier tokens."""
    pool = MHAKVPool.create(num_pages=pages, num_layers=num_layers, layer_ids=layer_ids, **POOL_LAYOUT)
    rng = np.random.default_rng(7)
    for i in range(num_layers):
        layer = pool.layer_ids[i] if pool.layer_ids is not None else i
        k, v = (rng.standard_normal((2, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
        pool = pool.set_kv_buffer(layer, EARLIER, k, v)
    return pool


def qkv(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q [8, HEADS, HEAD_DIM]``, ``k, v [8, KV_HEADS, HEAD_DIM]`` float32."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((8, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((8, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((8, KV_HEADS, HEAD_DIM)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
