"""Trace replay: a production request trace through kvjax's own radix tree and allocator, with
no device, against the offline optimum (``python -m kvjax replay``; ``docs/replay.md``).

Pure Python and numpy (jax is never imported). The parts:

* ``trace``: the `Trace` every replay reads (prefix-unique blocks); ``mooncake`` and
  ``token_trace`` read the two file formats, ``formats.read_trace`` by name;
* ``sessions``: which earlier request a request continues, and its depth in its session;
* ``rank``: one rank's cache (tree, page allocator, request table, host tier) and the request
  lifecycle; ``replayer.replay_trace``: a trace through one or more ranks (DP routing);
* ``future_use`` and ``belady``: the offline optimum as an eviction policy of the same tree;
* ``report``: several policies side by side with their gap to the optimum; ``table``: as rich
  tables.
"""

from __future__ import annotations

from kvjax.replay.belady import OPTIMUM, BeladyPolicy
from kvjax.replay.formats import TRACE_FORMATS, read_trace
from kvjax.replay.future_use import NEVER, FutureUses
from kvjax.replay.mooncake import read_mooncake_trace
from kvjax.replay.replay_config import POLICIES, ReplayConfig
from kvjax.replay.replayer import replay_trace
from kvjax.replay.report import ReplayReport, replay_policies, trace_summary
from kvjax.replay.result import PositionStats, ReplayResult
from kvjax.replay.sessions import session_positions
from kvjax.replay.token_trace import read_token_trace
from kvjax.replay.trace import Trace, TraceRequest, flatten_blocks

__all__ = [
    "NEVER",
    "OPTIMUM",
    "POLICIES",
    "TRACE_FORMATS",
    "BeladyPolicy",
    "FutureUses",
    "PositionStats",
    "ReplayConfig",
    "ReplayReport",
    "ReplayResult",
    "Trace",
    "TraceRequest",
    "flatten_blocks",
    "read_mooncake_trace",
    "read_token_trace",
    "read_trace",
    "replay_policies",
    "replay_trace",
    "session_positions",
    "trace_summary",
]
