"""Logical KV dtypes, their storage dtypes, and the conversions between them (jax side).

A pool is *logically* bf16, f32 or fp8, but on some backends it is *stored* as the unsigned
integer of the same width and bit-cast on every read and write:

* XLA:CPU makes any in-place update of a bf16 buffer cost O(buffer) (it upcasts or copies the
  whole buffer); an update of a uint16 buffer is truly in place. So on CPU bf16 is stored as uint16.
* fp8 is stored as uint8 on CPU for the same reason (SGLang does the same on GPU because
  ``index_put`` lacks fp8).

Which dtype is stored where is decided by name in ``kvjax.layout.storage`` (jax-free, for the
planner); this module only turns those names into jax dtypes. Bit-casting between types of the
same width is free in XLA (no data movement).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.layout import storage
from kvjax.layout.storage import is_fp8

__all__ = ["from_storage", "is_fp8", "logical_dtype", "storage_dtype", "to_storage"]


def logical_dtype(name: str) -> np.dtype:
    """The JAX dtype of a kvjax dtype name (``"bfloat16"``, ``"fp8_e4m3"``, ...)."""
    return jnp.dtype(storage.logical_dtype_name(name))


def storage_dtype(name: str, platform: str) -> np.dtype:
    """The dtype a pool of logical dtype ``name`` is stored as on ``platform``."""
    return jnp.dtype(storage.storage_dtype_name(name, platform))


def to_storage(x: jnp.ndarray, store: np.dtype) -> jnp.ndarray:
    """Bit-cast an array of the logical dtype to the storage dtype (no-op when equal)."""
    return x if x.dtype == store else jnp.asarray(x).view(store)


def from_storage(x: jnp.ndarray, logical: np.dtype) -> jnp.ndarray:
    """Bit-cast a stored array back to its logical dtype (no-op when equal)."""
    return x if x.dtype == logical else x.view(logical)
