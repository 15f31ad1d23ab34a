"""SWAKVPool: built from a hybrid plan, sliding layers routed through the full->SWA mapping, trash
routing for ids that map nowhere, bounds, donation in place; build_kv_cache end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import CacheConfig, InvalidSlotError, build_kv_cache
from kvjax.alloc import SWATokenToKVPoolAllocator
from kvjax.plan import plan_kv_cache
from kvjax.pools import SWAKVPool
from kvjax.pools.registry import BuildContext, create_pool_group
from kvjax.radix import SWARadixCache
from tests.specs import swa

# Layers 0, 1, 2 sliding, 3 full (tests.specs.swa); 4 KV heads of 128.
CONFIG = CacheConfig(max_total_tokens=64, max_running_requests=4, context_length=64, page_size=4)


def make_pool() -> tuple[SWAKVPool, object]:
    plan = plan_kv_cache(swa(window=8), CONFIG.replace(platform="cpu"))
    members = tuple(p for p in plan.pools if p.kind == "swa")
    return create_pool_group("swa", members, BuildContext(platform="cpu")), plan


def kv(n: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    k = rng.integers(-8, 8, size=(n, 4, 128)).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(-k)


write = jax.jit(
    lambda pool, layer, loc, k, v, m: pool.set_kv_buffer(layer, loc, k, v, full_to_swa=m),
    static_argnums=1,
    donate_argnums=0,
)


def test_group_builder_sizes_both_pools_from_the_plan():
    pool, plan = make_pool()
    assert pool.full is not None
    assert pool.full_layer_ids == (3,) and pool.swa_layer_ids == (0, 1, 2)
    assert pool.full.size == plan.full_tokens_per_layer and pool.swa.size == plan.swa_tokens_per_layer
    assert pool.full.kv[0].shape[0] == plan.full_tokens_per_layer // 4 + 1  # + the trash page
    assert pool.swa.num_layers == 3 and pool.full.num_layers == 1
    assert pool.layers_mapping == {3: (0, False), 0: (0, True), 1: (1, True), 2: (2, True)}
    assert pool.nbytes() == sum(p.nbytes for p in plan.pools if p.kind == "swa")


def test_sliding_layers_write_through_the_mapping_full_layers_at_full_slots():
    pool, plan = make_pool()
    alloc = SWATokenToKVPoolAllocator(plan.full_tokens_per_layer, plan.swa_tokens_per_layer, 4)
    alloc.alloc(8)  # move the SWA side off the identity
    alloc.free_swa(np.arange(4, 12))
    loc = alloc.alloc(8)
    assert loc is not None
    swa_loc = alloc.translate_loc_from_full_to_swa(loc)
    assert not np.array_equal(loc, swa_loc)
    k, v = kv(8)
    m = alloc.device_mapping()
    pool = write(pool, 1, jnp.asarray(loc), k, v, m)
    pool = write(pool, 3, jnp.asarray(loc), 2 * k, 2 * v, m)
    got_k, got_v = pool.swa.get_kv(1, swa_loc)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    np.testing.assert_array_equal(pool.get_kv(1, loc, full_to_swa=m)[0], k)
    assert pool.full is not None
    np.testing.assert_array_equal(pool.full.get_kv(0, loc)[0], 2 * k)
    assert not np.asarray(pool.swa.kv[0]).any() and not np.asarray(pool.swa.kv[2]).any()


def test_ids_that_map_nowhere_go_to_the_trash_page_never_onto_live_slots():
    pool, plan = make_pool()
    alloc = SWATokenToKVPoolAllocator(plan.full_tokens_per_layer, plan.swa_tokens_per_layer, 4)
    loc = alloc.alloc(4)
    assert loc is not None
    alloc.free_swa(loc[:4])  # unpaired now: mapping 0
    live = alloc.alloc(4)
    assert live is not None
    m = alloc.device_mapping()
    k, v = kv(3)
    # an unpaired slot, a full id past the pool, a negative id: all to the trash page
    pool = write(pool, 0, jnp.array([int(loc[0]), 10_000, -5]), k, v, m)
    data = np.asarray(pool.swa.kv[0])
    assert not data[1:].any(), "no live SWA page was written"
    # a mapping entry pointing outside the SWA pool also goes to the trash page
    bad = jnp.asarray(alloc.full_to_swa_index_mapping).at[int(live[0])].set(10_000)
    pool = write(pool, 0, jnp.asarray(live[:1]), k[:1], v[:1], bad)
    assert not np.asarray(pool.swa.kv[0])[1:].any()


def test_bad_input_raises_and_leaves_the_pool_unchanged():
    pool, plan = make_pool()
    k, v = kv(2)
    before = [np.asarray(a).copy() for a in pool.swa.kv]
    with pytest.raises(InvalidSlotError, match="outside"):
        pool.set_kv_buffer(0, np.array([4, 10_000]), k, v, full_to_swa=jnp.zeros(70, jnp.int32))
    with pytest.raises(InvalidSlotError, match="layer_id=9"):
        pool.set_kv_buffer(9, np.array([4, 5]), k, v)
    with pytest.raises(ValueError, match="full_to_swa"):
        pool.set_kv_buffer(0, np.array([4, 5]), k, v)
    for a, b in zip(pool.swa.kv, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_donated_write_is_in_place():
    pool, plan = make_pool()
    alloc = SWATokenToKVPoolAllocator(plan.full_tokens_per_layer, plan.swa_tokens_per_layer, 4)
    loc = alloc.alloc(4)
    assert loc is not None
    k, v = kv(4)
    before = pool.swa.kv[2]
    pointer = before.unsafe_buffer_pointer()
    pool = write(pool, 2, jnp.asarray(loc), k, v, alloc.device_mapping())
    assert before.is_deleted(), "the donated layer must be consumed"
    assert pool.swa.kv[2].unsafe_buffer_pointer() == pointer, "the update must reuse the donated buffer"


def test_build_kv_cache_builds_a_hybrid_plan_end_to_end():
    cache = build_kv_cache(swa(window=8), CONFIG)
    assert cache.is_hybrid_swa
    pool = cache.pools.swa
    assert isinstance(pool, SWAKVPool)
    alloc = cache.token_to_kv_pool_allocator
    assert isinstance(alloc, SWATokenToKVPoolAllocator)
    assert (alloc.size_full, alloc.size_swa) == (cache.full_tokens_per_layer, cache.swa_tokens_per_layer)
    tree = cache.tree_cache
    assert isinstance(tree, SWARadixCache) and tree.sliding_window_size == 8
    assert tree.token_to_kv_pool_allocator is alloc
    loc = alloc.alloc(4)
    assert loc is not None
    k, v = kv(4)
    step = jax.jit(
        lambda pools, loc, k, m: pools.replace(swa=pools.swa.set_kv_buffer(0, loc, k, k, full_to_swa=m)),
        donate_argnums=0,
    )
    cache.set_pools(step(cache.pools, jnp.asarray(loc), k, alloc.device_mapping()))
    np.testing.assert_array_equal(cache.pools.swa.get_kv(0, loc, full_to_swa=alloc.device_mapping())[0], k)
