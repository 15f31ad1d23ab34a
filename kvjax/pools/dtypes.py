"""Logical KV dtypes, their storage dtypes, and the conversions between them.

A pool is *logically* bf16, f32 or fp8, but on some backends it is *stored* as the unsigned
integer of the same width and bit-cast on every read and write:

* XLA:CPU makes any in-place update of a bf16 buffer cost O(buffer) (it upcasts or copies the
  whole buffer); an update of a uint16 buffer is truly in place. So on CPU bf16 is stored as uint16.
* fp8 is stored as uint8 on CPU for the same reason (SGLang does the same on GPU because
  ``index_put`` lacks fp8).

Bit-casting between types of the same width is free in XLA (no data movement).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.errors import ConfigError

LOGICAL_DTYPES: dict[str, np.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}

_BITS_DTYPE = {1: jnp.dtype(jnp.uint8), 2: jnp.dtype(jnp.uint16), 4: jnp.dtype(jnp.uint32)}

# Backends on which an in-place update of a sub-32-bit float buffer is not in place.
_STORE_AS_BITS_PLATFORMS = frozenset({"cpu"})


def logical_dtype(name: str) -> np.dtype:
    """The JAX dtype of a kvjax dtype name (``"bfloat16"``, ``"fp8_e4m3"``, ...)."""
    try:
        return LOGICAL_DTYPES[name]
    except KeyError:
        raise ConfigError("kv_cache_dtype", name, f"use one of {sorted(LOGICAL_DTYPES)}") from None


def storage_dtype(name: str, platform: str) -> np.dtype:
    """The dtype a pool of logical dtype ``name`` is stored as on ``platform``.

    On CPU, floats narrower than 32 bits are stored as their unsigned-integer bit pattern;
    everywhere else the logical dtype is stored as is.
    """
    dtype = logical_dtype(name)
    if platform in _STORE_AS_BITS_PLATFORMS and dtype.itemsize < 4:
        return _BITS_DTYPE[dtype.itemsize]
    return dtype


def is_fp8(name: str) -> bool:
    return name.startswith("fp8")


def to_storage(x: jnp.ndarray, store: np.dtype) -> jnp.ndarray:
    """Bit-cast an array of the logical dtype to the storage dtype (no-op when equal)."""
    return x if x.dtype == store else jnp.asarray(x).view(store)


def from_storage(x: jnp.ndarray, logical: np.dtype) -> jnp.ndarray:
    """Bit-cast a stored array back to its logical dtype (no-op when equal)."""
    return x if x.dtype == logical else x.view(logical)
