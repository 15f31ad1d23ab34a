"""`PageTransferEngine`: asynchronous page copies between a device pool and its host pool.

Device -> host (backup): the page gather kernel packs the node's pages of every layer into one
buffer (dispatched, not awaited), whose copy to host memory starts at once
(``copy_to_host_async``, or an output placed in ``pinned_host`` memory); ``poll`` stores the
buffer into the host pool once it is ready. Host -> device (load): the host pages are read into a
buffer, put on the device and scattered into the pool with the layers donated (in place); the new
pools are stored in the holder at once, so the next step's reads depend on the scatter through
jax's ordinary data dependencies and need no wait of their own (SGLang's per-layer
``layer_done_counter`` wait). ``poll`` reports a load DONE once its arrays are ready.

Page counts are padded to powers of two (padding reads the trash page and writes nowhere), so a
handful of shapes compile. Slots must be whole pages in order (the tree's nodes are).

``staging``: ``"pinned_host"`` places the gathered buffer in ``pinned_host`` memory (the
backend must have it), ``"numpy"`` copies through ``device_get``; ``"auto"`` picks
:data:`DEFAULT_STAGING`, chosen by ``benchmarks/host_tier.py`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import InvalidSlotError
from kvjax.tiers.copy_engine import CopyError, TransferStatus
from kvjax.tiers.device_pages import page_layers, with_page_layers
from kvjax.tiers.host_pool import HostKVPool
from pallas_kernels.page_gather import PINNED_HOST, gather_pages, has_memory_kind, scatter_pages

DEFAULT_STAGING = "pinned_host"
STAGINGS = ("auto", "pinned_host", "numpy")


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


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(layers: tuple[jax.Array, ...], buffer: jax.Array, pages: jax.Array) -> tuple[jax.Array, ...]:
    if layers[0].ndim == 3:
        new = scatter_pages(_as_4d(layers), buffer[:, :, :, None, :], pages)
        return tuple(x[:, :, 0, :] for x in new)
    return scatter_pages(layers, buffer, pages)


@dataclass
class _Backup:
    buffer: Any
    host_slots: np.ndarray
    num_pages: int
    status: TransferStatus = TransferStatus.PENDING
    cancelled: bool = False


@dataclass
class _Load:
    arrays: tuple[Any, ...]  # the scattered layers (``jax.Array``; ``is_ready`` is not in its stubs)
    status: TransferStatus = TransferStatus.PENDING


def device_pages(slots: Any, page_size: int, num_slots: int) -> np.ndarray:
    """Pages of device ``slots`` (whole pages in order, none on the trash page), else InvalidSlotError."""
    idx = np.asarray(slots, dtype=np.int64).ravel()
    if idx.size % page_size:
        raise InvalidSlotError(f"device slots: {idx.size} ids are not whole pages of {page_size}")
    if ((idx < page_size) | (idx >= num_slots)).any():
        raise InvalidSlotError(f"device slots out of the allocatable range [{page_size}, {num_slots})")
    rows = idx.reshape(-1, page_size)
    if page_size > 1 and (
        (rows % page_size != np.arange(page_size)).any() or (rows // page_size != rows[:, :1] // page_size).any()
    ):
        raise InvalidSlotError(f"device slots are not whole pages of {page_size} in order")
    return (rows[:, 0] // page_size).astype(np.int32)


class PageTransferEngine:
    """A :class:`~kvjax.tiers.copy_engine.CopyEngine` over a device pool and its host pool.

    Args:
        holder: owns the current device state: ``holder.pools`` (a ``CachePools``) and
            ``holder.set_pools(new)`` (a ``KVCache``).
        host_pool: the host pool (its page row must equal the device pool's).
        pool_name: the device pool in ``holder.pools`` (``"kv"``).
        staging: see the module docstring.
    """

    def __init__(self, holder: Any, host_pool: HostKVPool, pool_name: str = "kv", staging: str = "auto") -> None:
        if staging not in STAGINGS:
            raise ValueError(f"staging={staging!r}: use one of {', '.join(STAGINGS)}")
        self.holder = holder
        self.host_pool = host_pool
        self.pool_name = pool_name
        layers = page_layers(holder.pools[pool_name])
        row = tuple(layers[0].shape[1:])
        if row != host_pool.page_row or len(layers) != host_pool.num_layers:
            raise ValueError(
                f"host pool rows {host_pool.num_layers} x {host_pool.page_row} do not match the device pool's "
                f"{len(layers)} x {row}"
            )
        if staging == "auto":
            staging = DEFAULT_STAGING
        if staging == "pinned_host" and not all(has_memory_kind(d) for d in layers[0].sharding.device_set):
            staging = "numpy"
        self.staging = staging
        self.page_size = row[0]
        self.num_slots = layers[0].shape[0] * self.page_size
        self.dtype = layers[0].dtype

    def _layers(self) -> tuple[jax.Array, ...]:
        return page_layers(self.holder.pools[self.pool_name])

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _Backup:
        pages = device_pages(device_slots, self.page_size, self.num_slots)
        self.host_pool.pages_of(host_slots)  # validates before anything starts
        padded = np.zeros(_bucket(pages.size), np.int32)
        padded[: pages.size] = pages
        layers = self._layers()
        if self.staging == "pinned_host":
            sharding = layers[0].sharding.with_memory_kind(PINNED_HOST)
            buf = _gather_to(sharding)(layers, jnp.asarray(padded))
        else:
            buf = _gather(layers, jnp.asarray(padded))
            buf.copy_to_host_async()
        return _Backup(buf, np.asarray(host_slots).copy(), pages.size)

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _Load:
        try:
            pages = device_pages(device_slots, self.page_size, self.num_slots)
            data = self.host_pool.read_pages(host_slots, self.dtype)
        except InvalidSlotError as e:
            raise CopyError(f"load cannot start: {e}") from e
        n = _bucket(pages.size)
        dst = np.zeros(n, np.int32)  # padding goes to the trash page, which the scatter drops
        dst[: pages.size] = pages
        if n != pages.size:
            data = np.concatenate([data, np.zeros((data.shape[0], n - pages.size, *data.shape[2:]), data.dtype)], 1)
        pools = self.holder.pools
        pool = pools[self.pool_name]
        new_layers = _scatter(
            page_layers(pool), jax.device_put(data), jnp.asarray(dst)
        )  # device_put: ~2x jnp.asarray here
        self.holder.set_pools(pools.replace(**{self.pool_name: with_page_layers(pool, new_layers)}))
        return _Load(new_layers)

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus:
        if handle.status is not TransferStatus.PENDING:
            return handle.status
        if isinstance(handle, _Load):
            # Layers donated into a later step are deleted: that step consumed the loaded pages
            # (it ran after the scatter), so the load is complete for every reader.
            live = [a for a in handle.arrays if not a.is_deleted()]
            if wait:
                jax.block_until_ready(live)
            elif not all(a.is_ready() for a in live):
                return TransferStatus.PENDING
            handle.status = TransferStatus.DONE
            handle.arrays = ()
            return handle.status
        if not wait and not handle.buffer.is_ready():
            return TransferStatus.PENDING
        try:
            data = np.asarray(handle.buffer)[:, : handle.num_pages]
            if not handle.cancelled:
                self.host_pool.write_pages(handle.host_slots, data)
            handle.status = TransferStatus.DONE
        except Exception:  # a backup that did not land: the tree falls back to recompute
            handle.status = TransferStatus.FAILED
        handle.buffer = None
        return handle.status

    def cancel(self, handle: Any) -> None:
        if isinstance(handle, _Backup):
            handle.cancelled = True
