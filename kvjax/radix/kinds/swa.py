"""The sliding-window kind's host-side state: the SWA allocator (hybrid: each full slot paired
with an SWA slot; pure, every layer sliding: the plain allocator handing out SWA slots) and the
trees over the ``"full"`` and ``"swa"`` components (``SWARadixCache``, ``HiSWARadixCache``, the
chunk caches, ``PureSWARadixCache``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvjax.kinds.names import SWA
from kvjax.plan.kinds.swa import is_pure_swa
from kvjax.radix.hiswa_radix_cache import HiSWARadixCache
from kvjax.radix.kinds.host_kind import HostKind
from kvjax.radix.pure_swa_radix_cache import PureSWARadixCache
from kvjax.radix.swa_chunk_cache import PureSWAChunkCache, SWAChunkCache
from kvjax.radix.swa_radix_cache import SWARadixCache

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.radix.tree_inputs import TreeInputs


def swa_tree(o: TreeOptions, inputs: TreeInputs) -> SWARadixCache | SWAChunkCache:
    """The unified tree over ``"full"`` and ``"swa"``: ``SWARadixCache`` (the SWA allocator);
    radix disabled, ``SWAChunkCache`` (SGLang's disabled tree); with the host tier
    ``HiSWARadixCache``."""
    window = o.sliding_window_size
    allocator: Any = inputs.token_to_kv_pool_allocator  # checked by the tree: an SWA allocator
    if o.attach_host_tier:
        if o.disable_radix_cache:
            raise NotImplementedError(
                "the host tier over a disabled hybrid sliding-window tree (the host_pool retraction backup with "
                "disable_radix_cache) is not built; use decode_retraction_backup='cpu_tensor' for this model"
            )
        return HiSWARadixCache(
            page_size=inputs.page_size,
            sliding_window_size=window,
            allocator=allocator,
            storage=inputs.storage,
            **inputs.host_tier,
            **inputs.common,
        )
    if o.disable_radix_cache:
        return swa_chunk_cache(o, inputs)
    return SWARadixCache(page_size=inputs.page_size, sliding_window_size=window, allocator=allocator, **inputs.common)


def swa_chunk_cache(o: TreeOptions, inputs: TreeInputs) -> SWAChunkCache:
    """``tree_cache_kind="swa_chunk"`` (needs the SWA allocator)."""
    return SWAChunkCache(**inputs.chunk, sliding_window_size=o.sliding_window_size)


def pure_swa_chunk_cache(o: TreeOptions, inputs: TreeInputs) -> PureSWAChunkCache:
    """``tree_cache_kind="pure_swa_chunk"``: every layer sliding, chunked prefill, radix off."""
    return PureSWAChunkCache(**inputs.chunk, sliding_window_size=o.sliding_window_size)


def pure_swa_tree(o: TreeOptions, inputs: TreeInputs) -> PureSWARadixCache:
    """``tree_cache_kind="pure_swa_radix"``: the pure-SWA tree over the SWA pool's plain allocator."""
    if o.attach_host_tier:
        # SGLang 0.5.23 builds its pure-SWA tree without the host tier (and refuses the
        # host_pool retraction backup for it); kvjax says so rather than drop the flag.
        raise NotImplementedError(
            "tree_cache_kind='pure_swa_radix' (every layer sliding) with the host tier: SGLang's pure-SWA "
            "tree has no host tier; turn off enable_hierarchical_cache for this model"
        )
    allocator: Any = inputs.token_to_kv_pool_allocator  # a plain allocator (checked by the tree)
    return PureSWARadixCache(
        page_size=inputs.page_size, sliding_window_size=o.sliding_window_size, allocator=allocator, **inputs.common
    )


def allocator(plan: CachePlan) -> Any:
    """Hybrid: the paired ``SWATokenToKVPoolAllocator``; pure: None (the plain allocator)."""
    if is_pure_swa(plan):
        return None
    from kvjax.alloc import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(
        int(plan.full_tokens_per_layer or 0),
        plan.swa_tokens_per_layer or 0,
        plan.alloc_page_size,
        need_sort=plan.need_sort,
    )


KIND = HostKind(
    name=SWA,
    tree_builders={
        "full+swa": swa_tree,
        "swa_chunk": swa_chunk_cache,
        "pure_swa_chunk": pure_swa_chunk_cache,
        "pure_swa_radix": pure_swa_tree,
    },
    allocator=allocator,
)
