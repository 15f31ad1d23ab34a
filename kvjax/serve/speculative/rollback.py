"""Rollback: give back the KV slots a round wrote for rejected tokens (target and draft at once).

A round of ``k`` draft tokens writes positions ``L .. L + k`` of a request (``L``: its committed KV
length before the round) in both pools. The draft's pool shares the target's slot ids (one
allocator, one request table; ``kvjax.plan.draft``), so one ``free`` releases a slot of both.
After acceptance the request keeps ``m`` new tokens of KV (``L .. L + m - 1``); the rest is rejected.

Paged (``page_size > 1``) only whole pages go back: the pages that begin at or after the first
position past the request's new last page. A rejected slot in the request's last, partial page
stays with the request (SGLang's ``align_evict_mask_to_page_size``: only fully empty pages are
evicted); the next round writes over it, and the tree releases the unaligned tail with the
request. So a request holds exactly ``ceil(kv_len / page_size)`` pages after every round, the
same as after a plain decode step.
"""

from __future__ import annotations

import numpy as np

__all__ = ["rejected_slots"]


def rejected_slots(row_slots: np.ndarray, start: int, kept_len: int, end: int, page_size: int) -> np.ndarray:
    """The slots to free of one request after a round.

    Args:
        row_slots: the request's row of the request table (slot per position).
        start: ``L``, the committed length before the round (positions ``start .. end - 1`` were
            allocated for it).
        kept_len: the committed length after it (``L + m``, ``start <= kept_len <= end``).
        end: ``L + k + 1``.
        page_size: the allocator's page size.

    Returns:
        int32 slots: those of positions ``max(kept_len rounded up to a page, start) .. end - 1``
        that lie in pages the request does not keep (empty when nothing is returned).
    """
    if not start <= kept_len <= end:
        raise ValueError(f"kept length {kept_len} outside the round's positions {start}..{end}")
    first = -(-kept_len // page_size) * page_size  # the first position of a page the request no longer needs
    first = max(first, start)
    if first >= end:
        return np.zeros(0, np.int32)
    return np.asarray(row_slots[first:end], np.int32)
