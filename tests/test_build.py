"""build_kv_cache: the plan executed — pools, allocator, request table, errors for what is not built."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import jax
import numpy as np
import pytest

import kvjax
from kvjax import CacheConfig, ModelSpec, build_kv_cache
from tests.mesh.subprocess_run import run_with_devices
from tests.specs import dense, mla, ssm


def tiny_cache(**kw):
    kw.setdefault("max_total_tokens", 1024)
    kw.setdefault("max_running_requests", 8)
    kw.setdefault("context_length", 256)
    return build_kv_cache(ModelSpec.preset("tiny"), CacheConfig(**kw))


def small_config(**overrides) -> CacheConfig:
    """A config for a hand-built spec at test sizes: 256 pool tokens, 4 requests of up to 64 tokens."""
    return CacheConfig(**{"max_total_tokens": 256, "max_running_requests": 4, "context_length": 64, **overrides})


def test_build_fills_the_seed_result_fields_plus_plan_and_pools():
    cache = tiny_cache()
    assert isinstance(cache, kvjax.KVCache)
    assert (cache.is_hybrid_swa, cache.is_hybrid_ssm, cache.sliding_window_size) == (False, False, None)
    assert (cache.full_tokens_per_layer, cache.swa_tokens_per_layer) == (None, None)
    assert cache.disable_radix_cache is False
    assert cache.plan.platform == "cpu" and cache.plan.max_total_tokens == 1024
    assert cache.allocator is cache.token_to_kv_pool_allocator


def test_build_allocates_what_the_plan_lists():
    cache = tiny_cache(page_size=16)
    kv, planned = cache.pools.kv, cache.plan.pool("kv")
    assert kv.num_layers == planned.count
    assert kv.kv[0].shape == planned.shape
    assert str(kv.store_dtype) == planned.dtype
    assert kv.nbytes() == planned.nbytes
    assert not any(np.asarray(layer).any() for layer in kv.kv), "pools start zeroed"
    rows = cache.req_to_token_pool
    assert rows.req_to_token.shape == cache.plan.pool("req_to_token").shape


def test_build_allocator_matches_pool_and_never_hands_out_page_zero():
    cache = tiny_cache(page_size=16)
    alloc = cache.allocator
    assert alloc.page_size == 16 and alloc.size == cache.pools.kv.size == 1024
    slots = alloc.alloc(1024)
    assert slots is not None and slots.min() >= 16 and slots.max() < cache.pools.kv.num_slots
    assert alloc.alloc(16) is None


def test_build_page_size_one_uses_token_allocator():
    cache = tiny_cache(page_size=1)
    assert type(cache.allocator).__name__ == "TokenToKVPoolAllocator"
    assert cache.pools.kv.kv[0].shape[:2] == (1025, 1)


def test_build_bf16_pool_stored_as_uint16_on_cpu():
    spec = dense(layers=2, kv_heads=2, head_dim=16, context=256, dtype="bfloat16")
    cache = build_kv_cache(spec, CacheConfig(max_total_tokens=256, max_running_requests=4))
    assert cache.pools.kv.store_dtype == np.uint16 and cache.plan.storage_dtype == "uint16"


def test_build_fp8_pool():
    cache = tiny_cache(kv_cache_dtype="fp8_e5m2")
    assert cache.pools.kv.store_dtype == np.uint8 and cache.pools.kv.dtype == "fp8_e5m2"


def test_built_pools_update_in_place_in_a_donated_step():
    cache = tiny_cache()
    kv = cache.pools.kv
    loc = cache.allocator.alloc_extend(np.array([0]), np.array([5]), np.array([-1]))
    k = np.ones((5, kv.num_kv_heads, kv.head_dim), np.float32)
    step = jax.jit(lambda pools, loc, k: pools.replace(kv=pools.kv.set_kv_buffer(1, loc, k, k)), donate_argnums=0)
    old = cache.pools.kv.kv[1]
    cache = cache.with_pools(step(cache.pools, loc, k))
    assert old.is_deleted()
    np.testing.assert_array_equal(cache.pools.kv.get_kv(1, loc)[0], k)


def test_build_host_tier_backs_up_and_loads_back_real_kv():
    import jax.numpy as jnp
    import numpy as np

    from kvjax.radix import HiRadixCache

    cache = tiny_cache(enable_hierarchical_cache=True, hicache_mem_layout="page_first")
    tree = cache.tree_cache
    assert isinstance(tree, HiRadixCache) and cache.host_pool.size == cache.plan.host_pool_tokens
    assert cache.host_pool.layout.name == "page_first"
    ps = cache.plan.alloc_page_size
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(2 * ps)
    pool = cache.pools.kv
    marked = tuple(a.at[1:3].set(jnp.asarray(7 + i, a.dtype)) for i, a in enumerate(pool.kv))  # pages 1, 2
    cache.set_pools(cache.pools.replace(kv=pool.replace(kv=marked)))
    assert slots.tolist() == list(range(ps, 3 * ps))
    tree.insert(list(range(2 * ps)), slots)
    tree.check_transfers(wait=True)
    assert tree.evict(2 * ps) == 2 * ps
    blank = tuple(a.at[1:3].set(0) for a in cache.pools.kv.kv)
    cache.set_pools(cache.pools.replace(kv=cache.pools.kv.replace(kv=blank)))
    m = tree.init_load_back(tree.match_prefix(list(range(2 * ps))))
    assert m.prefix_len == 2 * ps
    cache.apply_pending()  # the owner of the step applies the recorded load
    tree.check_transfers(wait=True)
    pages = np.unique(m.indices // ps)
    for i, layer in enumerate(cache.pools.kv.kv):
        assert (np.asarray(layer)[pages] == 7 + i).all()  # the KV came back from the host


def test_build_bad_config_raises_config_error_before_allocating():
    with pytest.raises(kvjax.ConfigError, match="memory_budget_bytes"):
        build_kv_cache(ModelSpec.preset("tiny"), CacheConfig())


def test_build_mem_fraction_needs_device_memory_on_cpu():
    # The CPU device reports no memory limit: the error says what to pass instead.
    try:
        cache = build_kv_cache(
            ModelSpec.preset("tiny"), CacheConfig(mem_fraction_static=0.001, max_running_requests=4, context_length=256)
        )
    except kvjax.ConfigError as e:
        assert "device_memory_bytes" in str(e)
    else:
        assert (cache.plan.kv_budget_bytes or 0) > 0
    cache = build_kv_cache(
        ModelSpec.preset("tiny"),
        CacheConfig(mem_fraction_static=0.5, max_running_requests=4, context_length=256),
        device_memory_bytes=2**24,
    )
    assert cache.plan.kv_budget_bytes == 2**23


def test_build_shards_kv_heads_over_a_tp_mesh():
    """Run in a subprocess: the host platform must be split into 8 devices before JAX starts."""
    code = textwrap.dedent(
        """
        import json, jax, numpy as np
        from jax.sharding import Mesh
        from kvjax import CacheConfig, build_kv_cache
        from tests.specs import dense
        mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        spec = dense(layers=2, kv_heads=8, head_dim=16, context=256, dtype="float32")
        cache = build_kv_cache(spec, CacheConfig(max_total_tokens=256, tp_size=4, max_running_requests=4), mesh=mesh)
        layer = cache.pools.kv.kv[0]
        shard = layer.addressable_shards[0].data.shape
        # A donated write and a move through the sharded pool: each device updates its own heads.
        loc = cache.allocator.alloc_extend(np.array([0]), np.array([3]), np.array([-1]))
        k = np.arange(3 * 8 * 16, dtype=np.float32).reshape(3, 8, 16)
        step = jax.jit(lambda kv, loc, k: kv.set_kv_buffer(1, loc, k, -k).move_kv_cache(loc + 32, loc),
                       donate_argnums=0)
        kv = step(cache.pools.kv, loc, k)
        got_k, got_v = kv.get_kv(1, loc + 32)
        ok = bool(np.array_equal(got_k, k) and np.array_equal(got_v, -k))
        sharded = str(kv.kv[1].sharding.spec)
        print(json.dumps({"global": list(layer.shape), "shard": list(shard),
                          "heads_per_rank": cache.plan.num_kv_heads_per_rank, "roundtrip": ok, "spec": sharded}))
        """
    )
    result = run_with_devices(["-c", code], timeout=120)
    assert result["global"] == [17, 16, 16, 16]  # 8 KV heads -> 16 combined K/V heads
    assert result["shard"] == [17, 16, 4, 16]  # 2 heads per rank: K0 V0 K1 V1
    assert result["heads_per_rank"] == 2
    assert result["roundtrip"], "write + move through the sharded pool must round-trip"
    assert "tp" in result["spec"], "the updated layer stays sharded over the KV-head axis"


def test_build_rejects_a_mesh_that_disagrees_with_tp_size():
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(kvjax.ConfigError, match="tp_size"):
        build_kv_cache(ModelSpec.preset("tiny"), CacheConfig(max_total_tokens=256, tp_size=2), mesh=mesh)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    with pytest.raises(kvjax.ConfigError, match="'tp'"):
        build_kv_cache(ModelSpec.preset("tiny"), CacheConfig(max_total_tokens=256), mesh=mesh)


def test_plan_of_a_built_cache_is_json_able():
    json.dumps(tiny_cache().plan.to_dict())


def test_set_pools_after_a_donated_step_keeps_cache_pools_readable():
    cache = tiny_cache()
    holder = cache  # another reference to the same cache (the scheduler's, the user's)
    kv = cache.pools.kv
    loc = cache.allocator.alloc_extend(np.array([0]), np.array([3]), np.array([-1]))
    k = np.full((3, kv.num_kv_heads, kv.head_dim), 2.0, np.float32)
    step = jax.jit(lambda pools, loc, k: pools.replace(kv=pools.kv.set_kv_buffer(0, loc, k, -k)), donate_argnums=0)
    old_layer = cache.pools.kv.kv[0]
    cache.set_pools(step(cache.pools, loc, k))
    assert old_layer.is_deleted(), "the step was donated"
    got_k, got_v = holder.pools.kv.get_kv(0, loc)  # the same holder reads live arrays
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, -k)
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(holder.pools))


def test_set_pools_rejects_other_state_and_leaves_the_cache_unchanged():
    cache = tiny_cache()
    before = cache.pools
    with pytest.raises(TypeError, match="expected CachePools"):
        cache.set_pools(before.kv)
    other = tiny_cache(kv_cache_dtype="fp8_e5m2").pools  # same names, other static fields
    with pytest.raises(TypeError, match="structure"):
        cache.set_pools(other)
    assert cache.pools is before


def test_with_pools_is_a_new_holder_sharing_the_host_objects():
    cache = tiny_cache()
    copy = cache.with_pools(cache.pools.replace(kv=cache.pools.kv))
    assert copy is not cache and copy.plan is cache.plan
    assert copy.allocator is cache.allocator and copy.tree_cache is cache.tree_cache
    assert copy.req_to_token_pool is cache.req_to_token_pool


def test_kv_cache_reads_the_build_result_names_from_its_plan():
    cache = tiny_cache()
    for name in ("is_hybrid_swa", "is_hybrid_ssm", "sliding_window_size", "full_tokens_per_layer"):
        assert getattr(cache, name) == getattr(cache.plan, name)
    assert cache.swa_tokens_per_layer is cache.plan.swa_tokens_per_layer
    assert cache.disable_radix_cache is cache.plan.disable_radix_cache


def test_build_makes_one_device_pool_per_planned_device_pool():
    cache = tiny_cache()
    planned = [p.name for p in cache.plan.pools if p.memory == "device"]
    assert list(cache.pools.names) == planned == ["kv"]
    assert cache.pools["kv"] is cache.pools.kv


def test_not_built_kinds_raise_from_their_registry_entry_before_allocating(monkeypatch):
    from kvjax.plan.kinds import PLANNER_KINDS, pool_kind

    mla_kind = next(k for k in PLANNER_KINDS if "mla" in {p.name for p in k.pool_kinds})
    unbuilt = dataclasses.replace(pool_kind("mla"), capability="a latent pool without a builder", built=False)
    monkeypatch.setitem(PLANNER_KINDS._entries, mla_kind.name, dataclasses.replace(mla_kind, pool_kinds=(unbuilt,)))
    with pytest.raises(NotImplementedError, match=r"pool kind 'mla'") as e:
        build_kv_cache(mla(), CacheConfig(max_total_tokens=1024, max_running_requests=4, context_length=256))
    assert unbuilt.capability in str(e.value)


def test_a_pool_kind_without_a_registered_builder_is_refused_before_allocating(monkeypatch):
    from kvjax.pools.registry import POOL_BUILDERS

    full = next(k for k in POOL_BUILDERS if "mha" in k.builders)
    monkeypatch.setitem(POOL_BUILDERS._entries, full.name, dataclasses.replace(full, builders={}))
    with pytest.raises(NotImplementedError, match=r"pool kind 'mha'.*register_pool_builders"):
        build_kv_cache(dense(), CacheConfig(max_total_tokens=1024, max_running_requests=4, context_length=256))


def test_build_hybrid_ssm_state_pool_and_request_table():
    from kvjax.hybrid_req_pool import HybridReqToTokenPool
    from tests.specs import F, R

    config = small_config(page_size=1, disable_radix_cache=True, max_mamba_cache_size=5)
    cache = build_kv_cache(ssm((R, F, R, F)), config)
    assert cache.is_hybrid_ssm and set(cache.pools.names) == {"kv", "recurrent"}
    state = cache.pools.recurrent
    assert state.layer_ids == (0, 2) and state.num_slots == 5
    assert state.nbytes() == sum(p.nbytes for p in cache.plan.pools if p.kind == "recurrent")
    assert cache.pools.kv.layer_ids == (1, 3)
    with pytest.raises(Exception, match="layer_id=2 not in full attention layers"):
        cache.pools.kv.get_kv(2, np.array([1]))
    table = cache.req_to_token_pool
    assert isinstance(table, HybridReqToTokenPool) and table.mamba_pool_size == 5


def test_build_shards_the_recurrent_state_over_a_tp_mesh():
    """In a subprocess (8 host devices): the state is sharded as SGLang shards it (conv channels and
    SSM heads over the ranks, whole slots per device); fork and zero run per device, in place."""
    code = textwrap.dedent(
        """
        import json, jax, numpy as np
        from jax.sharding import Mesh
        from kvjax import CacheConfig, build_kv_cache
        from tests.specs import F, R, ssm
        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
        config = CacheConfig(max_total_tokens=64, tp_size=2, max_running_requests=2, context_length=32,
                             page_size=1, disable_radix_cache=True, max_mamba_cache_size=4)
        cache = build_kv_cache(ssm((R, F)), config, mesh=mesh)
        state = cache.pools.recurrent
        rng = np.random.default_rng(0)
        conv = [rng.standard_normal((5, *a.shape[2:])).astype(np.float32) for a in state.conv]
        ssm_new = rng.standard_normal((5, *state.ssm.shape[2:])).astype(np.float32)
        state = state.set_states(0, np.arange(5), conv, ssm_new)
        before = np.asarray(state.ssm)
        pointer = state.ssm.addressable_shards[0].data.unsafe_buffer_pointer()
        fork = jax.jit(lambda p, s, d: p.fork(s, d).zero_slots(s), donate_argnums=0)
        state = fork(state, np.array([1]), np.array([3]))
        after = np.asarray(state.ssm)
        print(json.dumps({
            "conv": [list(a.shape) for a in state.conv],
            "conv_shard": list(state.conv[0].addressable_shards[0].data.shape),
            "ssm": list(state.ssm.shape), "ssm_shard": list(state.ssm.addressable_shards[0].data.shape),
            "forked": bool(np.array_equal(after[:, 3], before[:, 1])), "zeroed": not after[:, 1].any(),
            "others": bool(np.array_equal(after[:, [0, 2, 4]], before[:, [0, 2, 4]])),
            "in_place": state.ssm.addressable_shards[0].data.unsafe_buffer_pointer() == pointer,
            "spec": str(state.ssm.sharding.spec)}))
        """
    )
    r = run_with_devices(["-c", code], timeout=120)
    # tests.specs.ssm: conv [256, 3] and SSM [4, 64, 64] per layer unsharded; 2 ranks hold half each.
    assert r["conv"] == [[1, 5, 256, 3]] and r["conv_shard"] == [1, 5, 128, 3]
    assert r["ssm"] == [1, 5, 4, 64, 64] and r["ssm_shard"] == [1, 5, 2, 64, 64]
    assert r["forked"] and r["zeroed"] and r["others"], r
    assert r["in_place"], "the donated shards must be reused"
    assert "tp" in r["spec"]


def test_build_host_tier_for_mla_and_refuses_dsa():
    from kvjax.radix import HiRadixCache
    from tests.specs import mla

    config = small_config(enable_hierarchical_cache=True)
    cache = build_kv_cache(mla(layers=2), config)
    assert isinstance(cache.tree_cache, HiRadixCache) and cache.host_pool.num_layers == 2
    with pytest.raises(NotImplementedError, match="DSA indexer"):
        build_kv_cache(mla(layers=2, dsa=True), config)


def test_set_pools_checks_each_compiled_steps_structure_once(monkeypatch):
    import kvjax.build as build_module

    cache = tiny_cache()
    flattened = []
    real = jax.tree_util.tree_structure

    def counting(tree, *args, **kwargs):
        flattened.append(type(tree).__name__)
        return real(tree, *args, **kwargs)

    step = jax.jit(lambda pools, x: (pools, x + 1), donate_argnums=0)
    monkeypatch.setattr(build_module.jax.tree_util, "tree_structure", counting)
    for i in range(6):
        pools, _ = step(cache.pools, i)
        cache.set_pools(pools)
    # The first (tracing) call and the compiled entry's outputs: one full check each, then none.
    assert len(flattened) <= 2
    # Pools of another structure are still refused, even rebuilt from a checked step output.
    with pytest.raises(TypeError, match="structure"):
        cache.set_pools(jax.tree_util.tree_map(lambda a: None, cache.pools))
    by_hand = cache.pools.replace(kv=cache.pools.kv)  # no origin: always fully checked
    assert by_hand.origin is None
    n = len(flattened)
    cache.set_pools(by_hand)
    assert len(flattened) == n + 1
    other = tiny_cache(kv_cache_dtype="fp8_e5m2")
    other_step = jax.jit(lambda pools: pools)
    with pytest.raises(TypeError, match="structure"):
        cache.set_pools(other_step(other.pools))
    assert cache.pools is by_hand


def test_build_plans_and_builds_the_host_tier_of_a_recurrent_model():
    """The host tier of a hybrid SSM model: the KV's host pool and the checkpoints' host pool
    (``"host_state"``, SGLang's ``MambaPoolHost`` sizing: ``int(slots * hicache_ratio) + 1``), the
    tree ``HiMambaRadixCache`` with the state engine beside the KV's."""
    from kvjax.radix.himamba_radix_cache import HiMambaRadixCache
    from kvjax.tiers.host_state_pool import HostStatePool

    config = small_config(enable_hierarchical_cache=True, hicache_ratio=3.0, page_size=1, platform="cpu")
    plan = kvjax.plan_kv_cache(ssm(), config)
    [state] = [p for p in plan.pools if p.name == "host_state"]
    assert state.memory == "host" and state.shape[0] == int(plan.max_mamba_cache_size * 3.0) + 1
    cache = build_kv_cache(ssm(), config)
    tree = cache.tree_cache
    assert isinstance(tree, HiMambaRadixCache)
    assert isinstance(cache.host_pools["host_state"], HostStatePool)
    assert tree.host_state_allocator is cache.host_pools["host_state"].allocator
    assert tree.mamba.engine.host_pool is cache.host_pools["host_state"]
    with pytest.raises(NotImplementedError, match="write_back"):
        build_kv_cache(ssm(), config.replace(hicache_write_policy="write_back"))
    # hicache_size split over the two host pools by their device bytes (SGLang's _split_hicache_size)
    sized = kvjax.plan_kv_cache(ssm(), config.replace(hicache_size=0.002))
    kv = sized.max_total_tokens * sized.bytes_per_token
    states = (
        sized.max_mamba_cache_size * [p for p in plan.pools if p.kind == "recurrent"][0].layout.bytes_per_slot_per_layer
    )
    states *= len(state.layer_ids)
    share = kv / (kv + states)
    assert sized.host_pool_tokens == int(0.002 * share * 1e9 // sized.bytes_per_token) + 1
    [sized_state] = [p for p in sized.pools if p.name == "host_state"]
    assert sized_state.shape[0] == int(0.002 * (1 - share) * 1e9 // sized_state.shape[1]) + 1
    # the host memory check counts both host pools (10 GiB are kept free, as SGLang keeps them)
    host = sum(p.nbytes for p in plan.pools if p.memory == "host" and p.kind in ("host_tier", "host_state"))
    kvjax.plan_kv_cache(ssm(), config, host_memory_bytes=10 * (1 << 30) + host)
    with pytest.raises(kvjax.ConfigError, match="hicache_ratio"):
        kvjax.plan_kv_cache(ssm(), config, host_memory_bytes=10 * (1 << 30) + host - 1)
