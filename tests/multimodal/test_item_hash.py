"""The content hash of a multimodal item: equal inputs, equal hash in every process; any change of
bytes, dtype, shape, modality or preprocessing, another hash; bad input refused."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvjax.multimodal import hash_item

PREP = {"image_mean": [0.5, 0.5, 0.5], "size": {"shortest_edge": 336}, "do_center_crop": True}


def _pixels(seed: int = 0, shape=(3, 8, 8)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_equal_inputs_hash_equal_and_in_range():
    a = hash_item(_pixels(), preprocessing=PREP)
    assert a == hash_item(_pixels().copy(), preprocessing=dict(reversed(list(PREP.items()))))
    assert 0 <= a < 2**64


def test_every_part_of_the_input_changes_the_hash():
    base = _pixels()
    h = hash_item(base, preprocessing=PREP)
    flipped = base.copy()
    flipped[0, 0, 0] += 1.0
    others = [
        hash_item(flipped, preprocessing=PREP),  # one pixel
        hash_item(base.reshape(3, 64), preprocessing=PREP),  # same bytes, another shape
        hash_item(base.view(np.int32), preprocessing=PREP),  # same bytes, another dtype
        hash_item(base, preprocessing={**PREP, "do_center_crop": False}),  # another preprocessing
        hash_item(base, preprocessing=None),
        hash_item(base, preprocessing=PREP, modality="video"),
    ]
    assert h not in others and len(set(others)) == len(others)


def test_layout_and_byte_order_do_not_change_the_hash():
    base = _pixels(1, (4, 6))
    fortran = np.asfortranarray(base)
    big_endian = base.astype(base.dtype.newbyteorder(">"))
    assert hash_item(fortran) == hash_item(big_endian) == hash_item(base)
    assert hash_item(base[:, ::2]) == hash_item(np.ascontiguousarray(base[:, ::2]))


def test_the_same_in_another_process():
    """SHA-256 with no per-process salt: a fresh interpreter (another hash seed) agrees."""
    code = (
        "import numpy as np; from kvjax.multimodal import hash_item; "
        "p = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32); "
        f"print(hash_item(p, preprocessing={PREP!r}))"
    )
    env = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=True
    )
    assert int(out.stdout.strip()) == hash_item(_pixels(), preprocessing=PREP)


def test_odd_dtypes_and_empty_arrays_hash():
    assert hash_item(np.zeros((0, 3), np.float32)) != hash_item(np.zeros((3, 0), np.float32))
    assert hash_item(np.ones(4, bool)) != hash_item(np.ones(4, np.uint8))
    assert hash_item(np.ones(2, np.complex64)) != hash_item(np.ones(4, np.float32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pixel_values": [1.0, 2.0]}, "give a numpy array"),
        ({"pixel_values": np.array(["a"])}, "give a numeric array"),
        ({"pixel_values": np.zeros(2), "modality": "text"}, "modality='text'"),
        ({"pixel_values": np.zeros(2), "preprocessing": {"f": object()}}, "preprocessing="),
        ({"pixel_values": np.zeros(2), "preprocessing": {"mean": float("nan")}}, "finite number"),
        ({"pixel_values": np.zeros(2), "preprocessing": [1, 2]}, "mapping with string keys"),
    ],
)
def test_bad_input_is_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hash_item(**kwargs)
