"""Benchmark: vectorised alloc_extend / alloc_decode against the per-request reference.

Prints one JSON object: microseconds per batch (median over repeats, each repeat starting
from the same allocator state), the speedup and whether the outputs are identical; and the
cost of ``alloc`` of 256 pages from a small and from a 1M-page allocator (it must not grow
with the pool).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvjax.alloc import PagedTokenToKVPoolAllocator  # noqa: E402
from tests.alloc.naive_reference import naive_alloc_decode, naive_alloc_extend  # noqa: E402

PAGE = 16
BATCH = 256
REPEATS = 41


def paired_us(
    fast: Callable[[], object], slow: Callable[[], object], setup: Callable[[], None], repeats: int = REPEATS
) -> tuple[float, float, float]:
    """Median µs of ``fast`` and ``slow``, and the median of their per-repeat ratio.

    The two run back to back in every repeat, each after ``setup``, so that load from other
    processes on the machine hits both alike.
    """
    t_fast: list[float] = []
    t_slow: list[float] = []
    for _ in range(repeats):
        for fn, acc in ((fast, t_fast), (slow, t_slow)):
            setup()
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    f, s = np.array(t_fast), np.array(t_slow)
    return float(np.median(f) * 1e6), float(np.median(s) * 1e6), float(np.median(s / f))


def make_batch(alloc: PagedTokenToKVPoolAllocator, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Mixed requests: a third without prefix, the rest with prefixes ending mid-page or on a
    page boundary; extends of 1..2000 tokens. Prefix pages are allocated for real."""
    prefix = rng.integers(1, 3000, BATCH)
    prefix[rng.random(BATCH) < 1 / 3] = 0
    boundary = rng.random(BATCH) < 0.25
    prefix[boundary] = prefix[boundary] // PAGE * PAGE
    ext = rng.integers(1, 2001, BATCH)
    seq = prefix + ext
    last = np.full(BATCH, -1, np.int64)
    for i, p in enumerate(prefix):
        if p:
            slots = alloc.alloc(-(-int(p) // PAGE) * PAGE)
            assert slots is not None, "the benchmark pool is sized for the batch"
            last[i] = slots[int(p) - 1]
    return prefix, seq, last


def main() -> None:
    rng = np.random.default_rng(0)
    alloc = PagedTokenToKVPoolAllocator(4 * BATCH * 5000, PAGE)
    prefix, seq, last = make_batch(alloc, rng)
    state = alloc.backup_state()
    restore = lambda: alloc.restore_state(state)  # noqa: E731

    vec_out = alloc.alloc_extend(prefix, seq, last)
    restore()
    free_list = alloc.free_pages
    naive_ext = naive_alloc_extend(prefix.tolist(), seq.tolist(), last.tolist(), free_list, PAGE)
    assert vec_out is not None and naive_ext is not None, "the benchmark pool is sized for the batch"
    naive_out = naive_ext[0]
    ext_vec, ext_naive, ext_ratio = paired_us(
        lambda: alloc.alloc_extend(prefix, seq, last),
        lambda: naive_alloc_extend(prefix.tolist(), seq.tolist(), last.tolist(), free_list, PAGE),
        restore,
    )

    # Decode: every request of the extend above takes one more token.
    restore()
    alloc.alloc_extend(prefix, seq, last)
    dec_seq = seq + 1
    dec_last = np.asarray(vec_out)[np.cumsum(seq - prefix) - 1]
    dec_state = alloc.backup_state()
    dec_restore = lambda: alloc.restore_state(dec_state)  # noqa: E731
    dec_vec_out = alloc.alloc_decode(dec_seq, dec_last)
    dec_restore()
    dec_free = alloc.free_pages
    naive_dec = naive_alloc_decode(dec_seq.tolist(), dec_last.tolist(), dec_free, PAGE)
    assert dec_vec_out is not None and naive_dec is not None, "the benchmark pool is sized for the batch"
    dec_naive_out = naive_dec[0]
    dec_vec, dec_naive, dec_ratio = paired_us(
        lambda: alloc.alloc_decode(dec_seq, dec_last),
        lambda: naive_alloc_decode(dec_seq.tolist(), dec_last.tolist(), dec_free, PAGE),
        dec_restore,
    )

    # alloc of 256 pages, back to back without restores, from a 16K-page and a 1M-page pool.
    alloc_us = {}
    for pages in (1 << 14, 1 << 20):
        a = PagedTokenToKVPoolAllocator(pages * PAGE, PAGE)
        times = []
        for _ in range(48):
            t0 = time.perf_counter()
            a.alloc(256 * PAGE)
            times.append(time.perf_counter() - t0)
        alloc_us[str(pages)] = round(float(np.median(times)) * 1e6, 1)

    print(
        json.dumps(
            {
                "page_size": PAGE,
                "batch": BATCH,
                "alloc_extend": {
                    "tokens": int((seq - prefix).sum()),
                    "vectorised_us": round(ext_vec, 1),
                    "naive_us": round(ext_naive, 1),
                    "speedup": round(ext_ratio, 1),
                    "identical": bool(np.array_equal(vec_out, naive_out)),
                },
                "alloc_decode": {
                    "new_pages": int(np.count_nonzero((dec_seq - 1) % PAGE == 0)),
                    "vectorised_us": round(dec_vec, 1),
                    "naive_us": round(dec_naive, 1),
                    "speedup": round(dec_ratio, 1),
                    "identical": bool(np.array_equal(dec_vec_out, dec_naive_out)),
                },
                "alloc_256_pages_us_by_pool_pages": alloc_us,
            }
        )
    )


if __name__ == "__main__":
    main()
