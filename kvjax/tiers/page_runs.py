"""Runs of consecutive pages: how the host tier turns a page copy into a few slice copies.

A copy of pages ``src[i] -> dst[i]`` is split into maximal runs where both ids grow by one; each
run is one slice copy (``dst_view[d:d + k] = src_view[s:s + k]``), a ``memcpy``-speed move, where a
fancy-indexed copy (``dst_view[dst] = src_view[src]``) gathers into a temporary first. Pages of one
sequence, allocated in order, are a handful of runs. The runs of a transfer are found once and
reused for every layer. Units: page ids.
"""

from __future__ import annotations

import numpy as np

#: Above this many runs a copy uses fancy indexing (one numpy call) instead of one call per run.
MAX_SLICE_RUNS = 16

Runs = list[tuple[int, int, int]]

_PYTHON_RUNS = 64


def page_runs(src: np.ndarray, dst: np.ndarray) -> Runs | None:
    """The maximal runs ``(src_start, dst_start, length)`` of ``src[i] -> dst[i]`` (same length),
    or None when there are more than :data:`MAX_SLICE_RUNS` (copy with fancy indexing then)."""
    n = len(src)
    if n <= _PYTHON_RUNS:  # a few pages: a Python loop beats numpy's per-call overhead
        s, d = np.asarray(src).tolist(), np.asarray(dst).tolist()
        runs: Runs = []
        start = 0
        for i in range(1, n):
            if s[i] != s[i - 1] + 1 or d[i] != d[i - 1] + 1:
                runs.append((s[start], d[start], i - start))
                start = i
        if n:
            runs.append((s[start], d[start], n - start))
        return runs if len(runs) <= MAX_SLICE_RUNS else None
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    if breaks.size >= MAX_SLICE_RUNS:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], n]
    return [(int(src[a]), int(dst[a]), b - a) for a, b in zip(starts, ends, strict=True)]


def copy_pages(
    dst_view: np.ndarray, dst: np.ndarray, src_view: np.ndarray, src: np.ndarray, runs: Runs | None = None
) -> None:
    """``dst_view[dst[i]] = src_view[src[i]]`` along axis 0, by runs (see the module docstring);
    ``runs``: ``page_runs(src, dst)`` when the caller already has them."""
    if runs is None:
        runs = page_runs(src, dst)
    if runs is None:
        dst_view[np.asarray(dst)] = src_view[np.asarray(src)]
        return
    for s, d, n in runs:
        dst_view[d : d + n] = src_view[s : s + n]
