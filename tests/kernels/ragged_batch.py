"""The paged side of a ragged attention test batch, shared by the MHA and MLA attention tests:
a shuffled page table, stale data poisoned, and the ragged lengths in the kernels' layout
(``paged_batch`` builds all three into a ``PagedBatch``; each test's batch adds its queries)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class PagedBatch:
    """A pool layer and the ragged batch's tables (numpy, the kernels' layout): ``kv_pages``
    ``[num_pages + 1, page_size, ...]``, int32 ``kv_lens`` ``[max_seqs]``, ``page_indices``
    ``[max_seqs, pages_per_seq]``, ``cu_q_lens`` ``[max_seqs + 1]`` and ``num_seqs`` ``[1]``."""

    kv_pages: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray

    def paged_args(self, kv_dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
        """The pool (in ``kv_dtype``) and the tables as jax arrays, in the kernels' argument order."""
        tables = (self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs)
        return (jnp.asarray(self.kv_pages, kv_dtype), *(jnp.asarray(t) for t in tables))


def paged_batch(
    rng: np.random.Generator,
    kv: np.ndarray,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    *,
    max_seqs: int,
    pages_per_seq: int,
    poison: float | None,
) -> PagedBatch:
    """The pool ``kv`` (``[num_pages + 1, page_size, ...]``, filled by the caller) over a
    ``shuffled_page_table`` (one permutation drawn from ``rng``) for the live sequences ``q_lens``
    / ``kv_lens``; what no output may read is set to ``poison`` in place (``poison_stale_rows``;
    None: left as it is)."""
    page_size = kv.shape[1]
    table, used = shuffled_page_table(rng, kv_lens, max_seqs=max_seqs, pages_per_seq=pages_per_seq, page_size=page_size)
    if poison is not None:
        poison_stale_rows(kv, table, used, kv_lens, page_size, poison)
    cu, lens, num_seqs = ragged_lengths(q_lens, kv_lens, max_seqs)
    return PagedBatch(kv, lens, table, cu, num_seqs)


def shuffled_page_table(
    rng: np.random.Generator, kv_lens: Sequence[int], *, max_seqs: int, pages_per_seq: int, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(table, used)`` for sequences of ``kv_lens`` keys over a pool of ``max_seqs * pages_per_seq``
    pages (plus the trash page 0).

    ``table``: int32 ``[max_seqs, pages_per_seq]``; sequence ``s`` gets ``ceil(kv_lens[s] / page_size)``
    pages, taken in turn from one random permutation of ``1..num_pages`` (so they are scattered
    and never shared); the rest of the table is 0. ``used``: bool ``[num_pages + 1]``, the pages
    given out. Draws one permutation from ``rng``.
    """
    num_pages = max_seqs * pages_per_seq
    table = np.zeros((max_seqs, pages_per_seq), np.int32)
    order = rng.permutation(np.arange(1, num_pages + 1))
    used = np.zeros(num_pages + 1, bool)
    k = 0
    for s, length in enumerate(kv_lens):
        need = -(-length // page_size)
        table[s, :need] = order[k : k + need]
        used[order[k : k + need]] = True
        k += need
    return table, used


def poison_stale_rows(
    kv: np.ndarray, table: np.ndarray, used: np.ndarray, kv_lens: Sequence[int], page_size: int, value: float
) -> None:
    """Fill, in place, what no output may read with ``value``: the trash page, the pages not in
    ``used``, and the rows past each sequence's end on its last page (stale data in a real pool).
    ``kv``: ``[num_pages + 1, page_size, ...]``."""
    kv[~used] = value
    for s, length in enumerate(kv_lens):
        if length % page_size:
            kv[table[s, length // page_size], length % page_size :] = value


def ragged_lengths(
    q_lens: Sequence[int], kv_lens: Sequence[int], max_seqs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(cu_q_lens, kv_lens, num_seqs)`` as the kernels take them (int32 ``[max_seqs + 1]``,
    ``[max_seqs]``, ``[1]``) for the live sequences ``q_lens``/``kv_lens``; the spare rows repeat
    the last offset and have no keys."""
    n = len(q_lens)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    lens = np.zeros(max_seqs, np.int32)
    lens[:n] = kv_lens
    return cu, lens, np.array([n], np.int32)
