"""kvjax: SGLang's KV-cache memory subsystem for JAX/XLA on TPU.

The public names (stable; ``README.md`` shows them in use): ``ModelSpec``, ``CacheConfig``,
``plan_kv_cache`` -> ``CachePlan``, ``build_kv_cache`` -> ``KVCache``, and the errors
``ConfigError``, ``InvalidSlotError``, ``DoubleFreeError``, ``OutOfMemoryError``.

``import kvjax`` is cheap and jax-free: the spec, config, planner and errors load at once; the
names that need jax (``build_kv_cache``, ``KVCache``, the pools) load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError, OutOfMemoryError
from kvjax.lazy import lazy_getattr
from kvjax.plan import CachePlan, PoolPlan, plan_kv_cache
from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec

if TYPE_CHECKING:
    from kvjax.build import KVCache, build_kv_cache
    from kvjax.pools.cache_pools import CachePools
    from kvjax.pools.mha import MHAKVPool

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CachePlan",
    "CachePools",
    "ConfigError",
    "DoubleFreeError",
    "InvalidSlotError",
    "KVCache",
    "LayerKind",
    "MHAKVPool",
    "ModelSpec",
    "OutOfMemoryError",
    "PoolPlan",
    "RecurrentStateSpec",
    "build_kv_cache",
    "plan_kv_cache",
]

# Names whose modules import jax: loaded on first attribute access.
_LAZY = {
    "KVCache": "kvjax.build",
    "build_kv_cache": "kvjax.build",
    "CachePools": "kvjax.pools.cache_pools",
    "MHAKVPool": "kvjax.pools.mha",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
