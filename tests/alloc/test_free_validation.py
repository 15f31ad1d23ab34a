"""The validated ``free``'s fast paths against a plain reference: the same pages in the same order
(``np.unique``'s ascending distinct pages), and every bad input refused with the state unchanged,
for int32 and int64 ids, sorted and unsorted, power-of-two page sizes and others."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.alloc import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvjax.errors import DoubleFreeError, InvalidSlotError
from tests.alloc.test_allocator_scenarios import got, snapshot

DTYPES = [np.int32, np.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [2, 3, 16])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_paged_free_returns_unique_pages_in_order(dtype, ps, data):
    a = PagedTokenToKVPoolAllocator(12 * ps, ps)
    slots = got(a.alloc(12 * ps))
    # Any selection of the handed-out slots, repeated and in any order.
    chosen = data.draw(st.lists(st.sampled_from(slots.tolist()), min_size=1, max_size=40))
    ids = np.asarray(chosen, dtype)
    expect = np.unique(ids // ps).tolist()
    a.free(ids)
    assert a.free_pages[: len(expect)].tolist() == expect  # prepended ascending (LIFO head first)
    assert a.available_size() == len(expect) * ps
    a.check_invariants()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [1, 3, 16])
def test_bad_ids_of_either_dtype_are_refused_with_state_unchanged(dtype, ps):
    a = TokenToKVPoolAllocator(8) if ps == 1 else PagedTokenToKVPoolAllocator(8 * ps, ps)
    x = got(a.alloc(4 * ps))
    a.free(x[:ps])
    before = snapshot(a)
    limit = 9 * ps  # trash page + 8 pages
    for bad, err, what in [
        ([0], InvalidSlotError, "trash page"),
        ([ps - 1, int(x[-1])], InvalidSlotError, "trash page"),
        ([int(x[-1]), -1], InvalidSlotError, "out of range"),
        ([limit], InvalidSlotError, "out of range"),
        ([int(x[-1]), limit + 5, 0], InvalidSlotError, "out of range"),  # range reported first
        ([int(x[ps]), int(x[0])], DoubleFreeError, "double free"),
    ]:
        with pytest.raises(err, match=what):
            a.free(np.asarray(bad, dtype))
        assert snapshot(a) == before, bad
    a.check_invariants()


def test_int32_extremes_are_out_of_range_not_wrapped():
    a = PagedTokenToKVPoolAllocator(8 * 16, 16)
    got(a.alloc(4 * 16))
    before = snapshot(a)
    for bad in ([np.iinfo(np.int32).min], [np.iinfo(np.int32).max], [-16, 16]):
        with pytest.raises(InvalidSlotError, match="out of range"):
            a.free(np.asarray(bad, np.int32))
    assert snapshot(a) == before


def test_one_page_free_and_partial_page_ids():
    a = PagedTokenToKVPoolAllocator(8 * 16, 16)
    x = got(a.alloc(3 * 16))
    a.free(x[16 + 5 : 16 + 9])  # four ids inside page 2 free the whole page
    assert a.free_pages[0] == 2
    with pytest.raises(DoubleFreeError, match=r"\[2\]"):
        a.free(x[16:17])
    a.free(np.concatenate([x[32:48], x[:16]])[::-1])  # pages 3 and 1, ids descending (sort fallback)
    assert a.free_pages[:3].tolist() == [1, 3, 2]
    a.check_invariants()


def test_free_does_not_keep_or_change_the_callers_array():
    a = PagedTokenToKVPoolAllocator(8 * 16, 16)
    x = got(a.alloc(2 * 16))
    ids = x.copy()
    a.free_group_begin()
    a.free(ids)
    ids[:] = 17  # the caller reuses its buffer before the group ends
    a.free_group_end()
    assert sorted(a.free_pages[:2].tolist()) == [1, 2]
    np.testing.assert_array_equal(x, np.arange(16, 48))
    a.check_invariants()
