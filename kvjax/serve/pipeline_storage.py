"""The storage tier (L3) over pipeline stages: one stored page holds every stage's layers.

Under pipeline parallelism each stage has a host pool of its own layers, on one host slot
allocator (stage 0's: one host slot id per token on every stage; ``kvjax.serve.pipeline_cache``).
The storage tier linked behind the tree reads and writes a page through :class:`StagedHostPages`:
stage ``s``'s host pool gives its layers of the page, concatenated in stage order (the model's
layer order), so a stored page is one page of every layer of the model, and a prefetched page is
split back into every stage's host pool before the host tier loads it onto every stage's devices.

The page's storage key (:func:`staged_storage_key`) is every stage's key merged: the page shape's
layer count and the layer ids are the whole model's, the fp8 scales every stage's in layer
order. So a store written at ``pp_size`` 2 is read at any other ``pp_size`` (and at 1) of the same
model and TP layout. SGLang 0.5.23 instead stores each stage's layers under a key of its own
(``hicache_storage.py``: the ``_{pp_size}_{pp_rank}`` suffix, or its unified key scheme's layer
ranges); kvjax's one entry per page keeps a page whole (a prefetch never lands one stage's layers
without the others').

``link_staged_storage(pipeline, config, host_pools)`` opens the store and links it behind stage
0's tree, after every stage's host pools are built. Units: pages, host slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.radix.storage_link import StorageLink
from kvjax.tiers.storage import StorageTier
from kvjax.tiers.storage_key import StorageKey
from kvjax.transfers.storage_attach import local_head_blocks, rank_shards, storage_key

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.plan import CachePlan
    from kvjax.pools import CachePools
    from kvjax.tiers.host_pool import HostKVPool

__all__ = ["StagedHostPages", "link_staged_storage", "staged_storage_key"]


class StagedHostPages:
    """Every stage's host pool as one page source (``storage_link.HostPages``): buffers
    ``[layers of every stage, n, page_size, C, D]``, stage ``s``'s layers after those of the
    stages before it. ``pools[s]``: stage ``s``'s host pool (the same slots on each)."""

    def __init__(self, pools: Sequence[HostKVPool]) -> None:
        if not pools:
            raise ValueError("StagedHostPages: one host pool per stage")
        rows = {tuple(p.page_row) for p in pools}
        if len(rows) != 1:
            raise ValueError(f"StagedHostPages: the stages' host pages differ in shape: {sorted(rows)}")
        self.pools = tuple(pools)
        self._bounds = np.cumsum([0, *(p.num_layers for p in pools)])

    @property
    def num_layers(self) -> int:
        return int(self._bounds[-1])

    def read_pages(self, host_slots: Any, dtype: Any = None) -> np.ndarray:
        """The pages of ``host_slots`` of every stage's layers, in stage order."""
        return np.concatenate([p.read_pages(host_slots, dtype) for p in self.pools], axis=0)

    def write_pages(self, host_slots: Any, buffer: np.ndarray) -> None:
        """Write ``buffer`` (``[num_layers, n, page_size, C, D]``) into every stage's host pool,
        each its own layers. ValueError (nothing written) for another layer count."""
        if buffer.shape[0] != self.num_layers:
            raise ValueError(f"write_pages: a buffer of {buffer.shape[0]} layers, the stages hold {self.num_layers}")
        for p, start, stop in zip(self.pools, self._bounds[:-1], self._bounds[1:], strict=True):
            p.write_pages(host_slots, buffer[start:stop])


def staged_storage_key(keys: Sequence[StorageKey]) -> StorageKey:
    """Every stage's key (``storage_key`` of its plan and host pool, in stage order) merged into
    the key of a page of every stage's layers (module docstring). ValueError when the stages'
    keys differ in anything but their layers and scales."""
    first = keys[0]
    layers = tuple(i for k in keys for i in (k.layers or range(k.page_shape[0])))
    merged = dataclasses.replace(
        first, page_shape=(len(layers), *first.page_shape[1:]), kv_scales=_merged_scales(keys), layers=layers
    )
    for s, k in enumerate(keys[1:], 1):
        same = dataclasses.replace(k, page_shape=merged.page_shape, kv_scales=merged.kv_scales, layers=layers)
        if same != merged:
            raise ValueError(f"stage {s}'s storage key differs from stage 0's beyond its layers: {k} vs {first}")
    return merged


def _merged_scales(keys: Sequence[StorageKey]) -> tuple[float, ...]:
    """The stages' fp8 scales in one-stage order: each key lists its scales in groups of one
    per layer (MHA: the K scales, then the V scales; MLA: the latent's), so group ``g`` of every
    stage in stage order, group after group."""
    if not any(k.kv_scales for k in keys):
        return ()
    groups = {len(k.kv_scales) // k.page_shape[0] for k in keys}
    if len(groups) != 1 or any(len(k.kv_scales) % k.page_shape[0] for k in keys):
        raise ValueError("staged_storage_key: the stages' keys hold different numbers of scales per layer")
    (n,) = groups
    return tuple(
        s for g in range(n) for k in keys for s in k.kv_scales[g * k.page_shape[0] : (g + 1) * k.page_shape[0]]
    )


def link_staged_storage(
    tree: Any,
    config: CacheConfig,
    plans: Sequence[CachePlan],
    pools: Sequence[CachePools],
    host_pools: Sequence[HostKVPool],
) -> StorageLink:
    """Open the store ``config.hicache_storage_*`` say under :func:`staged_storage_key` over
    :class:`StagedHostPages` of ``host_pools`` (stage ``s``'s, with ``plans[s]`` and device pools
    ``pools[s]``) and link it behind ``tree``'s host tier (``tree.storage``; its landed host
    copies are stored from then on). ``tree`` must have the host tier and no storage tier yet."""
    if tree.host is None or tree.storage is not None:
        raise ValueError("link_staged_storage: a tree with the host tier and no storage tier")
    key = staged_storage_key(
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
        StagedHostPages(host_pools),
        prefetch_policy=config.hicache_storage_prefetch_policy,
        prefetch_timeout_s=config.hicache_storage_prefetch_timeout_s,
        prefetch_threshold=config.hicache_storage_prefetch_threshold,
    )
    tree.storage = link
    return link
