"""Page copies by runs of consecutive pages equal the fancy-indexed copy they replace."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.tiers.page_runs import MAX_SLICE_RUNS, copy_pages, page_runs


def test_runs_of_a_sequence_and_of_scattered_pages():
    assert page_runs(np.array([4, 5, 6]), np.array([0, 1, 2])) == [(4, 0, 3)]
    assert page_runs(np.array([4, 5, 9, 10, 2]), np.array([0, 1, 2, 3, 7])) == [(4, 0, 2), (9, 2, 2), (2, 7, 1)]
    assert page_runs(np.array([], np.int32), np.array([], np.int32)) == []
    scattered = np.arange(0, 4 * (MAX_SLICE_RUNS + 1), 4)
    assert page_runs(scattered, np.arange(scattered.size)) is None  # too many runs: fancy indexing
    long = np.arange(200)
    assert page_runs(long, long + 3) == [(0, 3, 200)]  # the numpy path (many pages)
    assert page_runs(np.r_[long, 500], np.r_[long, 7]) == [(0, 0, 200), (500, 7, 1)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 120), st.data())
def test_copy_by_runs_equals_the_fancy_indexed_copy(n, data):
    src = np.array(data.draw(st.permutations(range(130)))[:n]) if data.draw(st.booleans()) else np.arange(n) + 5
    dst = np.array(data.draw(st.permutations(range(130)))[:n])
    if data.draw(st.booleans()):
        dst = np.sort(dst)
    source = np.arange(130 * 3).reshape(130, 3)
    want = np.zeros_like(source)
    want[dst] = source[src]
    got = np.zeros_like(source)
    copy_pages(got, dst, source, src)
    np.testing.assert_array_equal(got, want)
