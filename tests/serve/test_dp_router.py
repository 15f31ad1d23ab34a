"""The DP router and its side-effect-free prefix probe (host only, no jax)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.errors import ConfigError
from kvjax.radix import ChunkCache, RadixCache
from kvjax.serve.dp_router import DPRouter, RankLoad, choose_rank
from kvjax.serve.prefix_probe import cached_prefix_len

# --- the probe ------------------------------------------------------------------------------------


def _snapshot(tree: RadixCache) -> tuple:
    """Everything a probe must not change: every node's edge, times, locks and children, and
    the tree's statistics and clock."""
    nodes = []
    stack = [tree.root]
    while stack:
        node = stack.pop()
        nodes.append(
            (
                node.id,
                node.klen,
                node.last_access,
                node.lock_ref,
                node.klist is None,
                node.key is None,
                tuple(sorted(map(repr, node.children))),
            )
        )
        stack.extend(node.children.values())
    stats = vars(tree.stats).copy() if hasattr(tree.stats, "__dict__") else repr(tree.stats)
    return tuple(sorted(nodes)), stats, tree._clock, tree.evictable_size()


tokens_st = st.lists(st.integers(0, 5), min_size=0, max_size=24)


@settings(max_examples=120, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4]),
    eagle=st.booleans(),
    inserts=st.lists(st.tuples(tokens_st, st.sampled_from([None, "a"]), st.booleans()), max_size=8),
    query=tokens_st,
    namespace=st.sampled_from([None, "a"]),
    as_array=st.booleans(),
)
def test_probe_equals_match_prefix_and_changes_nothing(page, eagle, inserts, query, namespace, as_array):
    tree = RadixCache(page_size=page, is_eagle=eagle)
    for key, ns, key_as_array in inserts:
        tree.insert(np.asarray(key, np.int32) if key_as_array else list(key), extra_key=ns)
    q = np.asarray(query, np.int32) if as_array else list(query)
    before = _snapshot(tree)
    probed = cached_prefix_len(tree, q, namespace)
    assert _snapshot(tree) == before
    assert probed == tree.match_prefix(q, namespace).prefix_len


def test_probe_of_a_disabled_or_missing_tree_is_zero():
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3])
    assert cached_prefix_len(tree, [1, 2, 3]) == 3
    tree.force_miss = True
    assert cached_prefix_len(tree, [1, 2, 3]) == 0
    assert cached_prefix_len(RadixCache(page_size=1, disable=True), [1, 2, 3]) == 0
    assert cached_prefix_len(ChunkCache(), [1, 2, 3]) == 0


# --- the decision -----------------------------------------------------------------------------------


def test_longest_prefix_wins_when_no_rank_is_overloaded():
    loads = [RankLoad(100, 1), RankLoad(0, 0), RankLoad(50, 1)]
    assert choose_rank([16, 32, 64], loads, max_load_gap_tokens=4096) == 2


def test_overloaded_rank_is_skipped():
    # rank 2 is 200 tokens above the least loaded (rank 1): more than the 100-token gap
    loads = [RankLoad(90, 1), RankLoad(0, 0), RankLoad(200, 1)]
    assert choose_rank([16, 0, 64], loads, max_load_gap_tokens=100) == 0
    assert choose_rank([16, 0, 64], loads, max_load_gap_tokens=200) == 2  # exactly at the gap: eligible


def test_ties_go_to_the_smaller_load_then_fewer_requests_then_lower_rank():
    assert choose_rank([8, 8, 8], [RankLoad(9, 1), RankLoad(5, 3), RankLoad(5, 2)], 100) == 2
    assert choose_rank([8, 8], [RankLoad(5, 2), RankLoad(5, 2)], 100) == 0
    assert choose_rank([0, 0, 0], [RankLoad(9, 0), RankLoad(3, 0), RankLoad(3, 0)], 100) == 1


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 500), st.integers(0, 8)), min_size=1, max_size=6),
    gap=st.integers(0, 600),
)
def test_decision_properties(data, gap):
    hits = [h for h, _, _ in data]
    loads = [RankLoad(t, r) for _, t, r in data]
    rank = choose_rank(hits, loads, gap)
    least = min(load.tokens for load in loads)
    eligible = [r for r, load in enumerate(loads) if load.tokens <= least + gap]
    assert rank in eligible  # never an overloaded rank; the least loaded is always eligible
    assert hits[rank] == max(hits[r] for r in eligible)  # the longest prefix among the eligible
    # deterministic and independent of how the ranks are presented (the same answer on a permutation)
    order = list(reversed(range(len(data))))
    again = choose_rank([hits[r] for r in order], [loads[r] for r in order], gap)
    winners = [
        r
        for r in eligible
        if (hits[r], loads[r].tokens, loads[r].requests) == (hits[rank], loads[rank].tokens, loads[rank].requests)
    ]
    assert order[again] in winners and rank == min(winners)


def test_bad_decision_inputs_are_refused():
    with pytest.raises(ConfigError, match="loads"):
        choose_rank([1, 2], [RankLoad()], 10)
    with pytest.raises(ConfigError, match="max_load_gap_tokens"):
        choose_rank([1], [RankLoad()], -1)
    with pytest.raises(ConfigError, match="tokens"):
        RankLoad(tokens=-1)


# --- the router -----------------------------------------------------------------------------------


def _trees(dp: int, page: int = 1) -> list[RadixCache]:
    return [RadixCache(page_size=page) for _ in range(dp)]


def test_round_robin_cycles_in_stream_order():
    router = DPRouter(_trees(3), "round_robin")
    assert [router.route([1, 2, 3]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.routed == 7


def test_cache_aware_sends_a_request_to_the_rank_holding_its_prefix():
    trees = _trees(2, page=2)
    trees[1].insert([7, 7, 1, 2, 3, 4])
    router = DPRouter(trees, "cache_aware", max_load_gap_tokens=64)
    idle = [RankLoad(), RankLoad()]
    assert router.cached_prefixes([7, 7, 1, 2, 9, 9]) == [0, 4]
    assert router.route([7, 7, 1, 2, 9, 9], idle) == 1
    # the last prompt token is never counted (admission matches all but it)
    assert router.cached_prefixes([7, 7, 1, 2]) == [0, 2]
    # a cold prompt goes to the least loaded rank
    assert router.route([5, 5, 5], [RankLoad(10, 1), RankLoad(3, 1)]) == 1
    # the prefix rank is skipped once it is more than the gap above the least loaded
    assert router.route([7, 7, 1, 2, 9, 9], [RankLoad(0, 0), RankLoad(65, 1)]) == 0
    # namespaces are kept apart
    assert router.cached_prefixes([7, 7, 1, 2, 9, 9], extra_key="tenant") == [0, 0]


def test_a_burst_sharing_a_prefix_stays_on_one_rank_through_the_routed_record():
    """Routed before any is prefilled (cold trees): the router's record of routed prompts keeps
    a shared prefix together; without it the burst is spread by load."""
    system = list(range(100, 132))
    burst = [system + [i, i + 1] for i in range(6)]
    for routed_tokens, expected in ((1 << 16, [0] * 6), (0, [0, 1, 0, 1, 0, 1])):
        router = DPRouter(_trees(2), "cache_aware", max_load_gap_tokens=1000, routed_tokens=routed_tokens)
        loads = [0, 0]
        ranks = []
        for prompt in burst:
            rank = router.route(prompt, [RankLoad(t, 0) for t in loads])
            loads[rank] += len(prompt)
            ranks.append(rank)
        assert ranks == expected
        assert router.trees[0].evictable_size() == router.trees[1].evictable_size() == 0  # trees untouched
    # the record is bounded: the least recently routed prompts go first
    router = DPRouter(_trees(1), "cache_aware", routed_tokens=40)
    router.route(list(range(34)), [RankLoad()])
    router.route(list(range(50, 84)), [RankLoad()])
    assert router.routed_prefixes(list(range(34))) == [0]
    assert router.routed_prefixes(list(range(50, 84))) == [33]


def test_cache_aware_routing_is_a_pure_function_of_its_inputs():
    """Two routers over equal trees, fed the same stream and loads, agree request by request."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4, 12).tolist() for _ in range(40)]
    runs = []
    for _ in range(2):
        trees = _trees(3)
        router = DPRouter(trees, "cache_aware", max_load_gap_tokens=24)
        loads = [0, 0, 0]
        ranks = []
        for i, prompt in enumerate(prompts):
            rank = router.route(prompt, [RankLoad(t, 0) for t in loads])
            ranks.append(rank)
            loads[rank] += len(prompt)
            trees[rank].insert(prompt)
            if i % 5 == 4:
                loads = [max(0, t - 30) for t in loads]
        runs.append(ranks)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


def test_router_refuses_bad_settings_and_loads():
    with pytest.raises(ConfigError, match="policy"):
        DPRouter(_trees(2), "random")
    with pytest.raises(ConfigError, match="dp_size"):
        DPRouter([], "round_robin")
    with pytest.raises(ConfigError, match="max_load_gap_tokens"):
        DPRouter(_trees(2), max_load_gap_tokens=-5)
    router = DPRouter(_trees(2), "cache_aware")
    with pytest.raises(ConfigError, match="loads"):
        router.route([1, 2], [RankLoad()])
    with pytest.raises(ConfigError, match="loads"):
        router.route([1, 2])
    assert router.routed == 0


# --- the hit-rate benchmark's simulation ----------------------------------------------------------


def test_simulated_hit_rates_favour_cache_aware_routing_under_memory_pressure():
    """Real trees and allocators per rank: cache-aware routing keeps each tenant on one rank,
    round robin makes every rank cache (and evict) every tenant; no rank leaks a slot."""
    from benchmarks.dp_routing import demo_stream, multi_tenant_stream, simulate

    stream = multi_tenant_stream(tenants=6, requests=60, system_tokens=256, question_tokens=16)
    rr = simulate(stream, 2, "round_robin", in_flight=4, pool_tokens_per_rank=1536)
    ca = simulate(stream, 2, "cache_aware", in_flight=4, pool_tokens_per_rank=1536)
    assert rr["prompt_tokens"] == ca["prompt_tokens"] == 60 * 272
    assert ca["hit_rate"] > rr["hit_rate"]
    assert sum(ca["requests_per_rank"]) == 60 and min(ca["requests_per_rank"]) > 0
    demo = {p: simulate(demo_stream(), 2, p)["hit_rate"] for p in ("round_robin", "cache_aware")}
    assert demo["cache_aware"] >= demo["round_robin"] > 0.5
