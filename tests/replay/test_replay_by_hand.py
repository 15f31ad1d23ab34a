"""Replays of tiny traces whose hit rates, evictions and outcomes are worked out by hand."""

from __future__ import annotations

import pytest

from kvjax.errors import ConfigError
from kvjax.replay import ReplayConfig, replay_trace
from kvjax.replay.rank import ReplayRank
from tests.replay._traces import token_trace

DOC = list(range(100, 108))  # an 8-token shared document


def test_a_follow_up_hits_the_previous_prompt_but_not_its_outputs(tmp_path):
    # 0: DOC (8 tokens) + 2 outputs. 1: DOC + 4 new tokens: the match covers DOC (8 of 12) only,
    # since 0's outputs are fresh tokens that 1's prompt does not hold. Hit rate 8 / (8 + 12).
    trace = token_trace(tmp_path, [(DOC, 2), (DOC + [1, 2, 3, 4], 1)])
    r = replay_trace(trace, ReplayConfig(capacity_tokens=64, page_size=1))
    assert (r.prompt_tokens, r.hit_tokens, r.evicted_tokens) == (20, 8, 0)
    assert r.token_hit_rate == pytest.approx(0.4)
    assert r.by_position["0"].hit_tokens == 0 and r.by_position["1"].hit_tokens == 8  # 1 continues 0
    assert r.peak_device_tokens == 10 + 4 + 1  # 0's prompt + outputs cached, then 1's new tokens


def test_the_match_stops_one_token_short_and_at_a_page(tmp_path):
    # The same 8-token prompt twice: the second matches at most 7 tokens, rounded down to a page:
    # 7 at page 1, 4 at page 4.
    trace = token_trace(tmp_path, [(DOC, 0), (DOC, 0)])
    assert replay_trace(trace, ReplayConfig(capacity_tokens=64, page_size=1)).hit_tokens == 7
    assert replay_trace(trace, ReplayConfig(capacity_tokens=64, page_size=4)).hit_tokens == 4


def test_eviction_drops_whole_leaves(tmp_path):
    # Capacity 12. 0 caches DOC + 2 outputs, split at the prompt boundary (SGLang 0.5.23): an
    # 8-token node and a 2-token leaf under it. 1 (6 new tokens) finds 2 free slots and needs 4
    # more: the leaf goes whole (2), then DOC, a leaf now (8). 2 repeats DOC: a miss, and to fit
    # its 8 tokens 1's 6-token leaf goes too: 16 tokens in 3 nodes.
    trace = token_trace(tmp_path, [(DOC, 2), (list(range(6)), 0), (DOC, 0)])
    r = replay_trace(trace, ReplayConfig(capacity_tokens=12, page_size=1))
    assert (r.hit_tokens, r.evicted_tokens, r.evicted_nodes, r.too_large) == (0, 16, 3, 0)
    assert r.peak_device_tokens == 10  # 0 alone; 1 and 2 each ran beside an emptied cache


def test_a_request_larger_than_the_cache_is_reported_not_crashed_on(tmp_path):
    # Capacity 8: request 1 needs 8 + 4 tokens and cannot run; 0 and 2 run, 2 hits 0's prompt.
    small = [1, 2, 3, 4, 5]
    trace = token_trace(tmp_path, [(small, 0), (DOC, 4), (small + [6], 0)])
    r = replay_trace(trace, ReplayConfig(capacity_tokens=8, page_size=1))
    assert (r.requests, r.too_large, r.hit_tokens) == (3, 1, 5)
    assert r.token_hit_rate == pytest.approx(5 / (5 + 8 + 6))


def test_the_rank_keeps_allocator_and_tree_in_balance(tmp_path):
    trace = token_trace(tmp_path, [(DOC, 3), (DOC + [1], 2), (list(range(9)), 5), (DOC + [1, 2], 0)])
    rank = ReplayRank(16, 2, "lru", 0, 32)
    for i in range(len(trace)):
        rank.serve(i, trace.prompt_tokens(i), trace.output_tokens(i))
        rank.tree.sanity_check()
        assert rank.allocator.available_size() + rank.tree.total_size() == rank.allocator.size
        assert rank.tree.protected_size() == 0


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"capacity_tokens": 8, "page_size": 16}, "capacity_tokens"),
        ({"capacity_tokens": 64, "eviction_policy": "random"}, "eviction_policy"),
        ({"capacity_tokens": 64, "dp_routing": "hash"}, "dp_routing"),
        ({"capacity_tokens": 64, "dp_size": 2, "eviction_policy": "belady"}, "eviction_policy"),
        ({"capacity_tokens": 64, "host_capacity_tokens": 64, "eviction_policy": "belady"}, "eviction_policy"),
        ({"capacity_tokens": 64, "host_capacity_tokens": 3, "page_size": 4}, "host_capacity_tokens"),
    ],
)
def test_bad_configurations_name_the_option(kwargs, option):
    with pytest.raises(ConfigError) as info:
        ReplayConfig(**kwargs)
    assert info.value.option == option
