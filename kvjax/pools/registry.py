"""The pool kinds, by ``PoolPlan.kind`` name (jax-free).

Each pool kind belongs to one cache kind (``kvjax.kinds``: the bundle of a kind's pools,
allocator, tree component, serving hooks and attention); this module keeps the pool-level names
importable from ``kvjax.pools``. The planner tags each ``PoolPlan`` with a kind from
``POOL_KINDS``; ``build_kv_cache`` builds it with ``pool_kind(pool.kind).create(pool, context)``.
A kind not built yet raises ``NotImplementedError`` naming its capability.
"""

from __future__ import annotations

from kvjax.kinds.pool_kind import BuildContext, PoolKind
from kvjax.kinds.registry import POOL_KINDS, is_built, pool_kind

__all__ = ["POOL_KINDS", "BuildContext", "PoolKind", "is_built", "pool_kind"]
