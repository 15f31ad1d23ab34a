"""Several host pools of the same slots as one page source of the storage tier: their layers stacked.

A stored page (``kvjax.tiers.storage``) is one page of every layer a key names. Where the pages of
one token live in several host pools that share one host slot allocator (one host slot id per
token in each), :class:`StackedHostPages` reads a page as every pool's layers concatenated in the
pools' order and splits a page read back from storage into each pool's own layers, so one stored
entry holds them all and a prefetch never lands one pool's layers without the others'. Two users:

* pipeline stages (``kvjax.serve.pipeline_storage``): stage ``s``'s host pool holds its own layers,
  the pools in stage order, so a page is one page of every layer of the model;
* a speculative draft model's host pool beside the target's (``kvjax.transfers.storage_attach``):
  the target's layers, then the draft's, so a page that comes back from storage brings the
  draft's KV with the target's (as the host tier's load-back does, ``kvjax.transfers.draft_pools``).

:func:`stacked_storage_key` merges the pools' storage keys (each that of its own pool, in the same
order) into the key of such a page: the layer count and layer ids of every pool in order, their
fp8 scales interleaved per scale group; every other field must agree. Units: pages, host slots,
layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.tiers.storage_key import StorageKey

if TYPE_CHECKING:
    from kvjax.tiers.host_pool import HostKVPool

__all__ = ["StackedHostPages", "stacked_storage_key"]


class StackedHostPages:
    """Host pools of the same slots as one page source (``kvjax.radix.host_pages.HostPages``): buffers
    ``[layers of every pool, n, page_size, C, D]``, pool ``i``'s layers after those of the pools
    before it. ``pools``: the host pools, in order (the same slots on each, the same page row;
    ValueError otherwise)."""

    def __init__(self, pools: Sequence[HostKVPool]) -> None:
        if not pools:
            raise ValueError("StackedHostPages: at least one host pool")
        rows = {tuple(p.page_row) for p in pools}
        if len(rows) != 1:
            raise ValueError(f"StackedHostPages: the host pools' pages differ in shape: {sorted(rows)}")
        self.pools = tuple(pools)
        self._bounds = np.cumsum([0, *(p.num_layers for p in pools)])

    @property
    def num_layers(self) -> int:
        return int(self._bounds[-1])

    def read_pages(self, host_slots: Any, dtype: Any = None) -> np.ndarray:
        """The pages of ``host_slots`` of every pool's layers, in pool order."""
        return np.concatenate([p.read_pages(host_slots, dtype) for p in self.pools], axis=0)

    def write_pages(self, host_slots: Any, buffer: np.ndarray) -> None:
        """Write ``buffer`` (``[num_layers, n, page_size, C, D]``) into every pool, each its own
        layers. ValueError (nothing written) for another layer count."""
        if buffer.shape[0] != self.num_layers:
            raise ValueError(f"write_pages: a buffer of {buffer.shape[0]} layers, the pools hold {self.num_layers}")
        for p, start, stop in zip(self.pools, self._bounds[:-1], self._bounds[1:], strict=True):
            p.write_pages(host_slots, buffer[start:stop])


def stacked_storage_key(keys: Sequence[StorageKey]) -> StorageKey:
    """The pools' keys (each of its own pool, in :class:`StackedHostPages` order) merged into the
    key of a page of every pool's layers (module docstring). ValueError when the keys differ in
    anything but their layers and scales."""
    first = keys[0]
    layers = tuple(i for k in keys for i in (k.layers or range(k.page_shape[0])))
    merged = dataclasses.replace(
        first, page_shape=(len(layers), *first.page_shape[1:]), kv_scales=_merged_scales(keys), layers=layers
    )
    for i, k in enumerate(keys[1:], 1):
        same = dataclasses.replace(k, page_shape=merged.page_shape, kv_scales=merged.kv_scales, layers=layers)
        if same != merged:
            raise ValueError(f"pool {i}'s storage key differs from pool 0's beyond its layers: {k} vs {first}")
    return merged


def _merged_scales(keys: Sequence[StorageKey]) -> tuple[float, ...]:
    """The pools' fp8 scales in stacked order: each key lists its scales in groups of one per
    layer (MHA: the K scales, then the V scales; MLA: the latent's), so group ``g`` of every pool
    in order, group after group."""
    if not any(k.kv_scales for k in keys):
        return ()
    groups = {len(k.kv_scales) // k.page_shape[0] for k in keys}
    if len(groups) != 1 or any(len(k.kv_scales) % k.page_shape[0] for k in keys):
        raise ValueError("stacked_storage_key: the keys hold different numbers of scales per layer")
    (n,) = groups
    return tuple(
        s for g in range(n) for k in keys for s in k.kv_scales[g * k.page_shape[0] : (g + 1) * k.page_shape[0]]
    )
