"""`HostStatePool`: the host tier's copies of recurrent-state checkpoints (SGLang's ``MambaPoolHost``).

A hybrid recurrent model's device state pool (``kvjax.pools.recurrent.RecurrentStatePool``) holds,
per tensor (each conv tensor, then the SSM tensor), one array ``[layers, slots + 1, *row]``. Its
host pool holds the same tensors slot-first (SGLang's ``page_first`` layout: one slot's rows of
every layer are contiguous)::

    arrays[i] : [size, layers, *row_i]     (numpy, the device array's storage dtype)

one host slot per checkpoint (a page of one slot, as SGLang's ``page_size = 1``), with no
reserved slot. Rows are stored bit for bit as the device stores them (16-bit floats as their
bit pattern on CPU, lane-dense conv rows on TPU), so a copy is a plain move of bytes.

Its size is planned (``kvjax.plan.kinds.recurrent.host_state_slots``, SGLang's
``MambaPoolHost.__init__`` sizing).

Slots come from a :class:`~kvjax.tiers.host_allocator.HostSlotAllocator` of page size 1
(``allocator``). Units: slots are states; bytes are host bytes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvjax.errors import ConfigError, InvalidSlotError
from kvjax.tiers.host_allocator import HostSlotAllocator

__all__ = ["HostStatePool", "create_host_state_pool", "state_rows"]

#: The lane width of a lane-dense conv row (``RecurrentStatePool``'s TPU storage).
_LANES = 128


def state_rows(layout: Any, platform: str) -> tuple[tuple[tuple[int, ...], str], ...]:
    """Per device array of a recurrent pool of ``layout`` (a ``RecurrentLayout``, per rank) on
    ``platform``: its stored row (every TP rank's channels or heads) and storage dtype name, as
    ``RecurrentStatePool.create`` stores them (lane-dense conv rows on TPU)."""
    from kvjax.layout import storage

    ranks = int(layout.tp_size)
    conv_store = storage.storage_dtype_name(layout.conv_dtype, platform)
    rows: list[tuple[tuple[int, ...], str]] = []
    for shape in layout.conv_state_shapes:
        per_rank = (-(-math.prod(shape) // _LANES), _LANES) if platform == "tpu" else tuple(shape)
        rows.append(((per_rank[0] * ranks, *per_rank[1:]), conv_store))
    ssm = tuple(layout.ssm_state_shape)
    rows.append(((ssm[0] * ranks, *ssm[1:]), storage.storage_dtype_name(layout.ssm_dtype, platform)))
    return tuple(rows)


class HostStatePool:
    """Host copies of recurrent-state slots (see the module docstring).

    Args:
        size: host state slots (> 0).
        num_layers: recurrent layers per array.
        rows: per device array, ``(row shape, storage dtype name)``: conv tensors first, then SSM.
    """

    def __init__(self, size: int, num_layers: int, rows: tuple[tuple[tuple[int, ...], str], ...]) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
            raise ConfigError("host state pool size", size, "use a positive number of slots")
        if num_layers < 1 or not rows:
            raise ConfigError("host state pool", (num_layers, rows), "give at least one layer and one array")
        self.size = int(size)
        self.num_layers = int(num_layers)
        self.rows = tuple((tuple(int(d) for d in shape), str(dtype)) for shape, dtype in rows)
        self.arrays = tuple(
            np.zeros((self.size, self.num_layers, *shape), dtype=_np_dtype(dtype)) for shape, dtype in self.rows
        )
        self.allocator = HostSlotAllocator(self.size, 1)

    @property
    def bytes_per_slot(self) -> int:
        """Host bytes of one state (every layer, every array)."""
        return sum(a[0].nbytes for a in self.arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def check_slots(self, host_slots: Any, what: str = "host state slots") -> np.ndarray:
        """``host_slots`` as an int64 array of ids in ``[0, size)``; InvalidSlotError naming them."""
        ids = np.asarray(host_slots, dtype=np.int64).ravel()
        bad = ids[(ids < 0) | (ids >= self.size)]
        if bad.size:
            raise InvalidSlotError(f"{what} {bad.tolist()} out of range [0, {self.size})")
        return ids

    def write(self, host_slots: Any, data: tuple[np.ndarray, ...]) -> None:
        """Store ``data`` (per array ``[layers, n, *row]``, the device's gather) into ``host_slots``."""
        ids = self.check_slots(host_slots)
        if len(data) != len(self.arrays):
            raise ValueError(f"{len(data)} arrays for a host state pool of {len(self.arrays)}")
        for host, rows in zip(self.arrays, data, strict=True):
            host[ids] = np.swapaxes(np.asarray(rows).view(host.dtype), 0, 1)

    def read(self, host_slots: Any) -> tuple[np.ndarray, ...]:
        """The rows of ``host_slots``, per array ``[layers, n, *row]`` (copies)."""
        ids = self.check_slots(host_slots)
        return tuple(np.ascontiguousarray(np.swapaxes(a[ids], 0, 1)) for a in self.arrays)

    def __repr__(self) -> str:
        return f"HostStatePool(size={self.size}, layers={self.num_layers}, rows={self.rows})"


def _np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a storage dtype name (bfloat16 and fp8 through ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def create_host_state_pool(pool: Any, context: Any) -> HostStatePool:
    """The pool registry's builder for ``"host_state"``: a ``PoolPlan`` of ``shape[0]`` host state
    slots over ``pool.layer_ids`` whose ``layout`` is the device pool's ``RecurrentLayout``; rows
    stored as the device stores them on ``context.platform``."""
    return HostStatePool(int(pool.shape[0]), len(pool.layer_ids), state_rows(pool.layout, context.platform))
