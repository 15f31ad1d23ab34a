"""`plan_kv_cache`: the planner as a pipeline of pure decisions over small records."""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.plan.cache_plan import CachePlan
from kvjax.plan.dcp import check_dcp_config
from kvjax.plan.draft import decide_draft, draft_pool_plans
from kvjax.plan.host_sizing import check_host_memory, validate_retraction_host_capacity
from kvjax.plan.kinds.host_tier import HOST_KV
from kvjax.plan.kinds.host_tier import POOL as HOST_TIER_POOL
from kvjax.plan.kinds.registry import planner_kinds
from kvjax.plan.model_kind import decide_model_kind
from kvjax.plan.pool_plans import plan_pools
from kvjax.plan.sizing import decide_sizes
from kvjax.plan.target import check_pipeline_stages, decide_target
from kvjax.plan.tree import decide_host_tier, decide_retraction_backup, decide_tree
from kvjax.spec import ModelSpec


def plan_kv_cache(
    spec: ModelSpec,
    config: CacheConfig,
    *,
    device_memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    draft_spec: ModelSpec | None = None,
) -> CachePlan:
    """Decide and size the KV cache of ``spec`` under ``config``. Pure and deterministic.

    ``device_memory_bytes`` is the memory of one device; it is needed only when the budget is
    given as ``mem_fraction_static``. ``host_memory_bytes``: the host memory available; when
    given, a host tier larger than it less SGLang's 10 GiB reserve is refused with the figures
    (``build_kv_cache`` passes what the host reports). ``draft_spec``: the draft model of EAGLE /
    EAGLE3 (optional) or STANDALONE (``kvjax.plan.draft``). Raises ``ConfigError`` for a
    combination that cannot be built.
    The stages, each a pure function of the records before it: model kind -> target layout ->
    sizes -> retraction backup -> tree -> host tier -> pools.
    """
    kind = decide_model_kind(spec, config)
    check_dcp_config(config, kind, spec.name, spec.num_attention_heads)
    check_pipeline_stages(spec, config.pp_size)  # the target's layers; a draft sits on the last stage
    target = decide_target(spec, config, kind)
    draft, draft_warnings = decide_draft(spec, config, kind, draft_spec)
    sizes = decide_sizes(
        spec,
        config,
        kind,
        target,
        device_memory_bytes=device_memory_bytes,
        draft_bytes_per_token=0 if draft is None else draft.bytes_per_token,
    )
    backup, hicache_ratio = decide_retraction_backup(config, kind, sizes)
    tree = decide_tree(spec, config, kind, sizes, backup)
    host = decide_host_tier(config, sizes, tree, backup, hicache_ratio)
    pools = plan_pools(kind, target, sizes, host)
    host_kv = next((p for p in pools if p.name == HOST_KV), None)
    drafts = draft_pool_plans(
        draft, sizes.num_pages, host_kv.shape[0] if host_kv is not None and host.draft_host_pools else None
    )
    pools = (
        tuple(p for p in pools if p.memory == "device")
        + tuple(p for p in drafts if p.memory == "device")
        + tuple(p for p in pools if p.memory != "device")
        + tuple(p for p in drafts if p.memory != "device")
    )
    # The host tier's pools: the KV's and those of a kind's per-request state (``host_state_pools``).
    state_kinds = {k.name for c in planner_kinds() if c.host_state_pools is not None for k in c.pool_kinds}
    host_tier_bytes = sum(
        p.nbytes for p in pools if p.memory == "host" and p.kind in {HOST_TIER_POOL.name, *state_kinds}
    )
    if host_tier_bytes and host_memory_bytes is not None:
        check_host_memory(host_tier_bytes, host_memory_bytes)
    if backup == "host_pool" and host.attach_host_tier:
        validate_retraction_host_capacity(host.host_pool_tokens, sizes.context_length, sizes.alloc_page_size)
    host_warnings: tuple[str, ...] = ()
    if host.attach_host_tier and host.host_pool_tokens <= (sizes.full_tokens_per_layer or sizes.max_total_tokens):
        host_warnings = (
            f"the host tier ({host.host_pool_tokens} tokens) is not larger than the device pool; "
            "raise hicache_ratio or hicache_size for it to hold evicted prefixes",
        )
    spec_warnings = tuple(getattr(spec, "warnings", ()))
    plan = CachePlan(
        model=spec.name,
        kind=kind,
        target=target,
        sizes=sizes,
        tree=tree,
        host=host,
        pools=pools,
        warnings=spec_warnings + sizes.warnings + tree.warnings + host_warnings + draft_warnings,
        draft=draft,
    )
    budget = sizes.kv_budget_bytes
    if budget is not None and plan.device_bytes > budget:  # an invariant of the sizing, never user error
        raise AssertionError(f"planner bug: {plan.device_bytes} device bytes planned for a budget of {budget}")
    return plan
