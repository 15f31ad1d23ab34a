"""MLAKVPool (latent rows) and DSAIndexerKeyPool (fp8 indexer keys + f32 scales): writes, reads,
fp8 scales, bad input, in-place updates under donation, and building both from a plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import CacheConfig, build_kv_cache
from kvjax.errors import InvalidSlotError
from kvjax.pools import DSAIndexerKeyPool, MLAKVPool
from kvjax.pools.mla import scatter_rows, update_rows_in_order
from tests.specs import mla

RANK, ROPE, PAGE = 8, 4, 4


def make_pool(dtype: str = "float32", **kw) -> MLAKVPool:
    return MLAKVPool.create(
        num_pages=5, page_size=PAGE, num_layers=2, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, dtype=dtype, **kw
    )


def latent(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, RANK)).astype(np.float32), rng.standard_normal((n, ROPE)).astype(np.float32)


def test_layout_and_roundtrip():
    pool = make_pool(row_padded=16, start_layer=3)
    assert pool.kv[0].shape == (6, PAGE, 16) and pool.kv_cache_dim == 12 and pool.num_slots == 24
    assert pool.bytes_per_token() == 2 * 16 * 4
    nope, rope = latent(3)
    loc = np.array([5, 6, 13])
    pool = pool.set_mla_kv_buffer(4, loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(4, loc)
    assert got_nope.shape == (3, 1, RANK) and got_rope.shape == (3, 1, ROPE)
    np.testing.assert_array_equal(got_nope[:, 0], nope)
    np.testing.assert_array_equal(got_rope[:, 0], rope)
    # Slot 5 is page 1, offset 1: the row is [nope | rope | zero padding].
    row = np.asarray(pool.kv[1][1, 1])
    np.testing.assert_array_equal(row, np.concatenate([nope[0], rope[0], np.zeros(4, np.float32)]))
    keys, values = pool.get_kv_buffer(4)
    assert keys.shape == (24, 1, 12) and values.shape == (24, 1, RANK)
    np.testing.assert_array_equal(np.asarray(values)[13, 0], nope[2])
    assert not np.asarray(pool.kv[0]).any(), "the other layer is untouched"


def test_sglang_shapes_and_set_kv_buffer_with_the_whole_row():
    pool = make_pool()
    nope, rope = latent(2)
    pool = pool.set_mla_kv_buffer(0, np.array([4, 9]), nope[:, None], rope[:, None])  # [n, 1, width]
    row = np.concatenate([nope, rope], axis=1)
    pool2 = make_pool().set_kv_buffer(0, np.array([4, 9]), row[:, None], None)
    np.testing.assert_array_equal(np.asarray(pool.kv[0]), np.asarray(pool2.kv[0]))


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_with_scale(dtype):
    pool = make_pool(dtype).set_kv_scale(1, 2.0)
    assert pool.store_dtype == np.uint8
    nope = np.full((1, RANK), 3.0, np.float32)
    rope = np.full((1, ROPE), -1.0, np.float32)
    pool = pool.set_mla_kv_buffer(1, np.array([7]), nope, rope)
    stored = np.asarray(pool.get_key_buffer(1)[7, 0].astype(jnp.float32))
    np.testing.assert_array_equal(stored, np.r_[np.full(RANK, 1.5), np.full(ROPE, -0.5)])  # value / 2
    got_nope, got_rope = pool.get_mla_kv_buffer(1, np.array([7]))
    np.testing.assert_array_equal(got_nope[:, 0], nope)
    np.testing.assert_array_equal(got_rope[:, 0], rope)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scale_rejected_and_pool_unchanged(bad):
    pool = make_pool("fp8_e4m3").set_kv_scale(0, 2.0)
    with pytest.raises(ValueError, match="scale=.* finite and > 0"):
        pool.set_kv_scale(0, bad)
    with pytest.raises(ValueError, match="scale=.* finite and > 0"):
        pool.set_mla_kv_buffer(0, np.array([4]), *latent(1), scale=bad)
    assert pool.scale.tolist() == [2.0, 1.0]
    assert not np.asarray(pool.kv[0]).any()


def test_width_mismatch_names_the_values_and_pool_unchanged():
    pool = make_pool()
    nope, rope = latent(2)
    with pytest.raises(ValueError, match=r"cache_k_nope has shape \[2, 7\]; expected \[tokens, 8\]"):
        pool.set_mla_kv_buffer(0, np.array([4, 5]), nope[:, :7], rope)
    with pytest.raises(
        ValueError, match=r"cache_k_rope has shape \[2, 6\].*qk_rope_head_dim|cache_k_rope .* width is 4"
    ):
        pool.set_mla_kv_buffer(0, np.array([4, 5]), nope, np.zeros((2, 6)))
    with pytest.raises(ValueError, match="cache_k has shape"):
        pool.set_kv_buffer(0, np.array([4, 5]), np.zeros((2, 11)))
    with pytest.raises(ValueError, match="loc has shape"):
        pool.set_mla_kv_buffer(0, np.array([4]), nope, rope)
    with pytest.raises(InvalidSlotError, match="outside"):
        pool.set_mla_kv_buffer(0, np.array([4, 24]), nope, rope)
    with pytest.raises(InvalidSlotError, match="layer_id=2"):
        pool.set_mla_kv_buffer(2, np.array([4, 5]), nope, rope)
    assert not np.asarray(pool.kv[0]).any()


def test_traced_out_of_range_and_trash_slots_are_dropped():
    pool = make_pool()
    nope, rope = latent(4)
    write = jax.jit(lambda p, loc, a, b: p.set_mla_kv_buffer(0, loc, a, b))
    pool = write(pool, jnp.array([-1, 24, 2, 9]), nope, rope)
    layer = np.asarray(pool.kv[0]).reshape(24, -1)
    np.testing.assert_array_equal(layer[9, :RANK], nope[3])
    assert not np.delete(layer, 9, axis=0).any(), "only slot 9 was written"


def test_update_in_place_under_donation():
    pool = make_pool("bfloat16")
    nope, rope = latent(3)
    step = jax.jit(lambda p, loc, a, b: p.set_mla_kv_buffer(1, loc, a, b), donate_argnums=0)
    old = pool.kv[1]
    pool = step(pool, jnp.array([4, 5, 17]), nope, rope)
    assert old.is_deleted()
    got, _ = pool.get_mla_kv_buffer(1, np.array([17]))
    np.testing.assert_allclose(got[0, 0], nope[2], rtol=1e-2)
    # O(tokens): the compiled write aliases the pool and allocates far less than one layer.
    big = MLAKVPool.create(num_pages=4096, page_size=16, num_layers=1, kv_lora_rank=64, qk_rope_head_dim=16)
    compiled = (
        jax.jit(lambda p, loc, a, b: p.set_mla_kv_buffer(0, loc, a, b), donate_argnums=0)
        .lower(big, jnp.zeros(8, jnp.int32), jnp.zeros((8, 64)), jnp.zeros((8, 16)))
        .compile()
    )
    memory = compiled.memory_analysis()
    if memory is not None:
        assert memory.temp_size_in_bytes < big.nbytes() // 100, memory


def test_move_kv_cache_reads_before_writing():
    pool = make_pool()
    nope, rope = latent(2)
    pool = pool.set_mla_kv_buffer(0, np.array([4, 5]), nope, rope)
    pool = pool.move_kv_cache(np.array([5, 6]), np.array([4, 5]))
    got, _ = pool.get_mla_kv_buffer(0, np.array([5, 6]))
    np.testing.assert_array_equal(got[:, 0], nope)


def test_fp8_tpu_row_updates_match_the_scatter_and_leave_trash_and_others_alone():
    """The TPU path of fp8 layers (one row update per token) writes what the scatter writes: live
    slots in any order, the trash page and out-of-range slots dropped, every other byte unchanged,
    in place under donation."""
    rng = np.random.default_rng(3)
    layer = jnp.asarray(rng.integers(0, 256, (6, PAGE, 16), dtype=np.uint8)).view(jnp.float8_e4m3fn)
    rows = jnp.asarray(rng.integers(0, 256, (7, 16), dtype=np.uint8)).view(jnp.float8_e4m3fn)
    loc = jnp.array([9, -1, 2, 23, 24, 4, 100], jnp.int32)  # live: 9, 23, 4
    want = np.asarray(scatter_rows(layer, rows, loc).view(jnp.uint8))
    before = np.asarray(layer.view(jnp.uint8))
    got = jax.jit(update_rows_in_order, donate_argnums=0)(jnp.array(layer), rows, loc)
    np.testing.assert_array_equal(np.asarray(got.view(jnp.uint8)), want)
    flat_want, flat_before = want.reshape(24, 16), before.reshape(24, 16)
    np.testing.assert_array_equal(np.delete(flat_want, [9, 23, 4], axis=0), np.delete(flat_before, [9, 23, 4], axis=0))
    np.testing.assert_array_equal(flat_want[[9, 23, 4]], np.asarray(rows.view(jnp.uint8))[[0, 3, 5]])


# --- DSA indexer keys ------------------------------------------------------------------------------


def test_indexer_keys_roundtrip_and_sglang_byte_layout():
    pool = DSAIndexerKeyPool.create(num_pages=3, page_size=4, num_layers=1, index_head_dim=256)
    assert pool.index_k[0].shape == (4, 4 * (256 + 8))
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 256)).astype(np.float32)
    keys[1, 128:] *= 100.0  # a second block with a different scale
    pool = pool.set_index_k(0, np.array([5, 10]), keys)
    got = np.asarray(pool.get_index_k(0, np.array([5, 10])))
    np.testing.assert_allclose(got, keys, rtol=0.07, atol=1e-3 * np.abs(keys).max())
    fp8, scale = pool.get_index_k_and_scale(0, np.array([5, 10]))
    np.testing.assert_allclose(np.asarray(scale), np.abs(keys).reshape(2, 2, 128).max(-1) / 448.0, rtol=1e-6)
    # Slot 10 = page 2, offset 2: its key bytes at [2 * 256, 3 * 256), its scales after the page's keys.
    page = pool.page_bytes(0)[2]
    np.testing.assert_array_equal(page[512:768], np.asarray(fp8[1].view(jnp.uint8)))
    np.testing.assert_array_equal(page[4 * 256 + 2 * 8 : 4 * 256 + 3 * 8].view(np.float32), np.asarray(scale[1]))
    assert not page[:512].any() and not page[768 : 4 * 256].any()


def test_indexer_tpu_token_updates_match_the_scatter():
    """The TPU path of the indexer write (two update slices per token) writes the scatter's bytes;
    dropped tokens (trash page, out of range) change nothing."""
    rng = np.random.default_rng(5)
    pool = DSAIndexerKeyPool.create(num_pages=3, page_size=4, num_layers=1, index_head_dim=256)
    layer = jnp.asarray(rng.integers(0, 256, pool.index_k[0].shape, dtype=np.uint8))
    loc = jnp.array([5, 2, 15, -3, 16, 4], jnp.int32)
    live = (loc >= 4) & (loc < 16)
    keys = jnp.asarray(rng.integers(0, 256, (6, 256), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(0, 256, (6, 8), dtype=np.uint8))
    want = pool.scatter_tokens(layer, loc, live, keys, scales)
    got = pool.update_tokens_in_order(layer, loc, live, keys, scales)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(want), np.asarray(layer))


def test_indexer_bad_input():
    with pytest.raises(ValueError, match="index_head_dim=100"):
        DSAIndexerKeyPool.create(num_pages=1, page_size=4, num_layers=1, index_head_dim=100)
    pool = DSAIndexerKeyPool.create(num_pages=1, page_size=4, num_layers=1, index_head_dim=128)
    with pytest.raises(ValueError, match=r"keys has shape \[1, 64\]"):
        pool.set_index_k(0, np.array([4]), np.zeros((1, 64)))
    with pytest.raises(InvalidSlotError):
        pool.set_index_k(0, np.array([8]), np.zeros((1, 128)))
    assert not pool.page_bytes(0).any()


# --- built from a plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("dsa", [False, True], ids=["v3", "v32_dsa"])
def test_build_kv_cache_builds_mla_plans(dsa):
    cache = build_kv_cache(
        mla(layers=2, dsa=dsa), CacheConfig(max_total_tokens=256, max_running_requests=2, context_length=128)
    )
    kv = cache.pools.kv
    assert isinstance(kv, MLAKVPool) and kv.kv[0].shape == (17, 16, 576) and kv.num_layers == 2
    assert ("index_k" in cache.pools) == dsa
    for planned in cache.plan.pools:
        if planned.memory == "device":
            built = cache.pools[planned.name]
            arrays = built.kv if planned.name == "kv" else built.index_k
            assert arrays[0].shape == planned.shape and len(arrays) == planned.count
    loc = cache.allocator.alloc_extend(np.array([0]), np.array([3]), np.array([-1]))
    nope, rope = np.ones((3, 512)), np.ones((3, 64))
    pools = cache.pools.replace(kv=kv.set_mla_kv_buffer(1, loc, nope, rope))
    np.testing.assert_array_equal(pools.kv.get_mla_kv_buffer(1, loc)[0][:, 0], nope)
    if dsa:
        pools = pools.replace(index_k=pools.index_k.set_index_k(0, loc, np.ones((3, 128))))
        np.testing.assert_allclose(np.asarray(pools.index_k.get_index_k(0, loc)), 1.0)
