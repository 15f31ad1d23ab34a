"""Runs of consecutive pages: how the host tier turns a page copy into a few slice copies.

A copy of pages ``src[i] -> dst[i]`` is split into maximal runs where both ids grow by one; each
run is one slice copy (``dst_view[d:d + k] = src_view[s:s + k]``), a ``memcpy``-speed move, where a
fancy-indexed copy (``dst_view[dst] = src_view[src]``) gathers into a temporary first. Pages of one
sequence, allocated in order, are a handful of runs. Units: page ids.
"""

from __future__ import annotations

import numpy as np

#: Above this many runs a copy uses fancy indexing (one numpy call) instead of one call per run.
MAX_SLICE_RUNS = 16


def page_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_starts, dst_starts, lengths)`` of the maximal runs of ``src[i] -> dst[i]`` (same length)."""
    src = np.asarray(src, np.int64).ravel()
    dst = np.asarray(dst, np.int64).ravel()
    if src.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [src.size]]))
    return src[starts], dst[starts], lengths


def copy_pages(dst_view: np.ndarray, dst: np.ndarray, src_view: np.ndarray, src: np.ndarray) -> None:
    """``dst_view[dst[i]] = src_view[src[i]]`` along axis 0, by runs (see the module docstring)."""
    s0, d0, k = page_runs(src, dst)
    if k.size > MAX_SLICE_RUNS:
        dst_view[np.asarray(dst)] = src_view[np.asarray(src)]
        return
    for s, d, n in zip(s0.tolist(), d0.tolist(), k.tolist(), strict=True):
        dst_view[d : d + n] = src_view[s : s + n]
