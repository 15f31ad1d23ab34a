"""DP ranks (cache-aware routing against round robin) and the host tier, on the trace excerpt."""

from __future__ import annotations

import pytest

from kvjax.replay import ReplayConfig, replay_trace
from tests.replay._traces import excerpt, full_capacity


@pytest.fixture(scope="module")
def trace():
    return excerpt()


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_cache_aware_routing_hits_at_least_round_robin(trace, dp_size):
    """Each rank holds its share of the excerpt's distinct blocks: what decides the hits is
    whether a conversation's turns meet on one rank."""
    capacity = full_capacity(trace) // dp_size
    results = {
        routing: replay_trace(trace, ReplayConfig(capacity, page_size=16, dp_size=dp_size, dp_routing=routing))
        for routing in ("round_robin", "cache_aware")
    }
    assert results["cache_aware"].hit_tokens >= results["round_robin"].hit_tokens
    assert results["round_robin"].per_rank_requests == [
        len(trace) // dp_size + (r < len(trace) % dp_size) for r in range(dp_size)
    ]
    for result in results.values():
        assert sum(result.per_rank_requests) == len(trace) and result.dp_routing is not None
        assert sum(result.per_rank_hit_tokens) == result.hit_tokens


def test_at_eight_ranks_cache_aware_routing_keeps_conversations_together(trace):
    capacity = full_capacity(trace) // 8
    rr = replay_trace(trace, ReplayConfig(capacity, page_size=16, dp_size=8, dp_routing="round_robin"))
    ca = replay_trace(trace, ReplayConfig(capacity, page_size=16, dp_size=8, dp_routing="cache_aware"))
    assert ca.by_position["1"].hit_rate > rr.by_position["1"].hit_rate + 0.2


def test_the_host_tier_adds_hits_when_the_device_is_small(trace):
    small = full_capacity(trace) // 20
    without = replay_trace(trace, ReplayConfig(small, page_size=16))
    with_host = replay_trace(trace, ReplayConfig(small, page_size=16, host_capacity_tokens=full_capacity(trace)))
    assert without.host_hit_tokens == 0 and with_host.host_hit_tokens > 0
    assert with_host.host_loaded_tokens == with_host.host_hit_tokens
    assert with_host.hit_tokens > without.hit_tokens
    assert with_host.device_hit_tokens == without.device_hit_tokens  # same device, same policy
    assert with_host.host_backed_up_tokens > 0
