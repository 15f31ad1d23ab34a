"""Host-side checks for callers of the kernels (pool methods, allocators' users): ids, fp8 scales.

The kernels never clamp: on the device an id out of range is dropped (writes) or reads the
trash page/slot (reads). These helpers reject such ids on the host *before* a call, with an
``InvalidSlotError`` naming the offending ids, so a bad id fails loudly instead of silently
doing nothing. They take concrete ids (numpy arrays, lists, concrete jax arrays); under a
trace the ids are unknown and there is nothing to check.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from kvjax.errors import InvalidSlotError

_SHOWN = 8


def _ids(name: str, ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise InvalidSlotError(f"{name} has shape {list(arr.shape)}; expected a 1-D array of ids")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidSlotError(f"{name} must hold integer ids, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _listing(values: np.ndarray) -> str:
    more = f" ... ({values.size} in all)" if values.size > _SHOWN else ""
    return f"{values[:_SHOWN].tolist()}{more}"


def check_ids_in_range(name: str, ids: Any, low: int, high: int, *, kind: str = "slot") -> np.ndarray:
    """Reject ids outside ``[low, high)``; return them as int64 numpy.

    ``kind`` names what the ids are (``"slot"``, ``"page"``) in the message.
    """
    arr = _ids(name, ids)
    bad = arr[(arr < low) | (arr >= high)]
    if bad.size:
        raise InvalidSlotError(f"{name}: {kind} id(s) outside [{low}, {high}): {_listing(bad)}")
    return arr


def check_unique(name: str, ids: Any, *, kind: str = "slot") -> np.ndarray:
    """Reject ids that occur more than once (two writes to one place)."""
    arr = _ids(name, ids)
    values, counts = np.unique(arr, return_counts=True)
    dup = values[counts > 1]
    if dup.size:
        raise InvalidSlotError(f"{name}: duplicate {kind} id(s) {_listing(dup)}; each destination must appear once")
    return arr


def check_disjoint(src_name: str, src: Any, dst_name: str, dst: Any, *, kind: str = "slot") -> None:
    """Reject destinations that are also sources (for kernels that require it, e.g. state forks)."""
    both = np.intersect1d(_ids(src_name, src), _ids(dst_name, dst))
    if both.size:
        raise InvalidSlotError(f"{dst_name}: {kind} id(s) {_listing(both)} are also in {src_name}")


def check_kv_write(loc: Any, num_slots: int, page_size: int, *, allow_trash: bool = True) -> np.ndarray:
    """Slots for ``write_kv``: in ``[0, num_slots)`` (trash page allowed for padding) and live ones unique."""
    arr = check_ids_in_range("loc", loc, 0 if allow_trash else page_size, num_slots)
    check_unique("loc (live slots)", arr[arr >= page_size])
    return arr


def check_copy(src: Any, dst: Any, num_ids: int, *, first_live: int, kind: str = "slot") -> None:
    """Ids for ``copy_slots``/``copy_pages``: sources in range, destinations live and unique."""
    s = check_ids_in_range("src", src, 0, num_ids, kind=kind)
    d = check_ids_in_range("dst", dst, first_live, num_ids, kind=kind)
    if s.shape != d.shape:
        raise InvalidSlotError(f"src has {s.size} ids but dst has {d.size}; pass one dst per src")
    check_unique("dst", d, kind=kind)


def check_fork(src: Any, dst: Any, num_slots: int) -> None:
    """Ids for ``copy_state_slots``: in ``[1, num_slots)``, destinations unique and not sources."""
    check_copy(src, dst, num_slots, first_live=1, kind="state slot")
    check_ids_in_range("src", src, 1, num_slots, kind="state slot")
    check_disjoint("src", src, "dst", dst, kind="state slot")


def check_kv_scale(name: str, scale: Any) -> None:
    """Reject a concrete fp8 scale that is zero, negative or not finite (``ValueError`` naming it).

    Traced scales cannot be checked here; ``MHAKVPool.set_kv_scale`` checks what the pool holds.
    """
    if scale is None or isinstance(scale, jax.core.Tracer):
        return
    values = np.asarray(scale, dtype=np.float64)
    if values.size != 1:
        raise ValueError(f"{name} has shape {list(values.shape)}; expected one scale (a scalar)")
    value = float(values.reshape(()))
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"{name}={value} is not a usable fp8 scale: it must be finite and > 0 (stored = value / scale)"
        )
