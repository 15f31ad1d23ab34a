"""The GGUF container read without the ``gguf`` package: metadata and tensor directory.

A GGUF file (llama.cpp's format, version 2 or 3, little-endian) is a header, ``kv_count``
metadata entries, ``tensor_count`` tensor descriptions, then the tensor data, aligned to
``general.alignment`` bytes (32 when absent). Each tensor's data starts at its ``offset``
from the data section. Dimensions are written innermost first (``ne0`` first): a ``[576, 49152]``
embedding is 49152 rows of 576 values, ``shape`` here is numpy's order ``(49152, 576)``.

Reading is a single pass over the header with ``struct`` (string arrays such as a 49k-entry
vocabulary take tens of milliseconds); tensor data is not read until asked for, as a read-only
``numpy.memmap`` of the raw bytes (`GGUFFile.raw`). Every malformed file is a `ConfigError` naming
the file and what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvjax.errors import ConfigError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

#: GGUF value types -> struct format of one scalar (8 is a string, 9 an array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

#: ggml tensor types kvjax knows the size of: type id -> (name, values per block, bytes per block).
#: The numbers are ggml's (``ggml.h``); which of them can be dequantised is `kvjax.gguf.tensors`' business.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` in numpy order (outermost first), ``type_name`` ggml's
    (``Q4_1``), ``offset`` in bytes from the data section, ``nbytes`` its stored size."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (``shape[-1]`` values, whole blocks)."""
        _, block, block_bytes = GGML_TYPES[self.type_id]
        return self.shape[-1] // block * block_bytes


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> str, int, float, bool or list), ``tensors`` in
    file order, and where the data section starts (``data_start``, bytes from the file's start)."""

    path: Path
    version: int
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo]
    data_start: int

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``, ...); a `ConfigError` when absent."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError("model", str(self.path), "has no general.architecture; it is not a model GGUF file")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored bytes as a read-only ``uint8`` array of shape ``(rows, row_bytes)``."""
        info = self.tensors[name]
        rows = math.prod(info.shape[:-1])
        data = np.memmap(
            self.path, dtype=np.uint8, mode="r", offset=self.data_start + info.offset, shape=(info.nbytes,)
        )
        return data.reshape(rows, info.row_bytes)


class _Cursor:
    """Little-endian reads from a byte buffer, failing with the file's name when it runs out."""

    def __init__(self, path: Path, data: bytes | memoryview) -> None:
        self.path, self.data, self.pos = path, data, 0

    def fail(self, what: str) -> ConfigError:
        return ConfigError("model", str(self.path), f"is not a valid GGUF file ({what} at byte {self.pos})")

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise self.fail("truncated")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.data):
            raise self.fail("truncated string")
        text = bytes(self.data[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                end = self.pos + count * dtype.itemsize
                if end > len(self.data):
                    raise self.fail("truncated array")
                values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item_type) for _ in range(count)]
        raise self.fail(f"unknown metadata value type {type_id}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor directory (no tensor data is read).

    A command reads one file up to three times (its spec, its tokenizer, its weights), so the
    last few parses are kept, keyed by the resolved path, size and modification time (a changed
    file is parsed again). Raises `ConfigError` for a file that is missing, not GGUF, of an
    unknown version, truncated, or names a tensor type ggml does not define.
    """
    file = Path(path)
    try:
        stat = file.stat()
    except OSError as e:
        raise ConfigError("model", str(path), f"cannot be read ({e}); pass a readable .gguf file") from None
    return _parse(file.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parse(file: Path, size: int, mtime_ns: int) -> GGUFFile:
    """`read_gguf`'s parse of ``file`` as it was at ``size`` bytes and ``mtime_ns``."""
    path = file
    try:
        raw = np.memmap(file, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError("model", str(path), f"cannot be read ({e}); pass a readable .gguf file") from None
    cursor = _Cursor(file, raw.data)
    if bytes(cursor.data[:4]) != MAGIC:
        raise ConfigError("model", str(path), "is not a GGUF file (it does not start with 'GGUF')")
    cursor.pos = 4
    version = cursor.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ConfigError("model", str(path), f"is GGUF version {version}{hint}; kvjax reads versions 2 and 3")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    tensors: dict[str, TensorInfo] = {}
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        type_id, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        if type_id not in GGML_TYPES:
            raise ConfigError("model", str(path), f"tensor {name} has ggml type {type_id}, which kvjax does not know")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        count = math.prod(dims)
        if dims and dims[0] % block:
            raise cursor.fail(f"tensor {name}'s rows of {dims[0]} are not whole {type_name} blocks of {block}")
        tensors[name] = TensorInfo(
            name, tuple(reversed(dims)), type_id, type_name, offset, count // block * block_bytes
        )
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise cursor.fail(f"general.alignment {alignment!r} is not a positive integer")
    data_start = -(-cursor.pos // alignment) * alignment
    for info in tensors.values():
        if data_start + info.offset + info.nbytes > len(raw):
            raise ConfigError(
                "model", str(path), f"is truncated: tensor {info.name} ends past the end of the file; re-download it"
            )
    return GGUFFile(file, version, metadata, tensors, data_start)
