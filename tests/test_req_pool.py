"""ReqToTokenPool: row free list, table writes and reads, page table."""

from __future__ import annotations

from typing import TypeVar

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.errors import ConfigError, DoubleFreeError, InvalidSlotError
from kvjax.req_pool import ReqToTokenPool

T = TypeVar("T")


def allocated(result: T | None) -> T:
    """An allocation's result, failing the test when it returned None."""
    assert result is not None, "the allocation returned None"
    return result


def state(p: ReqToTokenPool) -> tuple:
    return (p.free_slots, p.available_size(), p.req_to_token.copy().tolist())


def test_init_and_alloc_fifo():
    p = ReqToTokenPool(4, 8)
    assert p.req_to_token.shape == (4, 8) and p.req_to_token.dtype == np.int32
    assert not p.req_to_token.any()
    assert p.alloc(0) == []
    assert p.alloc(2) == [0, 1]  # row 0 is an ordinary row here
    assert p.available_size() == 2
    assert p.alloc(3) is None
    p.free(0)
    p.free([1])
    assert p.free_slots == [2, 3, 0, 1]
    assert p.alloc(4) == [2, 3, 0, 1]
    assert p.alloc(1) is None
    p.clear()
    assert p.free_slots == [0, 1, 2, 3]
    p.check_invariants()


def test_free_errors_leave_state_unchanged():
    p = ReqToTokenPool(4, 8)
    rows = allocated(p.alloc(3))
    p.free(rows[0])
    before = state(p)
    with pytest.raises(DoubleFreeError, match=r"\[0\]"):
        p.free(0)
    with pytest.raises(DoubleFreeError, match=r"\[3\]"):
        p.free([3])
    with pytest.raises(DoubleFreeError, match="more than once"):
        p.free([1, 1])
    with pytest.raises(InvalidSlotError, match="out of range"):
        p.free([1, 4])
    with pytest.raises(InvalidSlotError, match="out of range"):
        p.free(-1)
    with pytest.raises(InvalidSlotError):
        p.alloc(-1)
    assert state(p) == before
    p.free([])
    assert state(p) == before
    with pytest.raises(ConfigError):
        ReqToTokenPool(-1, 8)
    with pytest.raises(ConfigError):
        ReqToTokenPool(2, 0)


def test_write_and_read():
    p = ReqToTokenPool(2, 8)
    (r,) = allocated(p.alloc(1))
    p.write(r, 2, np.array([40, 41, 42]))
    p.write(r, 5, [43])
    assert p.read(r, 0, 6).tolist() == [0, 0, 40, 41, 42, 43]
    view = p.read(r, 2, 4)
    view[0] = 7
    assert p.req_to_token[r, 2] == 40  # read returns a copy
    before = state(p)
    with pytest.raises(InvalidSlotError, match=f"request row {r}.*4 tokens.*max_context_len=8"):
        p.write(r, 5, [1, 2, 3, 4])
    with pytest.raises(InvalidSlotError, match="not allocated"):
        p.write(1, 0, [1])
    with pytest.raises(InvalidSlotError, match="out of range"):
        p.write(2, 0, [1])
    with pytest.raises(InvalidSlotError):
        p.write(r, -1, [1])
    with pytest.raises(InvalidSlotError):
        p.read(r, 3, 9)
    with pytest.raises(InvalidSlotError):
        p.read(5, 0, 1)
    assert state(p) == before


def test_page_table_exact():
    ps = 4
    p = ReqToTokenPool(3, 16)
    a, b, c = allocated(p.alloc(3))
    p.write(a, 0, np.arange(12, 22))  # pages 3, 4, 5 (10 tokens)
    p.write(b, 0, np.array([29, 30]))  # page 7, mid-page start (offset 1)
    t = p.page_table([a, b, c], [10, 2, 0], ps)
    assert isinstance(t, jax.Array) and t.dtype == np.int32
    assert np.asarray(t).tolist() == [[3, 4, 5], [7, 0, 0], [0, 0, 0]]
    t = p.page_table([b, a], [2, 10], ps, max_pages=5)
    assert np.asarray(t).tolist() == [[7, 0, 0, 0, 0], [3, 4, 5, 0, 0]]
    with pytest.raises(InvalidSlotError, match="needs 3 pages"):
        p.page_table([a], [10], ps, max_pages=2)
    with pytest.raises(InvalidSlotError, match="seq_len=17"):
        p.page_table([a], [17], ps)
    p.free(c)
    with pytest.raises(InvalidSlotError, match="not allocated"):
        p.page_table([c], [0], ps)
    assert np.asarray(p.page_table([], [], ps)).shape == (0, 0)


@settings(max_examples=40, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4, 16]),
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_page_table_matches_per_request_loop(ps, lens, seed):
    rng = np.random.default_rng(seed)
    p = ReqToTokenPool(len(lens) + 1, 40)
    rows = allocated(p.alloc(len(lens)))
    for r, n in zip(rows, lens, strict=True):
        p.write(r, 0, rng.integers(ps, 10_000, n))
    got = p.page_table_numpy(rows, lens, ps)
    width = max(-(-n // ps) for n in lens)
    for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
        pages = [int(p.req_to_token[r, j * ps]) // ps for j in range(-(-n // ps))]
        assert got[i].tolist() == pages + [0] * (width - len(pages))
