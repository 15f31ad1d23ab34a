"""The MLA kind (``kv_pool_kind="mla"``): the latent KV pool ``"kv"`` (and, for DSA models, the
indexer keys ``"index_k"``). Allocator, request table and tree component are the defaults; the
attention is the DeepSeek-V2 family's absorbed form."""

from __future__ import annotations

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

POOL = PoolKind(
    "mla",
    "device",
    "the MLA latent KV pool (kv_pool_kind='mla', with the DSA indexer keys)",
    "kvjax.pools.mla:create_pool",
)

KIND = CacheKind(
    name="mla",
    pool_kinds=(POOL,),
    kv_pool_kind="mla",
    tree_components=("full",),
    attention="kvjax.attention.mla_attention:mla_attention",
)
