"""kvjax: SGLang's KV-cache memory subsystem for JAX/XLA on TPU.

The public names (stable; ``README.md`` shows them in use): ``ModelSpec``, ``CacheConfig``,
``plan_kv_cache`` -> ``CachePlan``, ``build_kv_cache`` -> ``KVCache``, and the errors
``ConfigError``, ``InvalidSlotError``, ``DoubleFreeError``, ``OutOfMemoryError``; for a serving
loop of your own, ``OwnLoop`` (``docs/integration.md``).

This package's ``__init__`` is the top (application) layer of the package's layers
(``docs/architecture.md``), and Python runs it before any submodule. So it imports only core
modules (``kvjax.lazy``, ``kvjax.version``): every public name loads its module on first access
(``_LAZY``), and ``import kvjax.alloc`` loads nothing above the allocators' layer. ``import
kvjax`` is cheap and jax-free; the names that need jax (``build_kv_cache``, ``KVCache``, the pools)
import jax when first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.lazy import lazy_getattr
from kvjax.version import __version__ as __version__

if TYPE_CHECKING:
    from kvjax.build import KVCache, build_kv_cache
    from kvjax.config import CacheConfig
    from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError, OutOfMemoryError
    from kvjax.plan import CachePlan, PoolPlan, plan_kv_cache
    from kvjax.pools.cache_pools import CachePools
    from kvjax.pools.mha import MHAKVPool
    from kvjax.serve.own_loop import LoopBatch, LoopRequest, OwnLoop
    from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec

__all__ = [
    "CacheConfig",
    "CachePlan",
    "CachePools",
    "ConfigError",
    "DoubleFreeError",
    "InvalidSlotError",
    "KVCache",
    "LayerKind",
    "LoopBatch",
    "LoopRequest",
    "MHAKVPool",
    "ModelSpec",
    "OutOfMemoryError",
    "OwnLoop",
    "PoolPlan",
    "RecurrentStateSpec",
    "build_kv_cache",
    "plan_kv_cache",
]

# Each public name and the module it is read from on first access (the modules the TYPE_CHECKING
# imports above name). Invariant: the keys are exactly __all__; ``__version__`` is read eagerly.
_LAZY = {
    "CacheConfig": "kvjax.config",
    "ConfigError": "kvjax.errors",
    "DoubleFreeError": "kvjax.errors",
    "InvalidSlotError": "kvjax.errors",
    "OutOfMemoryError": "kvjax.errors",
    "LayerKind": "kvjax.spec",
    "ModelSpec": "kvjax.spec",
    "RecurrentStateSpec": "kvjax.spec",
    "CachePlan": "kvjax.plan",
    "PoolPlan": "kvjax.plan",
    "plan_kv_cache": "kvjax.plan",
    "KVCache": "kvjax.build",
    "build_kv_cache": "kvjax.build",
    "CachePools": "kvjax.pools.cache_pools",
    "MHAKVPool": "kvjax.pools.mha",
    "OwnLoop": "kvjax.serve.own_loop",
    "LoopRequest": "kvjax.serve.own_loop",
    "LoopBatch": "kvjax.serve.own_loop",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
