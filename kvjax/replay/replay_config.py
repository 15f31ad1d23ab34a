"""`ReplayConfig`: the cache a trace is replayed through (per rank), checked before any replay.

Units: tokens for capacities, ms for the routing window. ``eviction_policy`` is a policy of
``kvjax.radix.eviction`` or ``"belady"``, the offline optimum (``belady.py``; one rank, no
host tier: the optimum is defined for one device cache).
"""

from __future__ import annotations

import dataclasses

from kvjax.errors import ConfigError
from kvjax.radix.eviction import EVICTION_POLICIES
from kvjax.replay.belady import OPTIMUM
from kvjax.serve.dp_router import ROUTING_POLICIES

__all__ = ["DEFAULT_LOAD_GAP_TOKENS", "DEFAULT_LOAD_WINDOW_MS", "POLICIES", "ReplayConfig"]

POLICIES: tuple[str, ...] = (*sorted(EVICTION_POLICIES), OPTIMUM)
"""Every eviction policy a replay takes: the tree's, then the offline optimum."""

DEFAULT_LOAD_WINDOW_MS = 10_000.0
"""How long a routed request counts in its rank's load (about one chat answer's decode)."""

DEFAULT_LOAD_GAP_TOKENS = 32768
"""The cache-aware router's overload margin in a replay: about two and a half requests of the
Mooncake conversation trace (12,035 prompt + 343 output tokens on average). The serving router's
own default (4,096 tokens, "about one long prompt" of its workloads) would make it route by load
alone on such prompts. Measured on the trace's first 1,000 requests, each of 2, 4 and 8 ranks
holding 1/dp of their distinct prompt tokens: 32,768 hits 34 to 118% more tokens than 4,096, and
41 to 166% more than round robin."""


def _whole(option: str, value: object, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(option, value, fix)


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """One replay's cache (per DP rank) and routing.

    Attributes:
        capacity_tokens: device KV slots per rank (>= page_size; rounded down to whole pages).
        page_size: tokens per page (>= 1).
        eviction_policy: one of `POLICIES`.
        host_capacity_tokens: host tier slots per rank (0: no host tier; else >= page_size;
            rounded down to whole pages).
        dp_size: DP ranks, each with its own tree and allocator (>= 1).
        dp_routing: ``"cache_aware"`` or ``"round_robin"`` (``kvjax.serve.dp_router``).
        dp_load_window_ms: a request counts in its rank's load (its prompt + output tokens) for
            this long after its arrival (> 0).
        dp_max_load_gap_tokens: the cache-aware router's overload margin (>= 0).

    Raises:
        ConfigError: a value out of range, or the optimum with several ranks or a host tier.
    """

    capacity_tokens: int
    page_size: int = 16
    eviction_policy: str = "lru"
    host_capacity_tokens: int = 0
    dp_size: int = 1
    dp_routing: str = "cache_aware"
    dp_load_window_ms: float = DEFAULT_LOAD_WINDOW_MS
    dp_max_load_gap_tokens: int = DEFAULT_LOAD_GAP_TOKENS

    def __post_init__(self) -> None:
        _whole("page_size", self.page_size, 1, "use a whole number of tokens per page, >= 1")
        _whole(
            "capacity_tokens",
            self.capacity_tokens,
            self.page_size,
            f"give the device cache at least one page ({self.page_size} tokens)",
        )
        if self.eviction_policy not in POLICIES:
            raise ConfigError("eviction_policy", self.eviction_policy, f"use one of {', '.join(POLICIES)}")
        _whole("host_capacity_tokens", self.host_capacity_tokens, 0, "use 0 (no host tier) or a number of tokens")
        if 0 < self.host_capacity_tokens < self.page_size:
            raise ConfigError(
                "host_capacity_tokens",
                self.host_capacity_tokens,
                f"give the host tier at least one page ({self.page_size} tokens)",
            )
        _whole("dp_size", self.dp_size, 1, "use 1 or more DP ranks")
        if self.dp_routing not in ROUTING_POLICIES:
            raise ConfigError("dp_routing", self.dp_routing, f"use one of {', '.join(ROUTING_POLICIES)}")
        if not self.dp_load_window_ms > 0:
            raise ConfigError("dp_load_window_ms", self.dp_load_window_ms, "use a window of more than 0 ms")
        _whole("dp_max_load_gap_tokens", self.dp_max_load_gap_tokens, 0, "use 0 or more tokens")
        if self.eviction_policy == OPTIMUM and (self.dp_size > 1 or self.host_capacity_tokens):
            raise ConfigError(
                "eviction_policy",
                OPTIMUM,
                "the offline optimum is defined for one device cache: use it with {dp_size} 1 and no host tier",
            )

    def with_policy(self, policy: str) -> ReplayConfig:
        """This configuration with another eviction policy."""
        return dataclasses.replace(self, eviction_policy=policy)
