"""The offline optimum: at least every online policy's hit rate on the trace excerpt, and equal to
libcachesim's Belady on the flattened excerpt, where no prefix constrains eviction."""

from __future__ import annotations

import pytest

from kvjax.replay import OPTIMUM, POLICIES, ReplayConfig, flatten_blocks, replay_policies, replay_trace
from tests.replay._traces import excerpt, full_capacity

ONLINE = [p for p in POLICIES if p != OPTIMUM]


@pytest.fixture(scope="module")
def trace():
    return excerpt()


@pytest.mark.parametrize("share, page_size", [(0.05, 512), (0.3, 512), (0.3, 16)])
def test_the_optimum_hits_at_least_as_much_as_every_policy(trace, share, page_size):
    config = ReplayConfig(capacity_tokens=int(share * full_capacity(trace)), page_size=page_size)
    report = replay_policies(trace, config, ONLINE, optimum=True)
    assert report.optimum is not None and report.optimum.evicted_tokens > 0
    for result in report.results:
        assert report.optimum.hit_tokens >= result.hit_tokens, result.policy
        gap = report.gap(result)
        assert gap is not None and gap >= 0
    assert max(report.gap(r) for r in report.results) > 0.01  # the optimum is not just a tie


def test_with_room_for_everything_every_policy_is_optimal(trace):
    config = ReplayConfig(capacity_tokens=2 * full_capacity(trace), page_size=512)
    report = replay_policies(trace, config, ["lru", "fifo"], optimum=True)
    assert report.optimum is not None
    assert {r.hit_tokens for r in report.results} == {report.optimum.hit_tokens}
    assert report.optimum.evicted_tokens == 0


def libcachesim_belady_hits(objects: list[int], cache_objects: int) -> int:
    """Hits of libcachesim's Belady over unit-size ``objects``, a cache of ``cache_objects``."""
    lcs = pytest.importorskip("libcachesim")
    next_access = [0] * len(objects)
    seen: dict[int, int] = {}
    for i in range(len(objects) - 1, -1, -1):
        next_access[i] = seen.get(objects[i], 2**62)
        seen[objects[i]] = i
    cache = lcs.Belady(cache_objects)
    return sum(
        bool(cache.get(lcs.Request(obj_size=1, obj_id=o, next_access_vtime=n)))
        for o, n in zip(objects, next_access, strict=True)
    )


@pytest.mark.parametrize("cache_blocks", [20, 150])
def test_on_a_flat_trace_the_optimum_is_belady(trace, cache_blocks):
    """Each full block access of the excerpt becomes a request of that block (+ one fresh token),
    replayed at page 512: every block is a leaf under the root. A request that misses needs two
    pages (its block and the fresh token's) beside the cached blocks, and its block joins them,
    so a device of ``C + 2`` pages holds ``C + 1`` blocks between requests: Belady at ``C + 1``
    objects, new objects always admitted (as libcachesim's)."""
    pytest.importorskip("libcachesim")
    flat = flatten_blocks(trace)
    config = ReplayConfig(capacity_tokens=(cache_blocks + 2) * 512, page_size=512, eviction_policy=OPTIMUM)
    result = replay_trace(flat, config)
    assert result.hit_tokens % 512 == 0
    expected = libcachesim_belady_hits([int(r.blocks[0]) for r in flat.requests], cache_blocks + 1)
    assert result.hit_tokens // 512 == expected
    lru = replay_trace(flat, config.with_policy("lru"))
    assert lru.hit_tokens < result.hit_tokens
