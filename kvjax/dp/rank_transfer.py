"""`RankPageTransferEngine`: a DP rank's host-tier page copies, reading and writing only its slice of the stacked pools.

Under lockstep DP attention (``kvjax.dp.lockstep``) every rank's pools are one set of arrays with a
leading rank axis sharded over ``"data"`` (``kvjax.dp.cache``): page ``p`` of rank ``r`` is
``layers[l][r, p]``, its KV heads split over the rank's ``"tp"`` devices (an MLA latent whole on
each). SGLang gives each DP rank its own host pool and cache controller; so does kvjax: each rank
has its own ``HostKVPool`` (built from the rank's plan as ``build_kv_cache`` builds it: every
distinct head of the rank once), its own ``HiRadixCache`` and this engine over them. Its host slot
ids and device page ids are the rank's own.

How a copy touches only the rank's slice, in place, O(pages moved):

* the page ids are a ``[dp, n]`` array (``n`` padded to a power of two): rank ``r``'s row holds
  the pages, every other row zeros (the trash page). The gather and the scatter run inside one
  ``shard_map`` over the ``("data", "tp")`` mesh, no collective: each device strips the leading
  axis of 1 of its slice and runs the page kernels of ``kvjax.transfers.transfer`` on it with its
  rank's row of page ids. Other ranks gather their trash page (dropped) and scatter nothing
  (destinations on the trash page are dropped), so their slices are left as they were.
* a backup's buffer is ``[dp, L, n, page_size, ...]``, split as the layers are; once ready, the
  engine's writer thread stores each distinct shard of the rank's devices into its heads of the
  host pages (``kvjax.tiers.head_shards``, over the rank's ``("tp",)`` sub-mesh: replicated heads
  read once). A load gives each of the rank's devices its heads of the host pages
  (``make_array_from_callback``; the other ranks' devices get zeros they never write), and its
  scatter, the layers donated, is recorded as a pending device update of the rank's own queue
  (``RankKVCache.pending``) for the rank's scheduler to apply before its next step. Polling,
  cancelling and the writer thread are ``PageTransferEngine``'s.

A cache kind that composes page engines (the sliding-window pair: one over each part of the
``SWAKVPool``, ``part="full"`` / ``"swa"``; a speculative draft's pair) gets the rank's through
:func:`rank_page_engine` (``TransferContext.page_engine``, ``kvjax.transfers.transfer_engines``).
:func:`rank_buffer` and :func:`rank_rows` are the rank-row layout of any stacked array (also the
recurrent state's: ``kvjax.dp.rank_state_transfer``).

:func:`rank_page_copy` and :func:`rank_page_load` are the same copies to and from numpy for the
``cpu_tensor`` retraction backup of one rank (``kvjax.serve.retraction_extension``).

Across processes each process backs up and loads only its own devices' shards of the rank (the
host blocks they hold), as the TP engine does; the page ids are passed replicated then
(``kvjax.dp.step.host_sharding``). The ``cpu_tensor`` copies read the rank's shards this process
addresses, so they need the rank's devices in this process.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.device_updates import PendingDeviceUpdates
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding, rank_devices, rank_mesh
from kvjax.errors import InvalidSlotError
from kvjax.tiers.copy_engine import CopyError, TransferStatus
from kvjax.tiers.head_shards import ROW_AXIS, HeadShards
from kvjax.tiers.host_pool import HostKVPool, aligned_empty
from kvjax.transfers.device_pages import page_layers, with_page_layers
from kvjax.transfers.transfer import (
    STAGINGS,
    PageTransferEngine,
    PoolRef,
    _Backup,
    _bucket,
    _gather_any,
    _layer_spec,
    _Load,
    _platform,
    _scatter_any,
    default_staging,
    device_pages,
)
from kvjax.transfers.transfer_engines import PageEngineFactory
from pallas_kernels.page_gather import PINNED_HOST, has_memory_kind

__all__ = [
    "RankPageTransferEngine",
    "rank_buffer",
    "rank_page_copy",
    "rank_page_engine",
    "rank_page_load",
    "rank_rows",
    "rank_shards",
]

# Axes of a stacked transfer buffer ``[dp, L, n, page_size, C, D]``: the rank's row of pages, and the
# page row and head axes of ``kvjax.tiers.head_shards`` (of a rank's ``[pages, page_size, C, D]``).
_BUFFER_ROWS = ROW_AXIS + 2
_BUFFER_HEADS = _BUFFER_ROWS + 1


def _buffer_spec(layer_spec: P) -> P:
    """A stacked buffer's spec: the rank axis as the layers', then the layer axis, then a page's."""
    return P(layer_spec[0], None, *layer_spec[1:])


def _rank_gather(layers: tuple[jax.Array, ...], pages: jax.Array) -> jax.Array:
    """One device: its rank's pages ``pages[0]`` of its slice of every layer, ``[1, L, n, ...]``."""
    return _gather_any(tuple(x[0] for x in layers), pages[0])[None]


def _rank_scatter(layers: tuple[jax.Array, ...], buffer: jax.Array, pages: jax.Array) -> tuple[jax.Array, ...]:
    """One device: ``buffer[0]`` written at pages ``pages[0]`` of its slice (trash page dropped)."""
    new = _scatter_any(tuple(x[0] for x in layers), buffer[0], pages[0])
    return tuple(x[None] for x in new)


@functools.lru_cache(maxsize=16)
def _gather_program(mesh: Mesh, layer_specs: tuple[P, ...], memory_kind: str | None) -> Any:

    spec = _buffer_spec(layer_specs[0])
    body = jax.shard_map(
        _rank_gather, mesh=mesh, in_specs=(layer_specs, P(DATA_MESH_AXIS)), out_specs=spec, check_vma=False
    )
    layers = tuple(NamedSharding(mesh, s) for s in layer_specs)
    return jax.jit(
        body,
        in_shardings=(layers, host_sharding(mesh)),
        out_shardings=NamedSharding(mesh, spec, memory_kind=memory_kind),
    )


@functools.lru_cache(maxsize=16)
def _scatter_program(mesh: Mesh, layer_specs: tuple[P, ...]) -> Any:

    spec = _buffer_spec(layer_specs[0])
    body = jax.shard_map(
        _rank_scatter,
        mesh=mesh,
        in_specs=(layer_specs, spec, P(DATA_MESH_AXIS)),
        out_specs=layer_specs,
        check_vma=False,
    )
    layers = tuple(NamedSharding(mesh, s) for s in layer_specs)
    return jax.jit(
        body,
        in_shardings=(layers, NamedSharding(mesh, spec), host_sharding(mesh)),
        out_shardings=layers,
        donate_argnums=0,
    )


class _RankPages:
    """The page copies of rank ``rank`` over stacked page arrays like ``layers`` (module docstring)."""

    def __init__(self, layers: tuple[jax.Array, ...], rank: int) -> None:
        stacked = layers[0]
        sharding = stacked.sharding
        if not isinstance(sharding, NamedSharding):
            raise NotImplementedError(f"DP pools laid out over a mesh (NamedSharding), not {type(sharding).__name__}")
        self.mesh = cast(Mesh, sharding.mesh)  # the DP cache's concrete ("data", "tp") mesh
        self.specs = tuple(_layer_spec(cast(NamedSharding, x.sharding), x.ndim) for x in layers)
        if self.specs[0][0] != DATA_MESH_AXIS:
            raise NotImplementedError(f"stacked DP pools have their rank axis over {DATA_MESH_AXIS!r}: {self.specs[0]}")
        self.dp_size = int(stacked.shape[0])
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is not one of the {self.dp_size} DP ranks")
        self.rank = rank
        self.rank_shape = tuple(stacked.shape[1:])  # one rank's page array [pages + 1, page_size, ...]
        self.page_size = int(self.rank_shape[1])
        self.num_slots = int(self.rank_shape[0]) * self.page_size
        self.dtype = stacked.dtype
        devices = rank_devices(self.mesh, rank)
        self.devices = set(devices.tolist())
        # The rank's arrays laid out over its own devices, as one rank's pool is over a ("tp",) mesh
        # (("tp", "dcp") under decode context parallelism: its page rows striped over "dcp").
        self.rank_sharding = NamedSharding(rank_mesh(self.mesh, rank), P(*self.specs[0][1:]))

    def rows(self, pages: np.ndarray) -> tuple[np.ndarray, int]:
        """``[dp, bucket]`` page ids: the rank's row ``pages`` padded with the trash page, the
        others the trash page; and the bucket."""
        n = _bucket(pages.size)
        rows = np.zeros((self.dp_size, n), np.int32)
        rows[self.rank, : pages.size] = pages
        return rows, n

    def gather(self, layers: tuple[jax.Array, ...], pages: np.ndarray, memory_kind: str | None = None) -> jax.Array:
        """The stacked buffer ``[dp, L, bucket, ...]`` whose rank row holds ``pages`` of every layer."""
        rows, _ = self.rows(pages)
        return cast(jax.Array, _gather_program(self.mesh, self.specs, memory_kind)(layers, rows))

    def scatter(self, layers: tuple[jax.Array, ...], buffer: jax.Array, rows: np.ndarray) -> tuple[jax.Array, ...]:
        """``layers`` (donated) with the rank row of ``buffer`` written at the rank row of ``rows``."""
        return cast(tuple[jax.Array, ...], _scatter_program(self.mesh, self.specs)(layers, buffer, rows))

    def buffer(self, num_layers: int, n: int, piece: Any) -> jax.Array:
        """A stacked buffer ``[dp, num_layers, n, ...]`` laid out as the gather's: each of the rank's
        devices holds ``piece(index)`` (``index``: its slices of the rank's ``[L, n, ...]``), every
        other device zeros."""
        shape = (self.dp_size, num_layers, n, *self.rank_shape[1:])
        sharding = NamedSharding(self.mesh, _buffer_spec(self.specs[0]))
        return rank_buffer(sharding, self.rank, shape, self.dtype, piece)

    def rank_shards(self, buffer: jax.Array) -> dict[Any, Any]:
        """This process's shards of the rank's devices of a stacked buffer, by device."""
        return rank_shards(buffer, self.devices)


def rank_buffer(sharding: NamedSharding, rank: int, shape: tuple[int, ...], dtype: Any, piece: Any) -> jax.Array:
    """A stacked array of ``shape`` ``[dp, ...]`` laid out as ``sharding`` (rank axis over
    ``"data"``) whose rank ``rank`` row is ``piece``'s: each of the rank's devices holds
    ``piece(index)`` (``index``: its slices of the rank's ``shape[1:]``), every other device zeros
    (O(the rank's rows) of host work; nothing is built for the other ranks but their zeros)."""
    dp_size = shape[0]

    def callback(index: tuple[slice, ...] | None) -> np.ndarray:
        if index is None:
            index = tuple(slice(None) for _ in shape)
        start, stop, _ = index[0].indices(dp_size)
        if not start <= rank < stop:
            return np.zeros([len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True)], dtype)
        if stop - start != 1:
            raise AssertionError(f"a device holds ranks {start}..{stop - 1} of a stacked DP buffer")
        return np.asarray(piece(index[1:]))[None]

    return jax.make_array_from_callback(shape, sharding, callback)


def rank_shards(buffer: jax.Array, devices: set[Any]) -> dict[Any, Any]:
    """This process's shards of a stacked array on ``devices`` (a rank's), by device."""
    return {s.device: s for s in buffer.addressable_shards if s.device in devices}


def rank_rows(buffer: jax.Array, devices: set[Any]) -> np.ndarray:
    """Rank row of a stacked array ``[dp, ...]``, assembled on the host from the shards of the
    rank's ``devices`` (every one of them this process's): ``buffer``'s ``shape[1:]``."""
    out = np.empty(buffer.shape[1:], buffer.dtype)
    for shard in rank_shards(buffer, devices).values():
        out[shard.index[1:]] = np.asarray(shard.data)[0]
    return out


class RankPageTransferEngine(PageTransferEngine):
    """The host tier's ``CopyEngine`` of DP rank ``rank``: its slice of the stacked pools and its
    own host pool (module docstring).

    Args:
        pending: the rank's pending device updates (``RankKVCache.pending``): its loads are
            recorded there; backups read the pools last handed in through it.
        host_pool: the rank's host pool (every distinct head of the rank once).
        rank: the rank's index along ``"data"``.
        pool_name: the device pool in the pools (``"kv"``).
        staging: ``"auto"``, ``"pinned_host"`` or ``"numpy"`` (``PageTransferEngine``'s meaning;
            there is no direct path: the stacked pools span several devices).
        part: ``"full"`` or ``"swa"``: the engine copies that part of the stacked ``SWAKVPool``
            named ``pool_name`` (one half of the rank's sliding-window pair,
            ``kvjax.transfers.swa_transfer``); ``None``: the pool itself.
    """

    def __init__(
        self,
        pending: PendingDeviceUpdates,
        host_pool: HostKVPool,
        rank: int,
        pool_name: str = "kv",
        staging: str = "auto",
        *,
        part: str | None = None,
    ) -> None:
        # Not PageTransferEngine.__init__: the static facts are a rank's slice of stacked arrays.
        if staging not in STAGINGS:
            raise ValueError(f"staging={staging!r}: use one of {', '.join(STAGINGS)}")
        if not isinstance(pending, PendingDeviceUpdates):
            raise TypeError(
                f"RankPageTransferEngine: expected the rank's PendingDeviceUpdates, got {type(pending).__name__}"
            )
        self.pending = pending
        self.host_pool = host_pool
        self.pool_name = pool_name
        self.ref = PoolRef(pool_name, part)
        layers = page_layers(self.ref.get(pending.owner_pools))
        self._pages = _RankPages(layers, rank)
        self.rank = rank
        row = self._pages.rank_shape[1:]
        host_heads = host_pool.page_row[1] if len(row) == 3 and len(host_pool.page_row) == 3 else None
        shards = HeadShards.of(
            self._pages.rank_sharding, self._pages.rank_shape, host_heads, host_pool.kv_head_replicas
        )
        self._shards = shards
        self._local_shards = shards.on_process(jax.process_index())
        host_row = row if host_heads is None else (row[0], host_heads, *row[2:])
        if host_row != host_pool.page_row or len(layers) != host_pool.num_layers:
            raise ValueError(
                f"rank {rank}'s host pool rows {host_pool.num_layers} x {host_pool.page_row} do not match its device "
                f"pool's {len(layers)} x {row}"
            )
        devices = layers[0].sharding.device_set
        if staging == "auto":
            staging = default_staging(_platform(devices))
        if staging == "pinned_host" and not all(has_memory_kind(d) for d in devices):
            staging = "numpy"
        self.staging = staging
        self.direct = False
        self.page_size = self._pages.page_size
        self.num_slots = self._pages.num_slots
        self.dtype = self._pages.dtype
        self._sharding = layers[0].sharding
        self._mesh = self._pages.mesh
        self._specs = self._pages.specs
        self._write_thread = None

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _Backup:
        pages = device_pages(device_slots, self.page_size, self.num_slots)
        self.host_pool.pages_of(host_slots)  # validates before anything starts
        layers = self._layers(pages)  # refuses stale pools and pages a pending load of the rank writes
        kind = PINNED_HOST if self.staging == "pinned_host" else None
        buf = self._pages.gather(layers, pages, kind)
        if kind is None:
            buf.copy_to_host_async()
        return _Backup(buf, np.asarray(host_slots).copy(), pages.size)

    def _land(self, handle: _Backup) -> TransferStatus:
        """Store the rank's distinct shards of a backup's buffer into their heads of the host pages
        (on the writer thread); other ranks' rows are never read."""
        try:
            assert self._local_shards is not None
            shards = self._pages.rank_shards(handle.buffer)
            has_heads = len(self.host_pool.page_row) == 3 and handle.buffer.ndim == 6
            for source in self._local_shards.sources:
                data = np.asarray(shards[source.device].data)[0, :, : handle.num_pages]
                if handle.cancelled:
                    break
                heads = source.host_heads if has_heads else None
                self.host_pool.write_pages(handle.host_slots, data, heads, source.rows)
            status = TransferStatus.DONE
        except Exception:  # a backup that did not land: the tree falls back to recompute
            status = TransferStatus.FAILED
        handle.buffer = None
        return status

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _Load:
        try:
            pages = device_pages(device_slots, self.page_size, self.num_slots)
            self.host_pool.pages_of(host_slots)
        except InvalidSlotError as e:
            raise CopyError(f"load cannot start: {e}") from e
        host = self.host_pool
        rows, n = self._pages.rows(pages)
        data = host.read_pages(host_slots, self.dtype, out=aligned_empty(host.buffer_shape(n), host.store_dtype))
        assert self._shards is not None
        host_heads = {(c.device_heads.start, c.device_heads.stop): c.host_heads for c in self._shards.copies}
        heads_split = len(self._pages.rank_shape) == 4 and len(host.page_row) == 3

        def piece(index: tuple[slice, ...]) -> np.ndarray:
            # index: the device's slices of the rank's [L, n, page_size, ...] buffer
            part = data[:, :, index[_BUFFER_ROWS - 1]]
            if not heads_split:
                return part
            start, stop, _ = index[_BUFFER_HEADS - 1].indices(self._pages.rank_shape[2])
            return part[:, :, :, host_heads[(start, stop)]]

        handle = _Load((self._pages.buffer(host.num_layers, n, piece),))
        buffer = handle.sources[0]

        return self._record_scatter(handle, pages, lambda layers: self._pages.scatter(layers, buffer, rows))


def rank_page_engine(rank: int) -> PageEngineFactory:
    """The page engine factory of rank ``rank`` (``TransferContext.page_engine``): every page
    engine a cache kind composes (the plain one, each half of the sliding-window pair, the draft's)
    is then a :class:`RankPageTransferEngine` of the rank over its pool's (or part's) slice."""

    def make(
        pending: PendingDeviceUpdates,
        host_pool: Any,
        pool_name: str = "kv",
        staging: str = "auto",
        *,
        part: str | None = None,
    ) -> RankPageTransferEngine:
        return RankPageTransferEngine(pending, host_pool, rank, pool_name, staging, part=part)

    return make


def rank_page_copy(rank: int) -> Any:
    """``get_copy(pool, slots)`` of the ``cpu_tensor`` retraction backup of rank ``rank`` over a
    stacked pool: per-layer numpy copies ``[tokens, ...]`` of the rank's whole-page ``slots``
    (its heads assembled from its devices' shards), O(pages)."""

    def get_copy(pool: Any, slots: np.ndarray) -> list[np.ndarray]:
        layers = page_layers(pool)
        pages_of = _RankPages(layers, rank)
        pages = device_pages(slots, pages_of.page_size, pages_of.num_slots)
        out = rank_rows(pages_of.gather(layers, pages), pages_of.devices)
        return [np.ascontiguousarray(b[: pages.size].reshape(-1, *b.shape[2:])) for b in out]

    return get_copy


def rank_page_load(rank: int) -> Any:
    """``load_copy(pool, copy, slots)`` of the ``cpu_tensor`` retraction backup of rank ``rank``:
    :func:`rank_page_copy`'s copies written into the rank's whole-page ``slots`` of the stacked
    pool (donated: in place), every other rank's slice untouched."""

    def load_copy(pool: Any, copy: list[np.ndarray], slots: np.ndarray) -> Any:
        layers = page_layers(pool)
        pages_of = _RankPages(layers, rank)
        pages = device_pages(slots, pages_of.page_size, pages_of.num_slots)
        rows, n = pages_of.rows(pages)
        data = np.zeros((len(layers), n, *pages_of.rank_shape[1:]), pages_of.dtype)
        for layer, c in enumerate(copy):
            data[layer, : pages.size] = c.reshape(pages.size, *pages_of.rank_shape[1:])
        buffer = pages_of.buffer(len(layers), n, lambda index: data[index])
        return with_page_layers(pool, pages_of.scatter(layers, buffer, rows))

    return load_copy
