"""What decode context parallelism (``dcp_size > 1``) combines with: checked on the config and the
model's kind before anything is sized (``ConfigError``), and on a plan before anything is built
(``NotImplementedError`` for what kvjax plans but does not build under DCP).

Under DCP each request's KV is striped over ``dcp_size`` ranks (``kvjax.alloc.dcp``): the
allocator's and the tree's page is ``page_size * dcp_size``, the pools hold ``page_size`` rows
of each striped page per device, and ``max_total_tokens`` counts the allocator's (striped) slots,
``dcp_size`` times one device's rows. Every ``page_size`` tiles the stripe (the striped page is
defined as ``page_size * dcp_size``); a pool that holds no striped page is refused by the sizing.

Refused, each by name, with what to do:

* DP attention and pipeline parallelism with DCP (kvjax's mesh is ``("dcp", "tp")``);
* a speculative draft model (its pool is not striped);
* the storage tier (L3) with DCP, as in SGLang;
* a cache kind that says why it cannot be striped (``PlannerKind.dcp_refusal``): the hybrid
  sliding-window pool (its second allocator is not striped: serve the model with one full-size
  pool, ``disable_hybrid_swa_memory``, where the window is a mask on global positions) and
  recurrent state (per request, not per token).

Served: the host tier (L1 host pool, L2 load-back) and the ``host_pool`` retraction backup over
a striped pool: the host page is the striped page, every rank's rows once, rank-major, and each
device moves its own rows of the pages (``kvjax.tiers.head_shards``). Not built yet
(``NotImplementedError`` at build): the DSA indexer keys.
"""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.kinds.planning import kinds_named
from kvjax.plan.records import ModelKind

__all__ = ["check_dcp_config", "check_dcp_plan_buildable"]


def check_dcp_config(config: CacheConfig, kind: ModelKind, model: str) -> None:
    """Refuse a combination DCP does not serve (module docstring), before anything is sized."""
    if not config.dcp_enabled:
        return
    dcp = config.dcp_size
    refusals: tuple[tuple[bool, str, object, str], ...] = (
        (
            config.enable_dp_attention,
            "enable_dp_attention",
            True,
            f"DP attention with {{dcp_size}} {dcp} is not served: kvjax's DCP mesh is ('dcp', 'tp'); turn one off",
        ),
        (
            config.pp_size > 1,
            "pp_size",
            config.pp_size,
            f"pipeline parallelism with {{dcp_size}} {dcp} is not served; use {{pp_size}} 1 or {{dcp_size}} 1",
        ),
        (
            config.hicache_storage_backend is not None,
            "hicache_storage_backend",
            config.hicache_storage_backend,
            f"the storage tier (L3) is not built with {{dcp_size}} {dcp} (SGLang refuses it for models without MLA, "
            "hicache_hook: resolve_hicache_dcp_compatibility); drop {hicache_storage_backend}",
        ),
        (
            config.speculative_algorithm is not None,
            "speculative_algorithm",
            config.speculative_algorithm,
            f"a draft model's pool is not striped over {{dcp_size}} {dcp} ranks; serve without speculation",
        ),
    )
    for refused, option, value, why in refusals:
        if refused:
            raise ConfigError(option, value, why)
    for cache_kind in kinds_named(kind.cache_kinds):
        if cache_kind.dcp_refusal is not None:
            raise ConfigError("dcp_size", dcp, f"{model}: {cache_kind.dcp_refusal}")


def check_dcp_plan_buildable(config: CacheConfig, pools: tuple[PoolPlan, ...]) -> None:
    """``NotImplementedError`` for what a DCP plan holds that kvjax does not build striped: the DSA
    indexer keys."""
    if not config.dcp_enabled:
        return
    if any(pool.name == "index_k" for pool in pools):
        raise NotImplementedError(
            f"the DSA indexer keys (pool 'index_k') striped over dcp_size={config.dcp_size} ranks are not built "
            "yet; serve the model with dcp_size=1"
        )
