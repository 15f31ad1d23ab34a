"""The host tier kind (HiCache: ``enable_hierarchical_cache``, or the ``host_pool`` retraction
backup): host pools of the device KV (``"host_kv"``; a hybrid SWA cache also ``"host_kv_swa"``),
``HostTierExtension`` in the serving loop, and the page transfer engine between the tiers.

The engine is the first one a kind of the cache offers (``CacheKind.transfer_engine``: the
sliding-window pair moves both sides), else ``PageTransferEngine`` over the first device pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.serve.extension import ServingExtension

POOL = PoolKind(
    "host_tier",
    "host",
    "the host-memory tier (HiCache: enable_hierarchical_cache or host_pool backup)",
    "kvjax.tiers.host_pool:create_host_pool",
)


def make_transfer_engine(cache: KVCache) -> Any:
    """The page transfer engine between ``cache``'s device pools and its host pool ``host_pool``:
    the first a kind of the cache offers, else ``PageTransferEngine`` over the first device pool.
    The engine holds no reference to the cache: it records its loads in ``cache.pending`` for
    the step's owner to apply and reads backups from the pools the owner last handed in."""
    from kvjax.kinds.registry import cache_kinds_of

    for kind in cache_kinds_of(cache.plan):
        if kind.transfer_engine is not None:
            engine = kind.transfer_engine(cache)
            if engine is not None:
                return engine
    from kvjax.tiers.transfer import PageTransferEngine

    device_pool = next(p.name for p in cache.plan.pools if p.memory == "device")
    return PageTransferEngine(cache.pending, cache.host_pool, pool_name=device_pool)


def serving_extension(cache: KVCache) -> ServingExtension | None:
    if cache.host_pool is None:
        return None
    from kvjax.serve.host_tier import HostTierExtension

    return HostTierExtension(cache)


KIND = CacheKind(name="host_tier", pool_kinds=(POOL,), serving_extension=serving_extension)
