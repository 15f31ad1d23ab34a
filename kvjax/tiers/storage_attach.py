"""Attach the storage tier (L3) to a built cache's host tier, as ``CacheConfig.hicache_storage_*`` say."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.storage_link import StorageLink
from kvjax.tiers.storage import StorageTier

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.config import CacheConfig


def storage_namespace(cache: KVCache) -> str:
    """The store's key prefix: the model and one page's shape and dtype, so caches of different
    models or layouts never read each other's pages."""
    pool = cache.host_pool
    shape = "x".join(str(d) for d in (pool.num_layers, *pool.page_row))
    model = re.sub(r"[^A-Za-z0-9_.-]", "_", str(cache.plan.model))
    return f"{model}-{shape}-{pool.store_dtype.name}"


def attach_storage_tier(cache: KVCache, config: CacheConfig) -> StorageLink:
    """Open the store (``"memory"``, or the ``"file"`` backend in ``hicache_storage_dir``) over
    pages of the cache's host pool and link it to the cache's HiRadixCache; returns the link.

    Raises TypeError for a cache without a HiRadixCache and a host pool.
    """
    tree = cache.tree_cache
    pool = cache.host_pool
    if not isinstance(tree, HiRadixCache) or pool is None:
        raise TypeError("the storage tier needs a HiRadixCache with a host pool (enable_hierarchical_cache)")
    location = "memory" if config.hicache_storage_backend == "memory" else str(config.hicache_storage_dir)
    store = StorageTier(
        location,
        page_shape=(pool.num_layers, *pool.page_row),
        dtype=pool.store_dtype,
        namespace=storage_namespace(cache),
    )
    tree.storage = StorageLink(
        tree.host,
        store,
        pool,
        prefetch_policy=config.hicache_storage_prefetch_policy,
        prefetch_timeout_s=config.hicache_storage_prefetch_timeout_s,
        prefetch_threshold=config.hicache_storage_prefetch_threshold,
    )
    return tree.storage
