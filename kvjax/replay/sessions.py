"""Sessions: which earlier request a request continues, and how deep it is in its conversation.

A chat server's next turn sends the whole conversation again: the previous prompt, the answer,
and the new message. In a trace of prefix-unique blocks (``trace.py``) the previous prompt's
*complete* blocks (its partial last block changes when the conversation grows) are then a
prefix of the new prompt. So:

* the **parent** of request ``i`` is the latest earlier request ``j`` whose complete blocks
  (at least two: the Mooncake conversations all share their first block, a system prompt) are
  a proper prefix of ``i``'s blocks; none: ``i`` starts a session;
* its **position** is the depth in that chain: 0 for a session's first request, the parent's
  position + 1 otherwise.

Cost: O(blocks) per request (a block id stands for its prefix, so a prefix is looked up by its
last block alone).
"""

from __future__ import annotations

import numpy as np

from kvjax.replay.trace import Trace

__all__ = ["MIN_SHARED_BLOCKS", "POSITION_BUCKETS", "position_bucket", "session_positions"]

MIN_SHARED_BLOCKS = 2
"""Complete blocks a parent must share with its child (one would be the shared system prompt)."""

POSITION_BUCKETS: tuple[tuple[int, int], ...] = ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 9), (10, 10**9))
"""The position ranges reports group requests by (inclusive bounds)."""


def position_bucket(position: int) -> str:
    """The report label of ``position``: ``"0"``.. ``"4"``, ``"5-9"``, ``"10+"``."""
    for lo, hi in POSITION_BUCKETS:
        if lo <= position <= hi:
            return str(lo) if lo == hi else (f"{lo}+" if hi >= 10**9 else f"{lo}-{hi}")
    raise ValueError(f"position {position} is negative")


def session_positions(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """``(parents, positions)``: per request (trace order) the index of its parent (-1: none)
    and its position in its session (module docstring). Both int64 arrays of ``len(trace)``."""
    n = len(trace)
    parents = np.full(n, -1, dtype=np.int64)
    positions = np.zeros(n, dtype=np.int64)
    b = trace.block_size
    latest_ending_at: dict[int, int] = {}  # last complete block id -> latest request whose complete blocks end there
    for i, req in enumerate(trace.requests):
        blocks = req.blocks.tolist()
        for length in range(len(blocks) - 1, MIN_SHARED_BLOCKS - 1, -1):
            j = latest_ending_at.get(blocks[length - 1])
            if j is not None:
                parents[i] = j
                positions[i] = positions[j] + 1
                break
        complete = req.input_length // b
        if complete >= MIN_SHARED_BLOCKS:
            latest_ending_at[blocks[complete - 1]] = i
    return parents, positions
