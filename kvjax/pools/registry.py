"""The pool kinds: what each one is, where it lives, whether kvjax can build it, and the function
that builds it (jax-free; the builder is imported only when a pool is built).

The planner asks each kind's layout module (``mha_layout``, ``mla_layout``, ``recurrent_layout``)
for ``PoolPlan`` s and tags them with a kind from this table; ``build_kv_cache`` loops over
``plan.pools`` and calls ``POOL_KINDS[pool.kind].create(pool, context)``. A kind that is not built
yet raises ``NotImplementedError`` naming its capability, from its entry here. Adding a kind is one
layout module, one pool module and one entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvjax.errors import ConfigError
from kvjax.pools.pool_plan import PoolPlan


@dataclass(frozen=True)
class BuildContext:
    """What a pool's ``create`` needs beyond its ``PoolPlan``.

    ``mesh``: a ``jax.sharding.Mesh`` or None; ``kv_head_axis``: its axis for KV heads;
    ``tp_size``: ranks along that axis (the planned per-rank heads are multiplied by it when a
    mesh shards the global array); ``platform``: where the arrays live; ``host_layout``: the host
    tier's memory layout (``hicache_mem_layout``).
    """

    platform: str
    mesh: Any = None
    kv_head_axis: str = "tp"
    tp_size: int = 1
    host_layout: str = "layer_first"


@dataclass(frozen=True)
class PoolKind:
    """One entry of the registry.

    Attributes:
        name: the key ``PoolPlan.kind`` uses.
        memory: ``"device"`` or ``"host"``.
        capability: what this kind is, in words (error messages name it).
        builder: ``"module:function"`` building one pool from ``(PoolPlan, BuildContext)``, or
            None while the capability is not built yet.
        group_builder: ``"module:function"`` building *every* ``PoolPlan`` of this kind in a plan
            as one pool from ``(tuple[PoolPlan, ...], BuildContext)``, stored under the kind's
            name (the recurrent state: one plan entry per tensor, one pool). Set instead of
            ``builder``.
    """

    name: str
    memory: str
    capability: str
    builder: str | None = None
    group_builder: str | None = None

    @property
    def built(self) -> bool:
        return self.builder is not None or self.group_builder is not None

    def require_built(self, model: str) -> None:
        """Raise ``NotImplementedError`` naming the capability when this kind cannot be built yet."""
        if not self.built:
            raise NotImplementedError(
                f"kvjax cannot build {self.capability} (pool kind {self.name!r}) yet for {model}; "
                "the plan is available from plan_kv_cache"
            )

    def create(self, pool: PoolPlan, context: BuildContext) -> Any:
        """Build ``pool`` (imports the builder on first use)."""
        self.require_built(f"pool {pool.name!r}")
        module, _, function = str(self.builder).partition(":")
        make: Callable[[PoolPlan, BuildContext], Any] = getattr(importlib.import_module(module), function)
        return make(pool, context)

    def create_group(self, pools: tuple[PoolPlan, ...], context: BuildContext) -> Any:
        """Build every pool of this kind in a plan as one (``group_builder``)."""
        self.require_built(f"pools {[p.name for p in pools]}")
        module, _, function = str(self.group_builder).partition(":")
        make: Callable[[tuple[PoolPlan, ...], BuildContext], Any] = getattr(importlib.import_module(module), function)
        return make(pools, context)


POOL_KINDS: dict[str, PoolKind] = {
    kind.name: kind
    for kind in (
        PoolKind("mha", "device", "the full-attention paged K/V pool", "kvjax.pools.mha:create_pool"),
        PoolKind(
            "mla",
            "device",
            "the MLA latent KV pool (kv_pool_kind='mla', with the DSA indexer keys)",
            "kvjax.pools.mla:create_pool",
        ),
        PoolKind(
            "swa",
            "device",
            "the hybrid sliding-window pools (kv_pool_kind='swa': full + SWA pools and the SWA allocator)",
            group_builder="kvjax.pools.swa:create_pool_group",
        ),
        PoolKind(
            "recurrent",
            "device",
            "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
            group_builder="kvjax.pools.recurrent:create_pool_group",
        ),
        PoolKind(
            "host_tier",
            "host",
            "the host-memory tier (HiCache: enable_hierarchical_cache or host_pool backup)",
            "kvjax.tiers.host_pool:create_host_pool",
        ),
        PoolKind("request_table", "host", "the request -> token-slot table", "kvjax.req_pool:create_pool"),
    )
}


def pool_kind(name: str) -> PoolKind:
    """The registry entry of kind ``name`` (``ConfigError`` naming the kinds otherwise)."""
    try:
        return POOL_KINDS[name]
    except KeyError:
        raise ConfigError("pool kind", name, f"use one of {sorted(POOL_KINDS)}") from None


def is_built(kind: str) -> bool:
    """True when kvjax can build pools of ``kind`` today."""
    return pool_kind(kind).built
