"""`DPRouter`: which DP-attention rank serves a request (round robin, or cache-aware).

Under DP attention every DP rank owns its own prefix tree, allocator and request table (SGLang
builds one scheduler per rank), so a request reuses a cached prefix only on the rank that holds
it. Two policies:

* ``"round_robin"`` (SGLang's ``DataParallelController`` default): request ``i`` of the stream
  goes to rank ``i % dp``; the trees are never read.
* ``"cache_aware"`` (beyond SGLang, where it is asked for and not merged): read each rank's
  tree with a side-effect-free prefix probe (``kvjax.serve.prefix_probe``: no split, no lock,
  no LRU touch, no statistics) and send the request to the rank that holds the longest prefix
  of it, unless that rank is overloaded.

Routed prefixes. A burst of requests is routed before any of them is prefilled, when every tree
is still cold for them: the trees alone would spread a shared prefix over the ranks. So the
cache-aware router also remembers the prompts it sent to each rank (a router-side radix tree
per rank, as sglang-router keeps one per worker, of at most ``routed_tokens`` tokens, least
recently routed evicted first), and a rank's prefix is the longer of what its tree holds and
what was routed to it.

Load and overload (cache-aware). Each rank reports a ``RankLoad``: the tokens it holds for
running requests plus the prompt tokens of the requests queued on it, and the number of those
requests. With ``least`` the smallest token load over the ranks, a rank is **overloaded** when
its token load exceeds ``least + max_load_gap_tokens``; overloaded ranks are skipped (the least
loaded rank never is, so some rank is always eligible). Among the eligible ranks the longest
cached prefix wins; ties go to the smaller token load, then the fewer requests, then the lower
rank id. When no eligible rank holds any of the prompt, that rule is plain least-load routing.

Determinism. A decision is a pure function of the request's tokens and namespace, the loads
passed in, the trees' contents and (round robin only) the number of requests routed before:
no wall clock, no randomness, no iteration over unordered containers. Every process that
replays the same request stream over the same trees and loads routes every request the same
way (a multi-controller deployment must feed every process the same loads, e.g. the ones in
the broadcast request batch).

The probe counts what admission would match (``match_and_lock`` matches at most all but the
last prompt token, page-aligned). Jax-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np

from kvjax.errors import ConfigError
from kvjax.radix import RadixCache
from kvjax.serve.prefix_probe import cached_prefix_len

__all__ = [
    "DEFAULT_ROUTED_TOKENS",
    "DEFAULT_MAX_LOAD_GAP_TOKENS",
    "ROUTING_POLICIES",
    "DPRouter",
    "RankLoad",
    "RoutingPolicy",
    "choose_rank",
]

RoutingPolicy = Literal["round_robin", "cache_aware"]
ROUTING_POLICIES: tuple[str, ...] = ("round_robin", "cache_aware")
DEFAULT_MAX_LOAD_GAP_TOKENS = 4096
"""Default overload margin: a rank holding more than this many tokens above the least loaded
rank is skipped by cache-aware routing (about one long prompt of work)."""
DEFAULT_ROUTED_TOKENS = 1 << 16
"""Default size of the router's record of routed prompts, per rank (tokens)."""


@dataclasses.dataclass(frozen=True)
class RankLoad:
    """What one DP rank has to do, as its scheduler reports it.

    Attributes:
        tokens: KV tokens of its running requests plus prompt tokens of its queued ones (>= 0).
        requests: running plus queued requests (>= 0).
    """

    tokens: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ConfigError(name, value, f"a rank's load counts {name}: use an integer >= 0")


def choose_rank(hits: Sequence[int], loads: Sequence[RankLoad], max_load_gap_tokens: int) -> int:
    """The cache-aware decision (module docstring) from each rank's cached prefix ``hits[r]``
    (tokens) and ``loads[r]``.

    Raises:
        ConfigError: no rank, ``hits`` and ``loads`` of different lengths, a negative hit or gap.
    """
    if not loads or len(hits) != len(loads):
        raise ConfigError("loads", len(loads), f"give one load per rank, as many as hits ({len(hits)}), at least one")
    if max_load_gap_tokens < 0:
        raise ConfigError("max_load_gap_tokens", max_load_gap_tokens, "use 0 or more tokens")
    if any(h < 0 for h in hits):
        raise ConfigError("hits", list(hits), "cached prefix lengths are 0 or more tokens")
    least = min(load.tokens for load in loads)
    eligible = [r for r, load in enumerate(loads) if load.tokens <= least + max_load_gap_tokens]
    return min(eligible, key=lambda r: (-hits[r], loads[r].tokens, loads[r].requests, r))


class DPRouter:
    """Routes requests to ``dp`` ranks with one of ``ROUTING_POLICIES`` (module docstring).

    Args:
        trees: each rank's prefix tree, rank order (read by the cache-aware policy only, never
            changed).
        policy: ``"round_robin"`` or ``"cache_aware"``.
        max_load_gap_tokens: the cache-aware overload margin (tokens above the least loaded rank).
        routed_tokens: tokens of routed prompts remembered per rank (0: the trees only).

    Attributes:
        routed: requests routed so far (round robin's position in the stream).
    """

    def __init__(
        self,
        trees: Sequence[Any],
        policy: RoutingPolicy | str = "cache_aware",
        *,
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
        routed_tokens: int = DEFAULT_ROUTED_TOKENS,
    ) -> None:
        if not trees:
            raise ConfigError("dp_size", 0, "a router needs the tree of every DP rank: give one or more")
        if policy not in ROUTING_POLICIES:
            raise ConfigError("policy", policy, f"use one of {', '.join(ROUTING_POLICIES)}")
        if isinstance(max_load_gap_tokens, bool) or not isinstance(max_load_gap_tokens, int) or max_load_gap_tokens < 0:
            raise ConfigError("max_load_gap_tokens", max_load_gap_tokens, "use an integer >= 0 (tokens)")
        if isinstance(routed_tokens, bool) or not isinstance(routed_tokens, int) or routed_tokens < 0:
            raise ConfigError("routed_tokens", routed_tokens, "use an integer >= 0 (tokens per rank)")
        self.trees = tuple(trees)
        self.policy = policy
        self.max_load_gap_tokens = max_load_gap_tokens
        self.routed_tokens = routed_tokens
        # The router's own record of the prompts it routed to each rank (never a rank's cache).
        self._routed = tuple(RadixCache(page_size=1) for _ in self.trees) if routed_tokens else ()
        self.routed = 0

    @property
    def dp_size(self) -> int:
        return len(self.trees)

    def cached_prefixes(self, tokens: Sequence[int] | np.ndarray, extra_key: Hashable = None) -> list[int]:
        """Tokens of ``tokens`` each rank's tree holds, as admission would match them (at most
        all but the last token), without changing any tree."""
        probe = tokens[: len(tokens) - 1]
        return [cached_prefix_len(tree, probe, extra_key) for tree in self.trees]

    def routed_prefixes(self, tokens: Sequence[int] | np.ndarray, extra_key: Hashable = None) -> list[int]:
        """Tokens of ``tokens`` (at most all but the last) that prompts routed to each rank share
        (zeros when nothing is remembered), read without changing the record."""
        if not self._routed:
            return [0] * self.dp_size
        probe = tokens[: len(tokens) - 1]
        return [cached_prefix_len(record, probe, extra_key) for record in self._routed]

    def route(
        self,
        tokens: Sequence[int] | np.ndarray,
        loads: Sequence[RankLoad] | None = None,
        extra_key: Hashable = None,
    ) -> int:
        """The rank (``0 <= rank < dp_size``) that serves a request of prompt ``tokens``.

        ``loads``: each rank's ``RankLoad`` (required by the cache-aware policy; ignored by
        round robin). Raises ``ConfigError`` (nothing routed, ``routed`` unchanged) for loads
        that do not name every rank.
        """
        if self.policy == "round_robin":
            rank = self.routed % self.dp_size
        else:
            if loads is None or len(loads) != self.dp_size:
                raise ConfigError(
                    "loads", None if loads is None else len(loads), f"give one RankLoad per DP rank ({self.dp_size})"
                )
            cached = self.cached_prefixes(tokens, extra_key)
            routed = self.routed_prefixes(tokens, extra_key)
            hits = [max(c, r) for c, r in zip(cached, routed, strict=True)]
            rank = choose_rank(hits, loads, self.max_load_gap_tokens)
            self._remember(rank, tokens, extra_key)
        self.routed += 1
        return rank

    def _remember(self, rank: int, tokens: Sequence[int] | np.ndarray, extra_key: Hashable) -> None:
        if not self._routed:
            return
        record = self._routed[rank]
        record.insert([int(t) for t in tokens], extra_key=extra_key)
        excess = record.evictable_size() - self.routed_tokens
        if excess > 0:
            record.evict(excess)
