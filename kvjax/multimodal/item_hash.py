"""`hash_item`: the content hash of one multimodal item's encoder inputs (SGLang's ``hash_feature``).

The hash names what the vision encoder will see: the pixel values' bytes, their dtype and shape,
the modality, and the preprocessing that produced them (resize, crop, normalisation, as a
JSON-able mapping such as a checkpoint's ``preprocessor_config.json``). Equal inputs give the
same hash in every process, every run and every rank (SHA-256, no per-process salt), so every
rank of a tensor-parallel group makes the same embedding-cache decision and writes the same pad
value into the request's key (``kvjax.multimodal.pad_values``).

Where kvjax differs from SGLang: SGLang's ``hash_feature`` hashes the feature's raw bytes alone
(``sha256(bytes)[:8]``, big-endian, unsigned), so two arrays with the same bytes but another dtype or
shape, or the same pixels preprocessed for another checkpoint, share a hash. kvjax hashes a header
(format tag, modality, dtype in little-endian form, shape, the preprocessing as canonical JSON)
before the bytes; the result has SGLang's form (the first 8 digest bytes, big-endian, unsigned:
an int in ``[0, 2**64)``). Big-endian arrays are hashed as their little-endian equivalent, so the
hash depends on the values, never on the byte order they are stored in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["HASH_FORMAT", "MODALITIES", "hash_item"]

#: Mixed into every hash: a change of the header's layout changes every hash.
HASH_FORMAT = b"kvjax-mm-item-v1"

#: The modalities an item may have (SGLang's ``Modality``: image, video, audio).
MODALITIES = ("image", "video", "audio")

_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex


def canonical_preprocessing(preprocessing: Mapping[str, Any] | None) -> bytes:
    """``preprocessing`` as canonical JSON bytes (keys sorted, no spaces); ``b"null"`` for None.

    Raises:
        ValueError: ``preprocessing`` is not a mapping with string keys, or holds a value JSON
            cannot write (give plain numbers, strings, lists and mappings).
    """
    if preprocessing is None:
        return b"null"
    if not isinstance(preprocessing, Mapping) or not all(isinstance(k, str) for k in preprocessing):
        raise ValueError(
            f"preprocessing={preprocessing!r}: give a mapping with string keys (the preprocessor's settings), or None"
        )
    try:
        text = json.dumps(preprocessing, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"preprocessing={preprocessing!r}: every value must be a finite number, a string, a bool, None, "
            f"a list or a mapping ({exc})"
        ) from exc
    return text.encode()


def hash_item(
    pixel_values: np.ndarray, *, preprocessing: Mapping[str, Any] | None = None, modality: str = "image"
) -> int:
    """The content hash of one item: an int in ``[0, 2**64)``, the same in every process.

    Args:
        pixel_values: the encoder's input for this item (a numpy array of any numeric dtype and
            shape, e.g. float32 ``[3, 336, 336]``); read, never changed.
        preprocessing: the settings that produced ``pixel_values`` (JSON-able mapping), or None.
        modality: one of :data:`MODALITIES`.

    Cost: one pass of SHA-256 over the array's bytes (plus a copy when the array is not
    C-contiguous or not little-endian).

    Raises:
        ValueError: ``pixel_values`` is not a numpy array of a numeric dtype, ``modality`` is
            unknown, or ``preprocessing`` is not JSON-able (nothing is hashed).
    """
    if modality not in MODALITIES:
        raise ValueError(f"modality={modality!r}: use one of {', '.join(MODALITIES)}")
    if not isinstance(pixel_values, np.ndarray):
        raise ValueError(
            f"pixel_values of type {type(pixel_values).__name__}: give a numpy array (np.asarray(...) first)"
        )
    if pixel_values.dtype.kind not in _NUMERIC_KINDS:
        raise ValueError(f"pixel_values of dtype {pixel_values.dtype}: give a numeric array (bool, int, float)")
    prep = canonical_preprocessing(preprocessing)
    array = pixel_values
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    array = np.ascontiguousarray(array)
    header = b"\0".join(
        [
            HASH_FORMAT,
            modality.encode(),
            array.dtype.str.encode(),
            ",".join(str(n) for n in array.shape).encode(),
            prep,
        ]
    )
    hasher = hashlib.sha256()
    hasher.update(len(header).to_bytes(8, "little"))
    hasher.update(header)
    hasher.update(array.reshape(-1).view(np.uint8).data)
    return int.from_bytes(hasher.digest()[:8], byteorder="big", signed=False)
