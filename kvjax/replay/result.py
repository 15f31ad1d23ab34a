"""`ReplayResult`: what one replay of a trace measured, and `PositionStats`, its hit rate by the
requests' position in their sessions (``sessions.py``).

Hit rates are token hit rates: prompt tokens served from the cache (device, plus what the host
tier loaded back) over all prompt tokens. The serving loop matches at most all but a prompt's
last token, in whole pages, so even a warm cache stays below 1. A request too large for the
device cache is not served and counts as all misses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["PositionStats", "ReplayResult"]


@dataclasses.dataclass
class PositionStats:
    """Requests at one session position (or range of them). Tokens."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hit_rate": round(self.hit_rate, 6)}


@dataclasses.dataclass
class ReplayResult:
    """One replay (module docstring). Tokens unless named otherwise.

    Attributes:
        policy: the eviction policy (``"belady"``: the offline optimum).
        page_size, capacity_tokens, host_capacity_tokens, dp_size, dp_routing: the cache
            replayed through (capacities per rank; ``dp_routing`` None for one rank).
        requests: requests replayed; ``too_large``: of them, those that did not fit.
        prompt_tokens: their prompt tokens.
        device_hit_tokens / host_hit_tokens: prompt tokens found on the device / loaded back
            from the host tier, at admission.
        evicted_tokens / evicted_nodes: device evictions (with a host tier, demotions included).
        host_backed_up_tokens / host_loaded_tokens: host tier copies (0 without one).
        peak_device_tokens: the most device slots in use at once on any rank.
        by_position: hit statistics by session position bucket (``sessions.position_bucket``).
        per_rank_requests / per_rank_hit_tokens: routing outcome per rank.
        seconds: wall time of the replay loop.
    """

    policy: str
    page_size: int
    capacity_tokens: int
    host_capacity_tokens: int
    dp_size: int
    dp_routing: str | None
    requests: int = 0
    too_large: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    evicted_tokens: int = 0
    evicted_nodes: int = 0
    host_backed_up_tokens: int = 0
    host_loaded_tokens: int = 0
    peak_device_tokens: int = 0
    by_position: dict[str, PositionStats] = dataclasses.field(default_factory=dict)
    per_rank_requests: list[int] = dataclasses.field(default_factory=list)
    per_rank_hit_tokens: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from the cache: device hits plus host-tier hits."""
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def token_hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 for an empty trace)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """``host_hit_tokens / prompt_tokens``: what the host tier added."""
        return self.host_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field, the derived rates, and ``by_position`` as plain dicts (JSON-ready)."""
        d = dataclasses.asdict(self)
        d["by_position"] = {k: v.to_dict() for k, v in self.by_position.items()}
        d["hit_tokens"] = self.hit_tokens
        d["token_hit_rate"] = round(self.token_hit_rate, 6)
        d["host_hit_rate"] = round(self.host_hit_rate, 6)
        d["seconds"] = round(self.seconds, 3)
        d["requests_per_second"] = round(self.requests_per_second, 1)
        return d
