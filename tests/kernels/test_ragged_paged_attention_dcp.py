"""Ragged paged attention over one rank of a token stripe, with its log-sum-exp (decode context parallelism).

A pool of striped pages of ``RANK_PAGE * dcp`` slots (offset ``o`` of a page is the sequence's
token ``page * RANK_PAGE * dcp + o``, ``kvjax.alloc.dcp``) is split by rank: rank ``r`` holds rows
``r, r + dcp, ..`` of every page, ``[pages + 1, RANK_PAGE, ...]``. Each rank's
``ragged_paged_attention_with_lse(..., key_stride=dcp, key_offset=r)`` is checked against

* the jnp reference of the same call (output and log-sum-exp), under both CPU interpreters of the
  kernel (``interpret=True``; the TPU interpreter with race detection), with ``key_offset`` traced;
* the dense oracle of ``test_ragged_paged_attention`` (float64 numpy over the whole sequences):
  the ranks' partials merged by their log-sum-exp equal it, and on a plain pool (``key_stride``
  1) the log-sum-exp equals the dense one.

The pools are poisoned with NaN where no output may read (the trash page, unused pages, rows past
a sequence's end), so a mask off by one stripe shows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference, ragged_paged_attention_with_lse
from tests.kernels.test_ragged_paged_attention import Config, make_batch, naive_attention

pytestmark = pytest.mark.timeout(120)

HLO = True
TPU = pltpu.InterpretParams(detect_races=True, vector_clock_size=64)
TOL = dict(atol=2e-5, rtol=2e-5)

# (dcp, config of the striped pool: page_size is the striped page, RANK_PAGE * dcp rows).
CASES = {
    "dcp2_gqa": (2, Config("dcp2_gqa", page_size=8, block_q=8, block_kv_pages=2)),
    "dcp4_window_softcap": (4, Config("dcp4_window", page_size=8, sliding_window=7, soft_cap=2.0, block_kv_pages=2)),
}
MIX = "mixed"  # extend chunks on cached prefixes next to decode tokens, a chunk across q blocks


def _rank_rows(kv_pages: np.ndarray, dcp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s rows of every striped page: offsets ``rank, rank + dcp, ..``."""
    return np.ascontiguousarray(kv_pages[:, rank::dcp])


@functools.cache
def _jitted(cfg: Config, dcp: int, interpret) -> object:
    """One jitted partial attention per (config, stripe, interpreter); ``key_offset`` is traced."""
    options = dict(sm_scale=cfg.sm_scale, sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap, key_stride=dcp)
    if interpret == "reference":
        fn = functools.partial(ragged_paged_attention_reference, return_lse=True, **options)
    else:
        fn = functools.partial(
            ragged_paged_attention_with_lse,
            block_q=cfg.block_q,
            block_kv_pages=cfg.block_kv_pages,
            interpret=interpret,
            **options,
        )
    return jax.jit(lambda *args, key_offset: fn(*args, key_offset=key_offset))


def _partials(cfg: Config, dcp: int, interpret) -> tuple[np.ndarray, np.ndarray, object]:
    """``(out [dcp, T, Hq, D], lse [dcp, T, Hq], batch)``: every rank's partial attention."""
    batch = make_batch(cfg, MIX)
    q, kv, *tables = batch.args()
    outs, lses = [], []
    for rank in range(dcp):
        rows = jnp.asarray(_rank_rows(np.asarray(kv), dcp, rank))
        out, lse = _jitted(cfg, dcp, interpret)(q, rows, *tables, key_offset=jnp.int32(rank))
        outs.append(np.asarray(out, np.float64))
        lses.append(np.asarray(lse, np.float64))
    return np.stack(outs), np.stack(lses), batch


def _merge(out: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """The exact merge over ranks (``kvjax.attention.dcp_merge``), in numpy."""
    peak = np.max(lse, axis=0)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weight = np.where(np.isfinite(lse), np.exp(lse - peak), 0.0)
    denom = weight.sum(axis=0)
    return (weight[..., None] * out).sum(axis=0) / np.where(denom > 0, denom, 1.0)[..., None]


def _dense_lse(cfg: Config, batch) -> np.ndarray:
    """The log-sum-exp of each query's visible logits over the whole sequence (float64; -inf when none)."""
    lse = np.full(batch.q.shape[:2], -np.inf)
    group = cfg.num_q_heads // cfg.num_kv_heads
    scale = cfg.sm_scale if cfg.sm_scale is not None else 1.0 / np.sqrt(cfg.head_dim)
    for s in range(int(batch.num_seqs[0])):
        q0, q1, kv_len = batch.cu_q_lens[s], batch.cu_q_lens[s + 1], batch.kv_lens[s]
        slots = np.arange(kv_len)
        rows = batch.kv_pages[batch.page_indices[s, slots // cfg.page_size], slots % cfg.page_size]
        keys = rows[:, 0::2, : cfg.head_dim].astype(np.float64)
        for i in range(q1 - q0):
            pos = kv_len - (q1 - q0) + i
            visible = slots <= pos
            if cfg.sliding_window is not None:
                visible &= slots > pos - cfg.sliding_window
            for head in range(cfg.num_q_heads):
                logits = keys[visible, head // group] @ batch.q[q0 + i, head].astype(np.float64) * scale
                if cfg.soft_cap is not None:
                    logits = cfg.soft_cap * np.tanh(logits / cfg.soft_cap)
                peak = logits.max()
                lse[q0 + i, head] = peak + np.log(np.exp(logits - peak).sum())
    return lse


@pytest.mark.parametrize("case", list(CASES))
def test_reference_partials_merge_to_dense_attention(case: str) -> None:
    dcp, cfg = CASES[case]
    out, lse, batch = _partials(cfg, dcp, "reference")
    np.testing.assert_allclose(_merge(out, lse), naive_attention(cfg, batch), **TOL)


@pytest.mark.parametrize("interpret", [HLO, TPU], ids=["hlo", "tpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_partials_and_lse_match_the_reference(case: str, interpret) -> None:
    dcp, cfg = CASES[case]
    want_out, want_lse, batch = _partials(cfg, dcp, "reference")
    got_out, got_lse, _ = _partials(cfg, dcp, interpret)
    np.testing.assert_allclose(got_out, want_out, **TOL)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], **TOL)
    np.testing.assert_allclose(_merge(got_out, got_lse), naive_attention(cfg, batch), **TOL)
    if interpret is TPU:
        assert not tpu_interpreter.races.races_found, "the TPU interpreter reported a data race"


@pytest.mark.parametrize("interpret", ["reference", HLO], ids=["reference", "hlo"])
def test_lse_of_a_plain_pool_is_the_dense_log_sum_exp(interpret) -> None:
    cfg = dataclasses.replace(CASES["dcp2_gqa"][1], name="plain")
    out, lse, batch = _partials(cfg, 1, interpret)
    want = _dense_lse(cfg, batch)
    np.testing.assert_array_equal(np.isinf(lse[0]), np.isinf(want))
    np.testing.assert_allclose(lse[0][np.isfinite(want)], want[np.isfinite(want)], **TOL)
    np.testing.assert_allclose(out[0], naive_attention(cfg, batch), **TOL)


def test_lse_with_sinks_or_a_bad_stride_is_refused_by_name() -> None:
    cfg = CASES["dcp2_gqa"][1]
    q, kv, *tables = make_batch(cfg, MIX).args()
    with pytest.raises(ValueError, match="return_lse with sinks"):
        ragged_paged_attention_reference(q, kv, *tables, return_lse=True, sinks=jnp.zeros(cfg.num_q_heads))
    with pytest.raises(ValueError, match="key_stride=0"):
        ragged_paged_attention_with_lse(q, kv, *tables, key_stride=0)
