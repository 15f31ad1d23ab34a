"""Which planned host tiers kvjax can build: checked on a plan, without jax.

A plan describes what SGLang 0.5.23 would build, including host tiers kvjax has no host copy for
yet. `check_host_tier_buildable` refuses those by name, with ``NotImplementedError`` (DESIGN §6:
a feature not built yet is named, never a silent fallback). ``build_kv_cache`` calls it before it
allocates anything, and the command line calls it before it imports jax.
"""

from __future__ import annotations

from kvjax.plan.cache_plan import CachePlan
from kvjax.plan.kinds.registry import planner_kinds_of


def check_host_tier_buildable(plan: CachePlan) -> None:
    """Raise ``NotImplementedError`` naming the pool when ``plan`` attaches a host tier over a pool
    kvjax keeps no host copies of: the DSA indexer keys, or a kind's state it has no host copy of
    (``PlannerKind.no_host_copy``; no built-in kind sets it: the recurrent-state checkpoints have
    their host pool, ``"host_state"``), or a kind's state under the ``write_back`` policy
    (``PlannerKind.write_back_refusal``: the recurrent-state checkpoints, whose tree,
    ``HiMambaRadixCache``, builds the write-through policies)."""
    if not plan.attach_host_tier:
        return
    if any(p.name == "index_k" for p in plan.pools):
        raise NotImplementedError(
            f"kvjax cannot build the host tier for {plan.model} yet: host copies of the DSA indexer keys "
            "(pool 'index_k') are not built; turn off enable_hierarchical_cache"
        )
    for kind in planner_kinds_of(plan):
        if plan.hicache_write_policy == "write_back" and kind.write_back_refusal is not None:
            raise NotImplementedError(
                f"kvjax cannot build the host tier for {plan.model} with hicache_write_policy='write_back' yet: "
                f"{kind.write_back_refusal}"
            )
        if kind.no_host_copy is not None:
            raise NotImplementedError(
                f"kvjax cannot build the host tier for {plan.model} yet: host copies of its {kind.no_host_copy} "
                "are not built; turn off enable_hierarchical_cache for this model"
            )
