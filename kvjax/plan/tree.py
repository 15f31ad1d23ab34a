"""Steps 3-7 of the planner past sizing: the retraction backup, radix on/off, the tree cache and
the host tier (pure). The decision table is in the ``kvjax.plan`` docstring."""

from __future__ import annotations

import logging

from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.plan.draft import DRAFT_MODEL_ALGORITHMS
from kvjax.plan.host_sizing import host_pool_tokens, kv_host_share
from kvjax.plan.kinds.planner_kind import PlannerKind
from kvjax.plan.kinds.planning import kinds_named
from kvjax.plan.records import HostTier, ModelKind, Sizes, TreeChoice
from kvjax.spec import ModelSpec

logger = logging.getLogger("kvjax.plan")

UNIFIED, CHUNK, FULL = "unified", "chunk", "full"  # the default trees and the component every tree has

HICACHE_RATIO_WITH_HOST_POOL = 1.0
HICACHE_RATIO_DEFAULT = 2.0
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")
MULTIMODAL_TRANSFORMERS_WARNING = (
    "Radix cache is disabled for multimodal models with the Transformers backend "
    "to avoid multimodal prefix-cache mismatches."
)


DECODE_RADIX_OFF_WARNING = (
    "Radix cache is disabled for decode server (as in SGLang); "
    "--disaggregation-decode-enable-radix-cache turns on decode-side prefix reuse"
)


def decide_retraction_backup(config: CacheConfig, kind: ModelKind, sizes: Sizes) -> tuple[str, float]:
    """SGLang's ``resolve_decode_retraction_backup`` and the ``hicache_ratio`` default: ``host_pool``
    only where every kind the model needs supports it (``PlannerKind.supports_host_pool_backup``)."""
    supports_host_pool = all(
        k.supports_host_pool_backup(sizes) for k in kinds_named(kind.cache_kinds) if k.supports_host_pool_backup
    )
    backup = config.disaggregation_decode_retraction_backup
    if backup is None:
        backup = (
            "host_pool"
            if config.disaggregation_mode == "decode"
            and not config.dcp_enabled
            and not config.disaggregation_decode_enable_radix_cache
            and not config.disaggregation_decode_enable_offload_kvcache
            and not config.priority_preemption
            and supports_host_pool
            else "cpu_tensor"
        )
    ratio = config.hicache_ratio
    if ratio is None:
        ratio = HICACHE_RATIO_WITH_HOST_POOL if backup == "host_pool" else HICACHE_RATIO_DEFAULT
    return backup, ratio


def _tree_cache_kind(
    kinds: tuple[PlannerKind, ...],
    sizes: Sizes,
    disable_radix_cache: bool,
    backup: str,
    chunked_prefill_size: int | None,
) -> tuple[str, tuple[str, ...]]:
    """The decision table of the ``kvjax.plan`` docstring: the tree and its components. A kind's
    own tree (``PlannerKind.own_tree``) replaces the chunk cache or the unified tree."""
    unified = (UNIFIED, tuple(dict.fromkeys(c for k in kinds for c in k.tree_components)))
    if disable_radix_cache and backup == "host_pool":
        return unified
    chunked = chunked_prefill_size is not None and disable_radix_cache
    for cache_kind in kinds:
        own = cache_kind.own_tree(sizes, chunked) if cache_kind.own_tree is not None else None
        if own is not None:
            return own.tree_cache_kind, own.components
    return (CHUNK, (FULL,)) if chunked else unified


def decide_tree(spec: ModelSpec, config: CacheConfig, kind: ModelKind, sizes: Sizes, backup: str) -> TreeChoice:
    """Radix cache on or off, the decode-side radix checks, the tree kind, its components and page."""
    warnings: list[str] = []
    mm_on_transformers = spec.is_multimodal and config.model_impl == "transformers"
    # SGLang 0.5.23 (``pd_disaggregation_hook``): a decode server's radix cache is off unless
    # --disaggregation-decode-enable-radix-cache turns it on.
    decode_without_radix = (
        config.disaggregation_mode == "decode" and not config.disaggregation_decode_enable_radix_cache
    )
    disable_radix_cache = config.disable_radix_cache or mm_on_transformers or decode_without_radix
    if mm_on_transformers and not config.disable_radix_cache:
        logger.warning(MULTIMODAL_TRANSFORMERS_WARNING)
        warnings.append(MULTIMODAL_TRANSFORMERS_WARNING)
    if decode_without_radix and not config.disable_radix_cache:
        warnings.append(DECODE_RADIX_OFF_WARNING)
    chunked_prefill_size = None if mm_on_transformers else config.chunked_prefill_size

    kinds = kinds_named(kind.cache_kinds)
    if config.disaggregation_decode_enable_radix_cache and config.disaggregation_mode == "decode":
        refusal = next((k.decode_radix_refusal for k in kinds if k.decode_radix_refusal), None)
        if refusal is not None:
            raise ConfigError("disaggregation_decode_enable_radix_cache", True, refusal)

    tree_kind, components = _tree_cache_kind(kinds, sizes, disable_radix_cache, backup, chunked_prefill_size)
    if backup == "host_pool":
        if tree_kind != UNIFIED:
            raise ConfigError(
                "disaggregation_decode_retraction_backup",
                backup,
                "--disaggregation-decode-retraction-backup=host_pool requires UnifiedRadixCache with HiCache "
                f"attached, and this configuration selects a {tree_kind!r} tree; use 'cpu_tensor'",
            )
        refusal = next((k.host_pool_backup_refusal for k in kinds if k.host_pool_backup_refusal), None)
        if refusal is not None:
            raise ConfigError("disaggregation_decode_retraction_backup", backup, refusal)
    if config.enable_session_radix_cache and tree_kind != UNIFIED:
        raise ConfigError(
            "enable_session_radix_cache",
            True,
            f"session radix cache needs the unified radix tree, and this configuration selects {tree_kind!r}; "
            "turn it off or enable the radix cache",
        )
    if config.enable_hierarchical_cache and not _attaches_host_tier(config, tree_kind, backup):
        warnings.append(f"enable_hierarchical_cache is ignored: a {tree_kind!r} tree has no host tier")
    return TreeChoice(
        disable_radix_cache=disable_radix_cache,
        chunked_prefill_size=chunked_prefill_size,
        tree_cache_kind=tree_kind,
        tree_components=components,
        tree_page_size=sizes.alloc_page_size if config.dcp_enabled else config.page_size,
        radix_eviction_policy=config.radix_eviction_policy,
        is_eagle=config.speculative_algorithm in EAGLE_ALGORITHMS,
        enable_kv_cache_events=config.enable_kv_cache_events,
        enable_metrics=config.enable_metrics,
        enable_session_radix_cache=config.enable_session_radix_cache,
        warnings=tuple(warnings),
        enable_mamba_extra_buffer=config.enable_mamba_extra_buffer,
        mamba_max_states_per_path=config.mamba_max_states_per_path,
    )


def _attaches_host_tier(config: CacheConfig, tree_kind: str, backup: str) -> bool:
    return tree_kind == UNIFIED and (config.enable_hierarchical_cache or backup == "host_pool")


def decide_host_tier(
    config: CacheConfig, sizes: Sizes, tree: TreeChoice, backup: str, hicache_ratio: float
) -> HostTier:
    """The host tier (attached to a unified tree under HiCache or host-pool retraction) and its
    size, draft host pools and the multimodal embedding cache."""
    attach = _attaches_host_tier(config, tree.tree_cache_kind, backup)
    has_draft_model = config.speculative_algorithm in DRAFT_MODEL_ALGORITHMS
    host_tokens = 0
    if attach:
        ps = sizes.alloc_page_size
        # A split pool pair is backed by the host per full-layer token (SGLang sizes by the full pool).
        device_tokens = sizes.max_total_tokens if sizes.full_tokens_per_layer is None else sizes.full_tokens_per_layer
        host_tokens = host_pool_tokens(
            device_tokens or 0,
            ps,
            hicache_ratio=hicache_ratio,
            hicache_size_gb=config.hicache_size * kv_host_share(sizes),
            bytes_per_token=sizes.host_bytes_per_token or sizes.bytes_per_token,  # every stage's slots alike
        )
    return HostTier(
        decode_retraction_backup=backup,
        hicache_ratio=hicache_ratio,
        attach_host_tier=attach,
        host_pool_tokens=host_tokens,
        draft_host_pools=has_draft_model and (config.enable_hierarchical_cache or backup == "host_pool"),
        mm_embedding_cache_bytes=config.vlm_cache_size_mb * 1024 * 1024,
        hicache_write_policy=config.hicache_write_policy,
        hicache_mem_layout=config.hicache_mem_layout,
        hicache_size_gb=float(config.hicache_size or 0),
        decode_retraction_active=config.disaggregation_mode == "decode"
        or config.disaggregation_decode_retraction_backup is not None,
    )
