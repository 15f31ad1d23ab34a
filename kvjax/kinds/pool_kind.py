"""`PoolKind`: one kind of pool a cache kind builds, and `BuildContext`, what building it needs
(jax-free; the builder is named ``"module:function"`` and imported only when a pool is built)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvjax.layout.pool_plan import PoolPlan

__all__ = ["BuildContext", "PoolKind", "resolve"]


@dataclass(frozen=True)
class BuildContext:
    """What a pool's ``create`` needs beyond its ``PoolPlan``.

    ``mesh``: a ``jax.sharding.Mesh`` or None; ``kv_head_axis``: its axis for KV heads;
    ``tp_size``: ranks along that axis (the planned per-rank heads are multiplied by it when a
    mesh shards the global array); ``platform``: where the arrays live; ``host_layout``: the host
    tier's memory layout (``hicache_mem_layout``); ``context_axis``: the mesh axis a paged pool's
    token rows are striped over under decode context parallelism (``"dcp"``), or None;
    ``dcp_size``: ranks along it (the planned per-device page rows are multiplied by it).
    """

    platform: str
    mesh: Any = None
    kv_head_axis: str = "tp"
    tp_size: int = 1
    host_layout: str = "layer_first"
    context_axis: str | None = None
    dcp_size: int = 1


@dataclass(frozen=True)
class PoolKind:
    """One kind of pool: the key ``PoolPlan.kind`` uses and the function that builds it.

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
        make: Callable[[PoolPlan, BuildContext], Any] = resolve(str(self.builder))
        return make(pool, context)

    def create_group(self, pools: tuple[PoolPlan, ...], context: BuildContext) -> Any:
        """Build every pool of this kind in a plan as one (``group_builder``)."""
        self.require_built(f"pools {[p.name for p in pools]}")
        make: Callable[[tuple[PoolPlan, ...], BuildContext], Any] = resolve(str(self.group_builder))
        return make(pools, context)


def resolve(reference: str) -> Any:
    """The object a ``"module:attribute"`` reference names (the module imported now).

    Raises ``ValueError`` naming the reference when it has no ``":"``.
    """
    module, sep, attribute = reference.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(
            f"{reference!r} is not a 'module:attribute' reference; write e.g. 'kvjax.pools.mha:create_pool'"
        )
    return getattr(importlib.import_module(module), attribute)
