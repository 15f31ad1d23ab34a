"""The storage tier (L3) behind a cache's host tier, as ``CacheConfig.hicache_storage_*`` say: opened
before the tree is built and passed to its constructor (``create_tree_cache(..., storage=...)``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.layout.storage import is_fp8, logical_dtype_name
from kvjax.radix.storage_link import StorageOptions
from kvjax.tiers.head_shards import HeadShards
from kvjax.tiers.storage import StorageTier
from kvjax.tiers.storage_key import StorageKey
from kvjax.transfers.device_pages import page_layers

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.plan import CachePlan
    from kvjax.tiers.host_pool import HostKVPool


def storage_key(plan: CachePlan, host_pool: HostKVPool, pools: Any, config: CacheConfig) -> StorageKey:
    """The key of the pages a cache of ``plan`` writes from ``host_pool``:
    ``config.hicache_storage_model_fingerprint``, the host pool's page shape and stored dtype, the
    plan's KV dtype, the device pool's fp8 scales (``pools.kv``; MHA: K then V per layer; MLA: the
    latent's per layer; as they are now, so set them before the store is opened), the pool kind,
    the TP size, this process's index as the rank (a pool sharded over TP ranks stores each rank's
    heads under its own rank's key instead: :func:`rank_shards`), the host pool's layer ids, and
    ``config.hicache_storage_namespace``.
    """
    import jax

    scales: tuple[float, ...] = ()
    if is_fp8(plan.kv_cache_dtype):
        device_kv = pools.kv
        names = ("k_scale", "v_scale") if hasattr(device_kv, "k_scale") else ("scale",)  # MHA; MLA latent
        scales = tuple(s for name in names for s in np.asarray(getattr(device_kv, name), np.float32).tolist())
    host_plan = next(p for p in plan.pools if p.name == "host_kv")
    return StorageKey(
        model=str(config.hicache_storage_model_fingerprint or ""),
        page_shape=(host_pool.num_layers, *host_pool.page_row),
        store_dtype=host_pool.store_dtype.name,
        kv_dtype=logical_dtype_name(plan.kv_cache_dtype),
        kv_scales=scales,
        layout=f"{plan.kind.kv_pool_kind}/page_first",
        tp_rank=jax.process_index(),
        tp_size=config.tp_size,
        layers=tuple(host_plan.layer_ids),
        namespace=config.hicache_storage_namespace,
    )


def rank_shards(
    host_pool: HostKVPool, config: CacheConfig, local_heads: Sequence[slice] | None = None
) -> tuple[tuple[int, slice], ...]:
    """The per-rank entries of a page (``StorageTier(shards=)``) for a pool sharded over
    ``config.attn_tp_size`` ranks: one per distinct head shard of the host page, keyed with the
    first rank that holds it (replicated heads are stored once, like the host page); ``()`` for
    one rank or a page without a head axis (MLA's latent, the same on every rank: one entry).
    ``local_heads``: the host head blocks this process's devices hold (:func:`local_head_blocks`;
    None: every block): across processes each stores and reads only its own ranks' entries."""
    if config.attn_tp_size == 1 or len(host_pool.page_row) != 3:
        return ()
    replicas = host_pool.kv_head_replicas
    shards = max(1, config.attn_tp_size // replicas)  # distinct head shards, each once in the host page
    width = host_pool.page_row[1] // shards
    every = tuple((i * replicas, slice(i * width, (i + 1) * width)) for i in range(shards))
    if local_heads is None:
        return every
    held = {(h.start, h.stop) for h in local_heads}
    return tuple((rank, heads) for rank, heads in every if (heads.start, heads.stop) in held)


def local_head_blocks(pools: Any, host_pool: HostKVPool) -> tuple[slice, ...] | None:
    """The host head blocks of the device KV pool (``pools.kv``) that this process's devices
    hold, when the pool's heads are split over devices of several processes; None when this
    process holds every block (one process, a pool on one device, or a page without a head axis)."""
    import jax

    if jax.process_count() == 1 or len(host_pool.page_row) != 3:
        return None
    layer = page_layers(pools.kv)[0]
    if len(layer.sharding.device_set) == 1 or layer.ndim != 4:
        return None
    shards = HeadShards.of(layer.sharding, layer.shape, host_pool.page_row[1], host_pool.kv_head_replicas)
    local = shards.on_process(jax.process_index())
    if len(local.host_blocks) == len(shards.host_blocks):
        return None
    return tuple(heads for _, heads in local.host_blocks)


def open_storage_tier(plan: CachePlan, host_pool: HostKVPool, pools: Any, config: CacheConfig) -> StorageOptions:
    """Open the store (``"memory"``, or the ``"file"`` backend in ``hicache_storage_dir``) over pages
    of ``host_pool``, under :func:`storage_key`, with the config's prefetch settings: what the
    tree's constructor links behind its host tier.
    """
    location = "memory" if config.hicache_storage_backend == "memory" else str(config.hicache_storage_dir)
    key = storage_key(plan, host_pool, pools, config)
    local = local_head_blocks(pools, host_pool)
    shards = rank_shards(host_pool, config, local)
    store = StorageTier(location, key=key, shards=shards, partial_shards=local is not None)
    return StorageOptions(
        store,
        host_pool,
        prefetch_policy=config.hicache_storage_prefetch_policy,
        prefetch_timeout_s=config.hicache_storage_prefetch_timeout_s,
        prefetch_threshold=config.hicache_storage_prefetch_threshold,
    )
