"""Logical KV dtypes and the dtype each is *stored* as, by name only (no jax, no numpy).

The planner is jax-free, so it reasons about dtypes by name and item size; ``kvjax.pools.dtypes``
turns the same names into jax dtypes for the arrays. Stored as their unsigned-integer bit pattern:
floats narrower than 32 bits on CPU (XLA:CPU makes in-place updates of those O(buffer)).
"""

from __future__ import annotations

from kvjax.errors import ConfigError

# kvjax's name -> (the array dtype's name, bytes per element)
LOGICAL_DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4),
    "bfloat16": ("bfloat16", 2),
    "float16": ("float16", 2),
    "fp8_e4m3": ("float8_e4m3fn", 1),
    "fp8_e5m2": ("float8_e5m2", 1),
}

BITS_DTYPES: dict[int, str] = {1: "uint8", 2: "uint16", 4: "uint32"}

# Backends on which an in-place update of a sub-32-bit float buffer is not in place.
STORE_AS_BITS_PLATFORMS = frozenset({"cpu"})


def _entry(name: str) -> tuple[str, int]:
    try:
        return LOGICAL_DTYPES[name]
    except KeyError:
        raise ConfigError("kv_cache_dtype", name, f"use one of {sorted(LOGICAL_DTYPES)}") from None


def logical_dtype_name(name: str) -> str:
    """The array dtype name of kvjax dtype ``name`` (``"fp8_e4m3"`` -> ``"float8_e4m3fn"``)."""
    return _entry(name)[0]


def itemsize(name: str) -> int:
    """Bytes per element of kvjax dtype ``name``."""
    return _entry(name)[1]


def storage_dtype_name(name: str, platform: str) -> str:
    """The dtype a pool of logical dtype ``name`` is stored as on ``platform`` (same item size)."""
    array_name, size = _entry(name)
    if platform in STORE_AS_BITS_PLATFORMS and size < 4:
        return BITS_DTYPES[size]
    return array_name


def is_fp8(name: str) -> bool:
    """True for the fp8 dtypes (stored values are divided by a per-layer scale)."""
    return name.startswith("fp8")
