"""`PageCopy`: a numpy copy of whole device pages of every layer, the blocks this process addresses.

The ``cpu_tensor`` retraction backup (``kvjax.serve.retraction_extension``) copies a retracted
request's pages of a device pool to numpy and writes them back into fresh pages when it resumes.
:func:`copy_pages` and :func:`load_pages` are those two copies, O(pages copied), never O(pool):

* **One device**: the page gather kernel packs the pages of every layer into one buffer
  ``[L, n, page_size, ...]`` (padded to a power of two; padding reads the trash page), fetched with
  ``device_get``; the load puts the buffer back and scatters it with the layers donated (in place).
* **Several devices** (a pool laid out over a mesh: KV heads split by TP, rows striped by DCP, or
  replicated): the gather runs on every device over its own shard (``shard_map``, no collective),
  and the copy keeps the buffer's *addressable* shards, one per distinct block (the part of a page
  row a device holds: its heads, its DCP rows; replicated blocks once). The load gives each device
  its block (``make_array_from_callback``) and scatters per shard into the donated layers.

Across processes (``jax.distributed``, a pool whose mesh spans several processes' devices) each
process thus copies and restores only the blocks its own devices hold: nothing is fetched from
another process's devices and no collective runs. Every process takes the same backups of the same
pages (the decisions come from the tree and allocators, identical on every process), so each block
of the pool is kept by the process that holds it, and restored there.

Units: ``pages`` are page ids of the pool (``[1, num_pages)``); a copy's tokens are
``num_pages * page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvjax.transfers.transfer import (
    _bucket,
    _buffer_spec,
    _gather,
    _gather_per_shard,
    _layer_spec,
    _scatter,
    _scatter_per_shard,
)

__all__ = ["PageCopy", "copy_pages", "load_pages"]

#: A block's extent along the page row's axes (``[page_size, ...]``): ``(start, stop)`` per axis.
BlockKey = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PageCopy:
    """``num_pages`` whole pages of every layer of a pool, as numpy.

    Attributes:
        num_pages: pages copied (tokens: ``num_pages * page_size``).
        page_size: tokens per page.
        blocks: by block (its extent along the page row's axes; ``()`` for a pool on one device,
            whose one block is the whole row), the layer-first copy ``[L, num_pages, *block_row]``
            of that block. Only the blocks this process's devices hold.
    """

    num_pages: int
    page_size: int
    blocks: dict[BlockKey, np.ndarray]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def tail(self, tokens: int) -> PageCopy:
        """The copy of its pages from token ``tokens`` (a multiple of the page size) on."""
        if tokens % self.page_size or not 0 <= tokens <= self.num_tokens:
            raise ValueError(f"tail({tokens}): not a page boundary of a copy of {self.num_tokens} tokens")
        skip = tokens // self.page_size
        return PageCopy(self.num_pages - skip, self.page_size, {k: b[:, skip:] for k, b in self.blocks.items()})


def _padded(pages: np.ndarray) -> np.ndarray:
    """``pages`` padded to a power of two with the trash page (reads of it are harmless, writes dropped)."""
    out = np.zeros(_bucket(pages.size), np.int32)
    out[: pages.size] = pages
    return out


def _block_key(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> BlockKey:
    """The extent of a buffer shard ``index`` (of a buffer ``[L, n, *row]`` of ``shape``; ``None``:
    all of it) along the row's axes."""
    if index is None:
        index = (slice(None),) * len(shape)
    return tuple(s.indices(n)[:2] for s, n in zip(index[2:], shape[2:], strict=True))


def _mesh_specs(layers: tuple[jax.Array, ...]) -> tuple[Any, tuple[Any, ...]] | None:
    """The mesh and padded layer specs of a pool over several devices; ``None`` on one device."""
    sharding = layers[0].sharding
    if len(sharding.device_set) == 1:
        return None
    if not isinstance(sharding, NamedSharding):
        raise NotImplementedError(
            f"the cpu_tensor page copy copies pools laid out over a mesh (NamedSharding), not {type(sharding).__name__}"
        )
    return sharding.mesh, tuple(_layer_spec(cast(NamedSharding, x.sharding), x.ndim) for x in layers)


def copy_pages(layers: tuple[jax.Array, ...], pages: np.ndarray) -> PageCopy:
    """The numpy copy of device ``pages`` of every layer (see the module docstring)."""
    pages = np.asarray(pages, np.int32)
    padded = jnp.asarray(_padded(pages))
    page_size = int(layers[0].shape[1])
    laid_out = _mesh_specs(layers)
    if laid_out is None:
        buffer = np.asarray(jax.device_get(_gather(layers, padded)))[:, : pages.size]
        return PageCopy(int(pages.size), page_size, {(): buffer})
    mesh, specs = laid_out
    gathered = _gather_per_shard(mesh, specs, None)(layers, padded)
    blocks: dict[BlockKey, np.ndarray] = {}
    for shard in gathered.addressable_shards:
        key = _block_key(shard.index, gathered.shape)
        if key not in blocks:  # a replicated block is kept once
            blocks[key] = np.asarray(shard.data)[:, : pages.size].copy()
    return PageCopy(int(pages.size), page_size, blocks)


def load_pages(layers: tuple[jax.Array, ...], copy: PageCopy, pages: np.ndarray) -> tuple[jax.Array, ...]:
    """Write ``copy`` into device ``pages`` (as many as it has); ``layers`` are donated (in place).
    Each device is given its own block, which this process copied (see the module docstring)."""
    pages = np.asarray(pages, np.int32)
    if pages.size != copy.num_pages:
        raise ValueError(f"a copy of {copy.num_pages} pages loaded into {pages.size} pages")
    dst = _padded(pages)
    n = dst.size

    def padded(block: np.ndarray) -> np.ndarray:
        out = np.zeros((block.shape[0], n, *block.shape[2:]), layers[0].dtype)
        out[:, : pages.size] = block
        return out

    laid_out = _mesh_specs(layers)
    if laid_out is None:
        return _scatter(layers, jnp.asarray(padded(copy.blocks[()])), jnp.asarray(dst))
    mesh, specs = laid_out
    shape = (len(layers), n, *layers[0].shape[1:])
    sharding = NamedSharding(mesh, _buffer_spec(specs[0]))
    buffer = jax.make_array_from_callback(shape, sharding, lambda index: padded(copy.blocks[_block_key(index, shape)]))
    return cast(tuple[jax.Array, ...], _scatter_per_shard(mesh, specs)(layers, buffer, jnp.asarray(dst)))
