"""MLA ragged paged attention: a mixed decode/prefill batch of absorbed MLA queries over the latent pool.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) caches one latent row per token,
``[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`` (``kvjax.pools.mla``). In the *absorbed* form
every query head attends to that row directly: the nope part of the query is pre-multiplied by
the head's key up-projection (``q_nope @ W_UK``, ``[kv_lora_rank]`` per head) and the output is the
latent ``c_kv`` mix, later up-projected by ``W_UV``. All heads share one KV "head" (MQA over the
latent), so one KV fetch feeds every head.

Arguments (``S = max_seqs``, ``T = total_q_tokens``, ``H`` query heads):

* ``ql_nope``: ``[T, H, kv_lora_rank]``, absorbed query (compute dtype: bf16, f16 or f32).
* ``q_pe``: ``[T, H, qk_rope_head_dim]``, the rotated query part (same dtype).
* ``kv_pages``: one latent layer in the logical dtype (``MLAKVPool.kv_buffer``),
  ``[num_pages + 1, page_size, row_padded]`` with ``row_padded >= kv_lora_rank + qk_rope_head_dim``;
  fp8, bf16 or f32. Page 0 is the trash page.
* ``kv_lens``, ``page_indices``, ``cu_q_lens``, ``num_seqs``: as in ``ragged_paged_attention``
  (int32 ``[S]``, ``[S, pages_per_seq]``, ``[S + 1]``, ``[1]``).
* ``sm_scale``: logit scale (required: DeepSeek's is ``1 / sqrt(qk_nope_head_dim +
  qk_rope_head_dim)``, times the YaRN mscale squared where used).
* ``kv_scale``: the layer's fp8 scale (``MLAKVPool.scale[i]``; default 1): attention reads
  ``kv_scale * stored``.
* Output: ``[T, H, kv_lora_rank]`` in ql_nope's dtype; padding tokens output 0.

Semantics (kernel and reference agree): ``logits = sm_scale * (ql_nope . c_kv + q_pe . k_pe)``,
causal (query ``i`` of a sequence with ``q_len`` new tokens and ``kv_len`` keys sits at position
``kv_len - q_len + i`` and sees keys up to it), softmax in f32, ``out = softmax . c_kv``. Keys on
page ids outside ``[1, num_pages]`` are masked; a query that sees no key outputs 0.

Kernel design (the MHA kernel's plan, ``ragged_paged_attention``; shared pieces in ``_ragged_attention``):

* The wrapper concatenates ``[ql_nope | q_pe]`` and zero-pads to ``row_padded``, so one query row
  meets one latent row in one dot product (the pool's padding is zero), and multiplies it by
  ``kv_scale`` (``q . (s k) = (s q) . k``); the output is multiplied by ``kv_scale`` once at the end.
  Rows are token-major: row ``r`` of a block is token ``r // H``, head ``r % H``.
* Grid: one step per ``block_q`` tokens (``"parallel"``). Per overlapping sequence the kernel walks
  the visible keys in KV blocks of ``block_kv_pages`` pages; each page is one DMA of a dense
  ``[page_size, row_padded]`` tile block into a VMEM double buffer (the next block is in flight
  while one is computed, across sequences). One ``[R, Dp] x [Dp, bkv]`` matmul gives the logits of
  all heads, one ``[R, bkv] x [bkv, kv_lora_rank]`` the update (V is the first ``kv_lora_rank``
  lanes of the same buffer: the latent is fetched once for K and V).
* Online softmax with f32 state; rows of different sequences never mix; V rows of skipped or
  masked keys are zeroed before ``p @ v`` (stale VMEM may hold NaN).
* dtypes: bf16 and f32 pools are multiplied as they are; fp8 blocks are widened once per block to
  bf16 (exact) and multiplied in bf16.

One rank of a token stripe and the log-sum-exp (decode context parallelism), as in
``ragged_paged_attention``: with ``key_stride`` ``n`` and ``key_offset`` ``r`` (a scalar-prefetch
operand, traced inside ``shard_map``) local latent row ``l`` is the sequence's token at position
``l * n + r``; ``mla_ragged_paged_attention_with_lse`` also returns each query's log-sum-exp
(f32 ``[T, H]``, ``-inf`` where no key is visible), the output normalised over those keys.

Public entry points ``mla_ragged_paged_attention`` and ``mla_ragged_paged_attention_with_lse``:
compiled Pallas when lowering for TPU, the jnp reference (``mla_ragged_paged_attention_reference``)
elsewhere, or an interpreter with ``interpret=``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _engine
from pallas_kernels import _ragged_attention as ra
from pallas_kernels._engine import Interpret
from pallas_kernels.validate import check_kv_scale

_TARGET_KV_TOKENS = 256
_TARGET_Q_ROWS = 256


def _check_args(
    ql_nope: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> None:
    """Trace-time shape/dtype checks naming the offending values."""
    if ql_nope.ndim != 3 or q_pe.ndim != 3 or ql_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"ql_nope {list(ql_nope.shape)} and q_pe {list(q_pe.shape)} must be [tokens, heads, kv_lora_rank] "
            "and [tokens, heads, qk_rope_head_dim] with the same tokens and heads"
        )
    if kv_pages.ndim != 3:
        raise ValueError(
            f"kv_pages has shape {list(kv_pages.shape)}; expected [num_pages + 1, page_size, row_padded] "
            "(MLAKVPool.kv_buffer)"
        )
    row = ql_nope.shape[2] + q_pe.shape[2]
    if row > kv_pages.shape[2]:
        raise ValueError(
            f"kv_lora_rank {ql_nope.shape[2]} + qk_rope_head_dim {q_pe.shape[2]} = {row} exceeds the pool's "
            f"row_padded={kv_pages.shape[2]}"
        )
    for name, x in (("ql_nope", ql_nope), ("q_pe", q_pe)):
        dtype = jnp.dtype(x.dtype)
        if not (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (2, 4)):
            raise TypeError(f"{name} has dtype {dtype}; pass queries in the compute dtype (bf16, f16 or f32)")
    if jnp.dtype(ql_nope.dtype) != jnp.dtype(q_pe.dtype):
        raise TypeError(f"ql_nope is {jnp.dtype(ql_nope.dtype)} but q_pe is {jnp.dtype(q_pe.dtype)}")
    pool = jnp.dtype(kv_pages.dtype)
    if not (jnp.issubdtype(pool, jnp.floating) and pool.itemsize in (1, 2, 4)):
        raise TypeError(f"kv_pages has dtype {pool}; pass the pool's logical-dtype view (MLAKVPool.kv_buffer)")
    ra.check_batch_tables(kv_lens, page_indices, cu_q_lens, num_seqs)


def _scale(kv_scale: float | jax.Array | None) -> jax.Array:
    check_kv_scale("kv_scale", kv_scale)
    return jnp.float32(1.0) if kv_scale is None else jnp.asarray(kv_scale, jnp.float32).reshape(())


# --------------------------------------------------------------------------------------------
# Reference (pure jnp)
# --------------------------------------------------------------------------------------------


def mla_ragged_paged_attention_reference(
    ql_nope: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    kv_scale: float | jax.Array | None = None,
    token_batch: int = 8,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
    return_lse: bool = False,
) -> Any:
    """Pure-jnp MLA attention (module docstring): per query token, gather its sequence's latent rows,
    dequantise (``* kv_scale``), masked softmax in f32. Returns ``[T, H, kv_lora_rank]`` (and with
    ``return_lse`` the f32 log-sum-exp ``[T, H]``); ``key_stride``/``key_offset``: one rank of a
    token stripe (module docstring)."""
    _check_args(ql_nope, q_pe, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    _check_stride(key_stride)
    total, heads, rank = ql_nope.shape
    rope = q_pe.shape[2]
    num_pool_pages, page_size, row_padded = kv_pages.shape
    pages_per_seq = page_indices.shape[1]
    max_kv = pages_per_seq * page_size
    dequant = _scale(kv_scale)
    if total == 0:
        empty = jnp.zeros_like(ql_nope)
        return (empty, jnp.full((0, heads), -jnp.inf, jnp.float32)) if return_lse else empty
    tokens = ra.token_rows(
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        total=total,
        num_pool_pages=num_pool_pages,
        page_size=page_size * key_stride,  # positions and the clamp are the sequences' own
    )
    page_ok, safe_pages = tokens.page_ok, tokens.safe_pages
    key_pos = jnp.arange(max_kv, dtype=jnp.int32) * key_stride + jnp.asarray(key_offset, jnp.int32)
    q32 = jnp.concatenate([ql_nope, q_pe], axis=-1).astype(jnp.float32)

    def attend(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qt, seq, pos, is_live = xs  # [H, rank + rope], scalars
        rows = kv_pages[safe_pages[seq]].reshape(max_kv, row_padded)[:, : rank + rope]
        rows = rows.astype(jnp.float32) * dequant
        logits = jnp.einsum("hd,ld->hl", qt, rows) * sm_scale
        visible = (key_pos <= pos) & jnp.repeat(page_ok[seq], page_size) & is_live
        logits = jnp.where(visible, logits, -jnp.inf)
        peak = jnp.max(logits, axis=-1, keepdims=True)
        peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
        weights = jnp.where(visible, jnp.exp(logits - peak), 0.0)
        denom = jnp.sum(weights, axis=-1, keepdims=True)
        out = weights @ jnp.where(visible[:, None], rows[:, :rank], 0.0)
        lse = jnp.where(denom > 0, peak + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
        return out / jnp.where(denom > 0, denom, 1.0), lse[:, 0]

    xs = (q32, tokens.seq, tokens.pos, tokens.live)
    out, lse = jax.lax.map(attend, xs, batch_size=min(token_batch, total))
    return (out.astype(ql_nope.dtype), lse) if return_lse else out.astype(ql_nope.dtype)


def _check_stride(key_stride: int) -> None:
    if isinstance(key_stride, bool) or not isinstance(key_stride, int) or key_stride < 1:
        raise ValueError(f"key_stride={key_stride!r}: give the number of ranks the keys are striped over (>= 1)")


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


class _SeqView(NamedTuple):
    t_lo: Any  # first token of the sequence in the block
    t_hi: Any  # one past its last token in the block
    first_pos: Any  # position of token t_lo
    kv_end: Any  # keys [0, kv_end) are visible to some row of the block
    k_lo: Any  # KV blocks [k_lo, k_hi) cover them: k_lo is 0 (no window)
    k_hi: Any
    page_base: Any  # offset of the sequence's row in the flat page table
    active: Any


def _mla_kernel(
    kv_lens_ref: Any,  # SMEM i32[S]
    page_ids_ref: Any,  # SMEM i32[S * padded_pages_per_seq] (0 = invalid id, never fetched)
    cu_q_lens_ref: Any,  # SMEM i32[S + 1]
    seq_lo_ref: Any,  # SMEM i32[num_q_blocks]
    seq_hi_ref: Any,  # SMEM i32[num_q_blocks]
    key_offset_ref: Any,  # SMEM i32[1]: the position of local key 0 (a stripe's rank; 0 for a plain pool)
    row_token_ref: Any,  # VMEM i32[R, 1]: r // H
    q_ref: Any,  # VMEM [R, Dp]
    kv_hbm_ref: Any,  # ANY [num_pages + 1, page_size, Dp]
    o_ref: Any,  # VMEM f32[R, rank]
    lse_ref: Any,  # VMEM f32[R, 1] (with return_lse; else None)
    kv_buf: Any,  # VMEM [2, bkv, Dp]
    sems: Any,  # DMA semaphores [2]
    m_ref: Any,  # VMEM f32[R, 1]
    l_ref: Any,  # VMEM f32[R, 1]
    acc_ref: Any,  # VMEM f32[R, rank]
    *,
    block_q: int,
    block_kv_pages: int,
    page_size: int,
    padded_pages_per_seq: int,
    rank: int,
    sm_scale: float,
    key_stride: int = 1,
) -> None:
    step = ra.start_grid_step(block_q, block_kv_pages * page_size, row_token_ref, m_ref, l_ref, acc_ref)
    key_offset = key_offset_ref[0] if key_stride > 1 else None

    def before_pos(position: Any) -> Any:
        """The local keys at positions before ``position`` (a stripe: ``ceil((position - offset) / stride)``)."""
        if key_offset is None:
            return position
        return jax.lax.div(jnp.maximum(position - key_offset + (key_stride - 1), 0), jnp.int32(key_stride))

    def view(s: Any) -> _SeqView:
        t_lo, t_hi, first_pos, kv_len = ra.sequence_rows(cu_q_lens_ref, kv_lens_ref, s, step.start, step.end)
        kv_end = jnp.clip(before_pos(first_pos + (t_hi - t_lo)), 0, before_pos(kv_len))  # last visible key + 1
        k_hi = jax.lax.div(kv_end + step.block_kv - 1, step.block_kv)  # lax.div: operands >= 0 (see the MHA kernel)
        return _SeqView(
            t_lo, t_hi, first_pos, kv_end, jnp.int32(0), k_hi, s * padded_pages_per_seq, (t_lo < t_hi) & (k_hi > 0)
        )

    def page_id(seq: _SeqView, k: Any, j: Any) -> Any:
        return page_ids_ref[seq.page_base + k * block_kv_pages + j]

    def fetch(seq: _SeqView, k: Any, slot: Any, action: str) -> None:
        """Start or wait for the page DMAs of KV block k of ``seq``; both evaluate the same conditions."""
        pages_visible = jax.lax.div(seq.kv_end + page_size - 1, page_size) - k * block_kv_pages
        j_hi = jnp.clip(pages_visible, 0, block_kv_pages)
        page_of = functools.partial(page_id, seq, k)
        ra.page_dmas(kv_hbm_ref, kv_buf, sems, slot, page_of, 0, j_hi, page_size=page_size, action=action)

    def key_ok(seq: _SeqView, k: Any, shape: tuple[int, int], axis: int) -> tuple[Any, Any]:
        offset = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        pos = k * step.block_kv + offset
        ok = pos < seq.kv_end
        page_of = functools.partial(page_id, seq, k)
        return ra.hide_unfetched_pages(ok, offset, page_of, block_kv_pages=block_kv_pages, page_size=page_size), pos

    def compute(seq: _SeqView, k: Any, slot: Any) -> None:
        col_ok, col_pos = key_ok(seq, k, (1, step.block_kv), 1)
        v_ok, _ = key_ok(seq, k, (step.block_kv, 1), 0)
        row_pos, row_ok = step.rows_of(seq)  # [R, 1]
        if key_offset is not None:
            col_pos = col_pos * key_stride + key_offset
        mask = row_ok & col_ok & (col_pos <= row_pos)
        rows = kv_buf[slot]  # [bkv, Dp]
        if jnp.dtype(rows.dtype).itemsize == 1:
            rows = rows.astype(jnp.float32)  # fp8 -> f32 -> the matmul dtype (exact)
        rows = jnp.where(v_ok, rows.astype(q_ref.dtype), jnp.zeros((), q_ref.dtype))
        q = q_ref[...]
        logits = jax.lax.dot_general(q, rows, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ra.online_softmax_update(m_ref, l_ref, acc_ref, ..., logits * sm_scale, mask, rows[:, :rank])

    ra.walk_sequences(seq_lo_ref[step.index], seq_hi_ref[step.index], kv_lens_ref.shape[0], view, fetch, compute)
    denom = l_ref[...]
    o_ref[...] = acc_ref[...] / jnp.where(denom > 0.0, denom, 1.0)
    if lse_ref is not None:
        lse_ref[...] = jnp.where(denom > 0.0, m_ref[...] + jnp.log(jnp.where(denom > 0.0, denom, 1.0)), -jnp.inf)


def _mla_kernel_refs(*refs: Any, return_lse: bool, **static: Any) -> None:
    """``_mla_kernel`` with its optional log-sum-exp output: the refs as ``pallas_call`` passes them
    (6 scalar prefetch, 3 inputs, 1 or 2 outputs, the scratch)."""
    inputs, rest = refs[:9], refs[9:]
    outputs, scratch = (rest[:2], rest[2:]) if return_lse else ((rest[0], None), rest[1:])
    _mla_kernel(*inputs, *outputs, *scratch, **static)


def default_block_sizes(
    total_q_tokens: int, max_seqs: int, num_heads: int, page_size: int, pages_per_seq: int
) -> tuple[int, int]:
    """``(block_q, block_kv_pages)``: 8 tokens for a decode batch (every row beyond a sequence's own
    is wasted work), else about ``_TARGET_Q_ROWS`` rows (``block_q * num_heads``); about
    ``_TARGET_KV_TOKENS`` keys per KV block."""
    if total_q_tokens <= max_seqs:
        block_q = 8
    else:
        block_q = max(8, (_TARGET_Q_ROWS // num_heads) // 8 * 8)
        block_q = min(block_q, ra.round_up(max(total_q_tokens, 1), 8))
    return block_q, max(1, min(pages_per_seq, _TARGET_KV_TOKENS // page_size))


def mla_ragged_paged_attention_kernel(
    ql_nope: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    kv_scale: float | jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = False,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
    return_lse: bool = False,
) -> Any:
    """The Pallas kernel (compiled when ``interpret`` is False: TPU only); the reference's contract."""
    _check_args(ql_nope, q_pe, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    _check_stride(key_stride)
    total, heads, rank = ql_nope.shape
    _, page_size, dim_padded = kv_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    dequant = _scale(kv_scale)
    if total == 0:
        empty = jnp.zeros_like(ql_nope)
        return (empty, jnp.full((0, heads), -jnp.inf, jnp.float32)) if return_lse else empty
    defaults = default_block_sizes(total, max_seqs, heads, page_size, pages_per_seq)
    block_q, block_kv_pages = ra.resolve_block_sizes(block_q, block_kv_pages, defaults)
    pool_dtype = jnp.dtype(kv_pages.dtype)
    compute = jnp.dtype(jnp.float32) if pool_dtype.itemsize == 4 else jnp.dtype(jnp.bfloat16)
    if pool_dtype == jnp.float16:
        compute = jnp.dtype(jnp.float32)
    num_blocks = -(-total // block_q)
    total_padded = num_blocks * block_q
    rows = block_q * heads

    q = jnp.concatenate([ql_nope, q_pe], axis=-1).astype(jnp.float32) * dequant
    q = jnp.pad(q, ((0, total_padded - total), (0, 0), (0, dim_padded - q.shape[-1])))
    q = q.astype(compute).reshape(total_padded * heads, dim_padded)

    max_kv = pages_per_seq * page_size
    schedule = ra.block_schedule(
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        kv_pages.shape,
        num_blocks,
        block_q,
        block_kv_pages,
        heads,
        key_stride,
    )
    offset = jnp.asarray(key_offset, jnp.int32).reshape(1)
    kernel = functools.partial(
        _mla_kernel_refs,
        return_lse=return_lse,
        **schedule.tiling,
        rank=rank,
        sm_scale=float(sm_scale),
        key_stride=key_stride,
    )
    block_kv = block_kv_pages * page_size
    kv_bytes = max_seqs * max_kv * dim_padded * pool_dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * total_padded * heads * max_kv * (dim_padded + rank),
        transcendentals=total_padded * heads * max_kv,
        bytes_accessed=kv_bytes + q.size * compute.itemsize + total_padded * heads * rank * 4,
    )
    vmem = (
        2 * rows * dim_padded * compute.itemsize
        + 2 * rows * rank * 4
        + 2 * block_kv * dim_padded * pool_dtype.itemsize
        + block_kv * dim_padded * 4
        + rows * (rank + 2 * 128) * 4
        + 4 * rows * block_kv * 4
    )
    manual = jax.typeof(q).manual_axis_type
    out_shape: Any = jax.ShapeDtypeStruct((total_padded * heads, rank), jnp.float32, manual_axis_type=manual)
    out_specs: Any = pl.BlockSpec((rows, rank), lambda b, *_: (b, 0))
    if return_lse:
        out_shape = (out_shape, jax.ShapeDtypeStruct((total_padded * heads, 1), jnp.float32, manual_axis_type=manual))
        out_specs = (out_specs, pl.BlockSpec((rows, 1), lambda b, *_: (b, 0)))
    result = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_blocks,),
            in_specs=[
                pl.BlockSpec((rows, 1), lambda b, *_: (0, 0)),
                pl.BlockSpec((rows, dim_padded), lambda b, *_: (b, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((2, block_kv, dim_padded), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, rank), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), disable_bounds_checks=True, vmem_limit_bytes=ra.vmem_limit_bytes(vmem)
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="mla_ragged_paged_attention",
    )(*schedule.prefetch, offset, schedule.row_token, q, kv_pages)
    out = (result[0] if return_lse else result).reshape(total_padded, heads, rank)[:total] * dequant
    if not return_lse:
        return out.astype(ql_nope.dtype)
    return out.astype(ql_nope.dtype), result[1].reshape(total_padded, heads)[:total]


def mla_ragged_paged_attention(
    ql_nope: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    kv_scale: float | jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = None,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
) -> jax.Array:
    """Absorbed MLA attention of a ragged batch over the latent pool (module docstring).

    ``interpret``: ``None``/``False``: the compiled kernel when lowering for TPU, the jnp reference
    elsewhere; ``True``: the HLO interpreter; ``pltpu.InterpretParams(...)``: the TPU interpreter.
    ``key_stride``/``key_offset``: one rank of a token stripe (module docstring).
    Returns ``[total_q_tokens, num_heads, kv_lora_rank]`` in ql_nope's dtype.
    """
    out: jax.Array = _attention(
        ql_nope,
        q_pe,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        kv_scale=kv_scale,
        block_q=block_q,
        block_kv_pages=block_kv_pages,
        interpret=interpret,
        key_stride=key_stride,
        key_offset=key_offset,
        return_lse=False,
    )
    return out


def mla_ragged_paged_attention_with_lse(
    ql_nope: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    kv_scale: float | jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = None,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
) -> tuple[jax.Array, jax.Array]:
    """``mla_ragged_paged_attention`` that also returns each query's log-sum-exp: ``(out, lse)``,
    ``out`` normalised over the keys the query sees in this pool (0 where none), ``lse`` f32
    ``[total_q_tokens, num_heads]`` (``-inf`` where none): one DCP rank's partial attention when
    ``key_stride``/``key_offset`` describe its stripe (``kvjax.attention.dcp_merge`` merges them)."""
    out, lse = _attention(
        ql_nope,
        q_pe,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        kv_scale=kv_scale,
        block_q=block_q,
        block_kv_pages=block_kv_pages,
        interpret=interpret,
        key_stride=key_stride,
        key_offset=key_offset,
        return_lse=True,
    )
    return out, lse


def _attention(
    ql_nope: jax.Array,
    q_pe: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    kv_scale: float | jax.Array | None,
    block_q: int | None,
    block_kv_pages: int | None,
    interpret: Interpret,
    key_stride: int,
    key_offset: int | jax.Array,
    return_lse: bool,
) -> Any:
    """The two public entry points' dispatch (their docstrings)."""
    _engine.check_interpret(interpret)
    _check_args(ql_nope, q_pe, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    _check_stride(key_stride)
    offset = jnp.asarray(key_offset, jnp.int32).reshape(())
    args = (ql_nope, q_pe, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, _scale(kv_scale), offset)
    stripe: dict[str, Any] = dict(key_stride=key_stride, return_lse=return_lse)

    def reference(*a: jax.Array) -> Any:
        return mla_ragged_paged_attention_reference(*a[:7], kv_scale=a[7], key_offset=a[8], sm_scale=sm_scale, **stripe)

    def kernel(*a: jax.Array, interpret: Interpret) -> Any:
        static = dict(sm_scale=sm_scale, block_q=block_q, block_kv_pages=block_kv_pages, **stripe)
        if interpret is False:  # the compiled kernel, traced once per shape (read only: nothing aliased)
            return _engine.traced_once(_kernel_of_args, **static)(*a)
        return _kernel_of_args(*a, interpret=interpret, **static)

    return _engine.dispatch(kernel, reference, *args, interpret=interpret)


def _kernel_of_args(*a: jax.Array, **static: Any) -> Any:
    """:func:`mla_ragged_paged_attention_kernel` of the dispatch's argument tuple (latent and rope
    queries, pages, lengths, page table, query starts, sequence count, scale, key offset);
    ``static``: its other options."""
    return mla_ragged_paged_attention_kernel(*a[:7], kv_scale=a[7], key_offset=a[8], **static)
