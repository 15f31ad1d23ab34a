"""Ragged paged attention: one call for a mixed batch of decode tokens and prefill/extend chunks.

The queries of all sequences are packed along one token axis; each sequence reads its K/V from
the pool's pages through its row of the page table. The new tokens' K/V must already be in the
pool (``MHAKVPool.set_kv_buffer``) before the call.

Arguments (``S = max_seqs``, ``T = total_q_tokens``):

* ``q``: ``[T, num_q_heads, head_dim]``. Sequence ``s`` owns tokens ``[cu_q_lens[s], cu_q_lens[s+1])``;
  tokens at or after ``cu_q_lens[num_seqs]`` are padding (their output is 0).
* ``kv_pages``: one layer of the pool, ``[num_pages + 1, page_size, 2 * num_kv_heads, head_dim_padded]``
  in the logical dtype (``MHAKVPool.kv_buffer(layer_id)``). Combined head ``2h`` is K of KV head
  ``h``, ``2h + 1`` is V. Page 0 is the trash page. ``head_dim <= head_dim_padded``; the padding of
  K and V is zero, so zero-padding ``q`` keeps ``q . k`` exact.
* ``kv_lens``: int32 ``[S]``, the KV length of each sequence INCLUDING its new tokens.
* ``page_indices``: int32 ``[S, pages_per_seq]``, the page table: token position ``p`` of sequence
  ``s`` lives at ``kv_pages[page_indices[s, p // page_size], p % page_size]``.
* ``cu_q_lens``: int32 ``[S + 1]``, non-decreasing over the first ``num_seqs + 1`` entries.
* ``num_seqs``: int32 ``[1]``, live sequences (``<= S``); rows of the tables beyond it are ignored.
* ``k_scale``, ``v_scale``: the layer's fp8 scales (f32 scalars; default 1).
* Output: ``[T, num_q_heads, head_dim]`` in q's dtype; V is read at q's ``head_dim`` (K and V of
  one head dim, as in the pool's MHA/GQA layouts).

Semantics (kernel and reference agree):

* Causal: query ``i`` of a sequence with ``q_len`` new tokens and ``kv_len`` keys sits at position
  ``kv_len - q_len + i`` and sees keys at positions up to its own.
* Sliding window ``w``: a query at position ``p`` sees keys in ``(p - w, p]``.
* Logits: ``sm_scale * q . k``, then ``soft_cap * tanh(logits / soft_cap)`` if ``soft_cap``.
* Attention sinks (gpt-oss): with ``sinks`` (f32 ``[num_q_heads]``), query head ``j`` gets one
  more logit ``sinks[j]`` in its softmax, with a zero value: the weights of the keys sum to less
  than one. A query with no visible key still outputs 0.
* GQA/MQA: query head ``j`` reads KV head ``j // (num_q_heads // num_kv_heads)``.
* Page ids outside ``[1, num_pages]`` (0 = the trash page, padding of the table) are never read
  as data: their keys are masked. A query with no visible key (padding, or only masked keys)
  outputs 0.
* ``kv_lens`` is clamped to ``[0, pages_per_seq * page_size]``.

One rank of a token stripe (decode context parallelism, ``kvjax.alloc.dcp``): with ``key_stride``
``n`` (static) and ``key_offset`` ``r`` (an int32 scalar, traced inside ``shard_map``), the pool
holds every ``n``-th key of each sequence, from position ``r``: its local key ``l`` (page
``l // page_size``, row ``l % page_size`` of the sequence's table) is the sequence's key at
position ``l * n + r``. ``kv_lens``, the queries' positions and both masks stay in the sequences'
own (global) positions; ``kv_lens`` is clamped to ``n`` times the table's capacity. With ``n = 1``
and ``r = 0`` (the default) this is the plain pool.

``return_lse``: also return the log-sum-exp of each query's visible logits, f32
``[T, num_q_heads]`` (``-inf`` where no key is visible); the output is then normalised over
those keys alone, the two together being what merging partial attentions over disjoint key sets
needs (``kvjax.attention.dcp_merge``). Not with ``sinks`` (a sink belongs to no key set: the merge
adds it once).

Kernel design (``_rpa_kernel``; the pieces shared with the MLA kernel are in ``_ragged_attention``):

* The wrapper regroups queries per KV head: ``[T, Hq, D] -> [Hkv, T * G, Dp]`` (``G`` query heads
  per KV head, ``Dp`` = the pool's padded head dim), so row ``r`` of a block is token ``r // G``,
  query head ``h * G + r % G``, and one KV head's attention is one ``[rows, Dp] x [Dp, keys]``
  matmul. The inverse reshapes the output. These reshapes live in the wrapper because neither
  CPU interpreter runs ``ref.reshape`` inside a kernel.
* Grid: one step per block of ``block_q`` consecutive tokens (``"parallel"``: steps are
  independent). q and out move by BlockSpec (pipelined by Pallas). A block may hold several short
  sequences (a decode batch packs ``block_q`` sequences per block) or part of a long one; the
  wrapper precomputes, per block, the range of sequences overlapping it (scalar prefetch).
* Per overlapping sequence the kernel computes the key range the block's rows can see (causal end,
  sliding-window start), then walks it in KV blocks of ``block_kv_pages`` pages. Each page is one
  fixed-size DMA (``[page_size, 2 * Hkv, Dp]``, all heads: one contiguous page of HBM) from the pool
  (``memory_space=pl.ANY``) into a VMEM double buffer. The buffer is one stream across the
  sequences of a grid step: while block ``k`` is computed, block ``k + 1`` is in flight, or after a
  sequence's last block the first block of the next sequence. Pages outside the visible range or
  with an invalid id are skipped (no DMA) and masked. Every started DMA is waited exactly once
  under the same condition. DMA bounds checks are off in compiled code (ids are clamped in the
  wrapper); the TPU interpreter still checks every DMA.
* K/V de-interleave (``_split_kv``): the block is copied once into a staging buffer of 32-bit rows
  (16-bit pools are bit-cast as values, pairing K and V of a head in one word) and each head's K/V
  is read with one sublane-strided load. Reading ``buf[:, 2h, :]`` directly compiled to ~4x more
  bundles per block (sublane gathers and shuffles) in the static schedule.
* Online softmax per KV head with f32 state (running max ``m``, sum ``l``, accumulator ``acc``) in
  VMEM scratch, initialised once per grid step and normalised at its end. Rows of different
  sequences never mix: every update is masked by the row's sequence, and ``p`` is zeroed (not just
  its logits) where masked, so fully masked rows stay at 0. V rows of skipped pages hold whatever
  VMEM held (maybe NaN in the TPU interpreter), so V is masked too before ``p @ v``.
* Interpreters: only static-size DMAs (whole pages), no ref reshape/bitcast, so both CPU
  interpreters run it: ``interpret=True`` (HLO interpreter) and
  ``interpret=pltpu.InterpretParams(...)`` (TPU interpreter, with race and bounds checks).
* dtypes: the query comes in the compute dtype (bf16, f16 or f32), never the pool's; the output
  is in q's dtype. The kernel reads bf16 (packed split), f32, and fp8 (e4m3, e5m2) and f16 pools
  (each block widened once to f32 staging rows); it multiplies in bf16 for bf16 and fp8 pools
  (every fp8 value is exact in bf16) and f32 otherwise, with f32 softmax state and output.
  Compiled for TPU: bf16, f32 and both fp8 pools (v5e and v6e compile them); f16 pools take the
  reference there. fp8 scales: the pool stores ``value / scale`` per layer; attention runs on the
  dequantised ``k_scale * k`` and ``v_scale * v``. The reference dequantises literally; the
  kernel folds ``k_scale`` into the queries and ``v_scale`` into the output (exact algebra, O(T)).
* Under ``shard_map`` (KV heads sharded over a mesh axis, the pool's combined head axis with them)
  each device runs the kernel on its heads; no collective is needed.

Public entry point: ``ragged_paged_attention``. With ``interpret=None`` the choice is made when
lowering: compiled Pallas for TPU (also in an ahead-of-time TPU compile from a CPU host), the jnp
reference (``ragged_paged_attention_reference``) for every other platform.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _engine
from pallas_kernels import _ragged_attention as ra
from pallas_kernels._engine import Interpret
from pallas_kernels.validate import check_kv_scale

# Test hook, never False in use: False prefetches into the buffer half being computed (a
# deliberate race), so the tests can check that the TPU interpreter's race detector sees this
# kernel's DMAs at all.
_DOUBLE_BUFFER = True

# Target KV tokens per KV block: 256 tokens x 8 KV heads x 2 x 128 x 2 B = 1 MiB per buffer
# half for Llama-3-8B in bf16: enough keys per block to amortise its fixed work (masks, loop
# control, the pipeline drain at the end of a grid step).
_TARGET_KV_TOKENS = 256
# Pool dtypes the compiled (TPU) kernel reads; others go through the reference there. The
# interpreters run the kernel on every pool dtype (fp8 and f16 widened to f32 per block).
_COMPILED_POOL_DTYPES = frozenset({"bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"})
# Target query rows (tokens x query heads per KV head) per grid step for prefill-shaped batches.
_TARGET_Q_ROWS = 256


# --------------------------------------------------------------------------------------------
# Argument checks and the shared per-token / per-sequence quantities
# --------------------------------------------------------------------------------------------


def _check_args(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> tuple[int, int, int]:
    """Trace-time shape/dtype checks; returns ``(num_kv_heads, q_per_kv, pages_per_seq)``."""
    if q.ndim != 3:
        raise ValueError(f"q has shape {list(q.shape)}; expected [total_q_tokens, num_q_heads, head_dim]")
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
        raise ValueError(
            f"kv_pages has shape {list(kv_pages.shape)}; expected "
            "[num_pages + 1, page_size, 2 * num_kv_heads, head_dim_padded]"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_pages.shape[2] // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim > kv_pages.shape[3]:
        raise ValueError(f"q head_dim={head_dim} exceeds the pool's head_dim_padded={kv_pages.shape[3]}")
    if not _is_compute_dtype(q.dtype):
        raise TypeError(
            f"q has dtype {jnp.dtype(q.dtype)}; pass the query in the compute dtype (bfloat16, float16 or "
            "float32), not the pool's: fp8 pools are dequantised inside attention through k_scale/v_scale"
        )
    if not _is_pool_dtype(kv_pages.dtype):
        raise TypeError(
            f"kv_pages has dtype {jnp.dtype(kv_pages.dtype)}; pass the pool's logical-dtype view "
            "(MHAKVPool.kv_buffer): a float dtype (fp8, bfloat16, float16 or float32), not its storage bits"
        )
    ra.check_batch_tables(kv_lens, page_indices, cu_q_lens, num_seqs)
    return num_kv_heads, num_q_heads // num_kv_heads, page_indices.shape[1]


def _is_compute_dtype(dtype: Any) -> bool:
    """Query/output dtypes: floats of 16 or 32 bits (never fp8)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (2, 4)


def _is_pool_dtype(dtype: Any) -> bool:
    """Pool dtypes read by attention: fp8 (e4m3, e5m2), bf16, f16 and f32."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (1, 2, 4)


def _kernel_compute_dtype(pool_dtype: Any) -> Any:
    """The kernel's matmul dtype for a pool dtype: bf16 for bf16 and fp8 pools (every e4m3 and
    e5m2 value is exact in bf16), f32 otherwise (f32 pools, and f16 whose range bf16 would keep
    but whose mantissa it would not)."""
    dtype = jnp.dtype(pool_dtype)
    if dtype == jnp.bfloat16 or dtype.itemsize == 1:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def _kernel_reads(dtype: Any) -> bool:
    """Pool dtypes the compiled kernel takes on TPU (see ``_COMPILED_POOL_DTYPES``)."""
    return jnp.dtype(dtype).name in _COMPILED_POOL_DTYPES


def _scale(name: str, scale: float | jax.Array | None) -> jax.Array:
    """A checked scale as an f32 scalar (1.0 when None)."""
    check_kv_scale(name, scale)
    if scale is None:
        return jnp.float32(1.0)
    return jnp.asarray(scale, jnp.float32).reshape(())


def _default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


# --------------------------------------------------------------------------------------------
# Reference (pure jnp): the spec, and the non-TPU path
# --------------------------------------------------------------------------------------------


def _check_sinks(sinks: Any, num_q_heads: int) -> jax.Array:
    """``sinks`` as f32 ``[num_q_heads]``; ValueError naming the shape otherwise."""
    arr = jnp.asarray(sinks, jnp.float32)
    if arr.shape != (num_q_heads,):
        raise ValueError(f"sinks has shape {arr.shape}; expected ({num_q_heads},), one logit per query head")
    return arr


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    sinks: jax.Array | None = None,
    token_batch: int = 8,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Pure-jnp ragged paged attention (module docstring); returns ``[T, num_q_heads, head_dim]``
    (and, with ``return_lse``, the f32 log-sum-exp ``[T, num_q_heads]``).

    The pool's K and V are dequantised first (``k * k_scale``, ``v * v_scale`` in f32), so this is
    dense attention on the dequantised K/V: the spec the kernel is held to.

    Works per query token: each token gathers its own sequence's pages (``lax.map`` over batches
    of ``token_batch`` tokens bounds the memory to ``token_batch * pages_per_seq`` pages) and runs
    a masked softmax in f32. Simple rather than fast: it is the spec and the CPU path. (On XLA:CPU
    batches of 8 tokens ran ~6x faster than 64 on a small mixed batch: the working set stays in
    cache.) V is read at q's head_dim: ``v_head_dim == head_dim`` is assumed, as in the kernel.
    """
    num_kv_heads, group, pages_per_seq = _check_args(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    _check_stripe(key_stride, return_lse, sinks)
    total, num_q_heads, head_dim = q.shape
    num_pool_pages, page_size, _, dim_padded = kv_pages.shape
    max_kv = pages_per_seq * page_size
    scale = _default_sm_scale(head_dim, sm_scale)
    k_dequant, v_dequant = _scale("k_scale", k_scale), _scale("v_scale", v_scale)
    if total == 0:
        return (jnp.zeros_like(q), jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else jnp.zeros_like(q)

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
    q32 = q.astype(jnp.float32).reshape(total, num_kv_heads, group, head_dim)
    key_pos = jnp.arange(max_kv, dtype=jnp.int32) * key_stride + jnp.asarray(key_offset, jnp.int32)
    sink = None if sinks is None else _check_sinks(sinks, num_q_heads).reshape(num_kv_heads, group, 1)

    def attend(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qt, seq, pos, is_live = xs  # [H, G, D], scalars
        pages = kv_pages[safe_pages[seq]].reshape(max_kv, 2 * num_kv_heads, dim_padded)
        k = pages[:, 0::2, :head_dim].astype(jnp.float32) * k_dequant  # [L, Hkv, D]
        v = pages[:, 1::2, :head_dim].astype(jnp.float32) * v_dequant
        logits = jnp.einsum("hgd,lhd->hgl", qt, k) * scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        visible = (key_pos <= pos) & jnp.repeat(page_ok[seq], page_size) & is_live
        if sliding_window is not None:
            visible &= key_pos > pos - sliding_window
        logits = jnp.where(visible, logits, -jnp.inf)
        peak = jnp.max(logits, axis=-1, keepdims=True)
        if sink is not None:
            peak = jnp.maximum(peak, sink)
        peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
        weights = jnp.where(visible, jnp.exp(logits - peak), 0.0)
        denom = jnp.sum(weights, axis=-1, keepdims=True)
        if sink is not None:
            denom = denom + jnp.exp(sink - peak)
        out = jnp.einsum("hgl,lhd->hgd", weights, jnp.where(visible[:, None, None], v, 0.0))
        lse = jnp.where(denom > 0, peak + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
        return out / jnp.where(denom > 0, denom, 1.0), lse[..., 0]

    xs = (q32, tokens.seq, tokens.pos, tokens.live)
    out, lse = jax.lax.map(attend, xs, batch_size=min(token_batch, total))
    out = out.reshape(total, num_q_heads, head_dim).astype(q.dtype)
    return (out, lse.reshape(total, num_q_heads)) if return_lse else out


def _check_stripe(key_stride: int, return_lse: bool, sinks: Any) -> None:
    """``key_stride`` a positive int; ``return_lse`` without ``sinks`` (module docstring)."""
    if isinstance(key_stride, bool) or not isinstance(key_stride, int) or key_stride < 1:
        raise ValueError(f"key_stride={key_stride!r}: give the number of ranks the keys are striped over (>= 1)")
    if return_lse and sinks is not None:
        raise ValueError(
            "return_lse with sinks: a sink belongs to no rank's keys; merge the partials first and add the sink once "
            "(kvjax.attention.dcp_merge)"
        )


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


class _SeqView(NamedTuple):
    """What one q block needs of one sequence (traced scalars; see ``_rpa_kernel``)."""

    t_lo: Any  # first token of the sequence in the block
    t_hi: Any  # one past its last token in the block
    first_pos: Any  # position of token t_lo
    kv_start: Any  # keys [kv_start, kv_end) are visible to some row of the block
    kv_end: Any
    k_lo: Any  # KV blocks [k_lo, k_hi) cover them
    k_hi: Any
    page_base: Any  # offset of the sequence's row in the flat page table
    active: Any  # bool: there is something to compute


def _split_kv(
    stage_ref: Any, h: int, num_kv_heads: int, block_kv: int, v_ok: Any, packed: bool, dtype: Any
) -> tuple[Any, Any]:
    """K and V of KV head ``h`` (``[bkv, Dp]`` each, ``dtype``) from the staged KV block.

    Why staging: in the pool's tiled layout one token's combined heads fill the sublanes of a tile,
    so K of one head is one sublane of every token's tile. Reading it with a plain ``ref[:, 2h, :]``
    makes Mosaic gather and shuffle sublane by sublane (about 4x the bundles per KV block in the
    compiler's static schedule). A sublane-strided load gathers 8 tokens per instruction, but Mosaic
    only has it for 32-bit data, so a 16-bit block is first bit-cast (as a value; neither
    interpreter nor Mosaic needs a ref bit-cast) to 32-bit words, which pairs rows ``2h`` and
    ``2h + 1``, i.e. K and V of head ``h``, in one word: K in the low half, V in the high half.

    ``stage_ref``: ``[chunks, bkv * Hkv, lanes]`` uint32 words (``packed``) or ``[chunks, bkv * 2 * Hkv,
    lanes]`` rows (``Dp = chunks * lanes``; one chunk unless ``Dp`` is a multiple of 128 above it) of a
    32-bit dtype (f32 pools as they are; fp8 and f16 blocks widened to f32 first). K and V come
    back in ``dtype``, the kernel's matmul dtype. ``v_ok``: bool ``[bkv, 1]``; V (and K) rows
    outside it are zeroed so that stale or uninitialised VMEM (NaN) cannot reach ``p @ v``.
    """
    chunks = int(stage_ref.shape[0])  # the staging buffer is split into lane chunks (see the wrapper)

    def load(start: int, stride: int) -> Any:
        parts = [stage_ref.at[c][pl.ds(start, block_kv, stride=stride), :] for c in range(chunks)]
        return parts[0] if chunks == 1 else jnp.concatenate(parts, axis=1)

    if packed:
        words = load(h, num_kv_heads)
        words = jnp.where(v_ok, words, jnp.uint32(0))
        # bf16 is the high half of an f32: a bf16's bits moved into the high half of a word are
        # that value as f32 (exact), so the split is two bit operations and a cast.
        keys = pltpu.bitcast(words << 16, jnp.float32).astype(dtype)
        values = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32).astype(dtype)
        return keys, values
    stride = 2 * num_kv_heads
    keys = load(2 * h, stride)
    values = load(2 * h + 1, stride)
    values = jnp.where(v_ok, values, jnp.zeros((), values.dtype))
    return keys.astype(dtype), values.astype(dtype)


def _rpa_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref: Any,  # i32[S], clamped to [0, pages_per_seq * page_size]
    page_ids_ref: Any,  # i32[S * padded_pages_per_seq], the flattened page table (0 = invalid id)
    cu_q_lens_ref: Any,  # i32[S + 1]
    seq_lo_ref: Any,  # i32[num_q_blocks]: first sequence overlapping each q block
    seq_hi_ref: Any,  # i32[num_q_blocks]: one past the last
    key_offset_ref: Any,  # i32[1]: the position of local key 0 (a stripe's rank; 0 for a plain pool)
    # inputs
    row_token_ref: Any,  # VMEM i32[R, 1]: token of row r within the block (r // G)
    q_ref: Any,  # VMEM [Hkv, R, Dp], R = block_q * G
    kv_hbm_ref: Any,  # ANY [num_pages + 1, page_size, 2 * Hkv, Dp]
    sink_ref: Any,  # VMEM f32[Hkv, R, 1]: the attention sink logit of each row's query head
    # outputs
    o_ref: Any,  # VMEM [Hkv, R, Dp]
    lse_ref: Any,  # VMEM f32[Hkv, R, 1] (with return_lse; else None)
    # scratch
    kv_buf: Any,  # VMEM [2, block_kv, 2 * Hkv, Dp]: double buffer of KV blocks
    sems: Any,  # DMA semaphores [2], one per buffer half
    m_ref: Any,  # VMEM f32[Hkv, R, 1]: running max
    l_ref: Any,  # VMEM f32[Hkv, R, 1]: running sum of exp
    acc_ref: Any,  # VMEM f32[Hkv, R, Dp]: running sum of p @ v
    stage_ref: Any,  # VMEM staging of one KV block as 32-bit rows (see _split_kv)
    *,
    block_q: int,
    block_kv_pages: int,
    page_size: int,
    padded_pages_per_seq: int,
    num_kv_heads: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
    key_stride: int = 1,
) -> None:
    """One grid step: all query rows of token block ``b`` against the KV of every overlapping sequence.

    ``key_stride`` above 1: the pool is one rank of a token stripe (module docstring): local key
    ``l`` is at position ``l * key_stride + key_offset``; the key ranges (``kv_start``,
    ``kv_end``, the KV blocks) are in local keys, the masks compare positions."""
    step = ra.start_grid_step(block_q, block_kv_pages * page_size, row_token_ref, m_ref, l_ref, acc_ref)
    key_offset = key_offset_ref[0] if key_stride > 1 else None

    def before_pos(position: Any) -> Any:
        """The local keys at positions before ``position``: all of them up to it on a plain pool;
        on a stripe, ``ceil((position - key_offset) / key_stride)``, at least 0."""
        if key_offset is None:
            return position
        ahead = jnp.maximum(position - key_offset + (key_stride - 1), 0)
        return jax.lax.div(ahead, jnp.int32(key_stride))  # lax.div: see view()

    def key_position(local: Any) -> Any:
        """The position of each local key."""
        return local if key_offset is None else local * key_stride + key_offset

    def view(s: Any) -> _SeqView:
        """What this q block needs of sequence ``s`` (``s < max_seqs``)."""
        # The rows of this block that belong to sequence s: tokens [t_lo, t_hi), t_lo at first_pos.
        t_lo, t_hi, first_pos, kv_len = ra.sequence_rows(cu_q_lens_ref, kv_lens_ref, s, step.start, step.end)
        last_pos = first_pos + (t_hi - 1 - t_lo)
        # Keys visible to any of these rows: [kv_start, kv_end) (local keys: before_pos).
        kv_end = jnp.clip(before_pos(last_pos + 1), 0, before_pos(kv_len))
        window_start = None if sliding_window is None else first_pos - sliding_window + 1
        kv_start = jnp.int32(0) if window_start is None else jnp.clip(before_pos(window_start), 0, kv_end)
        # lax.div, not //: floor division of signed scalars lowers through sign(), which the
        # interpreters only run with a TPU device kind. All operands are >= 0 here.
        k_lo = jax.lax.div(kv_start, step.block_kv)
        k_hi = jax.lax.div(kv_end + step.block_kv - 1, step.block_kv)
        return _SeqView(
            t_lo, t_hi, first_pos, kv_start, kv_end, k_lo, k_hi, s * padded_pages_per_seq, (t_lo < t_hi) & (k_lo < k_hi)
        )

    def page_range(seq: _SeqView, k: Any) -> tuple[Any, Any]:
        """Pages ``[j_lo, j_hi)`` of KV block k (block-local numbers) that hold visible keys."""
        base = k * block_kv_pages
        g_lo = jax.lax.div(seq.kv_start, page_size)
        g_hi = jax.lax.div(seq.kv_end + page_size - 1, page_size)
        return (jnp.clip(g_lo - base, 0, block_kv_pages), jnp.clip(g_hi - base, 0, block_kv_pages))

    def page_id(seq: _SeqView, k: Any, j: Any) -> Any:
        """Pool page of page j of KV block k; 0 (never fetched) where the table had an invalid id."""
        return page_ids_ref[seq.page_base + k * block_kv_pages + j]

    def fetch(seq: _SeqView, k: Any, slot: Any, action: str) -> None:
        """Start (or wait for) the DMAs of the pages of KV block k of ``seq`` that hold visible
        keys, into buffer half ``slot`` (``ra.page_dmas``)."""
        j_lo, j_hi = page_range(seq, k)
        page_of = functools.partial(page_id, seq, k)
        ra.page_dmas(kv_hbm_ref, kv_buf, sems, slot, page_of, j_lo, j_hi, page_size=page_size, action=action)

    def key_mask(seq: _SeqView, k: Any, shape: tuple[int, int], axis: int) -> tuple[Any, Any]:
        """(bool mask of the keys of block k that are fetched and visible to some row, their
        positions), laid out along ``axis`` of ``shape``."""
        offset = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        pos = k * step.block_kv + offset
        ok = (pos >= seq.kv_start) & (pos < seq.kv_end)  # implies the page is in page_range
        page_of = functools.partial(page_id, seq, k)
        return ra.hide_unfetched_pages(ok, offset, page_of, block_kv_pages=block_kv_pages, page_size=page_size), pos

    def compute(seq: _SeqView, k: Any, slot: Any) -> None:
        """Online-softmax update of this block's rows of ``seq`` with KV block k (in ``slot``)."""
        col_ok, col_pos = key_mask(seq, k, (1, step.block_kv), 1)  # [1, bkv]
        v_ok, _ = key_mask(seq, k, (step.block_kv, 1), 0)  # [bkv, 1]: the same mask along sublanes
        row_pos, row_ok = step.rows_of(seq)  # [R, 1]
        col_pos = key_position(col_pos)
        mask = row_ok & col_ok & (col_pos <= row_pos)
        if sliding_window is not None:
            mask = mask & (col_pos > row_pos - sliding_window)
        # De-interleave K and V through the staging buffer (see _split_kv): one copy of the
        # block, then one sublane-strided load per head.
        block = kv_buf[slot]  # [bkv, 2 * Hkv, Dp]
        packed = jnp.dtype(block.dtype) == jnp.bfloat16
        if packed:
            block = pltpu.bitcast(block, jnp.uint32)  # [bkv, Hkv, Dp]: word = (K_h low, V_h high)
        elif jnp.dtype(block.dtype).itemsize != 4:
            block = block.astype(jnp.float32)  # fp8 / f16: widened once per block (exact)
        chunks, stage_rows, lanes = (int(d) for d in stage_ref.shape)
        flat = block.reshape(stage_rows, chunks * lanes)
        for c in range(chunks):  # static: lane chunks of 128 (strided loads need a 128-lane base)
            stage_ref[c] = flat[:, c * lanes : (c + 1) * lanes]
        for h in range(num_kv_heads):  # static: one [R, Dp] x [Dp, bkv] matmul per KV head
            q = q_ref[h]
            keys, values = _split_kv(stage_ref, h, num_kv_heads, step.block_kv, v_ok, packed, q_ref.dtype)
            logits = (
                jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * sm_scale
            )
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            ra.online_softmax_update(m_ref, l_ref, acc_ref, h, logits, mask, values)

    halves = 2 if _DOUBLE_BUFFER else 1  # 1: a deliberate race, for the tests only
    ra.walk_sequences(
        seq_lo_ref[step.index], seq_hi_ref[step.index], kv_lens_ref.shape[0], view, fetch, compute, halves=halves
    )

    for h in range(num_kv_heads):
        denom = l_ref[h]
        acc = acc_ref[h]
        if lse_ref is not None:  # over the keys alone (no sinks with return_lse)
            lse_ref[h] = jnp.where(denom > 0.0, m_ref[h] + jnp.log(jnp.where(denom > 0.0, denom, 1.0)), -jnp.inf)
        if has_sinks:  # one more logit per row with a zero value, folded into the final state
            sink = sink_ref[h]
            m_new = jnp.maximum(m_ref[h], sink)
            alpha = jnp.exp(m_ref[h] - m_new)
            denom = alpha * denom + jnp.exp(sink - m_new)
            acc = alpha * acc
        o_ref[h] = (acc / jnp.where(denom > 0.0, denom, 1.0)).astype(o_ref.dtype)


def default_block_sizes(
    total_q_tokens: int, max_seqs: int, q_per_kv: int, page_size: int, pages_per_seq: int
) -> tuple[int, int]:
    """``(block_q, block_kv_pages)`` heuristics; both are static (they shape the compiled kernel).

    * ``block_q`` (tokens per grid step, a multiple of 8; rows ``block_q * q_per_kv`` a multiple
      of 16 so bf16 blocks tile): 8 (16 for odd ``q_per_kv``) for a decode-shaped batch
      (``total_q_tokens <= max_seqs``), where every extra row is wasted work on other sequences'
      keys; else about ``_TARGET_Q_ROWS`` rows, so each KV block fetched feeds a full matmul.
    * ``block_kv_pages``: about ``_TARGET_KV_TOKENS`` keys per KV block, at most the table width.
    """
    unit = 8 if q_per_kv % 2 == 0 else 16
    if total_q_tokens <= max_seqs:
        block_q = unit
    else:
        block_q = max(unit, (_TARGET_Q_ROWS // q_per_kv) // unit * unit)
        block_q = min(block_q, ra.round_up(max(total_q_tokens, 1), unit))
    block_kv_pages = max(1, min(pages_per_seq, _TARGET_KV_TOKENS // page_size))
    return block_q, block_kv_pages


def ragged_paged_attention_kernel(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = False,
    sinks: jax.Array | None = None,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The Pallas kernel (compiled when ``interpret`` is False: TPU only). Same contract as the reference.

    ``block_q``: tokens per grid step (a multiple of 8); ``block_kv_pages``: pages per KV block.
    Defaults: ``default_block_sizes``.

    fp8 scales are folded in outside the kernel, exactly: ``q . (k_scale * k) = (k_scale * q) . k``
    and ``sum p (v_scale * v) = v_scale * sum p v``, so the kernel multiplies the queries by
    ``k_scale`` once (O(tokens)) and the output by ``v_scale`` once, and reads the stored values.
    The kernel computes in ``_kernel_compute_dtype`` (bf16 for bf16/fp8 pools, f32 otherwise) with
    f32 softmax state and an f32 output, cast to q's dtype at the end.
    """
    num_kv_heads, group, pages_per_seq = _check_args(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    _check_stripe(key_stride, return_lse, sinks)
    total, num_q_heads, head_dim = q.shape
    _, page_size, combined, dim_padded = kv_pages.shape
    max_seqs = page_indices.shape[0]
    scale = _default_sm_scale(head_dim, sm_scale)
    k_dequant, v_dequant = _scale("k_scale", k_scale), _scale("v_scale", v_scale)
    if total == 0:
        return (jnp.zeros_like(q), jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else jnp.zeros_like(q)
    out_dtype = q.dtype
    compute = _kernel_compute_dtype(kv_pages.dtype)
    q = (q.astype(jnp.float32) * k_dequant).astype(compute)
    defaults = default_block_sizes(total, max_seqs, group, page_size, pages_per_seq)
    block_q, block_kv_pages = ra.resolve_block_sizes(block_q, block_kv_pages, defaults)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")

    num_blocks = -(-total // block_q)
    total_padded = num_blocks * block_q
    rows = block_q * group

    # Queries per KV head: [T, Hq, D] -> [Hkv, T_pad * G, Dp] (zero padding of tokens and dims).
    qp = jnp.pad(q, ((0, total_padded - total), (0, 0), (0, dim_padded - head_dim)))
    qp = qp.reshape(total_padded, num_kv_heads, group, dim_padded).transpose(1, 0, 2, 3)
    qp = qp.reshape(num_kv_heads, total_padded * group, dim_padded)

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
        group,
        key_stride,
    )
    offset = jnp.asarray(key_offset, jnp.int32).reshape(1)
    # Row r of a block is query head h * G + r % G: its sink, per KV head (zeros when unused).
    sink_heads = jnp.zeros((num_q_heads,), jnp.float32) if sinks is None else _check_sinks(sinks, num_q_heads)
    sink_rows = jnp.tile(sink_heads.reshape(num_kv_heads, group), (1, block_q)).reshape(num_kv_heads, rows, 1)

    kernel = functools.partial(
        _rpa_kernel_refs,
        return_lse=return_lse,
        **schedule.tiling,
        num_kv_heads=num_kv_heads,
        sm_scale=scale,
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
        has_sinks=sinks is not None,
        key_stride=key_stride,
    )
    block_kv = block_kv_pages * page_size
    itemsize = jnp.dtype(q.dtype).itemsize
    kv_itemsize = jnp.dtype(kv_pages.dtype).itemsize
    # Mosaic's sublane-strided load needs a base whose last dim is 128: a wider head dim (Gemma's
    # 256) is staged as 128-lane chunks and each head's rows are loaded chunk by chunk.
    lanes = 128 if dim_padded > 128 and dim_padded % 128 == 0 else dim_padded
    chunks = dim_padded // lanes
    if jnp.dtype(kv_pages.dtype) == jnp.bfloat16:  # K/V pairs as 32-bit words
        stage = pltpu.VMEM((chunks, block_kv * num_kv_heads, lanes), jnp.uint32)
    elif kv_itemsize == 4:
        stage = pltpu.VMEM((chunks, block_kv * combined, lanes), kv_pages.dtype)
    else:  # fp8 / f16: the block is widened to f32 rows
        stage = pltpu.VMEM((chunks, block_kv * combined, lanes), jnp.float32)
    q_block = pl.BlockSpec((num_kv_heads, rows, dim_padded), lambda b, *_: (0, b, 0))
    # Rough cost for XLA's scheduler: the keys actually read depend on the batch, unknown when
    # tracing; state the page table's capacity read once (the decode case).
    kv_bytes = max_seqs * max_kv * combined * dim_padded * kv_itemsize
    cost = pl.CostEstimate(
        flops=4 * total_padded * num_q_heads * max_kv * dim_padded,
        transcendentals=total_padded * num_q_heads * max_kv,
        bytes_accessed=kv_bytes + qp.size * (itemsize + 4),
    )
    # VMEM: double-buffered q/out blocks, the KV double buffer and its staging copy, the f32
    # state (m and l pad to 128 lanes) and the logits temporaries.
    vmem = (
        2 * num_kv_heads * rows * dim_padded * (itemsize + 4)
        + 2 * block_kv * combined * dim_padded * kv_itemsize
        + block_kv * combined * dim_padded * 4
        + num_kv_heads * rows * (dim_padded + 2 * 128) * 4
        + 4 * rows * block_kv * 4
        + rows * 128 * 4
    )
    # Bounds checks off (as in tpu-inference): they double the scalar work of issuing a page DMA,
    # and every DMA is in bounds by construction: page ids were clamped into [0, num_pages] above
    # (0 is never fetched) and a destination is page j < block_kv_pages of its buffer half. The
    # TPU interpreter still checks every DMA in the tests.
    # Inside shard_map the outputs vary over the same mesh axes as the queries.
    manual = jax.typeof(qp).manual_axis_type
    out_shape: Any = jax.ShapeDtypeStruct(qp.shape, jnp.float32, manual_axis_type=manual)
    out_specs: Any = q_block
    if return_lse:
        lse_shape = (num_kv_heads, total_padded * group, 1)
        out_shape = (out_shape, jax.ShapeDtypeStruct(lse_shape, jnp.float32, manual_axis_type=manual))
        out_specs = (q_block, pl.BlockSpec((num_kv_heads, rows, 1), lambda b, *_: (0, b, 0)))
    result = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_blocks,),
            in_specs=[
                pl.BlockSpec((rows, 1), lambda b, *_: (0, 0)),
                q_block,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((num_kv_heads, rows, 1), lambda b, *_: (0, 0, 0)),
            ],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((2, block_kv, combined, dim_padded), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, dim_padded), jnp.float32),
                stage,
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), disable_bounds_checks=True, vmem_limit_bytes=ra.vmem_limit_bytes(vmem)
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="ragged_paged_attention",
    )(*schedule.prefetch, offset, schedule.row_token, qp, kv_pages, sink_rows)

    out = result[0] if return_lse else result
    out = out.reshape(num_kv_heads, total_padded, group, dim_padded).transpose(1, 0, 2, 3)
    out = out.reshape(total_padded, num_q_heads, dim_padded)[:total, :, :head_dim]
    out = (out * v_dequant).astype(out_dtype)
    if not return_lse:
        return out
    lse = result[1].reshape(num_kv_heads, total_padded, group).transpose(1, 0, 2)
    return out, lse.reshape(total_padded, num_q_heads)[:total]


def _rpa_kernel_refs(*refs: Any, return_lse: bool, **static: Any) -> None:
    """``_rpa_kernel`` with its optional log-sum-exp output: the refs as ``pallas_call`` passes
    them (6 scalar prefetch, 4 inputs, 1 or 2 outputs, the scratch)."""
    inputs, rest = refs[:10], refs[10:]
    outputs, scratch = (rest[:2], rest[2:]) if return_lse else ((rest[0], None), rest[1:])
    _rpa_kernel(*inputs, *outputs, *scratch, **static)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = None,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
) -> jax.Array:
    """Attention of a ragged batch of queries over the paged KV pool (see the module docstring).

    Args:
      q: ``[total_q_tokens, num_q_heads, head_dim]`` (padding tokens at the end).
      kv_pages: one pool layer in the logical dtype (``MHAKVPool.kv_buffer(layer_id)``): fp8,
        bf16, f16 or f32, independent of q's dtype.
      kv_lens, page_indices, cu_q_lens, num_seqs: int32 ``[S]``, ``[S, pages_per_seq]``,
        ``[S + 1]``, ``[1]``.
      sm_scale: logit scale (default ``1 / sqrt(head_dim)``).
      sliding_window: a query at position ``p`` sees keys in ``(p - sliding_window, p]``.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      sinks: f32 ``[num_q_heads]`` attention-sink logits (gpt-oss), or None.
      k_scale, v_scale: the layer's fp8 scales (``MHAKVPool.k_scale[i]``; stored = value / scale):
        attention runs on ``k_scale * k`` and ``v_scale * v``. Default 1. Concrete scales that are
        zero, negative or not finite raise ``ValueError``.
      block_q, block_kv_pages: kernel tiling (``default_block_sizes``); ignored by the reference.
      interpret: ``None`` (default) or ``False``: compiled kernel when lowering for TPU, the jnp
        reference elsewhere. ``True``: the kernel under the HLO interpreter.
        ``pltpu.InterpretParams(...)``: the kernel under the TPU interpreter.
      key_stride, key_offset: the pool is one rank of a token stripe (module docstring): local
        key ``l`` is the sequences' key at position ``l * key_stride + key_offset`` (``key_offset``
        an int32 scalar, traced or not). Default: a plain pool.

    Returns:
      ``[total_q_tokens, num_q_heads, head_dim]`` in q's dtype (the compute dtype); padding tokens are 0.
    """
    return _attention(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
        block_q=block_q,
        block_kv_pages=block_kv_pages,
        interpret=interpret,
        key_stride=key_stride,
        key_offset=key_offset,
    )


def ragged_paged_attention_with_lse(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = None,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
) -> tuple[jax.Array, jax.Array]:
    """``ragged_paged_attention`` (same arguments, no sinks) that also returns each query's
    log-sum-exp: ``(out, lse)``, ``out`` normalised over the keys the query sees in this pool
    (0 where none), ``lse`` f32 ``[total_q_tokens, num_q_heads]`` (``-inf`` where none). With
    ``key_stride``/``key_offset`` over one rank of a token stripe, the partials of every rank
    merge exactly (``kvjax.attention.dcp_merge``). Same dispatch: compiled kernel on TPU, the
    reference elsewhere, an interpreter when asked."""
    out, lse = _attention(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        block_q=block_q,
        block_kv_pages=block_kv_pages,
        interpret=interpret,
        key_stride=key_stride,
        key_offset=key_offset,
        return_lse=True,
    )
    return out, lse


def _kernel_of_args(*a: jax.Array, **static: Any) -> Any:
    """:func:`ragged_paged_attention_kernel` of ``_attention``'s argument tuple (q, pages, lengths,
    page table, query starts, sequence count, scales, key offset[, sinks]); ``static``: its other
    options."""
    return ragged_paged_attention_kernel(
        *a[:6], k_scale=a[6], v_scale=a[7], key_offset=a[8], sinks=a[9] if len(a) > 9 else None, **static
    )


def _attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    interpret: Interpret = None,
    key_stride: int = 1,
    key_offset: int | jax.Array = 0,
    return_lse: bool = False,
) -> Any:
    """``ragged_paged_attention`` and ``ragged_paged_attention_with_lse`` (their docstrings)."""
    _engine.check_interpret(interpret)
    _check_stripe(key_stride, return_lse, sinks)
    stripe: dict[str, Any] = dict(key_stride=key_stride, return_lse=return_lse)

    def reference(*a: jax.Array) -> Any:
        return ragged_paged_attention_reference(
            *a[:6],
            k_scale=a[6],
            v_scale=a[7],
            key_offset=a[8],
            sinks=a[9] if len(a) > 9 else None,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            **stripe,
        )

    def kernel(*a: jax.Array, interpret: Interpret) -> Any:
        static = dict(
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            block_q=block_q,
            block_kv_pages=block_kv_pages,
            **stripe,
        )
        if interpret is False:  # the compiled kernel, traced once per shape (read only: nothing aliased)
            return _engine.traced_once(_kernel_of_args, **static)(*a)
        return _kernel_of_args(*a, interpret=interpret, **static)

    _check_args(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    args: tuple[jax.Array, ...] = (
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        _scale("k_scale", k_scale),
        _scale("v_scale", v_scale),
        jnp.asarray(key_offset, jnp.int32).reshape(()),
    )
    if sinks is not None:
        args = (*args, _check_sinks(sinks, q.shape[1]))
    if not _kernel_reads(kv_pages.dtype) and not interpret:
        return reference(*args)  # a pool dtype the compiled kernel does not take (_COMPILED_POOL_DTYPES)
    return _engine.dispatch(kernel, reference, *args, interpret=interpret)
