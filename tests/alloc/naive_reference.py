"""Straightforward per-request reference for ``alloc_extend`` / ``alloc_decode``.

A loop over requests in the style of SGLang's ``alloc_extend_naive``: each request fills its
old partial page, then whole new pages, then a new partial page. It works on a plain free
list (head first) and returns the slots with the number of pages it took from the head, so
tests and the benchmark can compare it with the vectorised allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def naive_alloc_extend(
    prefix_lens: Sequence[int],
    seq_lens: Sequence[int],
    last_loc: Sequence[int],
    free_pages: Sequence[int] | np.ndarray,
    page_size: int,
) -> tuple[np.ndarray, int] | None:
    """Slots for the new tokens of each request, and pages used; None if too few pages."""
    ps = page_size
    offsets = np.arange(ps, dtype=np.int64)
    chunks: list[np.ndarray] = []
    next_page = 0
    for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc, strict=True):
        prefix, seq, last = int(prefix), int(seq), int(last)
        old_end = min(seq, -(-prefix // ps) * ps)
        n_old = old_end - prefix
        if n_old > 0:
            chunks.append(last + 1 + offsets[:n_old])
        if old_end == seq:
            continue  # every new token fitted in the old partial page
        n_full = seq // ps - -(-prefix // ps)
        if n_full > 0:
            if next_page + n_full > len(free_pages):
                return None
            pages = np.asarray(free_pages[next_page : next_page + n_full], np.int64)
            chunks.append((pages[:, None] * ps + offsets).ravel())
            next_page += n_full
        n_tail = seq % ps
        if n_tail:
            if next_page + 1 > len(free_pages):
                return None
            chunks.append(int(free_pages[next_page]) * ps + offsets[:n_tail])
            next_page += 1
    out = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(0, np.int32)
    return out, next_page


def naive_alloc_decode(
    seq_lens: Sequence[int],
    last_loc: Sequence[int],
    free_pages: Sequence[int] | np.ndarray,
    page_size: int,
) -> tuple[np.ndarray, int] | None:
    """One slot per request for its token at position ``seq_len - 1``, and pages used."""
    out = []
    next_page = 0
    for seq, last in zip(seq_lens, last_loc, strict=True):
        if (int(seq) - 1) % page_size == 0:
            if next_page >= len(free_pages):
                return None
            out.append(int(free_pages[next_page]) * page_size)
            next_page += 1
        else:
            out.append(int(last) + 1)
    return np.asarray(out, np.int32), next_page
