"""Ragged paged attention: kernel (both CPU interpreters) vs the jnp reference vs naive dense attention.

Tiny shapes (a few sequences, <= 64 tokens, small head dims), f32 pools unless stated, so that the
interpreters stay fast and comparisons tight. The naive attention here is written independently
of the module: per sequence it gathers K/V from the pages with numpy, builds the causal (and
window) mask and takes a softmax.
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

from pallas_kernels.ragged_paged_attention import (
    default_block_sizes,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests.kernels.ragged_batch import PagedBatch, paged_batch

HLO = True
TPU = pltpu.InterpretParams(detect_races=True, vector_clock_size=64)

pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static facts of a batch (one kernel compile): shapes, tiling and attention options.

    Decode-only, prefill-only and mixed batches differ only in data (``MIXES``), so one compile
    per config serves all three, as it would in a serving loop.
    """

    name: str
    page_size: int = 16
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dim_padded: int = 32
    max_seqs: int = 5  # > the live sequences: the spare rows of the tables are ignored padding
    total_tokens: int = 40  # query tokens incl. padding after the last sequence
    max_kv: int = 64  # keys per sequence at most
    sliding_window: int | None = None
    soft_cap: float | None = None
    sm_scale: float | None = None
    block_q: int | None = 8
    block_kv_pages: int | None = 2
    sinks: bool = False  # attention sinks (gpt-oss): SINKS[:num_q_heads]

    @property
    def pages_per_seq(self) -> int:
        return self.max_kv // self.page_size + 1  # one spare column: padding 0s in every row

    @property
    def num_pages(self) -> int:
        return self.max_seqs * self.pages_per_seq


CONFIGS = [
    Config("gqa_ps16"),
    Config("gqa_ps1", page_size=1, block_kv_pages=4),
    Config("window_ps16", sliding_window=7),
    Config("window_ps1", page_size=1, sliding_window=5, block_kv_pages=4),
    Config("softcap_mqa_ps16", num_kv_heads=1, soft_cap=2.0, sm_scale=0.5),
    # MHA, and a q head_dim below the pool's padded dim (TPU pads 64 -> 128): zero padding is exact.
    Config("mha_padded_dim_ps16", num_q_heads=2, num_kv_heads=2, head_dim=24, dim_padded=32),
    # gpt-oss: attention sinks with a sliding window (its sliding layers have both).
    Config("sinks_window_ps16", sliding_window=7, sinks=True),
    # Gemma's head dim 256: the kernel stages K/V in 128-lane chunks (Mosaic's strided loads).
    Config("hd256_window_ps16", num_q_heads=2, num_kv_heads=1, head_dim=256, dim_padded=256, sliding_window=9),
]
# Sink logits of order 1 next to logits of order 1: they take a visible share of the softmax.
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
CONFIG_IDS = [c.name for c in CONFIGS]
BY_NAME = {c.name: c for c in CONFIGS}

# (q_lens, kv_lens) of the live sequences; kv_lens include the new tokens.
MIXES = {
    "decode": ((1, 1, 1, 1), (1, 17, 40, 64)),
    "prefill": ((20, 13), (20, 13)),
    # Extend chunks on top of cached prefixes next to decode tokens; a chunk straddles q blocks.
    "mixed": ((1, 12, 1, 9, 6), (33, 30, 5, 9, 50)),
    # A sequence with no new token between live ones: skipped, and the prefetch stream jumps it.
    "with_empty_seq": ((1, 0, 12, 1), (33, 20, 30, 5)),
}


@dataclasses.dataclass
class Batch(PagedBatch):
    q: np.ndarray

    def args(self, dtype=jnp.float32) -> tuple[jax.Array, ...]:
        return (jnp.asarray(self.q, dtype), *self.paged_args(dtype))


def make_batch(cfg: Config, mix: str, *, seed: int = 0, poison: float | None = np.nan) -> Batch:
    """Random pool, queries and a shuffled page table for ``cfg`` holding the sequences of ``mix``.

    ``poison`` fills the trash page, the unused pages and the tail of each sequence's last page
    (stale data in a real pool): none of it may reach an output.
    """
    q_lens, kv_lens = MIXES[mix]
    rng = np.random.default_rng(seed)
    ps, n = cfg.page_size, len(q_lens)
    assert n <= cfg.max_seqs and sum(q_lens) <= cfg.total_tokens and max(kv_lens) <= cfg.max_kv
    kv = rng.standard_normal((cfg.num_pages + 1, ps, 2 * cfg.num_kv_heads, cfg.dim_padded)).astype(np.float32)
    kv[..., cfg.head_dim :] = 0.0  # the pool zero-pads K and V
    paged = paged_batch(rng, kv, q_lens, kv_lens, max_seqs=cfg.max_seqs, pages_per_seq=cfg.pages_per_seq, poison=poison)
    q = rng.standard_normal((cfg.total_tokens, cfg.num_q_heads, cfg.head_dim)).astype(np.float32)
    return Batch(**vars(paged), q=q)


def naive_attention(cfg: Config, batch: Batch) -> np.ndarray:
    """Dense per-sequence attention in float64 numpy: the independent oracle.

    Keys on page ids outside ``[1, num_pages]`` are hidden; a query that sees no key outputs 0.
    """
    out = np.zeros(batch.q.shape, np.float64)
    group = cfg.num_q_heads // cfg.num_kv_heads
    scale = cfg.sm_scale if cfg.sm_scale is not None else 1.0 / np.sqrt(cfg.head_dim)
    for s in range(int(batch.num_seqs[0])):
        q0, q1 = batch.cu_q_lens[s], batch.cu_q_lens[s + 1]
        kv_len = batch.kv_lens[s]
        slots = np.arange(kv_len)
        ids = batch.page_indices[s, slots // cfg.page_size]
        page_ok = (ids >= 1) & (ids < batch.kv_pages.shape[0])
        rows = batch.kv_pages[np.where(page_ok, ids, 0), slots % cfg.page_size]
        keys = rows[:, 0::2, : cfg.head_dim].astype(np.float64)  # [L, Hkv, D]
        values = rows[:, 1::2, : cfg.head_dim].astype(np.float64)
        for i in range(q1 - q0):
            pos = kv_len - (q1 - q0) + i
            visible = (slots <= pos) & page_ok
            if cfg.sliding_window is not None:
                visible &= slots > pos - cfg.sliding_window
            if not visible.any():
                continue
            for head in range(cfg.num_q_heads):
                kvh = head // group
                logits = keys[visible, kvh] @ batch.q[q0 + i, head].astype(np.float64) * scale
                if cfg.soft_cap is not None:
                    logits = cfg.soft_cap * np.tanh(logits / cfg.soft_cap)
                peak = logits.max()
                sink = 0.0
                if cfg.sinks:
                    peak = max(peak, float(SINKS[head]))
                    sink = np.exp(float(SINKS[head]) - peak)
                weights = np.exp(logits - peak)
                out[q0 + i, head] = weights @ values[visible, kvh] / (weights.sum() + sink)
    return out


_JITTED: dict = {}


def _jitted(cfg: Config, interpret) -> object:
    """One jitted callable per (config, interpreter), so every batch of a config hits one compile."""
    key = (cfg, interpret)
    if key not in _JITTED:
        options: dict = dict(sm_scale=cfg.sm_scale, sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap)
        if cfg.sinks:
            options["sinks"] = jnp.asarray(SINKS[: cfg.num_q_heads])
        if interpret == "reference":
            fn = functools.partial(ragged_paged_attention_reference, **options)
        else:
            fn = functools.partial(
                ragged_paged_attention,
                block_q=cfg.block_q,
                block_kv_pages=cfg.block_kv_pages,
                interpret=interpret,
                **options,
            )
        _JITTED[key] = jax.jit(fn)
    return _JITTED[key]


def run(cfg: Config, batch: Batch, interpret, dtype=jnp.float32) -> np.ndarray:
    return np.asarray(_jitted(cfg, interpret)(*batch.args(dtype)).astype(jnp.float32))


def reference(cfg: Config, batch: Batch, dtype=jnp.float32) -> np.ndarray:
    return run(cfg, batch, "reference", dtype)


TOL = dict(atol=2e-5, rtol=2e-5)


# --- reference vs naive ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_reference_matches_naive(cfg: Config) -> None:
    for mix in MIXES:
        batch = make_batch(cfg, mix)
        got = reference(cfg, batch)
        assert np.isfinite(got).all(), mix
        np.testing.assert_allclose(got, naive_attention(cfg, batch), **TOL, err_msg=mix)


def test_reference_bf16() -> None:
    cfg = BY_NAME["gqa_ps16"]
    batch = make_batch(cfg, "mixed")
    np.testing.assert_allclose(reference(cfg, batch, jnp.bfloat16), naive_attention(cfg, batch), atol=3e-2, rtol=3e-2)


# --- kernel vs reference -------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_kernel_hlo_interpreter(cfg: Config) -> None:
    for mix in MIXES:
        batch = make_batch(cfg, mix)
        np.testing.assert_allclose(run(cfg, batch, HLO), reference(cfg, batch), **TOL, err_msg=mix)


# The TPU interpreter simulates every DMA (~ms each) and compiles slowly: a subset covering page
# sizes 1 and 16, every mix, GQA and a sliding window, with race detection on.
TPU_CONFIGS = ["gqa_ps16", "window_ps1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TPU_CONFIGS)
def test_kernel_tpu_interpreter_no_races(name: str) -> None:
    cfg = BY_NAME[name]
    for mix in MIXES:
        batch = make_batch(cfg, mix)
        got = run(cfg, batch, TPU)
        assert not tpu_interpreter.races.races_found, "the TPU interpreter reported a data race"
        np.testing.assert_allclose(got, reference(cfg, batch), **TOL, err_msg=mix)


def test_sinks_tpu_interpreter() -> None:
    """Attention sinks under the TPU interpreter (the HLO interpreter runs every mix above)."""
    cfg = BY_NAME["sinks_window_ps16"]
    batch = make_batch(cfg, "mixed")
    got = run(cfg, batch, TPU)
    assert not tpu_interpreter.races.races_found
    np.testing.assert_allclose(got, naive_attention(cfg, batch), **TOL)


@pytest.mark.slow
def test_head_dim_256_tpu_interpreter() -> None:
    """128-lane staging chunks under the TPU interpreter, in f32 and on the packed bf16 path."""
    cfg = BY_NAME["hd256_window_ps16"]
    batch = make_batch(cfg, "mixed")
    np.testing.assert_allclose(run(cfg, batch, TPU), naive_attention(cfg, batch), **TOL)
    got = run(cfg, batch, TPU, jnp.bfloat16)
    assert not tpu_interpreter.races.races_found
    np.testing.assert_allclose(got, naive_attention(cfg, batch), atol=3e-2, rtol=3e-2)


def test_sinks_shape_is_checked() -> None:
    cfg = BY_NAME["sinks_window_ps16"]
    args = make_batch(cfg, "decode").args()
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\)"):
        ragged_paged_attention(*args, sinks=jnp.zeros(3))


def test_race_detector_sees_a_single_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: prefetching into the half being computed is a race, and is reported."""
    import pallas_kernels.ragged_paged_attention as rpa

    cfg = BY_NAME["gqa_ps16"]
    batch = make_batch(cfg, "decode")
    monkeypatch.setattr(rpa, "_DOUBLE_BUFFER", False)
    fn = functools.partial(
        ragged_paged_attention, block_q=cfg.block_q, block_kv_pages=cfg.block_kv_pages, interpret=TPU
    )
    jax.block_until_ready(jax.jit(fn)(*batch.args()))  # a fresh jit: traced with the hook set
    assert tpu_interpreter.races.races_found
    pltpu.reset_tpu_interpret_mode_state()


def test_kernel_bf16_tpu_interpreter() -> None:
    """A 16-bit pool takes the packed path (K/V of a head share a 32-bit word); f32 softmax state.
    (The HLO interpreter runs it in ``test_reads_what_the_pool_wrote``.)"""
    cfg = BY_NAME["gqa_ps16"]
    batch = make_batch(cfg, "mixed")
    got = run(cfg, batch, TPU, jnp.bfloat16)
    assert not tpu_interpreter.races.races_found
    np.testing.assert_allclose(got, naive_attention(cfg, batch), atol=3e-2, rtol=3e-2)


def test_kernel_default_tiling() -> None:
    """Default block sizes (here: one KV block spans the whole padded table)."""
    cfg = dataclasses.replace(BY_NAME["gqa_ps16"], block_q=None, block_kv_pages=None)
    batch = make_batch(cfg, "mixed")
    np.testing.assert_allclose(run(cfg, batch, HLO), naive_attention(cfg, batch), **TOL)


# --- page 0, invalid ids, padding, num_seqs --------------------------------------------------------


def test_trash_page_and_invalid_ids_are_masked() -> None:
    """Page ids 0 or out of range inside a sequence's range hide those keys; NaN never leaks."""
    cfg = BY_NAME["gqa_ps16"]
    batch = make_batch(cfg, "mixed")
    batch.page_indices[0, 1] = 0  # the trash page (NaN-filled) inside sequence 0's keys [16, 32)
    batch.page_indices[4, 2] = batch.kv_pages.shape[0] + 7  # beyond the pool
    want = naive_attention(cfg, batch)
    for interpret in ("reference", HLO, TPU):  # the TPU interpreter raises on an out-of-bounds DMA
        got = run(cfg, batch, interpret)
        assert np.isfinite(got).all(), interpret
        np.testing.assert_allclose(got, want, **TOL, err_msg=str(interpret))


def test_padding_tokens_and_spare_sequences() -> None:
    """Tokens after the last sequence output 0; table rows past num_seqs are ignored."""
    cfg = BY_NAME["gqa_ps16"]
    batch = make_batch(cfg, "mixed")
    live_seqs = int(batch.num_seqs[0])
    live_tokens = int(batch.cu_q_lens[live_seqs])
    batch.cu_q_lens[live_seqs + 1 :] = 0  # garbage past num_seqs
    batch.kv_lens[live_seqs:] = 999
    want = naive_attention(cfg, batch)
    for interpret in ("reference", HLO):
        got = run(cfg, batch, interpret)
        assert (got[live_tokens:] == 0).all(), interpret
        np.testing.assert_allclose(got, want, **TOL, err_msg=str(interpret))
    batch.num_seqs[:] = 0
    for interpret in ("reference", HLO):
        assert (run(cfg, batch, interpret) == 0).all(), interpret


# --- the public wrapper ------------------------------------------------------------------------------


def test_default_path_on_cpu_is_the_reference() -> None:
    cfg = BY_NAME["window_ps16"]
    batch = make_batch(cfg, "mixed")
    fn = functools.partial(ragged_paged_attention, sliding_window=cfg.sliding_window)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(*batch.args())), reference(cfg, batch))


def test_tpu_lowering_selects_the_kernel() -> None:
    """Lowering for TPU from this host picks the Pallas kernel (no TPU runtime needed)."""
    batch = make_batch(BY_NAME["gqa_ps16"], "mixed")
    lowered = jax.jit(ragged_paged_attention).trace(*batch.args(jnp.bfloat16)).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
    # fp8 pools with a bf16 query take the kernel too.
    q, kv, *rest = batch.args()
    args = (q.astype(jnp.bfloat16), kv.astype(jnp.float8_e4m3fn), *rest)
    lowered = jax.jit(ragged_paged_attention).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
    # A pool dtype the compiled kernel does not read (f16) takes the reference on TPU.
    lowered = jax.jit(ragged_paged_attention).trace(*batch.args(jnp.float16)).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" not in lowered.as_text()


def test_argument_errors() -> None:
    q, kv, kv_lens, table, cu, n = make_batch(BY_NAME["gqa_ps16"], "decode").args()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(q[:, :3], kv, kv_lens, table, cu, n)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(q, kv, kv_lens, table, cu[:-1], n)
    with pytest.raises(TypeError, match="logical-dtype view"):
        ragged_paged_attention(q, kv.astype(jnp.bfloat16).view(jnp.uint16), kv_lens, table, cu, n)
    with pytest.raises(TypeError, match="compute dtype"):
        ragged_paged_attention(q.astype(jnp.float8_e4m3fn), kv.astype(jnp.float8_e4m3fn), kv_lens, table, cu, n)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention(q, kv, kv_lens, table, cu, n, block_q=12, interpret=True)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        for name in ("k_scale", "v_scale"):
            with pytest.raises(ValueError, match=f"{name}=.* finite and > 0"):
                ragged_paged_attention(q, kv, kv_lens, table, cu, n, **{name: bad})


def test_default_block_sizes() -> None:
    assert default_block_sizes(64, 64, 4, 16, 128) == (8, 16)  # decode: 8 tokens = 32 rows
    assert default_block_sizes(2048, 4, 4, 16, 128) == (64, 16)  # prefill: 256 rows
    assert default_block_sizes(64, 64, 7, 1, 3) == (16, 3)  # odd group: rows stay a multiple of 16


# --- with the pool -------------------------------------------------------------------------------------


def test_reads_what_the_pool_wrote() -> None:
    """End to end with ``MHAKVPool``: write K/V with ``set_kv_buffer``, attend over ``kv_buffer``."""
    from kvjax.pools.mha import MHAKVPool

    rng = np.random.default_rng(3)
    page_size, kv_heads, head_dim, q_heads = 4, 2, 16, 4
    pool = MHAKVPool.create(
        num_pages=12,
        page_size=page_size,
        num_layers=2,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype="bfloat16",
        platform="cpu",
    )
    # Two sequences: 7 tokens on pages (3, 5), 2 tokens on page (9,). Layer 1.
    tables = [[3, 5], [9]]
    kv_lens = [7, 2]
    k_all, v_all, slots = [], [], []
    for pages, length in zip(tables, kv_lens, strict=False):
        pos = np.arange(length)
        slots.append(np.asarray(pages)[pos // page_size] * page_size + pos % page_size)
        k_all.append(rng.standard_normal((length, kv_heads, head_dim)))
        v_all.append(rng.standard_normal((length, kv_heads, head_dim)))
    pool = pool.set_kv_buffer(
        1,
        jnp.asarray(np.concatenate(slots), jnp.int32),
        jnp.asarray(np.concatenate(k_all), jnp.bfloat16),
        jnp.asarray(np.concatenate(v_all), jnp.bfloat16),
    )
    # Sequence 0 prefills its last 3 tokens, sequence 1 decodes one.
    q_lens = [3, 1]
    q = jnp.asarray(rng.standard_normal((sum(q_lens), q_heads, head_dim)), jnp.bfloat16)
    table = jnp.asarray([[3, 5], [9, 0], [0, 0]], jnp.int32)
    args = (
        q,
        pool.kv_buffer(1),
        jnp.asarray(kv_lens + [0], jnp.int32),
        table,
        jnp.asarray([0, 3, 4, 4], jnp.int32),
        jnp.asarray([2], jnp.int32),
    )
    got_ref = np.asarray(jax.jit(ragged_paged_attention)(*args).astype(jnp.float32))
    got_hlo = np.asarray(jax.jit(functools.partial(ragged_paged_attention, interpret=True))(*args).astype(jnp.float32))
    # Oracle from the K/V as written (rounded to bf16 like the pool).
    q32 = np.asarray(q.astype(jnp.float32))
    want = np.zeros_like(got_ref)
    token = 0
    for s, (length, n_new) in enumerate(zip(kv_lens, q_lens, strict=False)):
        keys = np.asarray(jnp.asarray(k_all[s], jnp.bfloat16).astype(jnp.float32))
        values = np.asarray(jnp.asarray(v_all[s], jnp.bfloat16).astype(jnp.float32))
        for i in range(n_new):
            pos = length - n_new + i
            for head in range(q_heads):
                logits = keys[: pos + 1, head // 2] @ q32[token, head] / np.sqrt(head_dim)
                w = np.exp(logits - logits.max())
                want[token, head] = w @ values[: pos + 1, head // 2] / w.sum()
            token += 1
    np.testing.assert_allclose(got_ref, want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(got_hlo, want, atol=2e-2, rtol=2e-2)


# --- fp8 pools: scales honoured, query and output in the compute dtype ----------------------------------

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
K_SCALE, V_SCALE = 2.0, 4.0


def quantised_batch(cfg: Config, mix: str, fp8: str) -> tuple[Batch, jax.Array]:
    """A batch whose pool holds fp8 ``k / K_SCALE`` and ``v / V_SCALE`` (the values scaled up so
    that the scales matter), and the same batch with the dequantised pool in f32 (the oracle's)."""
    batch = make_batch(cfg, mix)
    kv = batch.kv_pages * 3.0
    kv[:, :, 0::2] /= K_SCALE
    kv[:, :, 1::2] /= V_SCALE
    stored = jnp.asarray(kv, FP8[fp8])
    dequant = np.array(stored.astype(jnp.float32))
    dequant[:, :, 0::2] *= K_SCALE
    dequant[:, :, 1::2] *= V_SCALE
    return dataclasses.replace(batch, kv_pages=dequant), stored


def run_fp8(cfg: Config, batch: Batch, stored: jax.Array, interpret, q_dtype=jnp.bfloat16) -> np.ndarray:
    """Scales as traced arguments (as the pool passes them), so one compile serves both fp8 kinds' scales."""
    q, _, *rest = batch.args()
    out = _jitted(cfg, interpret)(q.astype(q_dtype), stored, *rest, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == q_dtype, "the output comes in the query's (compute) dtype"
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("fp8", sorted(FP8))
def test_fp8_pool_matches_dense_attention_on_dequantised_kv(fp8: str) -> None:
    """Reference and kernel (HLO interpreter) against dense attention on ``scale * stored``, with
    ``set_kv_scale(k=2, v=4)``-style scales. The tolerance is the bf16 query's rounding."""
    cfg = BY_NAME["gqa_ps16"]
    batch, stored = quantised_batch(cfg, "mixed", fp8)
    want = naive_attention(cfg, batch)
    for interpret in ("reference", HLO):
        got = run_fp8(cfg, batch, stored, interpret)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=5e-2, rtol=5e-2, err_msg=str(interpret))
    got32 = run_fp8(cfg, batch, stored, "reference", q_dtype=jnp.float32)
    np.testing.assert_allclose(got32, want, **TOL, err_msg="f32 query")


@pytest.mark.parametrize("fp8", [pytest.param("e4m3"), pytest.param("e5m2", marks=pytest.mark.slow)])
def test_fp8_pool_tpu_interpreter(fp8: str) -> None:
    """The kernel under the TPU interpreter reads fp8 pages (widened to f32 staging rows)."""
    cfg = BY_NAME["gqa_ps16"]
    batch, stored = quantised_batch(cfg, "mixed", fp8)
    got = run_fp8(cfg, batch, stored, TPU)
    assert not tpu_interpreter.races.races_found
    np.testing.assert_allclose(got, naive_attention(cfg, batch), atol=5e-2, rtol=5e-2)


def test_fp8_pool_end_to_end_with_set_kv_scale() -> None:
    """``MHAKVPool`` in fp8 with ``set_kv_scale(k=2, v=4)``: attention over ``kv_buffer`` with the
    layer's scales equals dense attention over the dequantised K/V (``get_kv``). Before the scales
    were honoured this was off by up to ~4.6 on outputs of ~5."""
    from kvjax.pools.mha import MHAKVPool

    rng = np.random.default_rng(5)
    page_size, kv_heads, head_dim, q_heads, length = 4, 2, 16, 4, 9
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        pool = MHAKVPool.create(
            num_pages=6, page_size=page_size, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype
        )
        pool = pool.set_kv_scale(0, 2.0, 4.0)
        slots = jnp.arange(page_size, page_size + length, dtype=jnp.int32)  # pages 1..3
        k = jnp.asarray(rng.standard_normal((length, kv_heads, head_dim)) * 4, jnp.float32)
        v = jnp.asarray(rng.standard_normal((length, kv_heads, head_dim)) * 4, jnp.float32)
        pool = pool.set_kv_buffer(0, slots, k, v)
        q = jnp.asarray(rng.standard_normal((length, q_heads, head_dim)), jnp.float32)
        args = (
            q,
            pool.kv_buffer(0),
            jnp.asarray([length], jnp.int32),
            jnp.asarray([[1, 2, 3]], jnp.int32),
            jnp.asarray([0, length], jnp.int32),
            jnp.asarray([1], jnp.int32),
        )
        scales = dict(k_scale=pool.k_scale[0], v_scale=pool.v_scale[0])
        keys, values = (np.asarray(x, np.float64) for x in pool.get_kv(0, slots))
        want = np.zeros((length, q_heads, head_dim))
        for i in range(length):
            for head in range(q_heads):
                logits = keys[: i + 1, head // 2] @ np.asarray(q[i, head], np.float64) / np.sqrt(head_dim)
                w = np.exp(logits - logits.max())
                want[i, head] = w @ values[: i + 1, head // 2] / w.sum()
        for interpret in (None, True) if dtype == "fp8_e4m3" else (None,):  # e5m2's kernel runs above
            got = jax.jit(functools.partial(ragged_paged_attention, interpret=interpret))(*args, **scales)
            assert got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got), want, atol=5e-2, rtol=5e-2, err_msg=f"{dtype} {interpret}")
