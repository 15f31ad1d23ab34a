"""MLA ragged paged attention over one rank of a token stripe, with its log-sum-exp (decode context parallelism).

The latent pool of ``test_mla_ragged_paged_attention`` (striped pages of ``PAGE`` rows) is split by
rank: rank ``r`` of ``dcp`` holds rows ``r, r + dcp, ..`` of every page. Each rank's
``mla_ragged_paged_attention_with_lse(..., key_stride=dcp, key_offset=r)`` (``key_offset``
traced) is checked against its jnp reference, under both CPU interpreters of the kernel, and the
ranks' partials merged by their log-sum-exp against the dense float64 oracle over the whole
sequences (the pool is NaN wherever no output may read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla_ragged_paged_attention import (
    mla_ragged_paged_attention_reference,
    mla_ragged_paged_attention_with_lse,
)
from tests.kernels.test_mla_ragged_paged_attention import SM_SCALE, make_batch, naive

pytestmark = pytest.mark.timeout(120)

HLO = True
TPU = pltpu.InterpretParams(detect_races=True, vector_clock_size=64)
TOL = dict(atol=2e-5, rtol=2e-5)
MIX = "mixed"


@functools.cache
def _jitted(dcp: int, interpret) -> object:
    if interpret == "reference":
        fn = functools.partial(mla_ragged_paged_attention_reference, sm_scale=SM_SCALE, return_lse=True)
    else:
        fn = functools.partial(
            mla_ragged_paged_attention_with_lse, sm_scale=SM_SCALE, block_q=8, block_kv_pages=2, interpret=interpret
        )
    return jax.jit(lambda *args, key_offset: fn(*args, key_stride=dcp, key_offset=key_offset))


def _partials(dcp: int, interpret) -> tuple[np.ndarray, np.ndarray, object]:
    """``(out [dcp, T, H, rank], lse [dcp, T, H], batch)``: every rank's partial attention."""
    batch = make_batch(MIX)
    ql_nope, q_pe, kv, *tables = batch.args()
    outs, lses = [], []
    for rank in range(dcp):
        rows = jnp.asarray(np.ascontiguousarray(np.asarray(kv)[:, rank::dcp]))
        out, lse = _jitted(dcp, interpret)(ql_nope, q_pe, rows, *tables, key_offset=jnp.int32(rank))
        outs.append(np.asarray(out, np.float64))
        lses.append(np.asarray(lse, np.float64))
    return np.stack(outs), np.stack(lses), batch


def _merge(out: np.ndarray, lse: np.ndarray) -> np.ndarray:
    peak = np.max(lse, axis=0)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weight = np.where(np.isfinite(lse), np.exp(lse - peak), 0.0)
    denom = weight.sum(axis=0)
    return (weight[..., None] * out).sum(axis=0) / np.where(denom > 0, denom, 1.0)[..., None]


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_reference_partials_merge_to_dense_mla(dcp: int) -> None:
    out, lse, batch = _partials(dcp, "reference")
    np.testing.assert_allclose(_merge(out, lse), naive(batch), **TOL)


@pytest.mark.parametrize(("dcp", "interpret"), [(2, HLO), (4, HLO), (4, TPU)], ids=["dcp2-hlo", "dcp4-hlo", "dcp4-tpu"])
def test_kernel_partials_and_lse_match_the_reference(dcp: int, interpret) -> None:
    want_out, want_lse, batch = _partials(dcp, "reference")
    got_out, got_lse, _ = _partials(dcp, interpret)
    np.testing.assert_allclose(got_out, want_out, **TOL)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], **TOL)
    np.testing.assert_allclose(_merge(got_out, got_lse), naive(batch), **TOL)
    if interpret is TPU:
        assert not tpu_interpreter.races.races_found, "the TPU interpreter reported a data race"
