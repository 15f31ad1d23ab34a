"""`create_tree_cache`: which tree a plan's `TreeOptions` get, and the kinds that are not built
yet."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.alloc import SWATokenToKVPoolAllocator, make_allocator
from kvjax.radix import (
    ChunkCache,
    PureSWAChunkCache,
    RadixCache,
    SWAChunkCache,
    SWARadixCache,
    TreeOptions,
    create_tree_cache,
)
from tests.radix._helpers import RecordingAllocator


def plan(**kw):
    base = dict(
        tree_cache_kind="unified",
        tree_components=("full",),
        disable_radix_cache=False,
        attach_host_tier=False,
        tree_page_size=1,
        radix_eviction_policy="lru",
        is_eagle=False,
        enable_kv_cache_events=False,
        enable_metrics=False,
        sliding_window_size=None,
    )
    base.update(kw)
    return TreeOptions(**base)


def test_chunk_kind_gives_chunk_cache():
    alloc = RecordingAllocator(16, 1)
    c = create_tree_cache(plan(tree_cache_kind="chunk", disable_radix_cache=True), token_to_kv_pool_allocator=alloc)
    assert isinstance(c, ChunkCache) and c.token_to_kv_pool_allocator is alloc


def test_unified_full_gives_radix_cache_with_plan_settings():
    alloc = RecordingAllocator(64, 16)
    sink: list = []
    t = create_tree_cache(
        plan(tree_page_size=16, radix_eviction_policy="slru", is_eagle=True, enable_kv_cache_events=True),
        token_to_kv_pool_allocator=alloc,
        event_sink=sink,
    )
    assert isinstance(t, RadixCache) and not t.disable
    assert t.page_size == 16 and t.eviction_policy == "slru" and t.is_eagle and t.enable_kv_cache_events
    t.insert(list(range(17)), np.arange(16, 33))
    assert len(sink) == 1


def test_recurrent_tree_with_the_host_tier_is_the_himamba_tree():
    from kvjax.radix.himamba_radix_cache import HiMambaRadixCache

    t = create_tree_cache(plan(tree_components=("full", "mamba"), attach_host_tier=True, host_pool_tokens=64))
    assert isinstance(t, HiMambaRadixCache) and t.host_allocator.size == 64


def test_disabled_unified_tree_behaves_like_chunk_cache():
    t = create_tree_cache(plan(disable_radix_cache=True))
    assert isinstance(t, RadixCache) and t.disable and t.is_chunk_cache()
    assert t.insert([1, 2], np.array([1, 2])) == 0


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(tree_components=("full", "swa", "mamba")), "SWA \\+ Mamba tree"),
        (
            dict(tree_components=("full", "mamba"), attach_host_tier=True, disable_radix_cache=True),
            "disabled recurrent-state tree",
        ),
        (dict(tree_cache_kind="pure_swa_radix", attach_host_tier=True, sliding_window_size=4), "pure-SWA tree"),
    ],
)
def test_unbuilt_components_raise_naming_them(kw, name):
    with pytest.raises(NotImplementedError, match=name):
        create_tree_cache(plan(**kw))


def test_swa_kinds_give_the_swa_caches():
    alloc = SWATokenToKVPoolAllocator(32, 16, 2)
    t = create_tree_cache(
        plan(tree_components=("full", "swa"), tree_page_size=2, sliding_window_size=4), token_to_kv_pool_allocator=alloc
    )
    assert isinstance(t, SWARadixCache) and t.sliding_window_size == 4 and t.token_to_kv_pool_allocator is alloc
    t = create_tree_cache(
        plan(tree_components=("full", "swa"), disable_radix_cache=True, sliding_window_size=4),
        token_to_kv_pool_allocator=SWATokenToKVPoolAllocator(16, 8, 1),
    )
    assert isinstance(t, SWAChunkCache)
    c = create_tree_cache(
        plan(tree_cache_kind="swa_chunk", tree_components=("full", "swa"), sliding_window_size=4),
        token_to_kv_pool_allocator=SWATokenToKVPoolAllocator(16, 8, 1),
    )
    assert isinstance(c, SWAChunkCache) and c.sliding_window_size == 4
    c = create_tree_cache(
        plan(tree_cache_kind="pure_swa_chunk", tree_components=("swa",), sliding_window_size=4),
        token_to_kv_pool_allocator=make_allocator(16, 1),
    )
    assert isinstance(c, PureSWAChunkCache)
    with pytest.raises(kvjax.ConfigError, match="SWATokenToKVPoolAllocator"):
        create_tree_cache(
            plan(tree_components=("full", "swa"), sliding_window_size=4),
            token_to_kv_pool_allocator=make_allocator(16, 1),
        )


def test_host_tier_builds_a_hiradix_cache_sized_by_the_plan():
    from kvjax.radix import HiRadixCache
    from kvjax.tiers import HostSlotAllocator

    t = create_tree_cache(plan(attach_host_tier=True, host_pool_tokens=132, hicache_write_policy="write_back"))
    assert isinstance(t, HiRadixCache) and t.host_allocator.size == 132 and t.host.write_policy == "write_back"
    given = HostSlotAllocator(8, 1)
    t = create_tree_cache(plan(attach_host_tier=True), host_allocator=given)
    assert t.host_allocator is given and t.host.write_policy == "write_through"


def test_full_and_mamba_components_build_the_mamba_tree():
    from kvjax.radix import MambaRadixCache

    tree = create_tree_cache(plan(tree_components=("full", "mamba")))
    assert isinstance(tree, MambaRadixCache) and tree.supports_mamba()


def test_unknown_kind_and_policy_are_config_errors():
    with pytest.raises(kvjax.ConfigError, match="tree_cache_kind"):
        create_tree_cache(plan(tree_cache_kind="lmcache"))
    with pytest.raises(kvjax.ConfigError, match="lru"):
        create_tree_cache(plan(radix_eviction_policy="nope"))
    with pytest.raises(kvjax.ConfigError, match="tree_components"):
        create_tree_cache(plan(tree_components=("full", "c128")))


def test_real_plans_route_as_documented():
    plan_mod = pytest.importorskip("kvjax.plan")
    config_mod = pytest.importorskip("kvjax.config")
    specs = pytest.importorskip("tests.specs")

    def real(spec, **kw):
        kw.setdefault("memory_budget_bytes", 2**30)
        return plan_mod.plan_kv_cache(spec, config_mod.CacheConfig(**kw))

    p = real(specs.dense(), page_size=16)
    t = create_tree_cache(p)
    assert isinstance(t, RadixCache) and t.page_size == p.tree_page_size and not t.disable
    p = real(specs.dense(), disable_radix_cache=True)
    assert isinstance(create_tree_cache(p), (ChunkCache, RadixCache)) and create_tree_cache(p).is_chunk_cache()
    p = real(specs.swa())
    t = create_tree_cache(p)  # standalone: no allocator
    assert isinstance(t, SWARadixCache) and t.sliding_window_size == p.sliding_window_size


def test_what_the_tree_holds_is_given_at_construction():
    from kvjax.radix import HiRadixCache
    from kvjax.tiers import SimulatedCopyEngine

    engine = SimulatedCopyEngine()
    t = create_tree_cache(plan(attach_host_tier=True, host_pool_tokens=16), host_engine=engine)
    assert isinstance(t, HiRadixCache) and t.host.engine is engine
    with pytest.raises(kvjax.ConfigError, match="host_engine"):
        create_tree_cache(plan(), host_engine=engine)  # no host tier to give it to
    with pytest.raises(TypeError, match="TreeOptions"):
        create_tree_cache(object())
