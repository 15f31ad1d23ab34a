"""Pieces shared by the two ragged paged attention kernels (MHA/GQA and absorbed MLA).

Both kernels (``ragged_paged_attention``, ``mla_ragged_paged_attention``) follow one plan: the
wrapper turns the ragged batch into a per-q-block schedule (scalar prefetch), and each grid step
walks the KV of every overlapping sequence in KV blocks of whole pages, fetched by one DMA per
page into a VMEM double buffer, with an online softmax in f32 VMEM state. What differs (query
layout, sliding window, K/V de-interleave, sinks) stays in each kernel's module; what is the
same logic lives here, so a fix to the page walk or the softmax update reaches both kernels.

The kernel-side helpers are called while tracing a kernel body: they emit exactly the ops the
kernels wrote inline, in the same order, so the kernels lower as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Logit of a masked (query, key) pair and the initial running max. Finite on purpose: with
# -inf, a row that has seen no key yet would compute exp(-inf - -inf) = NaN when rescaling.
MASK_VALUE = -1e30

# Page of a KV block: (block-local page number j) -> pool page id (0: invalid, never fetched).
PageOf = Callable[[Any], Any]


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= x`` (``x >= 0``, ``multiple > 0``)."""
    return -(-x // multiple) * multiple


# --------------------------------------------------------------------------------------------
# Wrapper side (plain jnp, outside the kernel)
# --------------------------------------------------------------------------------------------


def check_batch_tables(kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any) -> None:
    """Trace-time checks of a ragged batch's tables, raising an error that names the table.

    ``page_indices`` ``[max_seqs, pages_per_seq]``, ``kv_lens`` ``[max_seqs]``, ``cu_q_lens``
    ``[max_seqs + 1]``, ``num_seqs`` ``[1]`` (ValueError otherwise), all of an integer dtype
    (TypeError otherwise: int32 expected).
    """
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices has shape {list(page_indices.shape)}; expected [max_seqs, pages_per_seq]")
    max_seqs = page_indices.shape[0]
    for name, x, shape in (
        ("kv_lens", kv_lens, (max_seqs,)),
        ("cu_q_lens", cu_q_lens, (max_seqs + 1,)),
        ("num_seqs", num_seqs, (1,)),
    ):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {list(x.shape)}; expected {list(shape)} (max_seqs={max_seqs})")
    for name, x in (
        ("kv_lens", kv_lens),
        ("page_indices", page_indices),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if jnp.dtype(x.dtype).kind not in "iu":
            raise TypeError(f"{name} has dtype {jnp.dtype(x.dtype)}; expected int32")


def resolve_block_sizes(block_q: int | None, block_kv_pages: int | None, defaults: tuple[int, int]) -> tuple[int, int]:
    """``(block_q, block_kv_pages)``: the given sizes, or ``defaults`` where None.

    ``block_q`` (tokens per grid step) must be a positive multiple of 8 (sublane tiling of the
    query block); ``block_kv_pages`` (pages per KV block) positive. ValueError naming both otherwise.
    """
    block_q = defaults[0] if block_q is None else int(block_q)
    block_kv_pages = defaults[1] if block_kv_pages is None else int(block_kv_pages)
    if block_q <= 0 or block_q % 8 or block_kv_pages <= 0:
        raise ValueError(
            f"block_q={block_q} must be a positive multiple of 8 and block_kv_pages={block_kv_pages} positive"
        )
    return block_q, block_kv_pages


@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """The scalar-prefetch operands of both kernels (int32 arrays) and the page-table width.

    * ``kv_lens``: ``[S]``, clamped to ``[0, pages_per_seq * page_size]``.
    * ``page_ids``: ``[S * padded_pages_per_seq]``, the page table with ids outside
      ``[1, num_pages]`` set to 0 (never fetched), padded to whole KV blocks (so a block's ids are
      always inside the SMEM table) and flattened (a 2-D SMEM array would pad its rows).
    * ``cu_q_lens``: ``[S + 1]``.
    * ``seq_lo``, ``seq_hi``: ``[num_q_blocks]``, the live sequences overlapping each q block are
      ``[seq_lo, seq_hi)`` (cu_q_lens is sorted over the live sequences, so they form a range).
    * ``padded_pages_per_seq``: the table width rounded up to whole KV blocks (static).
    """

    kv_lens: jax.Array
    page_ids: jax.Array
    cu_q_lens: jax.Array
    seq_lo: jax.Array
    seq_hi: jax.Array
    padded_pages_per_seq: int

    @property
    def prefetch(self) -> tuple[jax.Array, ...]:
        """The five scalar-prefetch operands, in the kernels' argument order."""
        return (self.kv_lens, self.page_ids, self.cu_q_lens, self.seq_lo, self.seq_hi)


def block_schedule(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    kv_pages_shape: tuple[int, ...],
    num_blocks: int,
    block_q: int,
    block_kv_pages: int,
) -> BlockSchedule:
    """The schedule of ``num_blocks`` q blocks of ``block_q`` tokens (see ``BlockSchedule``).

    ``kv_pages_shape``: the pool layer's shape, ``[num_pages + 1, page_size, ...]``;
    ``block_kv_pages``: pages per KV block.
    """
    num_pool_pages, page_size = kv_pages_shape[0], kv_pages_shape[1]
    max_seqs, pages_per_seq = page_indices.shape
    max_kv = pages_per_seq * page_size
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, max_kv)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    padded_pages = round_up(pages_per_seq, block_kv_pages)
    page_ids = page_indices.astype(jnp.int32)
    page_ids = jnp.where((page_ids >= 1) & (page_ids < num_pool_pages), page_ids, 0)  # 0: never read
    page_ids = jnp.pad(page_ids, ((0, 0), (0, padded_pages - pages_per_seq))).reshape(-1)
    live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs.astype(jnp.int32)[0]
    blk_start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    # Sequences overlapping block b: live, starting before its end and ending after its start.
    seq_lo = jnp.sum(live[None, :] & (cu_q_lens[None, 1:] <= blk_start[:, None]), axis=1, dtype=jnp.int32)
    seq_hi = jnp.sum(live[None, :] & (cu_q_lens[None, :-1] < blk_start[:, None] + block_q), axis=1, dtype=jnp.int32)
    seq_hi = jnp.maximum(seq_hi, seq_lo)
    return BlockSchedule(kv_lens, page_ids, cu_q_lens, seq_lo, seq_hi, padded_pages)


def vmem_limit_bytes(vmem: int) -> int | None:
    """The scoped VMEM limit to ask for when a kernel needs ``vmem`` bytes: None (the compiler's
    default) up to 12 MiB, the smallest default scoped limit; above it twice the need, at most 100 MiB."""
    return int(min(2 * vmem, 100 * 2**20)) if vmem > 12 * 2**20 else None


# --------------------------------------------------------------------------------------------
# Kernel side (traced inside a kernel body)
# --------------------------------------------------------------------------------------------


def init_softmax_state(m_ref: Any, l_ref: Any, acc_ref: Any) -> None:
    """Reset the online-softmax state of a grid step: running max ``MASK_VALUE``, sum and acc 0."""
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def sequence_rows(
    cu_q_lens_ref: Any, kv_lens_ref: Any, s: Any, blk_start: Any, blk_end: Any
) -> tuple[Any, Any, Any, Any]:
    """``(t_lo, t_hi, first_pos, kv_len)`` of sequence ``s`` in the q block of tokens ``[blk_start, blk_end)``.

    The block's rows of sequence ``s`` are its tokens ``[t_lo, t_hi)`` (empty when ``t_lo >= t_hi``);
    ``first_pos`` is the position of token ``t_lo`` (query ``i`` of a sequence with ``q_len`` new
    tokens and ``kv_len`` keys sits at ``kv_len - q_len + i``); ``kv_len`` the sequence's keys.
    Traced int32 scalars read from the SMEM tables.
    """
    q_start = cu_q_lens_ref[s]
    q_end = cu_q_lens_ref[s + 1]
    kv_len = kv_lens_ref[s]
    t_lo = jnp.maximum(q_start, blk_start)
    t_hi = jnp.minimum(q_end, blk_end)
    first_pos = kv_len - (q_end - q_start) + (t_lo - q_start)
    return t_lo, t_hi, first_pos, kv_len


def page_dmas(
    kv_hbm_ref: Any,
    kv_buf: Any,
    sems: Any,
    slot: Any,
    page_of: PageOf,
    j_lo: Any,
    j_hi: Any,
    *,
    page_size: int,
    action: str,
) -> None:
    """Start (``action="start"``) or wait for (``"wait"``) the page DMAs of one KV block.

    Page ``j`` in ``[j_lo, j_hi)`` of the block is pool page ``page_of(j)``, copied whole (one
    fixed-size DMA: both interpreters run it) into rows ``[j * page_size, (j + 1) * page_size)``
    of buffer half ``slot``, on semaphore ``sems[slot]``; page id 0 (invalid) is skipped. Start
    and wait evaluate the same conditions, so each started DMA is waited exactly once with a
    descriptor of its own size.
    """

    @pl.loop(j_lo, j_hi)
    def _(j: Any) -> None:
        page = page_of(j)

        @pl.when(page != 0)
        def _() -> None:
            copy = pltpu.make_async_copy(
                kv_hbm_ref.at[page], kv_buf.at[slot, pl.ds(j * page_size, page_size)], sems.at[slot]
            )
            getattr(copy, action)()


def hide_unfetched_pages(ok: Any, offset: Any, page_of: PageOf, *, block_kv_pages: int, page_size: int) -> Any:
    """``ok`` with the keys of the block's invalid pages (id 0: never fetched) cleared.

    ``offset``: each key's block-local position (same shape as ``ok``). Static loop over the
    block's pages: a few vector ops per page.
    """
    for j in range(block_kv_pages):
        in_page = (offset >= j * page_size) & (offset < (j + 1) * page_size)
        ok = ok & jnp.logical_not(in_page & (page_of(j) == 0))
    return ok


def online_softmax_update(
    m_ref: Any, l_ref: Any, acc_ref: Any, index: Any, logits: Any, mask: Any, values: Any
) -> None:
    """Fold one KV block into the online-softmax state ``m_ref[index]``, ``l_ref[index]``, ``acc_ref[index]``.

    ``logits``: f32 ``[R, bkv]``, already scaled (and capped); ``mask``: bool, broadcastable to
    it; ``values``: ``[bkv, Dv]`` with masked rows already zeroed. ``index``: ``...`` or a KV head.
    Masked logits become ``MASK_VALUE`` and their ``p`` exactly 0, so a row with no visible key
    so far keeps ``l = 0`` and ``acc = 0``; ``p`` is cast to the values' dtype for the matmul
    (f32 accumulation).
    """
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_prev = m_ref[index]
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    m_ref[index] = m_new
    l_ref[index] = alpha * l_ref[index] + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(
        p.astype(values.dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    acc_ref[index] = alpha * acc_ref[index] + pv
