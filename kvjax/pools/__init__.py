"""Device state: the pools of a KV cache, as immutable pytrees (see ``docs/architecture.md``).

Importing this package is jax-free: the pytrees (``CachePools``, ``MHAKVPool``, ``SWAKVPool``,
``MLAKVPool``, ``DSAIndexerKeyPool``) and the builder registry (``registry``) load on first access.
The layouts and ``PoolPlan`` the planner sizes them by live below, in ``kvjax.layout``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.layout.build_context import BuildContext
from kvjax.layout.pool_plan import PoolPlan
from kvjax.lazy import lazy_getattr

if TYPE_CHECKING:
    from kvjax.pools.cache_pools import CachePools
    from kvjax.pools.dsa_indexer import DSAIndexerKeyPool
    from kvjax.pools.mha import MHAKVPool
    from kvjax.pools.mla import MLAKVPool
    from kvjax.pools.registry import PoolBuilders, create_pool, create_pool_group, register_pool_builders
    from kvjax.pools.swa import SWAKVPool

__all__ = [
    "BuildContext",
    "CachePools",
    "DSAIndexerKeyPool",
    "MHAKVPool",
    "MLAKVPool",
    "PoolBuilders",
    "PoolPlan",
    "SWAKVPool",
    "create_pool",
    "create_pool_group",
    "register_pool_builders",
]

_LAZY = {
    "CachePools": "kvjax.pools.cache_pools",
    "MHAKVPool": "kvjax.pools.mha",
    "MLAKVPool": "kvjax.pools.mla",
    "DSAIndexerKeyPool": "kvjax.pools.dsa_indexer",
    "SWAKVPool": "kvjax.pools.swa",
    "PoolBuilders": "kvjax.pools.registry",
    "create_pool": "kvjax.pools.registry",
    "create_pool_group": "kvjax.pools.registry",
    "register_pool_builders": "kvjax.pools.registry",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
