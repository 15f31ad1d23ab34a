"""Where the TPU's shapes rules live: the lane width that pads head dims, and the packing of
narrow dtypes into 32-bit words. Every pool layout asks these; nothing else restates them.

* ``head_dim_alignment(platform)``: on TPU the minor (lane) axis of an array is 128 wide, and the
  ragged paged attention kernels (tpu-inference, sglang-jax) read head dims padded to a multiple
  of 128; elsewhere no padding (1).
* ``tpu_packing(itemsize)``: tokens of a sub-32-bit dtype are packed ``32 / bits`` to a word
  (bf16 2, fp8 4, f32 1); tpu-inference's RPA v3 needs ``page_size`` divisible by it.
"""

from __future__ import annotations

TPU_LANE_WIDTH = 128
"""Elements along the TPU's minor (lane) axis; head dims are padded to a multiple of it on TPU."""

TPU_WORD_BITS = 32


def head_dim_alignment(platform: str) -> int:
    """The multiple head dims are padded to on ``platform``: 128 on TPU, 1 elsewhere."""
    return TPU_LANE_WIDTH if platform == "tpu" else 1


def tpu_packing(itemsize: int) -> int:
    """Elements of ``itemsize`` bytes packed in one 32-bit TPU word (bf16 2, fp8 4, f32 1)."""
    return max(1, TPU_WORD_BITS // (8 * itemsize))


def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (> 0)."""
    return -(-x // multiple) * multiple
