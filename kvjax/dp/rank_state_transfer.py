"""`RankStateTransferEngine`: a DP rank's host copies of recurrent-state checkpoints, over its slice only.

Under lockstep DP attention every rank's recurrent state is one ``RecurrentStatePool`` whose
arrays carry a leading rank axis over ``"data"`` (``kvjax.dp.cache``): slot ``s`` of rank ``r`` is
``<array>[r, :, s]`` (``[rank, layer, slot, *row]``, the row's channels or heads over the rank's
``"tp"`` devices). As SGLang gives each DP rank its own ``MambaPoolHost``, each rank has its own
``HostStatePool`` (the rank's whole row, every ``"tp"`` shard of it), its own ``HiMambaRadixCache``
and this engine, whose slot ids are the rank's own. It is
:class:`~kvjax.transfers.state_transfer.StateTransferEngine` (handles, validation, polling, the
device-state rule: both directions are pending device updates of the rank's own queue, applied by
the rank's owner of the step) with the rows moved per rank:

* **backup** (the gather): one program over the ``("data", "tp")`` mesh, ``"data"`` manual
  (``shard_map``): each rank reads its row of slot ids (``[dp, n]``, ``n`` padded to a power of
  two with the padding slot 0; every other rank's row is all slot 0) from its own slice, so the
  buffer ``[dp, layers, n, *row]`` is laid out as the pool. Its rank row is assembled on the host
  from the rank's devices' shards (``kvjax.dp.rank_transfer.rank_rows``).
* **load** (the scatter, the pool donated: in place, O(slots)): the host rows are given to the
  rank's devices only (``rank_buffer``: the other ranks' devices get zeros), and each rank writes
  its row at its row of slot ids; padding and every other rank's ids are past the last slot and
  dropped (``mode="drop"``), so no other rank's slice changes.
* **the tree's queued state copies** (recorded ahead of a backup that reads what they write) are
  the rank's ``kvjax.dp.rank_state.RankStateCopies`` update, as its ``RecurrentStateExtension``
  records them.

One process only (the base engine refuses a pool it cannot address whole, and the DP cache's
build refuses the host state pool over several processes before allocating).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.device_updates import DeviceUpdate, PendingDeviceUpdates
from kvjax.dp.rank_mesh import DATA_MESH_AXIS, host_sharding, rank_devices
from kvjax.dp.rank_transfer import rank_buffer, rank_rows
from kvjax.tiers.host_state_pool import HostStatePool
from kvjax.transfers.state_transfer import STATE_POOL, StateTransferEngine, with_state_arrays
from kvjax.transfers.transfer import _bucket, _layer_spec

if TYPE_CHECKING:
    from kvjax.dp.layout import DPLayout
    from kvjax.dp.rank_state import RankStateCopies
    from kvjax.transfers.transfer_engines import StateEngineFactory

__all__ = ["RankStateRows", "RankStateTransferEngine", "rank_state_engine", "rank_state_row_copies"]

_RANKS = P(DATA_MESH_AXIS)  # every per-rank input and output: split over "data", the rest automatic


def _rank_gather(arrays: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
    """One rank: its ``slots[0]`` of every layer of its slice ``a[0]``, ``[1, layers, n, *row]``."""
    return tuple(a[0][:, slots[0]][None] for a in arrays)


def _rank_scatter(
    arrays: tuple[jax.Array, ...], slots: jax.Array, rows: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
    """One rank: ``rows[0]`` written at ``slots[0]`` of its slice (ids past the last slot dropped)."""
    return tuple(
        a[0].at[:, slots[0]].set(r[0].astype(a.dtype), mode="drop")[None] for a, r in zip(arrays, rows, strict=True)
    )


@functools.lru_cache(maxsize=16)
def _gather_program(mesh: Mesh, specs: tuple[P, ...]) -> Any:
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    body = jax.shard_map(
        _rank_gather,
        mesh=mesh,
        in_specs=(_RANKS, _RANKS),
        out_specs=_RANKS,
        axis_names={DATA_MESH_AXIS},
        check_vma=False,
    )
    return jax.jit(body, in_shardings=(shardings, host_sharding(mesh)), out_shardings=shardings)


@functools.lru_cache(maxsize=16)
def _scatter_program(mesh: Mesh, specs: tuple[P, ...]) -> Any:
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    body = jax.shard_map(
        _rank_scatter,
        mesh=mesh,
        in_specs=(_RANKS, _RANKS, _RANKS),
        out_specs=_RANKS,
        axis_names={DATA_MESH_AXIS},
        check_vma=False,
    )
    return jax.jit(
        body,
        in_shardings=(shardings, host_sharding(mesh), shardings),
        out_shardings=shardings,
        donate_argnums=0,
    )


class RankStateRows:
    """Rows of DP rank ``rank``'s slice of a stacked recurrent pool's ``arrays``: the gather, its
    rows on the host, and the in-place scatter (module docstring). Shared by the rank's host-tier
    state engine and its ``cpu_tensor`` retraction backup (``kvjax.serve.recurrent_retraction``).

    Raises:
        ValueError: a rank outside ``[0, dp_size)``.
        NotImplementedError: arrays not laid out over a ``("data", ...)`` mesh.
    """

    def __init__(self, arrays: tuple[jax.Array, ...], rank: int) -> None:
        sharding = arrays[0].sharding
        if not isinstance(sharding, NamedSharding):
            raise NotImplementedError(f"DP state pools laid out over a mesh (NamedSharding), not {type(sharding)}")
        self.specs = tuple(_layer_spec(cast(NamedSharding, a.sharding), a.ndim) for a in arrays)
        if self.specs[0][0] != DATA_MESH_AXIS:
            raise NotImplementedError(f"stacked DP pools have their rank axis over {DATA_MESH_AXIS!r}: {self.specs}")
        self.dp_size = int(arrays[0].shape[0])
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is not one of the {self.dp_size} DP ranks")
        self.rank = rank
        self.mesh = cast(Mesh, sharding.mesh)
        self.devices = set(rank_devices(self.mesh, rank).tolist())

    def _slot_rows(self, slots: np.ndarray, fill: int) -> np.ndarray:
        """``[dp, bucket]`` slot ids: the rank's row ``slots`` padded with ``fill``, the others ``fill``."""
        rows = np.full((self.dp_size, _bucket(slots.size)), fill, np.int32)
        rows[self.rank, : slots.size] = slots
        return rows

    def gather(self, arrays: tuple[jax.Array, ...], slots: np.ndarray) -> tuple[jax.Array, ...]:
        """The rank's ``slots`` of every array, as device buffers ``[dp, layers, bucket, *row]``."""
        rows = self._slot_rows(slots, 0)  # padding reads the padding slot
        return cast(tuple[jax.Array, ...], _gather_program(self.mesh, self.specs)(arrays, rows))

    def host(self, buffers: tuple[jax.Array, ...], n: int) -> tuple[np.ndarray, ...]:
        """:meth:`gather`'s buffers on the host: the rank's first ``n`` rows, ``[layers, n, *row]``."""
        return tuple(rank_rows(b, self.devices)[:, :n] for b in buffers)

    def scatter(
        self, arrays: tuple[jax.Array, ...], slots: np.ndarray, rows: tuple[np.ndarray, ...]
    ) -> tuple[jax.Array, ...]:
        """``arrays`` (donated: in place) with ``rows`` written at the rank's ``slots``."""
        ids = self._slot_rows(slots, int(arrays[0].shape[2]))  # past the last slot: dropped
        n = ids.shape[1]
        buffers = []
        for r, spec in zip(rows, self.specs, strict=True):
            padded = np.zeros((r.shape[0], n, *r.shape[2:]), r.dtype)
            padded[:, : r.shape[1]] = r
            shape = (self.dp_size, padded.shape[0], n, *padded.shape[2:])
            piece = functools.partial(_piece, padded)
            buffers.append(rank_buffer(NamedSharding(self.mesh, spec), self.rank, shape, padded.dtype, piece))
        return cast(tuple[jax.Array, ...], _scatter_program(self.mesh, self.specs)(arrays, ids, tuple(buffers)))


class RankStateTransferEngine(StateTransferEngine):
    """The state copy engine of DP rank ``rank`` (module docstring).

    Args:
        pending: the rank's pending device updates (``RankKVCache.pending``).
        host_pool: the rank's host state pool (rows of the rank's whole state).
        rank: the rank's index along ``"data"``.
        copies: the ranks' state-copy updates (``kvjax.dp.rank_state.RankStateCopies``).
        pool_name: the stacked recurrent pool in the pools (``"recurrent"``).

    Raises:
        ValueError: a rank outside ``[0, dp_size)``, or host rows that do not match the rank's.
        NotImplementedError: pools not laid out over a ``("data", ...)`` mesh, or not addressable
            whole by this process.
    """

    def __init__(
        self,
        pending: PendingDeviceUpdates,
        host_pool: HostStatePool,
        rank: int,
        copies: RankStateCopies,
        pool_name: str = STATE_POOL,
    ) -> None:
        self._rows = RankStateRows(pending.owner_pools[pool_name].arrays(), rank)
        self.dp_size = self._rows.dp_size
        self.rank = rank
        self._copies = copies
        super().__init__(pending, host_pool, pool_name)

    def _copied_shapes(self, arrays: tuple[jax.Array, ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(d) for d in a.shape[1:]) for a in arrays)  # one rank's slice

    def _gather_rows(self, arrays: tuple[jax.Array, ...], slots: np.ndarray) -> tuple[jax.Array, ...]:
        return self._rows.gather(arrays, slots)

    def _host_rows(self, buffers: tuple[jax.Array, ...], n: int) -> tuple[np.ndarray, ...]:
        return self._rows.host(buffers, n)

    def _scatter_rows(
        self, arrays: tuple[jax.Array, ...], slots: np.ndarray, rows: tuple[np.ndarray, ...]
    ) -> tuple[jax.Array, ...]:
        return self._rows.scatter(arrays, slots, rows)

    def _copies_update(self, copies: list[tuple[int, int]]) -> DeviceUpdate:
        return self._copies.update(self.rank, copies)


def rank_state_row_copies(rank: int) -> tuple[Callable[[Any, np.ndarray], Any], Callable[[Any, Any, np.ndarray], Any]]:
    """``(get_copy, load_copy)`` of DP rank ``rank``'s state rows for the ``cpu_tensor`` retraction
    backup (a ``RowPart``'s, ``kvjax.serve.recurrent_retraction``): ``get_copy(pool, slots)`` the
    numpy rows of the rank's ``slots`` (O(slots)); ``load_copy(pool, rows, slots)`` the stacked
    pool with them written at the rank's ``slots`` (donated: in place), no other rank's slice
    changed."""

    def get_copy(pool: Any, slots: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = RankStateRows(pool.arrays(), rank)
        return rows.host(rows.gather(pool.arrays(), slots), int(slots.size))

    def load_copy(pool: Any, copy: tuple[np.ndarray, ...], slots: np.ndarray) -> Any:
        arrays = pool.arrays()
        return with_state_arrays(pool, RankStateRows(arrays, rank).scatter(arrays, slots, copy))

    return get_copy, load_copy


def _piece(rows: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    return rows[index]


def rank_state_engine(rank: int, layout: DPLayout) -> StateEngineFactory:
    """The state engine factory of rank ``rank`` of the DP cache laid out as ``layout``
    (``TransferContext.state_engine``): its queued state copies go through the cache's one
    ``RankStateCopies`` (``kvjax.dp.rank_state.rank_state_copies``, made on first use)."""

    def make(pending: PendingDeviceUpdates, host_pool: Any) -> RankStateTransferEngine:
        from kvjax.dp.rank_state import rank_state_copies

        return RankStateTransferEngine(pending, host_pool, rank, rank_state_copies(layout))

    return make
