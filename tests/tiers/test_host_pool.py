"""Host pool, its slot allocator and sizing (SGLang's HostKVCache rules)."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError
from kvjax.tiers import HostKVPool, HostSlotAllocator, check_host_memory, host_pool_tokens


@pytest.mark.parametrize("page,expect", [(1, 129), (4, 132)])
def test_sizing_matches_sglang_reference(page, expect):
    # 64 device tokens, ratio 2 -> 129 at page 1, 132 at page 4 (no reserved host slot)
    assert host_pool_tokens(64, page, hicache_ratio=2.0) == expect
    assert HostSlotAllocator(expect, page).available_size() == expect


def test_sizing_rounds_pages_down_then_adds_one():
    assert host_pool_tokens(65, 4, hicache_ratio=2.0) == 132  # 130 // 4 = 32 pages + 1
    assert (
        host_pool_tokens(0, 4, hicache_ratio=2.0, hicache_size_gb=1e-6, bytes_per_token=100) == 12
    )  # 10 tokens -> 2 pages + 1


def test_sizing_by_gb_needs_bytes_per_token():
    with pytest.raises(ConfigError, match="bytes_per_token"):
        host_pool_tokens(64, 1, hicache_ratio=2.0, hicache_size_gb=1.0)


def test_host_memory_check_names_the_figures():
    with pytest.raises(ConfigError, match=r"needs 20\.00 GiB.*24\.00 GiB"):
        check_host_memory(20 << 30, 24 << 30)
    check_host_memory(10 << 30, 24 << 30)


def test_allocator_hands_out_every_slot_fifo_whole_pages():
    a = HostSlotAllocator(8, 2)
    assert a.alloc(4).tolist() == [0, 1, 2, 3]
    assert a.alloc(4).tolist() == [4, 5, 6, 7]
    assert a.alloc(2) is None and a.available_size() == 0
    a.free(np.array([6, 7, 0, 1]))
    assert a.alloc(2).tolist() == [6, 7]  # freed pages come back in the order given
    a.check_invariants()


@pytest.mark.parametrize(
    "bad,err",
    [([9], InvalidSlotError), ([-1], InvalidSlotError), ([4], DoubleFreeError), ([0, 4], DoubleFreeError)],
)
def test_allocator_rejects_bad_frees_unchanged(bad, err):
    a = HostSlotAllocator(8, 2)
    a.alloc(4)
    before = (a.available_size(), a.free_pages.tolist())
    with pytest.raises(err):
        a.free(np.array(bad))
    assert (a.available_size(), a.free_pages.tolist()) == before


def test_allocator_rejects_unaligned_sizes():
    with pytest.raises(ValueError, match="multiple of page_size"):
        HostSlotAllocator(8, 2).alloc(3)
    with pytest.raises(ConfigError):
        HostSlotAllocator(7, 2)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pool_layouts_round_trip_pages(layout):
    pool = HostKVPool(size=8, num_layers=3, page_row=(2, 4, 5), itemsize=2, layout=layout)
    want = (3, 4, 2, 4, 5) if layout == "layer_first" else (4, 3, 2, 4, 5)
    assert pool.storage.shape == want and pool.storage.dtype == np.uint16
    assert pool.bytes_per_token == 3 * 4 * 5 * 2
    slots = pool.allocator.alloc(4)
    buf = np.arange(np.prod(pool.buffer_shape(2)), dtype=np.uint16).reshape(pool.buffer_shape(2))
    pool.write_pages(slots, buf)
    np.testing.assert_array_equal(pool.read_pages(slots), buf)
    np.testing.assert_array_equal(pool.read_pages(slots[2:]), buf[:, 1:])


def test_pool_rejects_partial_pages_and_wrong_buffers():
    pool = HostKVPool(size=8, num_layers=1, page_row=(2, 1, 1), itemsize=2, layout="layer_first")
    with pytest.raises(InvalidSlotError, match="whole pages"):
        pool.write_pages([1, 2], np.zeros(pool.buffer_shape(1), np.uint16))
    with pytest.raises(ValueError, match="buffer"):
        pool.write_pages([0, 1], np.zeros((1, 2, 2, 1, 1), np.uint16))
    assert not pool.storage.any()


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_unbuilt_layouts_are_named(layout):
    with pytest.raises(NotImplementedError, match=layout):
        HostKVPool(size=4, num_layers=1, page_row=(1, 1, 1), itemsize=2, layout=layout)
