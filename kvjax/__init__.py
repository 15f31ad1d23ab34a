"""kvjax: SGLang's KV-cache memory subsystem for JAX/XLA on TPU.

The public names (DESIGN §2): ``ModelSpec``, ``CacheConfig``, ``plan_kv_cache`` -> ``CachePlan``,
``build_kv_cache`` -> ``KVCache``, and the errors ``ConfigError``, ``InvalidSlotError``,
``DoubleFreeError``, ``OutOfMemoryError``.
"""

from kvjax.build import KVCache, build_kv_cache
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError, OutOfMemoryError
from kvjax.plan import CachePlan, PoolPlan, plan_kv_cache
from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CachePlan",
    "ConfigError",
    "DoubleFreeError",
    "InvalidSlotError",
    "KVCache",
    "LayerKind",
    "ModelSpec",
    "OutOfMemoryError",
    "PoolPlan",
    "RecurrentStateSpec",
    "build_kv_cache",
    "plan_kv_cache",
]
