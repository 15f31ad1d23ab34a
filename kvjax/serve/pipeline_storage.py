"""The storage tier (L3) over pipeline stages: one stored page holds every stage's layers.

Under pipeline parallelism each stage has a host pool of its own layers, on one host slot
allocator (stage 0's: one host slot id per token on every stage; ``kvjax.serve.pipeline_cache``).
The storage tier linked behind the tree reads and writes a page through
:class:`~kvjax.tiers.stacked_pages.StackedHostPages` of the stages' host pools in stage order:
stage ``s``'s host pool gives its layers of the page, concatenated in stage order (the model's
layer order), so a stored page is one page of every layer of the model, and a prefetched page is
split back into every stage's host pool before the host tier loads it onto every stage's devices
(the same seam stacks a draft model's host pool after the target's).

The page's storage key (:func:`~kvjax.tiers.stacked_pages.stacked_storage_key` of the stages'
keys) is every stage's key merged: the page shape's layer count and the layer ids are the whole
model's, the fp8 scales every stage's in layer order. So a store written at ``pp_size`` 2 is read
at any other ``pp_size`` (and at 1) of the same model and TP layout. SGLang 0.5.23 instead stores
each stage's layers under a key of its own (``hicache_storage.py``: the ``_{pp_size}_{pp_rank}``
suffix, or its unified key scheme's layer ranges); kvjax's one entry per page keeps a page whole
(a prefetch never lands one stage's layers without the others').

``link_staged_storage(pipeline, config, host_pools)`` opens the store and links it behind stage
0's tree, after every stage's host pools are built. Units: pages, host slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvjax.radix.storage_link import StorageLink
from kvjax.tiers.stacked_pages import StackedHostPages, stacked_storage_key
from kvjax.tiers.storage import StorageTier
from kvjax.transfers.storage_attach import local_head_blocks, rank_shards, storage_key

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.plan import CachePlan
    from kvjax.pools import CachePools
    from kvjax.tiers.host_pool import HostKVPool

__all__ = ["link_staged_storage"]


def link_staged_storage(
    tree: Any,
    config: CacheConfig,
    plans: Sequence[CachePlan],
    pools: Sequence[CachePools],
    host_pools: Sequence[HostKVPool],
) -> StorageLink:
    """Open the store ``config.hicache_storage_*`` say under the stages' keys merged
    (``stacked_storage_key``) over ``StackedHostPages`` of ``host_pools`` (stage ``s``'s, with
    ``plans[s]`` and device pools ``pools[s]``) and link it behind ``tree``'s host tier
    (``tree.storage``; its landed host copies are stored from then on). ``tree`` must have the
    host tier and no storage tier yet."""
    if tree.host is None or tree.storage is not None:
        raise ValueError("link_staged_storage: a tree with the host tier and no storage tier")
    key = stacked_storage_key(
        [storage_key(plan, host, p, config) for plan, host, p in zip(plans, host_pools, pools, strict=True)]
    )
    location = "memory" if config.hicache_storage_backend == "memory" else str(config.hicache_storage_dir)
    local = local_head_blocks(pools[0], host_pools[0])
    store = StorageTier(
        location, key=key, shards=rank_shards(host_pools[0], config, local), partial_shards=local is not None
    )
    link = StorageLink(
        tree.host,
        store,
        StackedHostPages(host_pools),
        prefetch_policy=config.hicache_storage_prefetch_policy,
        prefetch_timeout_s=config.hicache_storage_prefetch_timeout_s,
        prefetch_threshold=config.hicache_storage_prefetch_threshold,
    )
    tree.storage = link
    return link
