"""Pad values (SGLang's shifted ``hash % 2**30``), items and the padded prompt: what each writes,
and one clear error for each bad input with the prompt unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.multimodal import (
    MM_PAD_SHIFT_VALUE,
    MultimodalItem,
    check_vocab_size,
    hash_item,
    is_pad_value,
    pad_input_ids,
    pad_value,
    placeholder_ranges,
)

IMG = 7  # the placeholder token id


def test_pad_value_is_sglangs_shifted_hash_and_fits_int32():
    for h in (0, 1, 2**30 - 1, 2**30, 2**64 - 1, 123456789012345):
        v = pad_value(h)
        assert v == 1_000_000 + h % (1 << 30) and is_pad_value(v) and v < 2**31
    assert not is_pad_value(MM_PAD_SHIFT_VALUE - 1) and not is_pad_value(0)
    with pytest.raises(ValueError, match="item_hash=-1"):
        pad_value(-1)


def test_vocab_check():
    check_vocab_size(1_000_000)
    with pytest.raises(ValueError, match="vocab_size=1000001"):
        check_vocab_size(1_000_001)


def test_item_from_pixels_and_its_checks():
    pixels = np.ones((3, 4, 4), np.float32)
    item = MultimodalItem.from_pixels(pixels, 2, 6, preprocessing={"size": 4})
    assert item.hash == hash_item(pixels, preprocessing={"size": 4}) and item.num_tokens == 4
    assert item.pad_value == pad_value(item.hash)
    with pytest.raises(ValueError, match=r"\[start, end\)=\[3, 3\)"):
        MultimodalItem(1, 3, 3)
    with pytest.raises(ValueError, match="start=-1"):
        MultimodalItem(1, -1, 3)
    with pytest.raises(ValueError, match="hash="):
        MultimodalItem(2**64, 0, 3)
    with pytest.raises(ValueError, match="modality='text'"):
        MultimodalItem(1, 0, 3, "text")


def test_placeholder_ranges_split_adjacent_images_by_count():
    ids = [1, IMG, IMG, IMG, IMG, IMG, 2, IMG, IMG, 3]
    assert placeholder_ranges(ids, IMG, [2, 3, 2]) == [(1, 3), (3, 6), (7, 9)]
    assert placeholder_ranges(np.array(ids), IMG, [5, 2]) == [(1, 6), (7, 9)]
    with pytest.raises(ValueError, match="holds 7 placeholder tokens .* 2 items need 6"):
        placeholder_ranges(ids, IMG, [3, 3])
    with pytest.raises(ValueError, match="not contiguous"):
        placeholder_ranges(ids, IMG, [4, 3])
    with pytest.raises(ValueError, match="at least one"):
        placeholder_ranges(ids, IMG, [0, 7])


def test_pad_input_ids_writes_each_items_pad_value_and_leaves_the_input():
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    a, b = MultimodalItem(11, 1, 3), MultimodalItem(22, 4, 7)
    out = pad_input_ids(ids, [a, b], IMG)
    assert out == [1, a.pad_value, a.pad_value, 2, b.pad_value, b.pad_value, b.pad_value, 3]
    assert ids == [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    assert pad_input_ids(np.array(ids, np.int32), [a, b], IMG) == out
    assert pad_input_ids([1, 2], [], IMG) == [1, 2]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([MultimodalItem(1, 1, 3)], "holds 5 placeholder tokens .* cover 2"),  # an image missing
        ([MultimodalItem(1, 0, 3), MultimodalItem(2, 4, 7)], "position 0, which holds 1"),
        ([MultimodalItem(1, 4, 7), MultimodalItem(2, 1, 3)], "overlaps or precedes"),
        ([MultimodalItem(1, 1, 3), MultimodalItem(2, 4, 9)], "ends past the prompt's 8 tokens"),
        ([(1, 3)], "give MultimodalItem"),
    ],
)
def test_pad_input_ids_bad_input(items, message):
    ids = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    with pytest.raises(ValueError, match=message):
        pad_input_ids(ids, items, IMG)
    assert ids == [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
