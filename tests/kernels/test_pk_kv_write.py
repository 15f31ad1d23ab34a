"""KV write kernel vs its reference, in both CPU interpreters; in-place, races, OOB, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _engine, kv_write
from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.testing import (
    TPU,
    Heads,
    assert_no_race,
    assert_same,
    interpreter_params,
    jit_interpreted,
    num_pages_for,
    pack_kv,
    race_found,
    random_pool,
    shape_params,
    slot_pattern,
)
from tests.kernels.donation import run_donated

INTERPRETERS = interpreter_params()

pytestmark = pytest.mark.timeout(60)


def _case(page_size: int, heads: Heads, seed: int = 0) -> tuple[jax.Array, np.ndarray, ...]:
    """(cache, loc, k, v, packed new_kv) of a tiny pool and a realistic slot pattern."""
    rng = np.random.default_rng(seed)
    num_pages = num_pages_for(page_size)
    cache = random_pool(rng, num_pages, page_size, heads.combined, heads.padded)
    loc = slot_pattern(rng, num_pages, page_size)
    k = rng.standard_normal((loc.size, heads.kv_heads, heads.k_dim)).astype(np.float32)
    v = rng.standard_normal((loc.size, heads.kv_heads, heads.v_dim)).astype(np.float32)
    return cache, loc, k, v, pack_kv(k, v, heads.padded)


@pytest.mark.parametrize("shape", shape_params())
@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_kernel_matches_reference(interpret, shape: tuple[int, Heads]) -> None:
    page_size, heads = shape
    cache, loc, _, _, new_kv = _case(page_size, heads)
    want = write_kv_reference(cache, jnp.asarray(new_kv), jnp.asarray(loc))
    got = jit_interpreted(write_kv, interpret=interpret)(cache, new_kv, loc)
    assert_same(got, want)
    assert_no_race()


def test_reference_semantics_exact() -> None:
    """Live slots get their rows; trash page and everything else untouched; padding dropped."""
    heads = Heads("gqa", kv_heads=1, k_dim=8, v_dim=4)
    cache, loc, k, v, new_kv = _case(16, heads)
    got = np.asarray(write_kv_reference(cache, jnp.asarray(new_kv), jnp.asarray(loc)))
    want = np.asarray(cache).reshape(-1, heads.combined, heads.padded).copy()
    live = (loc >= 16) & (loc < want.shape[0])
    want[loc[live]] = new_kv[live]
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    # K and V come back from their interleaved places; V's padding is zero.
    rows = got.reshape(want.shape)[loc[live]]
    np.testing.assert_array_equal(rows[:, 0::2, : heads.k_dim], k[live])
    np.testing.assert_array_equal(rows[:, 1::2, : heads.v_dim], v[live])
    assert not rows[:, 1::2, heads.v_dim :].any()


def test_runs_coalesce_consecutive_slots_within_a_page() -> None:
    """DMAs grow with runs: 20 prefill tokens from page 1 offset 8 at page size 16 -> 2 runs."""
    runs = jax.jit(lambda dst: _engine.contiguous_runs(jnp.arange(dst.shape[0], dtype=jnp.int32), dst, dst_group=16))
    starts, num_runs = runs(np.arange(16 + 8, 16 + 8 + 20, dtype=np.int32))
    assert int(num_runs[0]) == 2
    np.testing.assert_array_equal(np.asarray(starts[:3]), [0, 8, 20])
    # Decode: one token per sequence on scattered slots -> one run each; dropped ones alone.
    starts, num_runs = runs(np.asarray([40, 17, -1, 90, 91], np.int32))
    assert int(num_runs[0]) == 4
    np.testing.assert_array_equal(np.asarray(starts), [0, 1, 2, 3, 5, 5])


@pytest.mark.parametrize("interpret", [None, *INTERPRETERS])
def test_donated_cache_is_updated_in_place(interpret) -> None:
    cache, loc, _, _, new_kv = _case(16, Heads("mha", 2, 8, 8))
    want = write_kv_reference(cache, jnp.asarray(new_kv), jnp.asarray(loc))
    cache = jnp.array(cache)  # a buffer of our own to donate
    out = run_donated(write_kv, cache, new_kv, loc, interpret=interpret)
    assert_same(out, want)


def test_static_size_dma_path_under_tpu_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The element-by-element DMAs used for the HLO interpreter is race-free and exact too."""
    monkeypatch.setattr(_engine, "uses_dynamic_dma", lambda interpret: False)
    cache, loc, _, _, new_kv = _case(16, Heads("gqa", 1, 8, 4))
    want = write_kv_reference(cache, jnp.asarray(new_kv), jnp.asarray(loc))
    got = jit_interpreted(write_kv, interpret=TPU)(cache, new_kv, loc)
    assert_same(got, want)
    assert_no_race()


def test_two_tokens_on_one_live_slot_is_reported_as_a_race() -> None:
    cache, _, _, _, _ = _case(16, Heads("gqa", 1, 8, 4))
    loc = np.array([20, 40, 20], np.int32)  # slot 20 twice, in two separate runs
    new_kv = np.ones((3, 2, 8), np.float32)
    jit_interpreted(write_kv, interpret=TPU)(cache, new_kv, loc).block_until_ready()
    assert race_found()


def test_out_of_bounds_dma_is_caught_by_tpu_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bypass the wrapper's routing of bad slots: the interpreter must refuse the write."""
    monkeypatch.setattr(kv_write, "_dst_slots", lambda loc, num_slots, page_size: loc)
    cache, _, _, _, _ = _case(16, Heads("gqa", 1, 8, 4))
    loc = np.array([cache.shape[0] * 16 + 3], np.int32)  # one page past the end
    with pytest.raises(Exception, match="(?i)out-of-bounds"):
        jit_interpreted(write_kv, interpret=TPU)(cache, np.ones((1, 2, 8), np.float32), loc).block_until_ready()


def test_default_path_is_the_reference_on_cpu_and_pallas_for_tpu() -> None:
    cache = jax.ShapeDtypeStruct((3, 16, 4, 128), jnp.bfloat16)
    new_kv = jax.ShapeDtypeStruct((8, 4, 128), jnp.bfloat16)
    loc = jax.ShapeDtypeStruct((8,), jnp.int32)
    traced = jax.jit(write_kv, donate_argnums=0).trace(cache, new_kv, loc)
    assert "tpu_custom_call" not in traced.lower().as_text()
    assert "tpu_custom_call" in traced.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize(
    ("cache_shape", "new_shape", "loc_shape", "dtype", "match"),
    [
        ((3, 16, 4, 8), (5, 4, 8), (5,), jnp.float32, None),
        ((3, 16, 4), (5, 4, 8), (5,), jnp.float32, r"cache has shape \[3, 16, 4\]"),
        ((3, 16, 4, 8), (5, 2, 8), (5,), jnp.float32, r"new_kv has shape \[5, 2, 8\]; expected \[\?, 4, 8\]"),
        ((3, 16, 4, 8), (5, 4, 8), (4,), jnp.float32, r"loc has shape \[4\]; expected \[5\]"),
        ((3, 16, 4, 8), (5, 4, 8), (5,), jnp.bfloat16, r"new_kv has dtype bfloat16; expected float32"),
    ],
)
def test_bad_shapes_and_dtypes_fail_at_trace_time(cache_shape, new_shape, loc_shape, dtype, match) -> None:
    args = (
        jax.ShapeDtypeStruct(cache_shape, jnp.float32),
        jax.ShapeDtypeStruct(new_shape, dtype),
        jax.ShapeDtypeStruct(loc_shape, jnp.int32),
    )
    if match is None:
        jax.jit(write_kv).trace(*args)
        return
    with pytest.raises((ValueError, TypeError), match=match):
        jax.jit(write_kv).trace(*args)


def test_float_slot_ids_and_bad_interpret_are_rejected() -> None:
    cache = jnp.zeros((3, 4, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match="loc has dtype float32"):
        write_kv(cache, jnp.zeros((2, 2, 8)), jnp.zeros((2,), jnp.float32))
    with pytest.raises(TypeError, match="interpret must be"):
        write_kv(cache, jnp.zeros((2, 2, 8)), jnp.zeros((2,), jnp.int32), interpret="tpu")


def test_storage_dtypes_move_as_bytes() -> None:
    """fp8 stored as uint8 (bf16 as uint16 is covered by the state tests): bytes, never values."""
    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.integers(0, 250, (3, 4, 2, 8)), jnp.uint8)
    new_kv = jnp.asarray(rng.integers(0, 250, (3, 2, 8)), jnp.uint8)
    loc = jnp.asarray([4, 5, 11], jnp.int32)
    got = jit_interpreted(write_kv, interpret=TPU)(cache, new_kv, loc)
    assert_same(got, write_kv_reference(cache, new_kv, loc))
