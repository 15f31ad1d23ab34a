"""The extra buffer's tracked states as ``RecurrentStateExtension`` records them (host side only).

With the extra buffer a step's row whose tokens reach a page boundary writes the state at the last
one into a ping-pong slot (``step_metadata``); ``after_step`` records it as the request's last
tracked state, the one the tree's caching donates. Recorded per request, as the request's last
packed batch tracked it: a pipeline step packs each micro-batch before any of them is stepped, and
a speculative round reports the tokens it kept (``after_step`` of a batch cut to them), so a state
tracked past them (after a rejected draft token) is not recorded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.serve.extension import StepBatch
from kvjax.serve.recurrent_extension import RecurrentStateExtension
from kvjax.serve.scheduler import ServingReq
from tests.serve.random_workloads import model

PAGE = 2


@pytest.fixture
def extension() -> RecurrentStateExtension:
    spec, _, _ = model("qwen3-next-tiny")
    config = CacheConfig(
        page_size=PAGE,
        max_total_tokens=64,
        max_running_requests=4,
        max_mamba_cache_size=16,
        context_length=32,
        enable_mamba_extra_buffer=True,
    )
    return RecurrentStateExtension(build_kv_cache(spec, config))


def _admitted(ext: RecurrentStateExtension, rid: str) -> ServingReq:
    req = ServingReq(rid, list(range(1, 9)), max_new_tokens=4)
    assert ext.table.alloc_reqs([req]) is not None  # its row, state slot and two ping-pong slots
    return req


def _batch(reqs: list[ServingReq], starts: list[int], ends: list[int], *, decode: bool = False) -> StepBatch:
    return StepBatch(
        rows=np.asarray([r.req_pool_idx for r in reqs]),
        starts=np.asarray(starts),
        seq_lens=np.asarray(ends),
        slots=np.zeros(0, np.int32),
        reqs=reqs,
        max_seqs=4,
        is_decode=decode,
    )


def _tracked(part: Any, row: int) -> tuple[int, int]:
    """A metadata part's tracked slot and position of ``row``."""
    return int(part.track_slots[row]), int(part.track_at[row])


def test_each_micro_batch_records_its_own_rows(extension):
    a, b = _admitted(extension, "a"), _admitted(extension, "b")
    first = _batch([a], [0], [5])
    second = _batch([b], [0], [6])
    parts = [extension.step_metadata(first), extension.step_metadata(second)]  # both packed, then stepped
    assert _tracked(parts[0], 0) == (int(a.mamba_ping_pong_track_buffer[0]), 4)
    assert _tracked(parts[1], 0) == (int(b.mamba_ping_pong_track_buffer[0]), 6)
    extension.after_step(first)
    extension.after_step(second)
    assert (a.mamba_last_track_idx, a.mamba_last_track_seqlen) == (0, 4)
    assert (b.mamba_last_track_idx, b.mamba_last_track_seqlen) == (0, 6)


def test_a_state_tracked_past_the_kept_tokens_is_not_recorded(extension):
    """A round over positions 4..7 tracks its state after 8 tokens into the other ping-pong slot;
    keeping 3 of them (a rejected draft) leaves the last record, keeping 4 records it."""
    req = _admitted(extension, "r")
    extension.step_metadata(_batch([req], [0], [4]))
    extension.after_step(_batch([req], [0], [4]))
    assert (req.mamba_last_track_idx, req.mamba_last_track_seqlen) == (0, 4)
    for kept, recorded in ((3, (0, 4)), (4, (1, 8))):
        part = extension.step_metadata(_batch([req], [4], [8]))
        assert _tracked(part, 0) == (int(req.mamba_ping_pong_track_buffer[1]), 4)
        extension.after_step(_batch([req], [4], [4 + kept], decode=True))
        assert (req.mamba_last_track_idx, req.mamba_last_track_seqlen) == recorded, kept


def test_a_batch_packed_again_tracks_anew_and_release_forgets(extension):
    req = _admitted(extension, "r")
    extension.step_metadata(_batch([req], [0], [4]))  # packed, never stepped
    extension.step_metadata(_batch([req], [0], [3]))  # packed again over 3 tokens: the state after 2
    extension.after_step(_batch([req], [0], [3]))
    assert (req.mamba_last_track_idx, req.mamba_last_track_seqlen) == (0, 2)
    extension.step_metadata(_batch([req], [3], [5]))
    extension.before_release(req, finished=False)
    extension.after_step(_batch([req], [3], [5]))
    assert req.mamba_last_track_seqlen == 2, "a released request's tracking is forgotten"
