"""The demo's cache settings and the checks of a demo run, without jax.

``python -m kvjax demo`` calls `check_demo` with every flag before it imports jax: a bad setting
or a workload the cache cannot serve is refused at once, not after the cold run.
"""

from __future__ import annotations

from typing import Any

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.pipeline_check import check_pipeline_config
from kvjax.plan import CachePlan, plan_kv_cache
from kvjax.plan.buildable import check_host_tier_buildable
from kvjax.serve.workload import Workload
from kvjax.spec import ModelSpec

DEMO_MODEL = "tiny"
MAX_BATCH = 8
CONTEXT_LENGTH = 1024


def demo_config(
    *,
    page_size: int = 16,
    max_total_tokens: int = 16384,
    disable_radix_cache: bool = False,
    chunked_prefill_size: int = 512,
    eviction_policy: str = "lru",
    context_length: int = CONTEXT_LENGTH,
    enable_hierarchical_cache: bool = False,
    **settings: Any,
) -> CacheConfig:
    """The demo's cache settings; ``settings``: other ``CacheConfig`` fields (the storage tier's
    ``hicache_storage_*``)."""
    return CacheConfig(
        **settings,
        enable_hierarchical_cache=enable_hierarchical_cache,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=2 * MAX_BATCH,
        context_length=context_length,
        disable_radix_cache=disable_radix_cache,
        chunked_prefill_size=chunked_prefill_size,
        radix_eviction_policy=eviction_policy,
    )


def demo_context_length(spec: ModelSpec) -> int:
    """The context the demo plans for: its own ``CONTEXT_LENGTH``, or the model's when shorter."""
    return min(CONTEXT_LENGTH, spec.context_length)


def check_demo(spec: ModelSpec, workload: Workload, **config_kwargs: Any) -> CachePlan:
    """The warm run's plan (``demo_config`` settings), after checking that the workload's longest
    request fits the context and the pool. Raises `ConfigError` naming the option to change."""
    context = demo_context_length(spec)
    longest = workload.longest_request_tokens
    if longest > context:
        shared = workload.system_tokens + workload.question_tokens + workload.output_tokens
        option = "system_tokens" if workload.groups and shared == longest else "turns"
        raise ConfigError(
            option,
            getattr(workload, option),
            f"the workload's longest request takes {longest:,} tokens with its output, more than the demo's "
            f"context of {context:,}; lower {{{option}}} or {{output_tokens}}",
        )
    config_kwargs.setdefault("context_length", context)
    if config_kwargs.get("hicache_storage_backend") is not None:
        # The storage tier's key needs the weights' fingerprint, known only once the model is
        # loaded (after this check); any non-empty value plans the same cache.
        config_kwargs.setdefault("hicache_storage_model_fingerprint", "not-loaded-yet")
    config = demo_config(**config_kwargs)
    if config.pp_size > 1:  # what pipeline stages do not serve, before jax starts
        check_pipeline_config(spec, config)
    plan = plan_kv_cache(spec, config)
    check_host_tier_buildable(plan)
    page = plan.page_size
    need = -(-longest // page) * page
    if plan.max_total_tokens < need:
        raise ConfigError(
            "max_total_tokens",
            config_kwargs.get("max_total_tokens"),
            f"the pool ({plan.max_total_tokens:,} tokens) must hold the workload's longest request, {longest:,} "
            f"tokens with its output; use {{max_total_tokens}} {need} or more",
        )
    return plan
