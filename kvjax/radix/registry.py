"""`create_tree_cache`: the prefix cache a plan asks for.

Mirrors SGLang's newest default chain (everything is one tree with components), restricted to
what is built. Kinds that need a component not built
yet raise ``NotImplementedError`` naming it, never a silent fallback.

=====================  ==========================================================
plan                   tree
=====================  ==========================================================
``chunk``              :class:`ChunkCache`
``unified``, full only :class:`RadixCache` (``disable=True`` when the radix cache is
                       disabled: SGLang builds a disabled tree that behaves like a
                       chunk cache when chunked prefill is off)
``unified`` + swa      :class:`SWARadixCache` (radix disabled: :class:`SWAChunkCache`, which
                       behaves as SGLang's disabled tree); with a host tier
                       :class:`HiSWARadixCache`; with a Mamba component too:
                       NotImplementedError
``unified`` + mamba    :class:`MambaRadixCache` (state slots from the request table's
                       ``mamba_allocator``; extra buffer and per-path cap from the plan)
host tier attached     :class:`HiRadixCache` (full only; the host allocator and copy
                       engine come from the build, else a simulated one); with a Mamba
                       component: NotImplementedError
``swa_chunk``          :class:`SWAChunkCache` (needs the SWA allocator)
``pure_swa_chunk``     :class:`PureSWAChunkCache`
``pure_swa_radix``     :class:`PureSWARadixCache` (the SWA pool's plain allocator); with a
                       host tier: NotImplementedError
=====================  ==========================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvjax.errors import ConfigError
from kvjax.radix.chunk_cache import ChunkCache
from kvjax.radix.events import EventSink
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.hiswa_radix_cache import HiSWARadixCache
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.radix.pure_swa_radix_cache import PureSWARadixCache
from kvjax.radix.radix_cache import RadixCache
from kvjax.radix.swa_chunk_cache import PureSWAChunkCache, SWAChunkCache
from kvjax.radix.swa_radix_cache import SWARadixCache

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.tiers import CopyEngine, HostSlotAllocator

TREE_CACHE_KINDS = ("chunk", "swa_chunk", "pure_swa_chunk", "pure_swa_radix", "unified")

_MISSING = {
    "swa": "SWA + Mamba tree (both components in one tree)",
    "mamba": "SWA + Mamba tree (both components in one tree)",
}


class TreeCachePlan(Protocol):
    """The attributes of a cache plan (``kvjax.plan.CachePlan``) that pick and configure a tree;
    any object with them works (the plan types are not imported here: ``kvjax.radix`` stays
    free of jax)."""

    @property
    def tree_cache_kind(self) -> str: ...

    @property
    def tree_components(self) -> tuple[str, ...]: ...

    @property
    def disable_radix_cache(self) -> bool: ...

    @property
    def attach_host_tier(self) -> bool: ...

    @property
    def tree_page_size(self) -> int: ...

    @property
    def radix_eviction_policy(self) -> str: ...

    @property
    def is_eagle(self) -> bool: ...

    @property
    def enable_kv_cache_events(self) -> bool: ...

    @property
    def enable_metrics(self) -> bool: ...


def create_tree_cache(
    plan: TreeCachePlan,
    *,
    req_to_token_pool: ReqToTokenPoolProtocol | None = None,
    token_to_kv_pool_allocator: AllocatorProtocol | None = None,
    event_sink: EventSink | None = None,
    host_allocator: HostSlotAllocator | None = None,
    copy_engine: CopyEngine | None = None,
) -> ChunkCache | RadixCache | MambaRadixCache:
    """Build the prefix cache described by ``plan`` (a ``CachePlan`` or anything with its
    attributes: ``tree_cache_kind``, ``tree_components``, ``disable_radix_cache``,
    ``attach_host_tier``, ``tree_page_size``, ``radix_eviction_policy``, ``is_eagle``,
    ``enable_kv_cache_events``, ``enable_metrics``; with a host tier also ``host_pool_tokens``
    and ``hicache_write_policy``, read when present). ``host_allocator`` / ``copy_engine``: the
    host pool's slot allocator and the transfers (defaults: sized from the plan, simulated).

    Raises:
        ConfigError: an unknown ``tree_cache_kind`` or eviction policy.
        NotImplementedError: a kind or component that is not built yet (named).
    """
    kind = plan.tree_cache_kind
    page_size = int(plan.tree_page_size or 1)
    if kind not in TREE_CACHE_KINDS:
        raise ConfigError("tree_cache_kind", kind, f"use one of {', '.join(TREE_CACHE_KINDS)}")
    if kind == "chunk":
        return ChunkCache(
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            page_size=page_size,
        )
    if kind in ("swa_chunk", "pure_swa_chunk"):
        cls = SWAChunkCache if kind == "swa_chunk" else PureSWAChunkCache
        return cls(
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            page_size=page_size,
            sliding_window_size=getattr(plan, "sliding_window_size", None),
        )
    if kind == "pure_swa_radix":
        if plan.attach_host_tier:
            # SGLang 0.5.23 builds its pure-SWA tree without the host tier (and refuses the
            # host_pool retraction backup for it); kvjax says so rather than drop the flag.
            raise NotImplementedError(
                "tree_cache_kind='pure_swa_radix' (every layer sliding) with the host tier: SGLang's pure-SWA "
                "tree has no host tier; turn off enable_hierarchical_cache for this model"
            )
        return PureSWARadixCache(
            page_size=page_size,
            sliding_window_size=getattr(plan, "sliding_window_size", None),
            eviction_policy=plan.radix_eviction_policy or "lru",
            req_to_token_pool=req_to_token_pool,
            allocator=token_to_kv_pool_allocator,  # type: ignore[arg-type]  # a plain allocator (see _check_allocator)
            is_eagle=bool(plan.is_eagle),
            enable_kv_cache_events=bool(plan.enable_kv_cache_events),
            event_sink=event_sink,
            enable_metrics=bool(plan.enable_metrics),
        )
    components = tuple(plan.tree_components or ("full",))
    if "mamba" in components and plan.attach_host_tier:
        raise NotImplementedError(
            f"tree_components={components!r} with the host tier needs a host copy of recurrent-state "
            "checkpoints, which is not built yet; turn off enable_hierarchical_cache for this model"
        )
    if components == ("full", "mamba"):
        return MambaRadixCache(
            page_size=page_size,
            eviction_policy=plan.radix_eviction_policy or "lru",
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            enable_mamba_extra_buffer=bool(getattr(plan, "enable_mamba_extra_buffer", False)),
            mamba_max_states_per_path=int(getattr(plan, "mamba_max_states_per_path", -1)),
            disable=bool(plan.disable_radix_cache),
            enable_kv_cache_events=bool(plan.enable_kv_cache_events),
            event_sink=event_sink,
            enable_metrics=bool(plan.enable_metrics),
        )
    if components == ("full", "swa"):
        window = getattr(plan, "sliding_window_size", None)
        if plan.attach_host_tier:
            if plan.disable_radix_cache:
                raise NotImplementedError(
                    "the host tier over a disabled hybrid sliding-window tree (the host_pool retraction backup with "
                    "disable_radix_cache) is not built; use decode_retraction_backup='cpu_tensor' for this model"
                )
            return HiSWARadixCache(
                page_size=page_size,
                sliding_window_size=window,
                eviction_policy=plan.radix_eviction_policy or "lru",
                host_allocator=host_allocator,
                host_pool_tokens=int(getattr(plan, "host_pool_tokens", 0)) or None,
                copy_engine=copy_engine,
                write_policy=getattr(plan, "hicache_write_policy", "write_through"),
                req_to_token_pool=req_to_token_pool,
                allocator=token_to_kv_pool_allocator,  # type: ignore[arg-type]
                is_eagle=bool(plan.is_eagle),
                enable_kv_cache_events=bool(plan.enable_kv_cache_events),
                event_sink=event_sink,
                enable_metrics=bool(plan.enable_metrics),
            )
        if plan.disable_radix_cache:
            return SWAChunkCache(
                req_to_token_pool=req_to_token_pool,
                token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                page_size=page_size,
                sliding_window_size=window,
            )
        return SWARadixCache(
            page_size=page_size,
            sliding_window_size=window,
            eviction_policy=plan.radix_eviction_policy or "lru",
            req_to_token_pool=req_to_token_pool,
            allocator=token_to_kv_pool_allocator,  # type: ignore[arg-type]
            is_eagle=bool(plan.is_eagle),
            enable_kv_cache_events=bool(plan.enable_kv_cache_events),
            event_sink=event_sink,
            enable_metrics=bool(plan.enable_metrics),
        )
    for comp in components:
        if comp == "full" or (comp == "mamba" and "swa" not in components):
            continue
        what = _MISSING.get(comp)
        if what is None:
            raise ConfigError("tree_components", components, "components are 'full', 'swa' and 'mamba'")
        raise NotImplementedError(f"tree_components={components!r} needs the {what}, which is not built yet")
    if plan.attach_host_tier:
        return HiRadixCache(
            page_size=page_size,
            eviction_policy=plan.radix_eviction_policy or "lru",
            host_allocator=host_allocator,
            host_pool_tokens=int(getattr(plan, "host_pool_tokens", 0)) or None,
            copy_engine=copy_engine,
            write_policy=getattr(plan, "hicache_write_policy", "write_through"),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            disable=bool(plan.disable_radix_cache),
            is_eagle=bool(plan.is_eagle),
            enable_kv_cache_events=bool(plan.enable_kv_cache_events),
            event_sink=event_sink,
            enable_metrics=bool(plan.enable_metrics),
        )
    return RadixCache(
        page_size=page_size,
        eviction_policy=plan.radix_eviction_policy or "lru",
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        disable=bool(plan.disable_radix_cache),
        is_eagle=bool(plan.is_eagle),
        enable_kv_cache_events=bool(plan.enable_kv_cache_events),
        event_sink=event_sink,
        enable_metrics=bool(plan.enable_metrics),
    )
