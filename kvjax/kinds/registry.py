"""The cache kind registry: every kind of cached state kvjax serves, in one fixed order.

``register_cache_kind`` adds a kind and its pool kinds; ``cache_kinds_of(plan)`` lists the kinds
a plan uses, in registration order (the built-in kinds first: request table, full attention,
MLA, sliding window, recurrent state, host tier, retraction backup; then kinds registered later,
in the order they were). ``build_kv_cache`` and the serving scheduler call the hooks of those
kinds in that order (the default serving extensions are theirs, in that order).

``POOL_KINDS`` maps each pool kind name (``PoolPlan.kind``) to its ``PoolKind``; the planner
tags pools with these names (``kvjax.pools.registry`` re-exports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.errors import ConfigError
from kvjax.kinds import full, host_tier, mla, recurrent, request_table, retraction, swa
from kvjax.kinds.cache_kind import CacheKind
from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.plan import CachePlan

_CACHE_KINDS: dict[str, CacheKind] = {}
POOL_KINDS: dict[str, PoolKind] = {}
_OWNER: dict[str, str] = {}  # pool kind name -> the cache kind that registered it


def register_cache_kind(kind: CacheKind) -> CacheKind:
    """Add ``kind`` (after every kind registered so far) and its pool kinds; returns it.

    Raises ``ConfigError`` (the registry unchanged) when its name, or one of its pool kinds'
    names, is taken already.
    """
    if not isinstance(kind, CacheKind):
        raise TypeError(f"register_cache_kind: expected a CacheKind, got {type(kind).__name__}")
    if kind.name in _CACHE_KINDS:
        raise ConfigError("cache kind", kind.name, f"the name is registered; pick another than {sorted(_CACHE_KINDS)}")
    names = [p.name for p in kind.pool_kinds]
    taken = sorted({n for n in names if n in POOL_KINDS} | {n for n in names if names.count(n) > 1})
    if taken:
        raise ConfigError(
            "pool kind",
            taken[0],
            f"cache kind {kind.name!r}: pool kinds {taken} are registered (by {[_OWNER.get(n) for n in taken]}) "
            "or repeated; give the kind's pools names of their own",
        )
    _CACHE_KINDS[kind.name] = kind
    for pool in kind.pool_kinds:
        POOL_KINDS[pool.name] = pool
        _OWNER[pool.name] = kind.name
    return kind


def unregister_cache_kind(name: str) -> CacheKind:
    """Remove the kind ``name`` and its pool kinds (``ConfigError`` naming the kinds when unknown);
    returns it. For kinds registered by the caller (a test, a plugin being reloaded)."""
    kind = cache_kind(name)
    del _CACHE_KINDS[name]
    for pool in kind.pool_kinds:
        POOL_KINDS.pop(pool.name, None)
        _OWNER.pop(pool.name, None)
    return kind


def cache_kind(name: str) -> CacheKind:
    """The kind registered as ``name`` (``ConfigError`` naming the registered kinds otherwise)."""
    try:
        return _CACHE_KINDS[name]
    except KeyError:
        raise ConfigError("cache kind", name, f"use one of {list(_CACHE_KINDS)}") from None


def cache_kinds() -> tuple[CacheKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_CACHE_KINDS.values())


def cache_kinds_of(plan: CachePlan) -> tuple[CacheKind, ...]:
    """The kinds ``plan`` uses (``CacheKind.used_by``), in registration order."""
    return tuple(kind for kind in _CACHE_KINDS.values() if kind.used_by(plan))


def pool_kind(name: str) -> PoolKind:
    """The pool kind ``name`` (``ConfigError`` naming the pool kinds otherwise)."""
    try:
        return POOL_KINDS[name]
    except KeyError:
        raise ConfigError("pool kind", name, f"use one of {sorted(POOL_KINDS)}") from None


def is_built(kind: str) -> bool:
    """True when kvjax can build pools of ``kind`` today."""
    return pool_kind(kind).built


for _builtin in (
    request_table.KIND,
    full.KIND,
    mla.KIND,
    swa.KIND,
    recurrent.KIND,
    host_tier.KIND,
    retraction.KIND,
):
    register_cache_kind(_builtin)
del _builtin
