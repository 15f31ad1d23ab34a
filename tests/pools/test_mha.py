"""The functional MHA pool: round trips, moves, fp8 with scales, donation, bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import InvalidSlotError
from kvjax.pools import MHAKVPool


def make_pool(dtype="float32", page_size=4, num_pages=8, layers=2, heads=2, head_dim=8, v_head_dim=6, platform="cpu"):
    return MHAKVPool.create(
        num_pages=num_pages,
        page_size=page_size,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        platform=platform,
    )


def kv(n, heads=2, head_dim=8, v_head_dim=6, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.integers(-8, 8, size=(n, heads, head_dim)).astype(np.float32)
    v = rng.integers(-8, 8, size=(n, heads, v_head_dim)).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(v)


write = jax.jit(lambda pool, layer, loc, k, v: pool.set_kv_buffer(layer, loc, k, v), static_argnums=1, donate_argnums=0)


def test_layout_interleaves_k_and_v_per_head_with_trash_page():
    pool = make_pool(v_head_dim=6)
    assert pool.kv[0].shape == (9, 4, 4, 8)  # num_pages + 1, page_size, 2 * heads, max(head dims)
    assert pool.size == 32 and pool.num_slots == 36
    k, v = kv(1)
    pool = pool.set_kv_buffer(0, np.array([5]), k, v)
    row = np.asarray(pool.kv[0][1, 1])  # slot 5 = page 1, offset 1
    np.testing.assert_array_equal(row[0], k[0, 0])
    np.testing.assert_array_equal(row[1, :6], v[0, 0])
    np.testing.assert_array_equal(row[1, 6:], 0)  # V zero-padded to the K head dim
    np.testing.assert_array_equal(row[2], k[0, 1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_trip_under_jit_with_donation(dtype, page_size):
    pool = make_pool(dtype=dtype, page_size=page_size, num_pages=64 // page_size)
    loc = np.array([page_size, page_size + 1, 3 * page_size + 2, 63], np.int32)
    k, v = kv(4)
    before = pool.kv[1]
    pointer = before.unsafe_buffer_pointer()
    pool = write(pool, 1, jnp.asarray(loc), k, v)
    assert before.is_deleted(), "the donated layer must be consumed"
    assert pool.kv[1].unsafe_buffer_pointer() == pointer, "the update must reuse the donated buffer"
    got_k, got_v = pool.get_kv(1, loc)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    # the other layer is untouched
    assert not np.asarray(pool.kv[0]).any()


def test_bfloat16_stored_as_uint16_on_cpu_and_native_elsewhere():
    assert make_pool(dtype="bfloat16").store_dtype == np.uint16
    assert make_pool(dtype="bfloat16", platform="tpu").store_dtype == jnp.bfloat16
    assert make_pool(dtype="bfloat16").kv_buffer(0).dtype == jnp.bfloat16


def test_get_key_and_value_buffers_per_slot():
    pool = make_pool()
    k, v = kv(2)
    pool = pool.set_kv_buffer(0, np.array([6, 9]), k, v)
    keys, values = pool.get_kv_buffer(0)
    assert keys.shape == (36, 2, 8) and values.shape == (36, 2, 6)
    np.testing.assert_array_equal(keys[np.array([6, 9])], k)
    np.testing.assert_array_equal(values[np.array([6, 9])], v)
    np.testing.assert_array_equal(pool.get_key_buffer(0), keys)
    np.testing.assert_array_equal(pool.get_value_buffer(0), values)


def test_move_kv_cache_copies_every_layer_and_reads_before_writing():
    pool = make_pool()
    k, v = kv(3)
    for layer in range(2):
        pool = pool.set_kv_buffer(layer, np.array([4, 5, 6]), k * (layer + 1), v * (layer + 1))
    # chain 4 -> 5, 5 -> 6: slot 6 gets the OLD slot 5
    pool = pool.move_kv_cache(np.array([5, 6]), np.array([4, 5]))
    for layer in range(2):
        got_k, got_v = pool.get_kv(layer, np.array([4, 5, 6]))
        np.testing.assert_array_equal(got_k, k[np.array([0, 0, 1])] * (layer + 1))
        np.testing.assert_array_equal(got_v, v[np.array([0, 0, 1])] * (layer + 1))


def test_move_kv_cache_under_jit_with_donation():
    pool = make_pool()
    k, v = kv(2)
    pool = pool.set_kv_buffer(0, np.array([4, 5]), k, v)
    move = jax.jit(lambda p, t, s: p.move_kv_cache(t, s), donate_argnums=0)
    pool = move(pool, jnp.array([12, 13]), jnp.array([4, 5]))
    np.testing.assert_array_equal(pool.get_kv(0, np.array([12, 13]))[0], k)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_storage_with_per_layer_scale(dtype):
    pool = make_pool(dtype=dtype)
    assert pool.store_dtype == np.uint8
    pool = pool.set_kv_scale(1, k_scale=4.0, v_scale=0.5)
    k = jnp.full((1, 2, 8), 8.0)
    v = jnp.full((1, 2, 6), 0.75)
    pool = pool.set_kv_buffer(1, np.array([7]), k, v)
    stored_k = np.asarray(pool.get_key_buffer(1)[7].astype(jnp.float32))
    np.testing.assert_array_equal(stored_k, 2.0)  # 8 / 4, exact in fp8
    np.testing.assert_array_equal(np.asarray(pool.get_value_buffer(1)[7].astype(jnp.float32)), 1.5)
    got_k, got_v = pool.get_kv(1, np.array([7]))
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_bad_fp8_scale_rejected_and_pool_unchanged(bad):
    pool = make_pool(dtype="fp8_e4m3").set_kv_scale(1, k_scale=2.0, v_scale=4.0)
    with pytest.raises(ValueError, match="k_scale=.* finite and > 0"):
        pool.set_kv_scale(1, k_scale=bad, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale=.* finite and > 0"):
        pool.set_kv_scale(1, k_scale=1.0, v_scale=bad)
    assert pool.k_scale.tolist() == [1.0, 2.0] and pool.v_scale.tolist() == [1.0, 4.0]


def test_fp8_explicit_scale_argument_overrides_stored_scale():
    pool = make_pool(dtype="fp8_e4m3")
    pool = pool.set_kv_buffer(
        0, np.array([4]), jnp.full((1, 2, 8), 6.0), jnp.full((1, 2, 6), 6.0), k_scale=2.0, v_scale=3.0
    )
    np.testing.assert_array_equal(np.asarray(pool.get_key_buffer(0)[4].astype(jnp.float32)), 3.0)
    np.testing.assert_array_equal(np.asarray(pool.get_value_buffer(0)[4].astype(jnp.float32)), 2.0)


def test_out_of_range_slots_rejected_on_host_and_pool_unchanged():
    pool = make_pool()
    k, v = kv(2)
    with pytest.raises(InvalidSlotError, match=r"\[36\]"):
        pool.set_kv_buffer(0, np.array([4, 36]), k, v)
    with pytest.raises(InvalidSlotError, match=r"\[-1\]"):
        pool.move_kv_cache(np.array([-1]), np.array([4]))
    with pytest.raises(InvalidSlotError, match="layer_id=2"):
        pool.set_kv_buffer(2, np.array([4, 5]), k, v)
    assert not np.asarray(pool.kv[0]).any()


def test_out_of_range_slots_under_jit_go_to_the_trash_page():
    pool = make_pool()
    k, v = kv(3)
    pool = write(pool, 0, jnp.array([5, 1000, -3]), k, v)
    data = np.asarray(pool.kv[0])
    np.testing.assert_array_equal(pool.get_kv(0, np.array([5]))[0], k[:1])
    live = data[1:].reshape(-1, 4, 8)
    assert np.count_nonzero(np.abs(live).sum(axis=(1, 2))) == 1, "only slot 5 of the live pages was written"


def test_shape_mismatch_names_the_argument():
    pool = make_pool()
    with pytest.raises(ValueError, match=r"k has shape .* expected \(2, 2, 8\)"):
        pool.set_kv_buffer(0, np.array([4, 5]), jnp.zeros((2, 2, 7)), jnp.zeros((2, 2, 6)))
    with pytest.raises(ValueError, match="loc has shape"):
        pool.set_kv_buffer(0, np.array([4]), *kv(2))


def test_cpu_copy_round_trip():
    pool = make_pool()
    k, v = kv(2)
    pool = pool.set_kv_buffer(1, np.array([8, 9]), k, v)
    copy = pool.get_cpu_copy(np.array([8, 9]))
    pool = pool.load_cpu_copy(copy, np.array([20, 21]))
    np.testing.assert_array_equal(pool.get_kv(1, np.array([20, 21]))[0], k)


def test_pool_is_a_pytree_with_static_meta():
    pool = make_pool()
    leaves, treedef = jax.tree_util.tree_flatten(pool)
    assert len(leaves) == 2 + 2  # two layers and two scale vectors
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.page_size == 4 and rebuilt.head_dim == 8 and rebuilt.v_head_dim == 6
