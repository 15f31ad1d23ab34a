"""`PageTransferEngine`: asynchronous page copies between a device pool and its host pool.

Two paths, by where the device pool lives:

* **Staged** (a device with its own memory, e.g. TPU; or a pool over several devices). Device ->
  host (backup): the page gather kernel packs the node's pages of every layer into one buffer
  (dispatched, not awaited), whose copy to host memory starts at once (``copy_to_host_async``, or
  an output placed in ``pinned_host`` memory); once it is ready, ``poll`` hands its write into the
  host pool to the engine's writer thread (the scheduler's thread never copies it; ``poll``
  reports DONE once it is written; ``cancel`` waits for a write under way). Host -> device
  (load): the host pages are read by runs into one padded buffer, put on the device and scattered
  into the pool by the scatter kernel, the layers donated (in place). A pool sharded over KV
  heads or striped over DCP ranks (several devices) moves **per shard**
  (``kvjax.tiers.head_shards``): gather and scatter run inside ``shard_map`` (each device its own
  heads and rows of the moved pages, no collective), the writer thread stores each distinct shard
  into its heads and rows of the host pages, and a load gives each device its heads and rows of
  the host buffer (``make_array_from_callback``); all O(pages moved). Across processes
  (``jax.distributed``) each process backs up and loads only its own devices' shards: its host
  pages hold the host blocks (heads, rows) its devices hold, the others are never written or read.
* **Direct** (one CPU device: device memory *is* host memory, so a staging buffer is a needless
  full copy). Backup with ``numpy`` staging: the layers are viewed without a copy
  (``np.from_dlpack``; the view waits for pending writes to the layer and is dropped before the
  call returns, so a later step can still donate the layer) and the pages are copied straight
  into the host pool, by runs of consecutive pages: one copy of the bytes, done when
  ``start_backup`` returns (``poll`` reports DONE). With ``pinned_host`` staging the gather runs
  as on the staged path (its output in ``pinned_host`` memory). Load: each layer's host pages are
  put on the device without a copy (``jax.device_put(..., may_alias=True)`` of a 64-byte aligned
  host view: ``HostKVPool`` storage is aligned; pages that are one run of a ``layer_first`` pool
  are read in place, others are first copied by runs into one aligned buffer) and scattered
  layer by layer into the donated layers (per-layer buffers: the CPU backend's scatter from one
  stacked buffer measured ~4x slower). The load's handle keeps the host views alive.

Device state (``docs/architecture.md``, "Device state: who changes it"): the engine holds no
device state and no reference to whoever holds it. A load reads and uploads the host pages when it
starts, and records its scatter as a pending device update
(:class:`~kvjax.device_updates.PendingDeviceUpdates`) that the owner of the step applies before
its next step (``pools = cache.apply_pending(pools)``), so that step's reads depend on the scatter
through jax's ordinary data dependencies and need no wait of their own (SGLang's per-layer
``layer_done_counter`` wait); ``poll`` reports it PENDING until it is applied, DONE once its
arrays are ready. A backup reads the pools the owner last handed in
(:meth:`~kvjax.device_updates.PendingDeviceUpdates.read`): the state after the step that wrote its
pages; a backup of pages a pending load has not written yet is refused. **The host slots of a load
must stay unchanged until it is DONE** (the direct path reads them in place; the tree keeps a
loading chain locked, and the retraction backup frees its held slots only then).

Page counts are padded to powers of two (padding reads the trash page, or host pages next to the
run on the direct path, and writes nowhere: destinations on the trash page are dropped), so a
handful of shapes compile. Slots must be whole pages in order (the tree's nodes are).

``staging``: ``"pinned_host"`` places the gathered buffer (backup) and the host buffer (direct
load) in ``pinned_host`` memory (the backend must have it), ``"numpy"`` copies through numpy
(``device_get``, or the direct copies above); ``"auto"`` picks :func:`default_staging`, chosen by
``benchmarks/host_tier.py`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.device_updates import DeviceUpdate, PendingDeviceUpdates
from kvjax.errors import InvalidSlotError
from kvjax.pools.cache_pools import CachePools
from kvjax.tiers.copy_engine import CopyError, TransferStatus
from kvjax.tiers.head_shards import ROW_AXIS, HeadShards
from kvjax.tiers.host_pool import HostKVPool, aligned_empty
from kvjax.tiers.page_runs import copy_pages, page_runs
from kvjax.transfers.device_pages import page_layers, with_page_layers
from pallas_kernels.page_gather import PINNED_HOST, gather_pages, has_memory_kind, scatter_pages

#: The staging ``"auto"`` picks, by platform, measured by ``benchmarks/host_tier.py`` (figures in
#: ``docs/architecture.md``): on the CPU backend the direct ``numpy`` copies (one copy of the bytes
#: each way) beat the ``pinned_host`` gather. Other platforms (TPU: not measurable on the machine
#: this was tuned on) get :data:`OTHER_PLATFORMS_STAGING`, their DMA path.
DEFAULT_STAGING = {"cpu": "numpy"}
OTHER_PLATFORMS_STAGING = "pinned_host"
STAGINGS = ("auto", "pinned_host", "numpy")


def default_staging(platform: str) -> str:
    """The staging ``"auto"`` resolves to on ``platform`` (see :data:`DEFAULT_STAGING`)."""
    return DEFAULT_STAGING.get(platform, OTHER_PLATFORMS_STAGING)


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _as_4d(layers: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Rank-3 page arrays (MLA's ``[pages, page, row]``) get a unit head axis (a free reshape in jit)."""
    return tuple(x[:, :, None, :] if x.ndim == 3 else x for x in layers)


def _gather_any(layers: tuple[jax.Array, ...], pages: jax.Array) -> jax.Array:
    buf = gather_pages(_as_4d(layers), pages)
    return buf[:, :, :, 0, :] if layers[0].ndim == 3 else buf


@jax.jit
def _gather(layers: tuple[jax.Array, ...], pages: jax.Array) -> jax.Array:
    return _gather_any(layers, pages)


@functools.lru_cache(maxsize=8)
def _gather_to(sharding: Any) -> Any:
    return jax.jit(_gather_any, out_shardings=sharding)


def _scatter_any(layers: tuple[jax.Array, ...], buffer: jax.Array, pages: jax.Array) -> tuple[jax.Array, ...]:
    if layers[0].ndim == 3:
        new = scatter_pages(_as_4d(layers), buffer[:, :, :, None, :], pages)
        return tuple(x[:, :, 0, :] for x in new)
    return scatter_pages(layers, buffer, pages)


_scatter = jax.jit(_scatter_any, donate_argnums=0)


def _layer_spec(sharding: NamedSharding, ndim: int) -> P:
    """The sharding's partition spec padded to ``ndim`` axes."""
    spec = tuple(sharding.spec)
    return P(*spec, *(None,) * (ndim - len(spec)))


def _buffer_spec(layer_spec: P) -> P:
    """A transfer buffer ``[L, n, page_size, ...]``'s spec: the page row's axes split as the layers'."""
    return P(None, *layer_spec)


@functools.lru_cache(maxsize=16)
def _gather_per_shard(mesh: Any, layer_specs: tuple[P, ...], memory_kind: str | None) -> Any:
    """The page gather run by every device on its own shard (``shard_map``): the buffer comes out
    split over the layers' head axis, each device gathering its heads of the moved pages only."""
    spec = _buffer_spec(layer_specs[0])
    body = jax.shard_map(_gather_any, mesh=mesh, in_specs=(layer_specs, P()), out_specs=spec, check_vma=False)
    return jax.jit(body, out_shardings=NamedSharding(mesh, spec, memory_kind=memory_kind))


@functools.lru_cache(maxsize=16)
def _scatter_per_shard(mesh: Any, layer_specs: tuple[P, ...]) -> Any:
    """The page scatter run by every device into its own shard (``shard_map``), the layers donated:
    each device writes its heads of the loaded pages in place (O(pages), no collective)."""
    body = jax.shard_map(
        _scatter_any,
        mesh=mesh,
        in_specs=(layer_specs, _buffer_spec(layer_specs[0]), P()),
        out_specs=layer_specs,
        check_vma=False,
    )
    return jax.jit(body, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_each(
    layers: tuple[jax.Array, ...], buffers: tuple[jax.Array, ...], pages: jax.Array
) -> tuple[jax.Array, ...]:
    """The direct path's scatter: ``layers[l][pages[i]] = buffers[l][i]``, one buffer per layer,
    destinations on the trash page or out of range dropped (``scatter_pages``' semantics; the
    CPU backend runs its jnp reference, so no kernel is bypassed)."""
    num_pages = layers[0].shape[0]
    dst = jnp.where((pages >= 1) & (pages < num_pages), pages, num_pages)  # out of bounds: dropped
    return tuple(x.at[dst].set(b, mode="drop") for x, b in zip(layers, buffers, strict=True))


@dataclass
class _Backup:
    buffer: Any
    host_slots: np.ndarray
    num_pages: int
    status: TransferStatus = TransferStatus.PENDING
    cancelled: bool = False
    landing: Future[TransferStatus] | None = None  # the host write, on the engine's writer thread


@dataclass
class _Load:
    sources: tuple[Any, ...] = ()  # the host buffers put on the device (may alias host memory)
    arrays: tuple[Any, ...] = ()  # the scattered layers once applied (``is_ready`` is not in the stubs)
    applied: bool = False  # the owner applied its scatter (``PendingDeviceUpdates.apply``)
    status: TransferStatus = TransferStatus.PENDING


@dataclass(frozen=True)
class PoolRef:
    """Where a transfer's page arrays live in a ``CachePools``: the pool ``name``, and ``part``
    (``"full"`` or ``"swa"`` of an ``SWAKVPool``) or ``None`` for the pool itself."""

    name: str
    part: str | None = None
    target: str = field(init=False)  # the name pending updates use (``"kv"``, ``"swa.full"``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", self.name if self.part is None else f"{self.name}.{self.part}")

    def get(self, pools: CachePools) -> Any:
        pool = pools[self.name]
        return pool if self.part is None else getattr(pool, self.part)

    def put(self, pools: CachePools, new: Any) -> CachePools:
        """``pools`` with this pool (or part) replaced by ``new``."""
        if self.part is not None:
            new = dataclass_replace(pools[self.name], **{self.part: new})
        return pools.replace(**{self.name: new})


def device_pages(slots: Any, page_size: int, num_slots: int) -> np.ndarray:
    """Pages of device ``slots`` (whole pages in order, none on the trash page), else InvalidSlotError."""
    idx = np.asarray(slots).ravel()
    if idx.size % page_size:
        raise InvalidSlotError(f"device slots: {idx.size} ids are not whole pages of {page_size}")
    rows = idx.reshape(-1, page_size)
    pages = rows[:, 0].astype(np.int64) // page_size
    # Whole pages in order, and every page in [1, pages): then every slot is in range.
    if pages.size and (pages.min() < 1 or pages.max() * page_size >= num_slots):
        raise InvalidSlotError(f"device slots out of the allocatable range [{page_size}, {num_slots})")
    if page_size > 1 and not np.array_equal(rows, pages[:, None] * page_size + np.arange(page_size)):
        raise InvalidSlotError(f"device slots are not whole pages of {page_size} in order")
    return pages.astype(np.int32)


def _platform(devices: Any) -> str:
    """The platform of a sharding's devices (``"cpu"``, ``"tpu"``, ...)."""
    return str(next(iter(devices)).platform)


def _is_direct(layers: tuple[jax.Array, ...]) -> bool:
    """One CPU device and a numpy-native dtype: the layers' memory can be viewed from numpy."""
    devices = layers[0].sharding.device_set
    return (
        len(devices) == 1
        and _platform(devices) == "cpu"
        and np.dtype(layers[0].dtype).isbuiltin == 1
        and layers[0].sharding.memory_kind in (None, "device", "unpinned_host")
    )


class PageTransferEngine:
    """A :class:`~kvjax.tiers.copy_engine.CopyEngine` over a device pool and its host pool.

    Args:
        pending: the cache's pending device updates (``KVCache.pending``): loads are recorded
            there for the owner of the step to apply; backups read the pools the owner last
            handed in through it. Static facts (shape, dtype, sharding) are read from its
            ``owner_pools`` once, here. The engine needs no ``KVCache``.
        host_pool: the host pool (its page row must equal the device pool's).
        pool_name: the device pool in the pools (``"kv"``).
        staging: see the module docstring.
        part: ``"full"`` or ``"swa"``: the engine copies that part of the ``SWAKVPool`` named
            ``pool_name`` (``swa_transfer.py``); ``None``: the pool itself.
        direct: the direct path (module docstring); ``None``: wherever it applies (one CPU device,
            a numpy dtype); ``False`` forces the staged path (its tests run on CPU).
    """

    def __init__(
        self,
        pending: PendingDeviceUpdates,
        host_pool: HostKVPool,
        pool_name: str = "kv",
        staging: str = "auto",
        *,
        part: str | None = None,
        direct: bool | None = None,
    ) -> None:
        if staging not in STAGINGS:
            raise ValueError(f"staging={staging!r}: use one of {', '.join(STAGINGS)}")
        if not isinstance(pending, PendingDeviceUpdates):
            raise TypeError(
                f"PageTransferEngine: expected the cache's PendingDeviceUpdates (cache.pending), got "
                f"{type(pending).__name__}"
            )
        self.pending = pending
        self.host_pool = host_pool
        self.pool_name = pool_name
        self.ref = PoolRef(pool_name, part)
        layers = page_layers(self.ref.get(pending.owner_pools))
        row = tuple(layers[0].shape[1:])
        devices = layers[0].sharding.device_set
        # Over several devices: per-shard copies (``head_shards``); the host row keeps each head once.
        self._shards: HeadShards | None = None
        self._local_shards: HeadShards | None = None
        self._mesh: Any = None
        self._specs: tuple[P, ...] = ()
        host_row = row
        if len(devices) > 1:
            sharding = layers[0].sharding
            if not isinstance(sharding, NamedSharding):
                raise NotImplementedError(
                    f"the host tier copies pools laid out over a mesh (NamedSharding), not {type(sharding).__name__}"
                )
            host_heads = host_pool.page_row[1] if len(row) == 3 and len(host_pool.page_row) == 3 else None
            self._shards = HeadShards.of(sharding, layers[0].shape, host_heads, host_pool.kv_head_replicas)
            # Across processes each one backs up (and loads) only its own devices' shards.
            self._local_shards = self._shards.on_process(jax.process_index())
            self._mesh = sharding.mesh
            self._specs = tuple(_layer_spec(cast(NamedSharding, x.sharding), x.ndim) for x in layers)
            if host_heads is not None:
                host_row = (row[0], host_heads, *row[2:])
        if host_row != host_pool.page_row or len(layers) != host_pool.num_layers:
            raise ValueError(
                f"host pool rows {host_pool.num_layers} x {host_pool.page_row} do not match the device pool's "
                f"{len(layers)} x {row}"
            )
        if staging == "auto":
            staging = default_staging(_platform(devices))
        if staging == "pinned_host" and not all(has_memory_kind(d) for d in devices):
            staging = "numpy"
        can_direct = _is_direct(layers)
        if direct and not can_direct:
            raise ValueError("direct=True: the direct path needs the pool on one CPU device in a numpy dtype")
        self.staging = staging
        self.direct = can_direct if direct is None else bool(direct)
        self.page_size = row[0]
        self.num_slots = layers[0].shape[0] * self.page_size
        self.dtype = layers[0].dtype
        self._sharding = layers[0].sharding
        self._write_thread: ThreadPoolExecutor | None = None

    def _layers(self, pages: np.ndarray) -> tuple[jax.Array, ...]:
        """The device layers to read ``pages`` from: the pools the owner last handed in."""
        return page_layers(self.ref.get(self.pending.read(self.ref.target, pages)))

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _Backup:
        pages = device_pages(device_slots, self.page_size, self.num_slots)
        host_pages = self.host_pool.pages_of(host_slots)  # validates before anything starts
        layers = self._layers(pages)  # before anything starts: refuses stale pools, pending pages
        if self.direct and self.staging == "numpy":
            handle = _Backup(None, np.asarray(host_slots).copy(), pages.size)
            try:
                self._copy_to_host(layers, pages, host_pages)
                handle.status = TransferStatus.DONE
            except Exception:  # a backup that did not land: the tree falls back to recompute
                handle.status = TransferStatus.FAILED
            return handle
        padded = np.zeros(_bucket(pages.size), np.int32)
        padded[: pages.size] = pages
        if self._shards is not None:  # each device gathers its own heads of the pages
            kind = PINNED_HOST if self.staging == "pinned_host" else None
            buf = _gather_per_shard(self._mesh, self._specs, kind)(layers, jnp.asarray(padded))
            if kind is None:
                buf.copy_to_host_async()
            return _Backup(buf, np.asarray(host_slots).copy(), pages.size)
        if self.staging == "pinned_host":
            sharding = layers[0].sharding.with_memory_kind(PINNED_HOST)
            buf = _gather_to(sharding)(layers, jnp.asarray(padded))
        else:
            buf = _gather(layers, jnp.asarray(padded))
            buf.copy_to_host_async()
        return _Backup(buf, np.asarray(host_slots).copy(), pages.size)

    def _copy_to_host(self, layers: tuple[jax.Array, ...], pages: np.ndarray, host_pages: np.ndarray) -> None:
        """The direct backup: each layer's pages copied by runs from a zero-copy view into the host pool."""
        host = self.host_pool
        runs = page_runs(pages, host_pages)
        for layer, array in enumerate(layers):
            view = np.from_dlpack(cast(Any, array))  # waits for pending writes; dropped before any donation
            copy_pages(
                host.layout.layer_view(host.storage, layer), host_pages, view.view(host.store_dtype), pages, runs
            )
            del view

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _Load:
        try:
            pages = device_pages(device_slots, self.page_size, self.num_slots)
            host_pages = self.host_pool.pages_of(host_slots)
        except InvalidSlotError as e:
            raise CopyError(f"load cannot start: {e}") from e
        if self.direct:
            return self._load_direct(host_slots, host_pages, pages)
        if self._shards is not None:
            return self._load_per_shard(host_slots, pages)
        host = self.host_pool
        n = _bucket(pages.size)
        dst = np.zeros(n, np.int32)  # padding goes to the trash page, which the scatter drops
        dst[: pages.size] = pages
        data = host.read_pages(host_slots, self.dtype, out=aligned_empty(host.buffer_shape(n), host.store_dtype))
        handle = _Load((jax.device_put(data),))
        buffer, dst_pages = handle.sources[0], jnp.asarray(dst)

        return self._record_scatter(handle, pages, lambda layers: _scatter(layers, buffer, dst_pages))

    def _load_per_shard(self, host_slots: np.ndarray, pages: np.ndarray) -> _Load:
        """The load over a sharded pool: the host pages read once by runs into one padded buffer,
        each device given its own heads of it (replicated heads: the same host heads to every rank
        of the group), and the per-shard scatter into the donated layers recorded for the owner."""
        assert self._shards is not None
        host = self.host_pool
        n = _bucket(pages.size)
        dst = np.zeros(n, np.int32)  # padding goes to the trash page, which the scatter drops
        dst[: pages.size] = pages
        data = host.read_pages(host_slots, self.dtype, out=aligned_empty(host.buffer_shape(n), host.store_dtype))
        layer = page_layers(self.ref.get(self.pending.owner_pools))[0]
        shape = (host.num_layers, n, *layer.shape[1:])
        head_axis = 3 if layer.ndim == 4 and len(host.page_row) == 3 else None  # of the buffer
        host_heads = {(c.device_heads.start, c.device_heads.stop): c.host_heads for c in self._shards.copies}

        def piece(index: tuple[slice, ...] | None) -> np.ndarray:
            if index is None:
                return data
            # A device's page rows (its DCP rank's, or all) are the same rows of the host page.
            rows = data[:, :, index[ROW_AXIS + 1]]
            if head_axis is None:
                return rows
            start, stop, _ = index[head_axis].indices(shape[head_axis])
            return rows[:, :, :, host_heads[(start, stop)]]

        sharding = NamedSharding(self._mesh, _buffer_spec(self._specs[0]))
        handle = _Load((jax.make_array_from_callback(shape, sharding, piece),))
        buffer, dst_pages = handle.sources[0], jnp.asarray(dst)
        scatter_fn = _scatter_per_shard(self._mesh, self._specs)

        return self._record_scatter(handle, pages, lambda layers: scatter_fn(layers, buffer, dst_pages))

    def _load_direct(self, host_slots: np.ndarray, host_pages: np.ndarray, pages: np.ndarray) -> _Load:
        """The direct load: per-layer host views put on the device without a copy; their scatter
        into the donated layers is recorded for the owner to apply."""
        host = self.host_pool
        n = pages.size
        bucket = _bucket(n)
        dst = np.zeros(bucket, np.int32)  # padding goes to the trash page, which the scatter drops
        one_run = n > 0 and host_pages[-1] - host_pages[0] == n - 1 and np.all(np.diff(host_pages) == 1)
        if one_run and host.layout.name == "layer_first" and bucket <= host.num_pages:
            # Read the run in place: a window of ``bucket`` host pages around it (the pages next
            # to the run are read and dropped).
            first = min(int(host_pages[0]), host.num_pages - bucket)
            offset = int(host_pages[0]) - first
            dst[offset : offset + n] = pages
            sources = [host.storage[layer, first : first + bucket] for layer in range(host.num_layers)]
        else:
            dst[:n] = pages
            staged = host.read_pages(host_slots, out=aligned_empty(host.buffer_shape(bucket), host.store_dtype))
            sources = list(staged)
        sharding = self._sharding
        if self.staging == "pinned_host":
            sharding = sharding.with_memory_kind(PINNED_HOST)
        handle = _Load(tuple(jax.device_put(src.view(self.dtype), sharding, may_alias=True) for src in sources))
        dst_pages = jnp.asarray(dst)

        return self._record_scatter(handle, pages, lambda layers: _scatter_each(layers, handle.sources, dst_pages))

    def _record_scatter(
        self, handle: _Load, pages: np.ndarray, scatter_layers: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    ) -> _Load:
        """Record the load's scatter (``scatter_layers``: the pool's page layers, donated, to the
        layers with the loaded ``pages`` written) as a pending device update for the owner to
        apply; the applied layers land on ``handle`` (``poll`` waits on them)."""

        def scatter(pools: CachePools) -> CachePools:
            pool = self.ref.get(pools)
            handle.arrays = scatter_layers(page_layers(pool))
            handle.applied = True
            return self.ref.put(pools, with_page_layers(pool, handle.arrays))

        self.pending.record(DeviceUpdate("host load", self.ref.target, pages, scatter))
        return handle

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus:
        if handle.status is not TransferStatus.PENDING:
            return handle.status
        if isinstance(handle, _Load):
            if not handle.applied:
                if wait:
                    raise RuntimeError(
                        "waiting for a host load whose scatter is still pending: the owner of the step applies the "
                        "pending device updates first (pools = cache.apply_pending(pools))"
                    )
                return TransferStatus.PENDING
            # Layers donated into a later step are deleted: that step consumed the loaded pages
            # (it ran after the scatter), so the load is complete for every reader.
            live = [a for a in handle.arrays if not a.is_deleted()]
            if wait:
                jax.block_until_ready(live)
            elif not all(a.is_ready() for a in live):
                return TransferStatus.PENDING
            handle.status = TransferStatus.DONE
            handle.arrays = ()
            handle.sources = ()
            return handle.status
        if handle.landing is None:
            if not wait and not handle.buffer.is_ready():
                return TransferStatus.PENDING
            handle.landing = self._writer().submit(self._land, handle)
        if not wait and not handle.landing.done():
            return TransferStatus.PENDING
        handle.status = handle.landing.result()
        handle.landing = None
        return handle.status

    def _writer(self) -> ThreadPoolExecutor:
        """The thread that writes staged backups into the host pool, off the scheduler's thread
        (numpy copies release the GIL), one at a time in the order they were ready."""
        if self._write_thread is None:
            self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvjax-host-write")
        return self._write_thread

    def _land(self, handle: _Backup) -> TransferStatus:
        """Store a staged backup's buffer into the host pool (on the writer thread)."""
        try:
            if self._shards is not None:
                self._land_per_shard(handle)
            else:
                data = np.asarray(handle.buffer)[:, : handle.num_pages]
                if not handle.cancelled:
                    self.host_pool.write_pages(handle.host_slots, data)
            status = TransferStatus.DONE
        except Exception:  # a backup that did not land: the tree falls back to recompute
            status = TransferStatus.FAILED
        handle.buffer = None
        return status

    def _land_per_shard(self, handle: _Backup) -> None:
        """Store a sharded backup: each distinct shard's pages (one rank per replicated head) into
        its heads, and its DCP rank's rows, of the host pages; nothing is assembled across devices.
        Across processes only this process's shards: the host blocks its devices hold (the other
        blocks of its host pages are never read: a load gives each device its own block)."""
        assert self._local_shards is not None
        shards = {shard.device: shard for shard in handle.buffer.addressable_shards}
        has_heads = len(self.host_pool.page_row) == 3 and handle.buffer.ndim == 5
        for source in self._local_shards.sources:
            data = np.asarray(shards[source.device].data)[:, : handle.num_pages]
            if handle.cancelled:
                return
            heads = source.host_heads if has_heads else None
            self.host_pool.write_pages(handle.host_slots, data, heads, source.rows)

    def cancel(self, handle: Any) -> None:
        if isinstance(handle, _Backup):
            handle.cancelled = True
            if handle.landing is not None:
                handle.landing.result()  # a write already under way lands before the slots are reused
