"""kvjax: SGLang's KV-cache memory subsystem for JAX/XLA on TPU."""

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError, OutOfMemoryError
from kvjax.plan import CachePlan, PoolPlan, plan_kv_cache
from kvjax.spec import LayerKind, ModelSpec, RecurrentStateSpec
