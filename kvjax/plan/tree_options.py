"""`TreeOptions`: the typed record a tree cache is built from (``create_tree_cache``).

The planner makes it (``CachePlan.tree_options``, from its tree, host-tier and model-kind
records; ``kvjax.plan.tree.tree_options``); a simulation or a test writes one directly. Field
names are the plan's. Jax-free, like the rest of ``kvjax.radix``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvjax.plan.records import HostTier, ModelKind, TreeChoice


@dataclass(frozen=True)
class TreeOptions:
    """Which tree, with which components, configured how.

    Attributes:
        tree_cache_kind: ``chunk``, ``swa_chunk``, ``pure_swa_chunk``, ``pure_swa_radix`` or
            ``unified`` (``registry.tree_cache_kinds()``: the kinds' own trees and the unified one).
        tree_components: the unified tree's components, FULL first: ``("full",)``,
            ``("full", "swa")``, ``("full", "mamba")``; ``("swa",)`` for pure sliding-window kinds.
        tree_page_size: tokens per page of the tree's edges (>= 1).
        radix_eviction_policy: FULL's eviction policy name (``eviction.EVICTION_POLICIES``).
        disable_radix_cache: the radix cache is off (SGLang's disabled tree, or a chunk cache).
        is_eagle: bigram keys (EAGLE speculative decoding).
        enable_kv_cache_events, enable_metrics: as for ``RadixCache``.
        sliding_window_size: the window ``W`` in tokens of the sliding-window kinds (else None).
        enable_mamba_extra_buffer, mamba_max_states_per_path: the Mamba component's options.
        attach_host_tier: a host tier (HiCache L2) behind the unified tree.
        host_pool_tokens: the host pool's size in tokens when no host allocator is given.
        hicache_write_policy: the host tier's write policy.
    """

    tree_cache_kind: str = "unified"
    tree_components: tuple[str, ...] = ("full",)
    tree_page_size: int = 1
    radix_eviction_policy: str = "lru"
    disable_radix_cache: bool = False
    is_eagle: bool = False
    enable_kv_cache_events: bool = False
    enable_metrics: bool = False
    sliding_window_size: int | None = None
    enable_mamba_extra_buffer: bool = False
    mamba_max_states_per_path: int = -1
    attach_host_tier: bool = False
    host_pool_tokens: int = 0
    hicache_write_policy: str = "write_through"


def tree_options(kind: ModelKind, tree: TreeChoice, host: HostTier) -> TreeOptions:
    """The typed record ``kvjax.radix.create_tree_cache`` builds the tree from: the tree choice,
    the model's sliding window, and the host tier's attachment, size and write policy."""
    return TreeOptions(
        tree_cache_kind=tree.tree_cache_kind,
        tree_components=tree.tree_components,
        tree_page_size=tree.tree_page_size,
        radix_eviction_policy=tree.radix_eviction_policy,
        disable_radix_cache=tree.disable_radix_cache,
        is_eagle=tree.is_eagle,
        enable_kv_cache_events=tree.enable_kv_cache_events,
        enable_metrics=tree.enable_metrics,
        sliding_window_size=kind.sliding_window_size,
        enable_mamba_extra_buffer=tree.enable_mamba_extra_buffer,
        mamba_max_states_per_path=tree.mamba_max_states_per_path,
        attach_host_tier=host.attach_host_tier,
        host_pool_tokens=host.host_pool_tokens,
        hicache_write_policy=host.hicache_write_policy,
    )
