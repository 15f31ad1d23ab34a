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
* a hybrid sliding-window pool (its second allocator is not striped): serve the model with one
  full-size pool (``disable_hybrid_swa_memory``), where the window is a mask on global positions;
* recurrent state (hybrid SSM) and the DSA indexer keys (not striped);
* a speculative draft model (its pool is not striped);
* the storage tier (L3) with DCP, as in SGLang.

Not built yet (``NotImplementedError`` at build): the host tier (L1/L2) and the host-pool
retraction backup over a striped pool.
"""

from __future__ import annotations

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
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
            f"the storage tier (L3) is refused with {{dcp_size}} {dcp}, as in SGLang; drop "
            "{hicache_storage_backend} (the host tier L1/L2 alone is allowed)",
        ),
        (
            config.speculative_algorithm is not None,
            "speculative_algorithm",
            config.speculative_algorithm,
            f"a draft model's pool is not striped over {{dcp_size}} {dcp} ranks; serve without speculation",
        ),
        (
            kind.is_hybrid_swa,
            "dcp_size",
            dcp,
            f"{model}'s hybrid sliding-window pool has its own allocator, not striped over DCP ranks; set "
            "{disable_hybrid_swa_memory} (one full-size pool: the window is a mask on global positions) or "
            "{dcp_size} 1",
        ),
        (
            kind.is_hybrid_ssm,
            "dcp_size",
            dcp,
            f"{model}'s recurrent state is per request, not per token: it cannot be striped; use {{dcp_size}} 1",
        ),
        (
            kind.is_dsa,
            "dcp_size",
            dcp,
            f"{model}'s DSA indexer keys are not striped over DCP ranks; use {{dcp_size}} 1",
        ),
    )
    for refused, option, value, why in refusals:
        if refused:
            raise ConfigError(option, value, why)


def check_dcp_plan_buildable(config: CacheConfig, kv_pool_kind: str, host_pools: bool) -> None:
    """``NotImplementedError`` for what a DCP plan holds that kvjax does not build striped:
    host pools (the host tier or the host-pool retraction backup), a pool other than the paged
    K/V or the MLA latent."""
    if not config.dcp_enabled:
        return
    if host_pools:
        raise NotImplementedError(
            f"a host pool (the host tier L1/L2 or the host_pool retraction backup) over a pool striped over "
            f"dcp_size={config.dcp_size} ranks is not built yet; serve with dcp_size=1, or without "
            "enable_hierarchical_cache / disaggregation_decode_retraction_backup='host_pool'"
        )
    if kv_pool_kind not in ("mha", "mla"):
        raise NotImplementedError(
            f"a {kv_pool_kind!r} KV pool striped over dcp_size={config.dcp_size} ranks is not built yet (DCP serves "
            "the paged K/V pool of MHA/GQA/MQA models and the MLA latent pool); serve it with dcp_size=1"
        )
