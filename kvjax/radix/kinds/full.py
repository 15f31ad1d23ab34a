"""The full-attention kind's trees: the chunk cache (chunked prefill, radix off) and the unified
tree over ``"full"`` (``RadixCache``, or ``HiRadixCache`` with the host tier). Its allocator and
request table are the plain ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.kinds.names import FULL
from kvjax.radix.chunk_cache import ChunkCache
from kvjax.radix.hiradix_cache import HiRadixCache
from kvjax.radix.kinds.host_kind import HostKind
from kvjax.radix.radix_cache import RadixCache

if TYPE_CHECKING:
    from kvjax.plan.tree_options import TreeOptions
    from kvjax.radix.tree_inputs import TreeInputs


def chunk_cache(o: TreeOptions, inputs: TreeInputs) -> ChunkCache:
    """``tree_cache_kind="chunk"``: chunked prefill with the radix cache off."""
    return ChunkCache(**inputs.chunk)


def radix_tree(o: TreeOptions, inputs: TreeInputs) -> RadixCache:
    """The unified tree over ``"full"``: ``RadixCache`` (disabled: SGLang's disabled tree), or with
    the host tier ``HiRadixCache``."""
    if o.attach_host_tier:
        return HiRadixCache(
            page_size=inputs.page_size,
            token_to_kv_pool_allocator=inputs.token_to_kv_pool_allocator,
            disable=bool(o.disable_radix_cache),
            storage=inputs.storage,
            **inputs.host_tier,
            **inputs.common,
        )
    return RadixCache(
        page_size=inputs.page_size,
        token_to_kv_pool_allocator=inputs.token_to_kv_pool_allocator,
        disable=bool(o.disable_radix_cache),
        **inputs.common,
    )


KIND = HostKind(name=FULL, tree_builders={"chunk": chunk_cache, "full": radix_tree})
