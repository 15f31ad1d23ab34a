"""Sessions: a request's parent is the latest earlier request whose complete blocks (two or more)
are a proper prefix of its blocks; its position is its depth in that chain."""

from __future__ import annotations

import numpy as np

from kvjax.replay import Trace, TraceRequest, session_positions
from kvjax.replay.sessions import position_bucket
from tests.replay._traces import excerpt


def req(blocks, input_length):
    return TraceRequest(0, np.array(blocks), input_length, 1)


def test_a_conversation_chains_by_complete_blocks():
    b = 4
    trace = Trace(
        [
            req([0, 1, 2], 12),  # 0: a session's first turn (complete blocks 0, 1, 2)
            req([0, 1, 2, 3, 9], 18),  # 1: continues 0; complete 0..3, block 9 partial
            req([0, 5], 8),  # 2: shares only the system block 0 with 0: a new session
            req([0, 1, 2, 3, 4], 20),  # 3: continues 1 (its complete blocks, not its partial 9)
            req([0, 1, 2, 3, 4, 6], 24),  # 4: continues 3, the latest whose blocks are a prefix
            req([0, 1, 2, 7], 16),  # 5: continues 0 again (a branch)
        ],
        block_size=b,
    )
    parents, positions = session_positions(trace)
    assert parents.tolist() == [-1, 0, -1, 1, 3, 0]
    assert positions.tolist() == [0, 1, 0, 2, 3, 1]


def test_position_buckets():
    assert [position_bucket(p) for p in (0, 1, 4, 5, 9, 10, 250)] == ["0", "1", "4", "5-9", "5-9", "10+", "10+"]


def test_the_excerpt_has_sessions_of_several_turns():
    parents, positions = session_positions(excerpt())
    assert (parents >= 0).sum() == 19 and positions.max() == 2
    assert all(parents[i] < i for i in np.flatnonzero(parents >= 0))
