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
    mesh shards the global array); ``platform``: where the arrays live.
    """

    platform: str
    mesh: Any = None
    kv_head_axis: str = "tp"
    tp_size: int = 1


@dataclass(frozen=True)
class PoolKind:
    """One entry of the registry.

    Attributes:
        name: the key ``PoolPlan.kind`` uses.
        memory: ``"device"`` or ``"host"``.
        capability: what this kind is, in words (error messages name it).
        builder: ``"module:function"`` building one pool from ``(PoolPlan, BuildContext)``, or
            None while the capability is not built yet.
    """

    name: str
    memory: str
    capability: str
    builder: str | None = None

    @property
    def built(self) -> bool:
        return self.builder is not None

    def require_built(self, model: str) -> None:
        """Raise ``NotImplementedError`` naming the capability when this kind cannot be built yet."""
        if self.builder is None:
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
        ),
        PoolKind(
            "recurrent",
            "device",
            "the recurrent-state pool of hybrid SSM / linear-attention models (kv_pool_kind='hybrid_linear')",
        ),
        PoolKind("host_tier", "host", "the host-memory tier (HiCache: enable_hierarchical_cache or host_pool backup)"),
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
