"""`HostKVPool`: the host copy of a paged device pool (SGLang's ``MHATokenToKVPoolHost``).

It holds, in host (numpy) memory, the pages of every layer of one device pool, in a
:class:`HostLayout`, with a :class:`HostSlotAllocator` over its slots. It does not know the device
pool's kind: any device pool whose layers are ``[pages + 1, page_size, C, D]`` arrays of one
shape (the page gather/scatter kernels' contract, see ``kvjax.transfers.device_pages``) gets a host
pool from its page row and layer count. MHA is registered today; SWA and MLA pools need one
entry each in ``device_pages``.

Why numpy storage. A jax array cannot be written in place page by page from the host, so the host
pool's *storage* is numpy; it is allocated on a 64-byte boundary (:data:`HOST_ALIGNMENT`) so
that on the CPU backend the transfer engine's direct path can put host pages on the device
without a copy. How pages move (staged through ``pinned_host`` or numpy, or directly) is the
transfer engine's choice, measured by ``benchmarks/host_tier.py`` (``kvjax.transfers.transfer``,
figures in ``docs/architecture.md``).

Bytes are kept as unsigned integers of the device dtype's width (bf16 as uint16, fp8 as
uint8): moved, never converted. Units: slots are tokens; ``bytes_per_token`` counts every layer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvjax.errors import InvalidSlotError
from kvjax.tiers.host_allocator import HostSlotAllocator
from kvjax.tiers.host_layout import HostLayout

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

#: Byte alignment of host buffers: the CPU backend puts a numpy array on its device without a
#: copy (``jax.device_put(..., may_alias=True)``) only when it is aligned to this.
HOST_ALIGNMENT = 64


def _aligned(shape: tuple[int, ...], dtype: Any, alloc: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = alloc(nbytes + HOST_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array whose data starts on a :data:`HOST_ALIGNMENT` boundary."""
    return _aligned(shape, dtype, np.zeros)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on a :data:`HOST_ALIGNMENT` boundary."""
    return _aligned(shape, dtype, np.empty)


class HostKVPool:
    """Host pages of one device pool kind (see module docstring).

    Args:
        size: host token slots, a multiple of ``page_row[0]`` (the page size); every slot is
            usable (no reserved page).
        num_layers: layers of the device pool.
        page_row: ``(page_size, C, D)``: one page of one layer.
        itemsize: bytes per element of the device pool's storage dtype.
        layout: ``"layer_first"`` or ``"page_first"``.
        kv_head_replicas: for the host pool of a device pool sharded over tensor-parallel ranks,
            how many ranks hold a copy of each KV head (> 1 when the TP size exceeds the model's
            KV heads); the page row keeps each head once (``kvjax.tiers.head_shards``).
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        page_row: tuple[int, ...],
        itemsize: int,
        layout: str,
        *,
        kv_head_replicas: int = 1,
    ) -> None:
        if itemsize not in _BITS:
            raise ValueError(f"itemsize={itemsize}: host pools store 1, 2, 4 or 8-byte elements")
        if num_layers < 1 or len(page_row) < 1 or min(page_row) < 1:
            raise ValueError(f"num_layers={num_layers}, page_row={page_row}: need >= 1 layer and a non-empty row")
        if kv_head_replicas < 1:
            raise ValueError(f"kv_head_replicas={kv_head_replicas}: need >= 1")
        self.kv_head_replicas = int(kv_head_replicas)
        self.page_size = int(page_row[0])
        self.allocator = HostSlotAllocator(size, self.page_size)
        self.size = self.allocator.size
        self.num_pages = self.allocator.num_pages
        self.num_layers = int(num_layers)
        self.page_row = tuple(int(x) for x in page_row)
        self.layout = HostLayout(layout)
        self.store_dtype = np.dtype(_BITS[itemsize])
        self.storage = aligned_zeros(
            self.layout.shape(self.num_layers, self.num_pages, self.page_row), self.store_dtype
        )

    @classmethod
    def for_device_layers(cls, layers: Any, size: int, layout: str = "layer_first") -> HostKVPool:
        """A host pool for per-layer device arrays ``[pages + 1, page_size, C, D]`` (any objects
        with ``shape`` and ``dtype``)."""
        first = layers[0]
        return cls(size, len(layers), tuple(first.shape[1:]), np.dtype(first.dtype).itemsize, layout)

    # --- facts ----------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Host bytes of one token over every layer."""
        return self.num_layers * math.prod(self.page_row[1:]) * self.store_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return int(self.storage.nbytes)

    def buffer_shape(self, num_pages: int) -> tuple[int, ...]:
        """The layer-first transfer buffer of ``num_pages`` pages (as the gather kernel packs it)."""
        return (self.num_layers, num_pages, *self.page_row)

    # --- pages ----------------------------------------------------------------------------------

    def pages_of(self, host_slots: Any) -> np.ndarray:
        """Host pages of ``host_slots`` (whole pages in order; InvalidSlotError otherwise)."""
        return self.allocator.slots_to_pages(host_slots, "host slots")

    def write_pages(
        self, host_slots: Any, buffer: np.ndarray, heads: slice | None = None, rows: slice | None = None
    ) -> None:
        """Store a gathered buffer ``[L, n, page_size, C, D]`` into the pages of ``host_slots``;
        with ``heads`` (a slice of the page row's head axis ``C``), the buffer holds only those
        heads (``[L, n, page_size, len(heads), D]``: one tensor-parallel shard) and only they are
        written; with ``rows`` (a slice of the page's token rows), only those rows (one DCP rank's
        rows of striped pages, ``kvjax.tiers.head_shards``).

        Raises (nothing written): InvalidSlotError for bad slots; ValueError for a buffer of
        another shape or item size, or ``heads`` on a page row without a head axis.
        """
        pages = self.pages_of(host_slots)
        buf = np.asarray(buffer)
        want = self.buffer_shape(pages.size)
        storage = self.storage
        if rows is not None:
            start, stop, step = rows.indices(self.page_size)
            if step != 1:
                raise ValueError(f"write_pages: rows={rows} must be a contiguous run of the page's rows")
            want = (*want[:2], stop - start, *want[3:])
            storage = storage[:, :, start:stop]
        if heads is not None:
            if len(self.page_row) != 3:
                raise ValueError(f"write_pages: heads={heads} for a page row {self.page_row} without a head axis")
            start, stop, _ = heads.indices(self.page_row[1])
            want = (*want[:3], stop - start, *want[4:])
            storage = storage[..., start:stop, :]
        if buf.shape != want or buf.dtype.itemsize != self.store_dtype.itemsize:
            raise ValueError(
                f"write_pages: buffer {buf.shape} {buf.dtype}, want {want} of {self.store_dtype.itemsize}-byte items"
            )
        self.layout.write(storage, pages, buf.view(self.store_dtype))

    def read_pages(self, host_slots: Any, dtype: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        """The layer-first buffer of the pages of ``host_slots`` (viewed as ``dtype`` when given),
        written into the leading pages of ``out`` when given (``[L, >= n, page_size, C, D]`` of the
        storage's item size: a padded transfer buffer, read without another copy)."""
        pages = self.pages_of(host_slots)
        if out is not None:
            self.layout.read(self.storage, pages, out.view(self.store_dtype)[:, : pages.size])
            buf = out
        else:
            buf = self.layout.read(self.storage, pages)
        return buf if dtype is None else buf.view(dtype)

    def check_slots_allocated(self, host_slots: Any) -> None:
        """Raise InvalidSlotError unless every slot is allocated (a transfer into free slots is a bug)."""
        if not self.allocator.is_allocated(host_slots):
            raise InvalidSlotError("host slots are not allocated in this host pool")


def create_host_pool(pool: Any, context: Any) -> HostKVPool:
    """The pool registry's builder for ``"host_tier"``: the host pool a ``PoolPlan`` describes.

    The plan's host pool lists ``shape[0]`` host pages (every one usable) of
    ``shape[1:] = (page_size, C, D)`` per layer, ``count`` layers, in the storage dtype; the
    layout is ``context.host_layout``. Over a tensor-parallel mesh the plan's row already holds
    every distinct head shard once (``kvjax.plan.pool_plans``); the pool records the context's
    ``kv_head_replicas`` for the transfer engine.
    """
    from kvjax.layout import storage

    pages, *row = pool.shape
    itemsize = storage.itemsize(pool.layout.dtype) if hasattr(pool.layout, "dtype") else np.dtype(pool.dtype).itemsize
    built = HostKVPool(pages * row[0], pool.count, tuple(row), itemsize, getattr(context, "host_layout", "layer_first"))
    if getattr(context, "mesh", None) is not None:
        built.kv_head_replicas = context.kv_head_replicas
    return built
