"""Hit counters of a prefix cache: O(1) updates, read by notebooks and metrics exporters."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    """Cumulative counters (tokens are key elements).

    Attributes:
        num_matches: ``match_prefix`` calls.
        query_tokens: page-aligned tokens asked for across those calls.
        hit_tokens: tokens returned as cached across those calls.
        last_query_tokens / last_hit_tokens: the same for the latest call.
        num_inserts: ``insert`` calls (including the request lifecycle's).
        inserted_tokens: tokens newly added to the tree.
        evicted_tokens: tokens freed by eviction; ``num_evictions``: evicted nodes.
    """

    num_matches: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    last_query_tokens: int = 0
    last_hit_tokens: int = 0
    num_inserts: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    num_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def reset(self) -> None:
        """Zero every counter."""
        for k in asdict(self):
            setattr(self, k, 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d
