"""MLA ragged paged attention: kernel (both CPU interpreters) vs the jnp reference vs naive dense
absorbed attention written here independently in float64 numpy. Tiny shapes."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla_ragged_paged_attention import (
    mla_ragged_paged_attention,
    mla_ragged_paged_attention_reference,
)
from tests.kernels.ragged_batch import PagedBatch, paged_batch

HLO = True
TPU = pltpu.InterpretParams(detect_races=True, vector_clock_size=64)
pytestmark = pytest.mark.timeout(120)

HEADS, RANK, ROPE, PADDED, PAGE, MAX_SEQS, TOKENS, MAX_KV = 4, 16, 8, 32, 8, 5, 40, 48
PAGES_PER_SEQ = MAX_KV // PAGE + 1
NUM_PAGES = MAX_SEQS * PAGES_PER_SEQ
SM_SCALE = 0.3

MIXES = {
    "decode": ((1, 1, 1, 1), (1, 9, 30, 48)),
    "prefill": ((20, 13), (20, 13)),
    "mixed": ((1, 12, 1, 9, 6), (33, 30, 5, 9, 40)),
    "with_empty_seq": ((1, 0, 12, 1), (33, 20, 30, 5)),
}


@dataclasses.dataclass
class Batch(PagedBatch):
    ql_nope: np.ndarray
    q_pe: np.ndarray

    def args(self, q_dtype=jnp.float32, kv_dtype=jnp.float32) -> tuple[jax.Array, ...]:
        return (jnp.asarray(self.ql_nope, q_dtype), jnp.asarray(self.q_pe, q_dtype), *self.paged_args(kv_dtype))


def make_batch(mix: str, seed: int = 0) -> Batch:
    """Random latent pool (NaN on unused pages and past each sequence's end), queries, a shuffled table."""
    q_lens, kv_lens = MIXES[mix]
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((NUM_PAGES + 1, PAGE, PADDED)).astype(np.float32)
    kv[..., RANK + ROPE :] = 0.0
    paged = paged_batch(rng, kv, q_lens, kv_lens, max_seqs=MAX_SEQS, pages_per_seq=PAGES_PER_SEQ, poison=np.nan)
    ql_nope = rng.standard_normal((TOKENS, HEADS, RANK)).astype(np.float32)
    q_pe = rng.standard_normal((TOKENS, HEADS, ROPE)).astype(np.float32)
    return Batch(**vars(paged), ql_nope=ql_nope, q_pe=q_pe)


def naive(batch: Batch, kv_scale: float = 1.0) -> np.ndarray:
    """Dense absorbed MLA attention per sequence in float64 over ``kv_scale * kv_pages``."""
    out = np.zeros((TOKENS, HEADS, RANK))
    for s in range(int(batch.num_seqs[0])):
        q0, q1, kv_len = batch.cu_q_lens[s], batch.cu_q_lens[s + 1], batch.kv_lens[s]
        slots = np.arange(kv_len)
        rows = batch.kv_pages[batch.page_indices[s, slots // PAGE], slots % PAGE].astype(np.float64) * kv_scale
        c_kv, k_pe = rows[:, :RANK], rows[:, RANK : RANK + ROPE]
        for i in range(q1 - q0):
            pos = kv_len - (q1 - q0) + i
            for h in range(HEADS):
                logits = (
                    c_kv[: pos + 1] @ batch.ql_nope[q0 + i, h] + k_pe[: pos + 1] @ batch.q_pe[q0 + i, h]
                ) * SM_SCALE
                w = np.exp(logits - logits.max())
                out[q0 + i, h] = w @ c_kv[: pos + 1] / w.sum()
    return out


_JIT: dict = {}


def run(batch: Batch, interpret, q_dtype=jnp.float32, kv_dtype=jnp.float32, kv_scale=None) -> np.ndarray:
    key = interpret
    if key not in _JIT:
        if interpret == "reference":
            fn = functools.partial(mla_ragged_paged_attention_reference, sm_scale=SM_SCALE)
        else:
            fn = functools.partial(
                mla_ragged_paged_attention, sm_scale=SM_SCALE, block_q=8, block_kv_pages=2, interpret=interpret
            )
        _JIT[key] = jax.jit(fn)
    out = _JIT[key](*batch.args(q_dtype, kv_dtype), kv_scale=kv_scale)
    assert out.dtype == q_dtype and out.shape == (TOKENS, HEADS, RANK)
    return np.asarray(out.astype(jnp.float32))


TOL = dict(atol=2e-5, rtol=2e-5)


def test_reference_matches_naive() -> None:
    for mix in MIXES:
        batch = make_batch(mix)
        got = run(batch, "reference")
        assert np.isfinite(got).all(), mix
        np.testing.assert_allclose(got, naive(batch), **TOL, err_msg=mix)


def test_kernel_hlo_interpreter_matches_reference() -> None:
    for mix in MIXES:
        batch = make_batch(mix)
        np.testing.assert_allclose(run(batch, HLO), naive(batch), **TOL, err_msg=mix)


def test_kernel_tpu_interpreter_decode_and_mixed() -> None:
    for mix in ("decode", "mixed"):
        batch = make_batch(mix)
        got = run(batch, TPU)
        assert not tpu_interpreter.races.races_found
        np.testing.assert_allclose(got, naive(batch), **TOL, err_msg=mix)


@pytest.mark.slow
def test_kernel_tpu_interpreter_all_mixes() -> None:
    for mix in MIXES:
        batch = make_batch(mix)
        np.testing.assert_allclose(run(batch, TPU), naive(batch), **TOL, err_msg=mix)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_latent_with_scale(fp8) -> None:
    """An fp8 pool holding ``value / 2`` with ``kv_scale=2``: dense attention on the dequantised
    latent, bf16 queries and output (kernel under the HLO interpreter, and the reference)."""
    batch = make_batch("mixed")
    stored = np.array(jnp.asarray(batch.kv_pages * 1.5, fp8).astype(jnp.float32))
    oracle = dataclasses.replace(batch, kv_pages=stored)
    want = naive(oracle, kv_scale=2.0)
    for interpret in ("reference", HLO):
        got = run(oracle, interpret, q_dtype=jnp.bfloat16, kv_dtype=fp8, kv_scale=2.0)
        np.testing.assert_allclose(got, want, atol=6e-2, rtol=6e-2, err_msg=str(interpret))


def test_bad_input() -> None:
    args = make_batch("decode").args()
    fn = functools.partial(mla_ragged_paged_attention, sm_scale=SM_SCALE)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="kv_scale=.* finite and > 0"):
            fn(*args, kv_scale=bad)
    with pytest.raises(
        ValueError, match=r"kv_lora_rank 16 \+ qk_rope_head_dim 24 = 40 exceeds the pool's row_padded=32"
    ):
        fn(args[0], jnp.zeros((TOKENS, HEADS, 24)), *args[2:])
    with pytest.raises(TypeError, match="compute dtype"):
        fn(args[0].astype(jnp.float8_e4m3fn), args[1].astype(jnp.float8_e4m3fn), *args[2:])
    with pytest.raises(ValueError, match="cu_q_lens"):
        fn(*args[:5], args[5][:-1], args[6])


def test_tpu_lowering_selects_the_kernel() -> None:
    args = make_batch("mixed").args(jnp.bfloat16, jnp.bfloat16)
    fn = functools.partial(mla_ragged_paged_attention, sm_scale=SM_SCALE)
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def test_reads_what_the_mla_pool_wrote() -> None:
    """End to end with ``MLAKVPool`` (fp8, scale 2): write latent rows, attend over ``kv_buffer``."""
    from kvjax.pools import MLAKVPool

    rng = np.random.default_rng(1)
    pool = MLAKVPool.create(
        num_pages=4, page_size=4, num_layers=1, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, dtype="fp8_e4m3"
    )
    pool = pool.set_kv_scale(0, 2.0)
    length = 7
    slots = np.arange(4, 4 + length)  # pages 1, 2
    pool = pool.set_mla_kv_buffer(0, slots, rng.standard_normal((length, RANK)), rng.standard_normal((length, ROPE)))
    nope, rope = (np.asarray(x[:, 0], np.float64) for x in pool.get_mla_kv_buffer(0, slots))
    ql = rng.standard_normal((2, HEADS, RANK))
    qp = rng.standard_normal((2, HEADS, ROPE))
    args = (
        jnp.asarray(ql, jnp.float32),
        jnp.asarray(qp, jnp.float32),
        pool.kv_buffer(0),
        jnp.array([length], jnp.int32),
        jnp.array([[1, 2]], jnp.int32),
        jnp.array([0, 2], jnp.int32),
        jnp.array([1], jnp.int32),
    )
    want = np.zeros((2, HEADS, RANK))
    for i, pos in enumerate((5, 6)):
        for h in range(HEADS):
            logits = (nope[: pos + 1] @ ql[i, h] + rope[: pos + 1] @ qp[i, h]) * SM_SCALE
            w = np.exp(logits - logits.max())
            want[i, h] = w @ nope[: pos + 1] / w.sum()
    for interpret in (None, True):
        fn = functools.partial(mla_ragged_paged_attention, sm_scale=SM_SCALE, interpret=interpret)
        got = jax.jit(fn)(*args, kv_scale=pool.scale[0])
        np.testing.assert_allclose(np.asarray(got), want, atol=3e-2, rtol=3e-2, err_msg=str(interpret))
