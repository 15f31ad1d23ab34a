"""Attach the storage tier (L3) to a built cache's host tier, as ``CacheConfig.hicache_storage_*`` say."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvjax.pools.storage import is_fp8, logical_dtype_name
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.storage_link import StorageLink
from kvjax.tiers.storage import StorageTier
from kvjax.tiers.storage_key import StorageKey

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.config import CacheConfig


def storage_key(cache: KVCache, config: CacheConfig) -> StorageKey:
    """The key of the pages ``cache`` writes: ``config.hicache_storage_model_fingerprint``, the
    host pool's page shape and stored dtype, the plan's KV dtype, the device pool's fp8 scales
    (MHA: K then V per layer; MLA: the latent's per layer; as they are now, so set them before
    the store is attached), the pool kind, the TP size, this
    process's index as the rank (one process drives every TP rank of its devices, and its host
    pool's pages hold all their KV heads), the host pool's layer ids, and
    ``config.hicache_storage_namespace``.

    Raises ConfigError when the config has no model fingerprint (``CacheConfig`` refuses a
    storage backend without one already).
    """
    import jax

    pool = cache.host_pool
    plan = cache.plan
    scales: tuple[float, ...] = ()
    if is_fp8(plan.kv_cache_dtype):
        device_kv = cache.pools.kv
        names = ("k_scale", "v_scale") if hasattr(device_kv, "k_scale") else ("scale",)  # MHA; MLA latent
        scales = tuple(s for name in names for s in np.asarray(getattr(device_kv, name), np.float32).tolist())
    host_plan = next(p for p in plan.pools if p.name == "host_kv")
    return StorageKey(
        model=str(config.hicache_storage_model_fingerprint or ""),
        page_shape=(pool.num_layers, *pool.page_row),
        store_dtype=pool.store_dtype.name,
        kv_dtype=logical_dtype_name(plan.kv_cache_dtype),
        kv_scales=scales,
        layout=f"{plan.kind.kv_pool_kind}/page_first",
        tp_rank=jax.process_index(),
        tp_size=config.tp_size,
        layers=tuple(host_plan.layer_ids),
        namespace=config.hicache_storage_namespace,
    )


def attach_storage_tier(cache: KVCache, config: CacheConfig) -> StorageLink:
    """Open the store (``"memory"``, or the ``"file"`` backend in ``hicache_storage_dir``) over
    pages of the cache's host pool, under :func:`storage_key`, and link it to the cache's
    HiRadixCache; returns the link.

    Raises TypeError for a cache without a HiRadixCache and a host pool.
    """
    tree = cache.tree_cache
    pool = cache.host_pool
    if not isinstance(tree, HiRadixCache) or pool is None:
        raise TypeError("the storage tier needs a HiRadixCache with a host pool (enable_hierarchical_cache)")
    location = "memory" if config.hicache_storage_backend == "memory" else str(config.hicache_storage_dir)
    store = StorageTier(location, key=storage_key(cache, config))
    tree.storage = StorageLink(
        tree.host,
        store,
        pool,
        prefetch_policy=config.hicache_storage_prefetch_policy,
        prefetch_timeout_s=config.hicache_storage_prefetch_timeout_s,
        prefetch_threshold=config.hicache_storage_prefetch_threshold,
    )
    return tree.storage
