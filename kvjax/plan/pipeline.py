"""`plan_kv_cache`: the planner as a pipeline of pure decisions over small records."""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.plan.cache_plan import CachePlan
from kvjax.plan.model_kind import decide_model_kind
from kvjax.plan.pool_plans import plan_pools
from kvjax.plan.sizing import decide_sizes
from kvjax.plan.target import decide_target
from kvjax.plan.tree import decide_host_tier, decide_retraction_backup, decide_tree
from kvjax.spec import ModelSpec


def plan_kv_cache(spec: ModelSpec, config: CacheConfig, *, device_memory_bytes: int | None = None) -> CachePlan:
    """Decide and size the KV cache of ``spec`` under ``config``. Pure and deterministic.

    ``device_memory_bytes`` is the memory of one device; it is needed only when the budget is
    given as ``mem_fraction_static``. Raises ``ConfigError`` for a combination that cannot be built.
    The stages, each a pure function of the records before it: model kind -> target layout ->
    sizes -> retraction backup -> tree -> host tier -> pools.
    """
    kind = decide_model_kind(spec, config)
    target = decide_target(spec, config, kind)
    sizes = decide_sizes(spec, config, kind, target, device_memory_bytes=device_memory_bytes)
    backup, hicache_ratio = decide_retraction_backup(config, kind, sizes)
    tree = decide_tree(spec, config, kind, sizes, backup)
    host = decide_host_tier(config, kind, sizes, tree, backup, hicache_ratio)
    pools = plan_pools(kind, target, sizes, host)
    spec_warnings = tuple(getattr(spec, "warnings", ()))
    plan = CachePlan(
        model=spec.name,
        kind=kind,
        target=target,
        sizes=sizes,
        tree=tree,
        host=host,
        pools=pools,
        warnings=spec_warnings + sizes.warnings + tree.warnings,
    )
    budget = sizes.kv_budget_bytes
    if budget is not None and plan.device_bytes > budget:  # an invariant of the sizing, never user error
        raise AssertionError(f"planner bug: {plan.device_bytes} device bytes planned for a budget of {budget}")
    return plan
