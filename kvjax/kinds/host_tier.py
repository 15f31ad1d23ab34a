"""The host tier kind (HiCache: ``enable_hierarchical_cache``, or the ``host_pool`` retraction
backup): host pools of the device KV (``"host_kv"``; a hybrid SWA cache also ``"host_kv_swa"``),
``HostTierExtension`` in the serving loop, and the page transfer engine between the tiers.

The engine is the first one a kind of the cache offers (``CacheKind.transfer_engine``: the
sliding-window pair moves both sides), else ``PageTransferEngine`` over the first device pool. It
is made before the tree (which takes it at construction): it holds no cache, only the pending
device updates its loads are recorded in (``kvjax.device_updates``) and the host pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.device_updates import PendingDeviceUpdates
    from kvjax.layout.pool_plan import PoolPlan
    from kvjax.plan import CachePlan
    from kvjax.plan.records import Sizes
    from kvjax.protocols import AllocatorProtocol
    from kvjax.serve.extension import ServingExtension

POOL = PoolKind(
    "host_tier",
    "host",
    "the host-memory tier (HiCache: enable_hierarchical_cache or host_pool backup)",
    "kvjax.tiers.host_pool:create_host_pool",
)


@dataclasses.dataclass(frozen=True)
class TransferContext:
    """What a host-tier transfer engine is made from, before the tree and the cache exist.

    ``pending``: the device updates its loads are recorded in (the cache's ``pending``);
    ``host_pools``: the built host pools by plan name (``"host_kv"``, a kind's own such as
    ``"host_kv_swa"``); ``allocator``: the device token allocator.
    """

    plan: CachePlan
    pending: PendingDeviceUpdates
    host_pools: Mapping[str, Any]
    allocator: AllocatorProtocol

    @property
    def host_pool(self) -> Any:
        """The host pool of the device KV (``"host_kv"``)."""
        return self.host_pools[HOST_KV]


HOST_KV = "host_kv"  # the host pool of the device KV (one per side for a pool pair: a kind names the other)


def host_pool_plan(device: PoolPlan, name: str) -> PoolPlan:
    """``device`` (a device pool's plan, sized for the host's pages) as the host tier's pool ``name``."""
    return dataclasses.replace(device, name=name, kind=POOL.name, memory="host", built=POOL.built)


def host_kv_pool(layout: Any, num_pages: int, name: str, layer_ids: tuple[int, ...]) -> PoolPlan:
    """The host pool ``name`` of ``num_pages`` pages (+ the trash page) over ``layer_ids``, in the
    attention ``layout`` (a latent layout: its latent row, without indexer keys)."""
    from kvjax.layout.mla import MLALayout

    if isinstance(layout, MLALayout):
        device = layout.pool_plans(num_pages=num_pages, layer_ids=layer_ids, built=False)[0]
    else:
        device = layout.pool_plan(name, POOL.name, num_pages=num_pages, layer_ids=layer_ids)
    return host_pool_plan(device, name)


def host_pages(sizes: Sizes, host_tokens: int) -> int:
    """Pages of a host pool of ``host_tokens`` tokens, less its trash page."""
    return host_tokens // sizes.alloc_page_size - 1


def make_transfer_engine(context: TransferContext) -> Any:
    """The page transfer engine between the device pools and the host pool ``host_kv``: the first
    a kind of the plan offers, else ``PageTransferEngine`` over the first device pool."""
    from kvjax.kinds.registry import cache_kinds_of

    for kind in cache_kinds_of(context.plan):
        if kind.transfer_engine is not None:
            engine = kind.transfer_engine(context)
            if engine is not None:
                return engine
    from kvjax.tiers.transfer import PageTransferEngine

    device_pool = next(p.name for p in context.plan.pools if p.memory == "device")
    return PageTransferEngine(context.pending, context.host_pool, pool_name=device_pool)


def serving_extension(cache: KVCache) -> ServingExtension | None:
    if cache.host_pool is None:
        return None
    from kvjax.serve.host_tier import HostTierExtension

    return HostTierExtension(cache)


KIND = CacheKind(name="host_tier", pool_kinds=(POOL,), serving_extension=serving_extension)
