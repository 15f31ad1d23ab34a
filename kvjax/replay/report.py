"""`ReplayReport`: the replays of one trace side by side, with the offline optimum and each
policy's gap to it; and `replay_policies`, which runs them.

The gap of a policy is ``optimum.token_hit_rate - policy.token_hit_rate`` (hit-rate points; the
optimum, ``belady.py``, is replayed over the same trace and capacity).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvjax.replay.belady import OPTIMUM
from kvjax.replay.replay_config import ReplayConfig
from kvjax.replay.replayer import replay_trace
from kvjax.replay.result import ReplayResult
from kvjax.replay.sessions import position_bucket, session_positions
from kvjax.replay.trace import Trace

__all__ = ["ReplayReport", "replay_policies", "trace_summary"]


def trace_summary(trace: Trace, trace_format: str) -> dict[str, Any]:
    """What a report says about the trace: its size, distinct content and sessions."""
    parents, positions = session_positions(trace)
    by_position = collections.Counter(position_bucket(int(p)) for p in positions)
    return {
        "source": trace.source,
        "format": trace_format,
        "requests": len(trace),
        "block_size": trace.block_size,
        "prompt_tokens": trace.prompt_token_count(),
        "output_tokens": sum(r.output_length for r in trace.requests),
        "distinct_blocks": trace.distinct_blocks(),
        "distinct_prompt_tokens": trace.distinct_prompt_tokens(),
        "sessions": int((parents < 0).sum()),
        "requests_by_position": dict(sorted(by_position.items(), key=lambda kv: int(kv[0].rstrip("+").split("-")[0]))),
    }


@dataclasses.dataclass
class ReplayReport:
    """Replays of one trace (module docstring).

    Attributes:
        trace: `trace_summary` of the trace.
        results: one replay per policy asked for, in order.
        optimum: the offline optimum's replay (None when not asked for).
    """

    trace: dict[str, Any]
    results: list[ReplayResult]
    optimum: ReplayResult | None = None

    def gap(self, result: ReplayResult) -> float | None:
        """``optimum - result`` token hit rate (None without the optimum)."""
        if self.optimum is None:
            return None
        return self.optimum.token_hit_rate - result.token_hit_rate

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the trace, each result (with ``gap_to_optimum``), the optimum."""
        results = []
        for r in self.results:
            d = r.to_dict()
            gap = self.gap(r)
            d["gap_to_optimum"] = None if gap is None else round(gap, 6)
            results.append(d)
        return {
            "trace": self.trace,
            "results": results,
            "optimum": None if self.optimum is None else self.optimum.to_dict(),
        }


def replay_policies(
    trace: Trace,
    config: ReplayConfig,
    policies: Sequence[str],
    *,
    optimum: bool = False,
    trace_format: str = "mooncake",
    on_request: Callable[[], None] | None = None,
) -> ReplayReport:
    """Replay ``trace`` once per policy of ``policies`` (``config`` otherwise), and once with the
    offline optimum when ``optimum`` (unless it is among ``policies`` already).

    Raises:
        ConfigError: a policy that is not one of ``replay_config.POLICIES``, or the optimum with
            several ranks or a host tier (before anything is replayed).
    """
    configs = [config.with_policy(p) for p in policies]
    optimum_config = config.with_policy(OPTIMUM) if optimum and OPTIMUM not in policies else None
    positions = session_positions(trace)[1]
    results = [replay_trace(trace, c, positions=positions, on_request=on_request) for c in configs]
    best = next((r for r in results if r.policy == OPTIMUM), None)
    if optimum_config is not None:
        best = replay_trace(trace, optimum_config, positions=positions, on_request=on_request)
    return ReplayReport(trace_summary(trace, trace_format), results, best)
