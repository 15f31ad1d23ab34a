"""Device state: the pools of a KV cache, as immutable pytrees (see ``docs/architecture.md``).

Importing this package is jax-free: the layouts (``mha_layout``, ``mla_layout``,
``recurrent_layout``), ``PoolPlan`` and the kind registry are plain Python for the planner; the
jax pytrees (``CachePools``, ``MHAKVPool``, ``SWAKVPool``, ``MLAKVPool``, ``DSAIndexerKeyPool``) load on
first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.layout.pool_plan import PoolPlan
from kvjax.lazy import lazy_getattr
from kvjax.pools.registry import POOL_KINDS, BuildContext, PoolKind, pool_kind

if TYPE_CHECKING:
    from kvjax.pools.cache_pools import CachePools
    from kvjax.pools.dsa_indexer import DSAIndexerKeyPool
    from kvjax.pools.mha import MHAKVPool
    from kvjax.pools.mla import MLAKVPool
    from kvjax.pools.swa import SWAKVPool

__all__ = [
    "POOL_KINDS",
    "BuildContext",
    "CachePools",
    "DSAIndexerKeyPool",
    "MHAKVPool",
    "MLAKVPool",
    "PoolKind",
    "PoolPlan",
    "SWAKVPool",
    "pool_kind",
]

_LAZY = {
    "CachePools": "kvjax.pools.cache_pools",
    "MHAKVPool": "kvjax.pools.mha",
    "MLAKVPool": "kvjax.pools.mla",
    "DSAIndexerKeyPool": "kvjax.pools.dsa_indexer",
    "SWAKVPool": "kvjax.pools.swa",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
