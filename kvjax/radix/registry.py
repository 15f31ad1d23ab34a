"""`create_tree_cache`: the prefix cache a plan asks for.

Mirrors SGLang's newest default chain (everything is one tree with components), restricted to
what is built: the plan's typed :class:`TreeOptions` pick the components, and everything the
tree holds (allocators, the host tier's transfer engine, the storage tier) is passed to its
constructor. Kinds that need a component not built yet raise ``NotImplementedError`` naming it,
never a silent fallback.

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
host tier attached     :class:`HiRadixCache` (full only; the host allocator, transfer
                       engine and storage tier come from the build, else a host
                       allocator of ``host_pool_tokens`` and a simulated engine); with a Mamba
                       component: NotImplementedError
``swa_chunk``          :class:`SWAChunkCache` (needs the SWA allocator)
``pure_swa_chunk``     :class:`PureSWAChunkCache`
``pure_swa_radix``     :class:`PureSWARadixCache` (the SWA pool's plain allocator); with a
                       host tier: NotImplementedError
=====================  ==========================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvjax.errors import ConfigError
from kvjax.radix.chunk_cache import ChunkCache
from kvjax.radix.events import EventSink
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.hiswa_radix_cache import HiSWARadixCache
from kvjax.radix.mamba_radix_cache import MambaRadixCache
from kvjax.radix.pure_swa_radix_cache import PureSWARadixCache
from kvjax.radix.radix_cache import RadixCache
from kvjax.radix.storage_link import StorageOptions
from kvjax.radix.swa_chunk_cache import PureSWAChunkCache, SWAChunkCache
from kvjax.radix.swa_radix_cache import SWARadixCache
from kvjax.radix.tree_options import TreeOptions

if TYPE_CHECKING:
    from kvjax.protocols import AllocatorProtocol, ReqToTokenPoolProtocol
    from kvjax.tiers import CopyEngine, HostSlotAllocator

TREE_CACHE_KINDS = ("chunk", "swa_chunk", "pure_swa_chunk", "pure_swa_radix", "unified")

_MISSING = {
    "swa": "SWA + Mamba tree (both components in one tree)",
    "mamba": "SWA + Mamba tree (both components in one tree)",
}


class HasTreeOptions(Protocol):
    """A cache plan (``kvjax.plan.CachePlan``): anything that carries its :class:`TreeOptions`
    (the plan types are not imported here: ``kvjax.radix`` stays free of jax)."""

    @property
    def tree_options(self) -> TreeOptions: ...


def create_tree_cache(
    plan: TreeOptions | HasTreeOptions,
    *,
    req_to_token_pool: ReqToTokenPoolProtocol | None = None,
    token_to_kv_pool_allocator: AllocatorProtocol | None = None,
    event_sink: EventSink | None = None,
    host_allocator: HostSlotAllocator | None = None,
    host_engine: CopyEngine | None = None,
    storage: StorageOptions | None = None,
) -> ChunkCache | RadixCache | MambaRadixCache:
    """Build the prefix cache described by ``plan`` (its :class:`TreeOptions`, or a plan whose
    ``tree_options`` they are), with everything it holds given now: ``host_allocator`` (the host
    pool's slot allocator; default: one of ``host_pool_tokens``), ``host_engine`` (the host tier's
    transfers; default: simulated) and ``storage`` (the storage tier behind the host tier; None:
    none). The last three need a plan with the host tier (``attach_host_tier``).

    Raises:
        TypeError: ``plan`` is neither a ``TreeOptions`` nor carries one.
        ConfigError: an unknown ``tree_cache_kind``, component or eviction policy; a host
            allocator, engine or storage tier for a plan without the host tier.
        NotImplementedError: a kind or component that is not built yet (named).
    """
    options = plan if isinstance(plan, TreeOptions) else getattr(plan, "tree_options", None)
    if not isinstance(options, TreeOptions):
        raise TypeError(
            f"create_tree_cache: expected TreeOptions or a plan with .tree_options, got {type(plan).__name__}"
        )
    return _create(
        options,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        event_sink=event_sink,
        host_allocator=host_allocator,
        host_engine=host_engine,
        storage=storage,
    )


def _create(
    o: TreeOptions,
    *,
    req_to_token_pool: ReqToTokenPoolProtocol | None,
    token_to_kv_pool_allocator: AllocatorProtocol | None,
    event_sink: EventSink | None,
    host_allocator: HostSlotAllocator | None,
    host_engine: CopyEngine | None,
    storage: StorageOptions | None,
) -> ChunkCache | RadixCache | MambaRadixCache:
    kind = o.tree_cache_kind
    page_size = int(o.tree_page_size or 1)
    if kind not in TREE_CACHE_KINDS:
        raise ConfigError("tree_cache_kind", kind, f"use one of {', '.join(TREE_CACHE_KINDS)}")
    if not o.attach_host_tier:
        for name, given in (("host_allocator", host_allocator), ("host_engine", host_engine), ("storage", storage)):
            if given is not None:
                raise ConfigError(name, type(given).__name__, "the plan has no host tier (attach_host_tier); drop it")
    # The presets' shared keyword arguments, and the host tier's.
    common: dict[str, Any] = dict(
        eviction_policy=o.radix_eviction_policy or "lru",
        req_to_token_pool=req_to_token_pool,
        is_eagle=bool(o.is_eagle),
        enable_kv_cache_events=bool(o.enable_kv_cache_events),
        event_sink=event_sink,
        enable_metrics=bool(o.enable_metrics),
    )
    host_tier: dict[str, Any] = dict(
        host_allocator=host_allocator,
        host_pool_tokens=int(o.host_pool_tokens) or None,
        copy_engine=host_engine,
        write_policy=o.hicache_write_policy,
    )
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
            sliding_window_size=o.sliding_window_size,
        )
    if kind == "pure_swa_radix":
        if o.attach_host_tier:
            # SGLang 0.5.23 builds its pure-SWA tree without the host tier (and refuses the
            # host_pool retraction backup for it); kvjax says so rather than drop the flag.
            raise NotImplementedError(
                "tree_cache_kind='pure_swa_radix' (every layer sliding) with the host tier: SGLang's pure-SWA "
                "tree has no host tier; turn off enable_hierarchical_cache for this model"
            )
        return PureSWARadixCache(
            page_size=page_size,
            sliding_window_size=o.sliding_window_size,
            allocator=token_to_kv_pool_allocator,  # type: ignore[arg-type]  # a plain allocator (see _check_allocator)
            **common,
        )
    components = tuple(o.tree_components or ("full",))
    if "mamba" in components and o.attach_host_tier:
        raise NotImplementedError(
            f"tree_components={components!r} with the host tier needs a host copy of recurrent-state "
            "checkpoints, which is not built yet; turn off enable_hierarchical_cache for this model"
        )
    if components == ("full", "mamba"):
        return MambaRadixCache(
            page_size=page_size,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            enable_mamba_extra_buffer=bool(o.enable_mamba_extra_buffer),
            mamba_max_states_per_path=int(o.mamba_max_states_per_path),
            disable=bool(o.disable_radix_cache),
            **{k: v for k, v in common.items() if k != "is_eagle"},  # as before: the Mamba tree takes no bigram keys
        )
    if components == ("full", "swa"):
        window = o.sliding_window_size
        if o.attach_host_tier:
            if o.disable_radix_cache:
                raise NotImplementedError(
                    "the host tier over a disabled hybrid sliding-window tree (the host_pool retraction backup with "
                    "disable_radix_cache) is not built; use decode_retraction_backup='cpu_tensor' for this model"
                )
            return HiSWARadixCache(
                page_size=page_size,
                sliding_window_size=window,
                allocator=token_to_kv_pool_allocator,  # type: ignore[arg-type]  # checked: an SWA allocator
                storage=storage,
                **host_tier,
                **common,
            )
        if o.disable_radix_cache:
            return SWAChunkCache(
                req_to_token_pool=req_to_token_pool,
                token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                page_size=page_size,
                sliding_window_size=window,
            )
        return SWARadixCache(
            page_size=page_size,
            sliding_window_size=window,
            allocator=token_to_kv_pool_allocator,  # type: ignore[arg-type]  # checked: an SWA allocator
            **common,
        )
    for comp in components:
        if comp == "full" or (comp == "mamba" and "swa" not in components):
            continue
        what = _MISSING.get(comp)
        if what is None:
            raise ConfigError("tree_components", components, "components are 'full', 'swa' and 'mamba'")
        raise NotImplementedError(f"tree_components={components!r} needs the {what}, which is not built yet")
    if o.attach_host_tier:
        return HiRadixCache(
            page_size=page_size,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            disable=bool(o.disable_radix_cache),
            storage=storage,
            **host_tier,
            **common,
        )
    return RadixCache(
        page_size=page_size,
        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        disable=bool(o.disable_radix_cache),
        **common,
    )
