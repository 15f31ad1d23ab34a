"""Cache kinds: one bundle (``CacheKind``) per kind of cached state, registered in one place.

Each built-in kind is one module: ``full`` (MHA/GQA), ``mla``, ``swa`` (sliding window),
``recurrent`` (SSM / linear-attention state), ``host_tier`` (HiCache host pools),
``request_table`` and ``retraction`` (the ``cpu_tensor`` decode retraction backup). A new kind
is a ``CacheKind`` passed to ``register_cache_kind`` (see ``docs/architecture.md``, "Adding a
cache kind"). Importing this package is jax-free.
"""

from __future__ import annotations

from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import BuildContext, PoolKind
from kvjax.kinds.registry import (
    POOL_KINDS,
    cache_kind,
    cache_kinds,
    cache_kinds_of,
    is_built,
    pool_kind,
    register_cache_kind,
    unregister_cache_kind,
)

__all__ = [
    "POOL_KINDS",
    "BuildContext",
    "CacheKind",
    "PoolKind",
    "cache_kind",
    "cache_kinds",
    "cache_kinds_of",
    "is_built",
    "pool_kind",
    "register_cache_kind",
    "unregister_cache_kind",
]
