"""The vectorised alloc_extend / alloc_decode against the per-request reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.alloc import BaseTokenToKVPoolAllocator, make_allocator
from tests.alloc.naive_reference import naive_alloc_decode, naive_alloc_extend

PAGE_SIZES = st.sampled_from([1, 2, 4, 16])


@st.composite
def batches(draw: st.DrawFn) -> tuple[BaseTokenToKVPoolAllocator, np.ndarray, np.ndarray, np.ndarray]:
    """An allocator with a shuffled free list, and a batch whose prefixes own real pages."""
    ps = draw(PAGE_SIZES)
    num_pages = draw(st.integers(4, 48))
    a = make_allocator(num_pages * ps, ps)
    a.alloc(a.size)
    n_req = draw(st.integers(0, 8))
    prefix = np.array(draw(st.lists(st.integers(0, 3 * ps + 1), min_size=n_req, max_size=n_req)), np.int64)
    ext = np.array(draw(st.lists(st.integers(0, 4 * ps + 2), min_size=n_req, max_size=n_req)), np.int64)
    held = -(-prefix // ps)
    if held.sum() > num_pages:
        prefix[:] = 0
        held[:] = 0
    pages = np.array(draw(st.permutations(range(1, num_pages + 1))), np.int64)
    last = np.full(n_req, -1, np.int64)
    cursor = 0
    for i in range(n_req):
        if prefix[i]:
            own = pages[cursor : cursor + held[i]]
            cursor += held[i]
            pos = int(prefix[i]) - 1
            last[i] = own[pos // ps] * ps + pos % ps
    for p in pages[cursor:]:  # freed one by one: any order of the free list
        a.free(np.array([p * ps]))
    return a, prefix, prefix + ext, last


@settings(max_examples=150, deadline=None)
@given(batches())
def test_alloc_extend_matches_reference(case):
    a, prefix, seq, last = case
    free_before = a.free_pages
    avail = a.available_size()
    expected = naive_alloc_extend(prefix.tolist(), seq.tolist(), last.tolist(), free_before.tolist(), a.page_size)
    out = a.alloc_extend(prefix, seq, last)
    if expected is None:
        assert out is None
        assert a.free_pages.tolist() == free_before.tolist() and a.available_size() == avail
    else:
        ref, used = expected
        assert out is not None and out.dtype == np.int32
        assert out.tolist() == ref.tolist()
        assert a.free_pages.tolist() == free_before[used:].tolist()
        assert len(set(out.tolist())) == out.size == int((seq - prefix).sum())
    a.check_invariants()


@settings(max_examples=100, deadline=None)
@given(batches())
def test_alloc_decode_matches_reference(case):
    a, prefix, seq, last = case
    # Decode the token at position `prefix` of every request: seq_len = prefix + 1.
    dec_seq = prefix + 1
    free_before = a.free_pages
    expected = naive_alloc_decode(dec_seq.tolist(), last.tolist(), free_before.tolist(), a.page_size)
    out = a.alloc_decode(dec_seq, last)
    if expected is None:
        assert out is None and a.free_pages.tolist() == free_before.tolist()
    else:
        ref, used = expected
        assert out.tolist() == ref.tolist()
        assert a.free_pages.tolist() == free_before[used:].tolist()
    a.check_invariants()
