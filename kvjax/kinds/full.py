"""The full-attention kind (``kv_pool_kind="mha"``): the paged K/V pool ``"kv"`` of MHA/GQA layers.

It decides nothing beyond its pool: the plain allocator (``make_allocator``), the plain request
table, the tree's ``"full"`` component and no serving extension are every kind's defaults.
"""

from __future__ import annotations

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

POOL = PoolKind("mha", "device", "the full-attention paged K/V pool", "kvjax.pools.mha:create_pool")

KIND = CacheKind(
    name="full",
    pool_kinds=(POOL,),
    kv_pool_kind="mha",
    tree_components=("full",),
    attention="kvjax.attention.paged_attention:paged_attention",
)
