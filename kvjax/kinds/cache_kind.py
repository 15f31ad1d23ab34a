"""`CacheKind`: everything one kind of cached state registers, in one record (jax-free).

A cache kind (full attention, MLA, sliding window, recurrent state, the host tier, ...) is one
module of ``kvjax.kinds`` holding one ``CacheKind``. ``build_kv_cache`` and the serving
scheduler loop over the kinds a plan uses (``kvjax.kinds.cache_kinds_of``) and call these hooks;
neither names a kind. Every hook is optional: a kind sets only what it owns.

Hooks are plain functions of the kind's own module that import heavy code (jax, the pools, the
serving loop) inside their body, so importing a kind stays jax-free (the planner imports the
registry). The attention function is a ``"module:function"`` string, resolved by the model side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvjax.kinds.pool_kind import PoolKind

if TYPE_CHECKING:
    from kvjax.build import KVCache
    from kvjax.kinds.host_tier import TransferContext
    from kvjax.plan import CachePlan
    from kvjax.pools.pool_plan import PoolPlan
    from kvjax.protocols import AllocatorProtocol
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.serve.extension import ServingExtension

__all__ = ["CacheKind"]


@dataclass(frozen=True)
class CacheKind:
    """One kind of cached state: its pools, allocator, tree component, serving hooks, attention.

    Attributes:
        name: the registry key (unique).
        pool_kinds: the pool kinds it builds (``PoolPlan.kind`` keys; each owned by one kind).
        kv_pool_kind: the plan's ``kv_pool_kind`` this kind serves (``"mha"``, ``"mla"``,
            ``"swa"``, ``"hybrid_linear"``), or None when it is not a KV pool kind.
        tree_components: the tree components it contributes (names of ``plan.tree_components``:
            ``"full"``, ``"swa"``, ``"mamba"``); documentation of the planner's choice.
        attention: ``"module:function"`` of the model-side function that reads and writes its
            pool in a layer, or None (no model-side state).
        uses: ``(plan) -> bool``, whether a plan uses this kind; default: a pool of
            ``plan.pools`` is of one of ``pool_kinds``.
        extra_pools: ``(plan) -> tuple[PoolPlan, ...]``, pools the kind adds to those the planner
            lists (built like them, appended to ``plan.pools``; not counted in the planner's
            memory budget: for small per-request state).
        allocator: ``(plan) -> allocator | None``, the token allocator when this kind decides it
            (the first kind of the plan that returns one wins; none: ``make_allocator``).
        request_table: ``(table, plan) -> table``, the request table this kind needs around the
            plain one (recurrent state: a state slot per request).
        serving_extension: ``(cache) -> ServingExtension | None``, the kind's serving hooks
            (``kvjax.serve.extension``); the scheduler's default extensions are these, in
            registry order.
        transfer_engine: ``(TransferContext) -> engine``, the host tier's page transfer engine
            over this kind's pools when the plain one (``PageTransferEngine``) does not fit them
            (made before the tree, which takes it at construction: ``kinds.host_tier``).
        windowed_request_kv: ``(plan) -> bool``, True when a request holds about one window of KV
            whatever its length (pure sliding window): the scheduler then does not refuse long
            requests for the pool's size.
        page_backup: whether the decode retraction backup (``cpu_tensor``, page copies of the
            ``"kv"`` pool) covers this kind's device state; a kind with state the copies miss
            (recurrent state, the sliding-window pair) sets False.
    """

    name: str
    pool_kinds: tuple[PoolKind, ...] = ()
    kv_pool_kind: str | None = None
    tree_components: tuple[str, ...] = ()
    attention: str | None = None
    uses: Callable[[CachePlan], bool] | None = None
    extra_pools: Callable[[CachePlan], tuple[PoolPlan, ...]] | None = None
    allocator: Callable[[CachePlan], AllocatorProtocol | None] | None = None
    request_table: Callable[[ReqToTokenPool, CachePlan], ReqToTokenPool] | None = None
    serving_extension: Callable[[KVCache], ServingExtension | None] | None = None
    transfer_engine: Callable[[TransferContext], Any] | None = None
    windowed_request_kv: Callable[[CachePlan], bool] | None = None
    page_backup: bool = True

    def used_by(self, plan: CachePlan) -> bool:
        """Whether ``plan`` uses this kind (``uses``, else: a pool of the plan is of its kinds)."""
        if self.uses is not None:
            return bool(self.uses(plan))
        names = {k.name for k in self.pool_kinds}
        return any(pool.kind in names for pool in plan.pools)
