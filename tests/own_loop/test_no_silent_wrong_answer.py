"""Each case a user's own loop once got a silent wrong answer from is refused where it happens,
naming the value and the fix, with state unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import kvjax
from kvjax.attention import MetadataBuilder, attend
from kvjax.device_updates import StaleDeviceStateError
from kvjax.errors import ConfigError, InvalidSlotError

SPEC = kvjax.ModelSpec.preset("tiny")  # 2 layers, 4 query heads and 2 KV heads of 16


def _cache(page_size: int = 16) -> kvjax.KVCache:
    config = kvjax.CacheConfig(page_size=page_size, max_total_tokens=256, max_running_requests=4, context_length=64)
    return kvjax.build_kv_cache(SPEC, config)


def _prefill_inputs(cache: kvjax.KVCache, n: int = 8, *, bad_slot: int | None = None):
    """A one-request batch of ``n`` tokens whose slots are written in the request's row."""
    rows = cache.req_to_token_pool
    row = rows.alloc(1)[0]
    slots = cache.allocator.alloc_extend(np.array([0]), np.array([n]), np.array([-1]))
    if bad_slot is not None:
        slots = slots.copy()
        slots[1] = bad_slot
    rows.write(row, 0, slots)
    builder = MetadataBuilder(rows, cache.allocator.page_size, max_seqs=2)
    tokens, meta = builder.build(
        tokens=[np.arange(n, dtype=np.int32)],
        starts=np.array([0]),
        slots=slots,
        rows=np.array([row]),
        seq_lens=np.array([n]),
    )
    return tokens, meta, slots, row


def _qkv(t: int, head_dim: int = 16, dtype=jnp.float32):
    q = jnp.ones((t, 4, head_dim), dtype)
    k = jnp.ones((t, 2, 16), dtype)
    return q, k, k


def test_a_query_of_another_head_dim_is_refused():
    cache = _cache()
    tokens, meta, _, _ = _prefill_inputs(cache)
    q, k, v = _qkv(tokens.shape[0], head_dim=8)
    before = cache.pools
    with pytest.raises(ValueError, match=r"q has shape \[.*, 4, 8\]; expected \[tokens, heads, 16\]"):
        attend(cache.pools, 0, q, k, v, meta)
    assert cache.pools is before


def test_integer_kv_is_refused_and_float_casts_are_allowed():
    cache = _cache()
    tokens, meta, _, _ = _prefill_inputs(cache)
    q, k, v = _qkv(tokens.shape[0])
    with pytest.raises(TypeError, match="k has dtype int32; K/V and queries must be floating point"):
        attend(cache.pools, 0, q, k.astype(jnp.int32), v.astype(jnp.int32), meta)
    out, pools = attend(cache.pools, 0, q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), meta)
    assert out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()


def test_a_short_k_is_named_as_k():
    cache = _cache()
    tokens, meta, _, _ = _prefill_inputs(cache)
    q, k, v = _qkv(tokens.shape[0])
    with pytest.raises(ValueError, match=r"k has shape \(1, 2, 16\)"):
        cache.pools.kv.set_kv_buffer(0, meta.out_loc[:2], k[:1], v[:2])


def test_slots_outside_the_pool_are_refused_on_the_host_and_reported_inside_jit():
    cache = _cache()
    num_slots = cache.pools.kv.num_slots
    rows = cache.req_to_token_pool
    row = rows.alloc(1)[0]
    slots = cache.allocator.alloc(16)
    bad = slots.copy()
    bad[3] = num_slots + 5
    rows.write(row, 0, bad)
    builder = MetadataBuilder.for_cache(cache, max_seqs=2)
    with pytest.raises(InvalidSlotError, match=rf"slot ids \[{num_slots + 5}\] are outside"):
        builder.build(
            tokens=[np.arange(16, dtype=np.int32)],
            starts=np.array([0]),
            slots=bad,
            rows=np.array([row]),
            seq_lens=np.array([16]),
        )
    rows.write(row, 0, slots)
    with pytest.raises(InvalidSlotError, match=f"row {row} does not hold sequence 0's slots"):
        builder.build(
            tokens=[np.arange(16, dtype=np.int32)],
            starts=np.array([0]),
            slots=slots[::-1],
            rows=np.array([row]),
            seq_lens=np.array([16]),
        )

    # Inside the user's jit the ids are traced: under checkify the bad id is reported by value.
    tokens, meta, _, _ = _prefill_inputs(_cache(), bad_slot=num_slots + 7)

    def step(pools, q, k, v, meta):
        return attend(pools, 0, q, k, v, meta)

    q, k, v = _qkv(tokens.shape[0])
    err, _ = jax.jit(checkify.checkify(step))(_cache().pools, q, k, v, meta.with_checks())
    with pytest.raises(Exception, match=rf"out_loc \(slot ids\): id {num_slots + 7} is outside \[0, {num_slots}\)"):
        err.throw()
    # Without with_checks the step has no effect: JAX's fast dispatch path stays.
    assert not jax.make_jaxpr(step)(_cache().pools, q, k, v, meta).effects
    assert jax.make_jaxpr(step)(_cache().pools, q, k, v, meta.with_checks()).effects


def test_the_allocator_refuses_to_free_slots_the_tree_holds():
    cache = _cache(page_size=4)
    alloc, tree = cache.allocator, cache.tree_cache
    s = alloc.alloc_extend([0], [8], [-1])
    tree.insert(list(range(1, 9)), s)
    available = alloc.available_size()
    with pytest.raises(InvalidSlotError, match=r"hold a cached prefix of the tree"):
        alloc.free(s[:4])
    with pytest.raises(InvalidSlotError, match=r"hold a cached prefix of the tree"):
        alloc.free_segment(s[4:], start_pos=0)
    assert alloc.available_size() == available
    alloc.check_invariants()
    tree.check_invariants()
    assert tree.evict(100) == 8
    assert alloc.available_size() == alloc.size
    alloc.check_invariants()
    tree.check_invariants()


def test_tp_without_a_mesh_is_refused_naming_the_mesh():
    config = kvjax.CacheConfig(max_total_tokens=256, max_running_requests=4, context_length=64, tp_size=2)
    with pytest.raises(ConfigError, match=r"needs a mesh with a 'tp' axis .*make_serving_mesh\(2\)"):
        kvjax.build_kv_cache(SPEC, config)


def test_a_donated_cache_pools_names_the_missing_set_pools():
    cache = _cache()
    tokens, meta, _, _ = _prefill_inputs(cache)
    q, k, v = _qkv(tokens.shape[0])
    step = jax.jit(lambda pools, q, k, v, meta: attend(pools, 0, q, k, v, meta)[::-1], donate_argnums=0)
    pools, _ = step(cache.pools, q, k, v, meta)
    with pytest.raises(StaleDeviceStateError, match=r"call cache.set_pools\(pools\)"):
        _ = cache.pools
    cache.set_pools(pools)
    assert cache.pools is pools
