"""`StateTransferEngine`: the host tier's copies of recurrent-state checkpoints (device state slot
<-> host state slot), SGLang's ``MambaPoolHost`` transfers.

A :class:`~kvjax.tiers.copy_engine.CopyEngine` over the recurrent pool (``pools.recurrent``) and
its :class:`~kvjax.tiers.host_state_pool.HostStatePool`; slots are state slots (one per checkpoint),
not token slots.

Device state (``docs/architecture.md``, "Device state: who changes it"): the engine holds no device
state. Both directions are recorded as pending device updates (``kvjax.device_updates``) that the
owner of the step applies, in order, before its next step:

* **backup** ``(device slots, host slots)``: the update gathers the slots' rows of every layer and
  array (a copy O(slots), the pool unchanged) and starts their copy to the host
  (``copy_to_host_async``); the first ``poll`` after the update was applied writes them into the
  host pool (waiting for the few rows if they are not there yet) and reports DONE. A checkpoint
  the tree donated this step is written by a state copy the tree queued
  (``MambaRadixCache.take_state_copies``) that is not recorded yet: :meth:`record_copies` records
  those copies first, so the gather reads the state they write (the order of the queue is the
  order of the device's writes). Unlike the KV engine, a backup cannot read "now": the state it
  reads may still be a queued copy. ``poll(wait=True)`` of a backup whose update is not applied
  yet reports PENDING (nothing can apply it but the owner); the tree keeps the node locked.
* **load** ``(host slots, device slots)``: the host rows are read when it starts (so the host slots
  may be reused at once) and the update scatters them into the device slots (the pool's arrays
  donated: in place, O(slots)). ``poll`` reports PENDING until the update is applied, then DONE (it
  waits for the written arrays). A load that started completes.

A transfer's status thus depends only on whether the owner applied its update, never on timing:
every process of a multi-process run would see it land at the same step. The pool must be fully
addressable by this process (one process: ``NotImplementedError`` otherwise).

Where the rows come from and go to is three methods (``_gather_rows``, ``_host_rows``,
``_scatter_rows``) and the recorded state copies one (``_copies_update``): here the whole pool's
``[layers, slots + 1, *row]`` arrays; a DP rank's engine
(``kvjax.dp.rank_state_transfer.RankStateTransferEngine``) overrides them to read and write only
its slice of the stacked pool, everything else (validation, handles, polling) being this one's.

Cancelled transfers never land: a cancelled backup's update gathers nothing and its poll reports
FAILED.

A draft model's pool (``"kv_draft"``: a STANDALONE draft's, or Qwen3-Next's MTP layer's, indexed by
the KV pool's token slots, with no state of its own) rides with the KV pages
(:meth:`KVAndStateEngine.pair_token_pages`, ``kvjax.transfers.draft_pools``), never with the
checkpoints: a prefix's draft pages go to the host and come back with its KV pages.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.device_updates import DeviceUpdate, PendingDeviceUpdates
from kvjax.pools.cache_pools import CachePools
from kvjax.pools.recurrent import apply_state_copies
from kvjax.tiers.copy_engine import CopyEngine, CopyError, TransferStatus
from kvjax.tiers.host_state_pool import HostStatePool

if TYPE_CHECKING:
    from kvjax.transfers.transfer_engines import TransferContext

__all__ = [
    "KVAndStateEngine",
    "StateTransferEngine",
    "copy_state_rows",
    "load_state_rows",
    "state_copies_update",
    "transfer_engine",
]

#: The device pool of recurrent state and the plan name of its host pool.
STATE_POOL = "recurrent"
HOST_STATE_POOL = "host_state"


def state_copies_update(copies: list[tuple[int, int]], pool_name: str = STATE_POOL) -> DeviceUpdate:
    """The state copies ``(src slot, dst slot)``, applied in order to ``pools[pool_name]`` (donated),
    as a pending device update (pages: the destination slots)."""
    copies = list(copies)

    def copy_states(pools: CachePools) -> CachePools:
        return pools.replace(**{pool_name: apply_state_copies(pools[pool_name], copies)})

    destinations = np.asarray([dst for _, dst in copies], np.int64)
    return DeviceUpdate("state fork", pool_name, destinations, copy_states)


@jax.jit
def _gather(arrays: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(a[:, slots] for a in arrays)


@functools.lru_cache(maxsize=8)
def _scatter_to(shardings: tuple[Any, ...]) -> Any:
    def scatter(arrays: tuple[jax.Array, ...], slots: jax.Array, rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(a.at[:, slots].set(r.astype(a.dtype)) for a, r in zip(arrays, rows, strict=True))

    return jax.jit(scatter, donate_argnums=(0,), out_shardings=shardings)


@dataclass(eq=False)
class _StateBackup:
    host_slots: np.ndarray
    applied: bool = False
    cancelled: bool = False
    buffers: tuple[Any, ...] = ()
    status: TransferStatus = TransferStatus.PENDING


@dataclass(eq=False)
class _StateLoad:
    applied: bool = False
    arrays: tuple[Any, ...] = field(default=())
    status: TransferStatus = TransferStatus.PENDING


def copy_state_rows(pool: Any, slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """The numpy copy of state ``slots``' rows of every layer and array of recurrent ``pool``,
    per array ``[layers, len(slots), *row]`` (the engine's row gather; O(slots), the pool
    unchanged). The decode retraction backup's copy of a request's state
    (``kvjax.serve.recurrent_retraction``). The pool must be fully addressable by this process."""
    gathered = _gather(pool.arrays(), jnp.asarray(slots, jnp.int32))
    return tuple(np.asarray(b) for b in jax.device_get(gathered))


def load_state_rows(pool: Any, rows: tuple[np.ndarray, ...], slots: np.ndarray) -> Any:
    """Recurrent ``pool`` with :func:`copy_state_rows`' ``rows`` written at state ``slots`` (the
    engine's row scatter, the pool's arrays donated: in place, O(slots))."""
    arrays = pool.arrays()
    scatter = _scatter_to(tuple(a.sharding for a in arrays))
    return with_state_arrays(pool, scatter(arrays, jnp.asarray(slots, jnp.int32), tuple(jnp.asarray(r) for r in rows)))


def with_state_arrays(pool: Any, arrays: tuple[Any, ...]) -> Any:
    """Recurrent ``pool`` with its arrays replaced by ``arrays``, in ``pool.arrays()``' order
    (every conv state, then the temporal state)."""
    return pool.replace(conv=tuple(arrays[:-1]), ssm=arrays[-1])


class StateTransferEngine:
    """See the module docstring.

    Args:
        pending: the cache's pending device updates (``KVCache.pending``).
        host_pool: the host state pool; its arrays must match the device pool's (layers, rows,
            storage dtypes), else ValueError naming both.
        pool_name: the recurrent pool in the pools (``"recurrent"``).
    """

    def __init__(self, pending: PendingDeviceUpdates, host_pool: HostStatePool, pool_name: str = STATE_POOL) -> None:
        device = pending.owner_pools[pool_name]
        arrays = device.arrays()
        shapes = self._copied_shapes(arrays)
        want = tuple((shape[2:], str(a.dtype)) for shape, a in zip(shapes, arrays, strict=True))
        have = tuple((tuple(h.shape[2:]), str(h.dtype)) for h in host_pool.arrays)
        if want != have or host_pool.num_layers != shapes[0][0]:
            raise ValueError(
                f"host state pool rows {have} over {host_pool.num_layers} layers for a device state pool of {want} "
                f"over {shapes[0][0]} layers; plan both from the same layout"
            )
        if not all(a.is_fully_addressable for a in arrays):
            raise NotImplementedError(
                "host copies of recurrent-state checkpoints across processes are not built (each process would copy "
                "its own devices' shards); serve the host tier of this model in one process"
            )
        self.pending = pending
        self.host_pool = host_pool
        self.pool_name = pool_name
        self.num_slots = shapes[0][1] - 1  # allocatable device slots (slot 0 pads)

    # --- where the rows come from and go to (overridden per DP rank) ----------------------------

    def _copied_shapes(self, arrays: tuple[jax.Array, ...]) -> tuple[tuple[int, ...], ...]:
        """Per state array, the shape ``[layers, slots + 1, *row]`` this engine copies from."""
        return tuple(tuple(int(d) for d in a.shape) for a in arrays)

    def _gather_rows(self, arrays: tuple[jax.Array, ...], slots: np.ndarray) -> tuple[jax.Array, ...]:
        """Device buffers holding ``slots``' rows of every array (dispatched, not awaited)."""
        return _gather(arrays, jnp.asarray(slots, jnp.int32))

    def _host_rows(self, buffers: tuple[jax.Array, ...], n: int) -> tuple[np.ndarray, ...]:
        """:meth:`_gather_rows`' buffers on the host, per array ``[layers, n, *row]``."""
        return tuple(np.asarray(b)[:, :n] for b in buffers)

    def _scatter_rows(
        self, arrays: tuple[jax.Array, ...], slots: np.ndarray, rows: tuple[np.ndarray, ...]
    ) -> tuple[jax.Array, ...]:
        """``arrays`` (donated: in place) with ``rows`` (per array ``[layers, n, *row]``) written
        at ``slots``."""
        ids = jnp.asarray(slots, jnp.int32)
        return tuple(_scatter_to(tuple(a.sharding for a in arrays))(arrays, ids, tuple(jnp.asarray(r) for r in rows)))

    def _copies_update(self, copies: list[tuple[int, int]]) -> DeviceUpdate:
        """The device update applying the tree's state copies ``(src, dst)`` in order."""
        return state_copies_update(copies, self.pool_name)

    def _device_slots(self, slots: Any) -> np.ndarray:
        ids = np.asarray(slots, dtype=np.int64).ravel()
        bad = ids[(ids < 1) | (ids > self.num_slots)]
        if bad.size:
            raise CopyError(f"device state slots {bad.tolist()} out of range [1, {self.num_slots}]")
        return ids

    def record_copies(self, copies: list[tuple[int, int]]) -> None:
        """Record the tree's queued state copies ``(src, dst)`` as one pending device update, ahead
        of a backup that reads what they write."""
        if copies:
            self.pending.record(self._copies_update(copies))

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> _StateBackup:
        slots = self._device_slots(device_slots)
        host = self.host_pool.check_slots(host_slots)
        if slots.size != host.size:
            raise CopyError(f"backup of {slots.size} state slots into {host.size} host slots")
        handle = _StateBackup(host)

        def gather(pools: CachePools) -> CachePools:
            if not handle.cancelled:
                handle.buffers = self._gather_rows(pools[self.pool_name].arrays(), slots)
                for buf in handle.buffers:
                    buf.copy_to_host_async()
            handle.applied = True
            return pools

        self.pending.record(DeviceUpdate("state backup", self.pool_name, np.empty(0, np.int64), gather))
        return handle

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> _StateLoad:
        try:
            slots = self._device_slots(device_slots)
            rows = self.host_pool.read(host_slots)  # read now: the host slots may be reused at once
        except Exception as e:
            raise CopyError(f"state load cannot start: {e}") from e
        if rows[0].shape[1] != slots.size:
            raise CopyError(f"load of {rows[0].shape[1]} host state slots into {slots.size} device slots")
        handle = _StateLoad()

        def scatter(pools: CachePools) -> CachePools:
            pool = pools[self.pool_name]
            new = self._scatter_rows(pool.arrays(), slots, rows)
            handle.arrays = tuple(new)
            handle.applied = True
            return pools.replace(**{self.pool_name: with_state_arrays(pool, new)})

        self.pending.record(DeviceUpdate("host state load", self.pool_name, slots, scatter))
        return handle

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus:
        if handle.status is not TransferStatus.PENDING:
            return handle.status
        if isinstance(handle, _StateLoad):
            if not handle.applied:
                return TransferStatus.PENDING
            jax.block_until_ready([a for a in handle.arrays if not a.is_deleted()])
            handle.status = TransferStatus.DONE
            handle.arrays = ()
            return handle.status
        if handle.cancelled:
            handle.status = TransferStatus.FAILED
            return handle.status
        if not handle.applied:
            return TransferStatus.PENDING
        try:
            self.host_pool.write(handle.host_slots, self._host_rows(handle.buffers, handle.host_slots.size))
            handle.status = TransferStatus.DONE
        except Exception:  # a backup that did not land: the tree keeps the node without a host state
            handle.status = TransferStatus.FAILED
        handle.buffers = ()
        return handle.status

    def cancel(self, handle: Any) -> None:
        if isinstance(handle, _StateBackup):
            handle.cancelled = True


class KVAndStateEngine:
    """The host tier's engines of a recurrent-state cache: a :class:`CopyEngine` over the KV pages
    (``kv``: what the host component copies through; every call goes to it) with the state engine
    beside it (``state``: what the tree's checkpoint copies go through)."""

    def __init__(self, kv: CopyEngine, state: StateTransferEngine) -> None:
        self.kv = kv
        self.state = state
        self.staging = getattr(kv, "staging", None)

    @property
    def engines(self) -> tuple[Any, ...]:
        """The engines this one copies through: the KV pages', then the state's."""
        return (self.kv, self.state)

    def pair_token_pages(self, pair: Callable[[Any], Any]) -> KVAndStateEngine:
        """A copy of this engine whose KV engine is ``pair(kv)`` and whose state engine is this
        one's (``kvjax.transfers.draft_pools.TokenPagesComposition``)."""
        new = copy.copy(self)
        new.kv = pair(self.kv)
        return new

    def start_backup(self, device_slots: np.ndarray, host_slots: np.ndarray) -> Any:
        return self.kv.start_backup(device_slots, host_slots)

    def start_load(self, host_slots: np.ndarray, device_slots: np.ndarray) -> Any:
        return self.kv.start_load(host_slots, device_slots)

    def poll(self, handle: Any, wait: bool = False) -> TransferStatus:
        return self.kv.poll(handle, wait)

    def cancel(self, handle: Any) -> None:
        self.kv.cancel(handle)


def transfer_engine(context: TransferContext) -> KVAndStateEngine | None:
    """The KV pages' plain engine with the state engine beside it, when the plan built a host
    state pool (``"host_state"``); None otherwise (the plain engine). Both are the context's
    (``TransferContext.page_engine`` / ``state_engine``; by default over the cache's own pools)."""
    from kvjax.transfers.transfer_engines import default_transfer_engine

    host = context.host_pools.get(HOST_STATE_POOL)
    if host is None or STATE_POOL not in context.pending.owner_pools.names:
        return None
    make = context.state_engine if context.state_engine is not None else StateTransferEngine
    return KVAndStateEngine(default_transfer_engine(context), make(context.pending, host))
