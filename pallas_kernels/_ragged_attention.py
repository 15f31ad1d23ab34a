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
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Logit of a masked (query, key) pair and the initial running max. Finite on purpose: with
# -inf, a row that has seen no key yet would compute exp(-inf - -inf) = NaN when rescaling.
MASK_VALUE = -1e30

# Page of a KV block: (block-local page number j) -> pool page id (0: invalid, never fetched).
PageOf = Callable[[Any], Any]


# What a kernel needs of one sequence in its q block (a NamedTuple of traced scalars with at least
# ``k_lo``, ``k_hi``: the KV blocks ``[k_lo, k_hi)`` it reads, and ``active``: bool, anything to do).
SeqView = Any


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
    """The scalar-prefetch operands of both kernels (int32 arrays), the row table and the tiling.

    * ``kv_lens``: ``[S]``, clamped to ``[0, pages_per_seq * page_size]``.
    * ``page_ids``: ``[S * padded_pages_per_seq]``, the page table with ids outside
      ``[1, num_pages]`` set to 0 (never fetched), padded to whole KV blocks (so a block's ids are
      always inside the SMEM table) and flattened (a 2-D SMEM array would pad its rows).
    * ``cu_q_lens``: ``[S + 1]``.
    * ``seq_lo``, ``seq_hi``: ``[num_q_blocks]``, the live sequences overlapping each q block are
      ``[seq_lo, seq_hi)`` (cu_q_lens is sorted over the live sequences, so they form a range).
    * ``row_token``: int32 ``[R, 1]``, ``R = block_q * rows_per_token``: the token of row ``r`` of a
      q block within the block (``r // rows_per_token``; a kernel input, not prefetched).
    * ``block_q``, ``block_kv_pages``, ``page_size`` and ``padded_pages_per_seq`` (the table width
      rounded up to whole KV blocks): static, the kernels' keyword arguments (``tiling``).
    """

    kv_lens: jax.Array
    page_ids: jax.Array
    cu_q_lens: jax.Array
    seq_lo: jax.Array
    seq_hi: jax.Array
    row_token: jax.Array
    block_q: int
    block_kv_pages: int
    page_size: int
    padded_pages_per_seq: int

    @property
    def prefetch(self) -> tuple[jax.Array, ...]:
        """The five scalar-prefetch operands, in the kernels' argument order."""
        return (self.kv_lens, self.page_ids, self.cu_q_lens, self.seq_lo, self.seq_hi)

    @property
    def tiling(self) -> dict[str, int]:
        """The static tiling keywords both kernels take."""
        return dict(
            block_q=self.block_q,
            block_kv_pages=self.block_kv_pages,
            page_size=self.page_size,
            padded_pages_per_seq=self.padded_pages_per_seq,
        )


def block_schedule(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    kv_pages_shape: tuple[int, ...],
    num_blocks: int,
    block_q: int,
    block_kv_pages: int,
    rows_per_token: int,
    key_stride: int = 1,
) -> BlockSchedule:
    """The schedule of ``num_blocks`` q blocks of ``block_q`` tokens (see ``BlockSchedule``).

    ``kv_pages_shape``: the pool layer's shape, ``[num_pages + 1, page_size, ...]``;
    ``block_kv_pages``: pages per KV block; ``rows_per_token``: query rows per token in a q block
    (the query heads a kernel stacks per token). ``key_stride``: the pool holds every
    ``key_stride``-th key of each sequence (one rank of a token stripe), so ``kv_lens`` (whole
    sequences) are clamped to ``key_stride`` times the table's capacity.
    """
    num_pool_pages, page_size = kv_pages_shape[0], kv_pages_shape[1]
    max_seqs, pages_per_seq = page_indices.shape
    max_kv = pages_per_seq * page_size * key_stride
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
    rows = block_q * rows_per_token
    row_token = (jnp.arange(rows, dtype=jnp.int32) // rows_per_token).reshape(rows, 1)
    return BlockSchedule(
        kv_lens, page_ids, cu_q_lens, seq_lo, seq_hi, row_token, block_q, block_kv_pages, page_size, padded_pages
    )


class TokenRows(NamedTuple):
    """Where each query token of a ragged batch stands, for the jnp references.

    * ``seq``: int32 ``[T]``, the token's sequence (padding tokens: clamped to ``max_seqs - 1``);
    * ``pos``: int32 ``[T]``, its position in the sequence (query ``i`` of ``q_len`` new tokens over
      ``kv_len`` keys sits at ``kv_len - q_len + i``);
    * ``live``: bool ``[T]``, a token of a live sequence (False for padding);
    * ``page_ok``: bool ``[S, pages_per_seq]``, the table's id is a pool page in ``[1, num_pages]``;
    * ``safe_pages``: int32 ``[S, pages_per_seq]``, the table with the other ids set to 0.
    """

    seq: jax.Array
    pos: jax.Array
    live: jax.Array
    page_ok: jax.Array
    safe_pages: jax.Array


def token_rows(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    total: int,
    num_pool_pages: int,
    page_size: int,
) -> TokenRows:
    """``TokenRows`` of the ``total`` query tokens of a batch over a pool of ``num_pool_pages``
    pages (trash page included) of ``page_size`` tokens; ``kv_lens`` is clamped to the table's
    capacity (``pages_per_seq * page_size``)."""
    max_seqs, pages_per_seq = page_indices.shape
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, pages_per_seq * page_size)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    page_indices = page_indices.astype(jnp.int32)
    live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs.astype(jnp.int32)[0]
    # Token -> sequence: the number of live sequences that end at or before the token. Padding
    # tokens (after the last live sequence) get max_seqs' worth of "no sequence".
    token = jnp.arange(total, dtype=jnp.int32)
    ends = jnp.where(live, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.sum(ends[None, :] <= token[:, None], axis=1, dtype=jnp.int32)
    is_live = (seq < num_seqs[0]) & (token >= cu_q_lens[0])
    seq = jnp.minimum(seq, max_seqs - 1)
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    pos = kv_lens[seq] - q_len + (token - q_start)
    page_ok = (page_indices >= 1) & (page_indices < num_pool_pages)
    return TokenRows(seq, pos, is_live, page_ok, jnp.where(page_ok, page_indices, 0))


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


class GridStep(NamedTuple):
    """What one grid step works on: its q block ``index`` (the program id ``b``), the block's
    tokens ``[start, end)`` (``start = b * block_q``), ``row_token``: the absolute token of each
    query row (``[R, 1]``), and ``block_kv``: the keys per KV block it walks in (static)."""

    index: Any
    start: Any
    end: Any
    row_token: Any
    block_kv: int

    def rows_of(self, seq: SeqView) -> tuple[Any, Any]:
        """``(pos, ok)``, ``[R, 1]`` each: every row's position in sequence ``seq`` (a view with
        ``t_lo``, ``t_hi``: its tokens in this block, and ``first_pos``: the position of ``t_lo``)
        and whether the row is one of those tokens."""
        pos = seq.first_pos + (self.row_token - seq.t_lo)
        ok = (self.row_token >= seq.t_lo) & (self.row_token < seq.t_hi)
        return pos, ok


def start_grid_step(block_q: int, block_kv: int, row_token_ref: Any, m_ref: Any, l_ref: Any, acc_ref: Any) -> GridStep:
    """The ``GridStep`` of the running grid step (``row_token_ref``: each row's token within the q
    block), with the online-softmax state reset (``init_softmax_state``)."""
    b = pl.program_id(0)
    start = b * block_q
    end = start + block_q
    init_softmax_state(m_ref, l_ref, acc_ref)
    return GridStep(b, start, end, start + row_token_ref[...], block_kv)


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


def walk_sequences(
    seq_lo: Any,
    seq_hi: Any,
    max_seqs: int,
    view: Callable[[Any], SeqView],
    fetch: Callable[[SeqView, Any, Any, str], None],
    compute: Callable[[SeqView, Any, Any], None],
    *,
    halves: int = 2,
) -> None:
    """Every KV block of sequences ``[seq_lo, seq_hi)`` of a grid step, through one DMA stream.

    ``view(s)``: what the q block needs of sequence ``s`` (``SeqView``); ``fetch(seq, k, slot,
    action)``: start (``action="start"``) or wait for (``"wait"``) the DMAs of KV block ``k`` of
    ``seq`` into buffer half ``slot``; ``compute(seq, k, slot)``: fold that block into the softmax
    state. While block ``k`` is computed, block ``k + 1`` is in flight in the other half, or after
    a sequence's last block the first block of the next active sequence, so the stream runs across
    sequences; each started DMA is waited once. ``halves``: buffer halves (2; 1 only for the race
    test hook, where the prefetch lands in the half being computed).
    """

    def seq_step(s: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        slot0, prefetched = carry  # buffer half of s's first block; whether it is in flight
        cur = view(s)
        nxt = view(jnp.minimum(s + 1, max_seqs - 1))
        next_active = (s + 1 < seq_hi) & nxt.active

        @pl.when(cur.active & (prefetched == 0))
        def _() -> None:
            fetch(cur, cur.k_lo, slot0, "start")

        @pl.when(cur.active)
        def _() -> None:
            @pl.loop(cur.k_lo, cur.k_hi)
            def _(k: Any) -> None:
                slot = jax.lax.rem(slot0 + (k - cur.k_lo), halves)
                last = k + 1 == cur.k_hi
                # Prefetch into the other half while block k is computed: the next block of s, or
                # after the last one the first block of the next sequence. One call site keeps
                # the loop body (and the scalar work per page) small.
                target = jax.tree.map(functools.partial(jnp.where, last), nxt, cur)
                target_k = jnp.where(last, nxt.k_lo, k + 1)

                @pl.when(jnp.logical_not(last) | next_active)
                def _() -> None:
                    fetch(target, target_k, jax.lax.rem(slot + 1, halves), "start")

                fetch(cur, k, slot, "wait")
                compute(cur, k, slot)

        blocks = jnp.where(cur.active, cur.k_hi - cur.k_lo, 0)
        return jax.lax.rem(slot0 + blocks, halves), (cur.active & next_active).astype(jnp.int32)

    jax.lax.fori_loop(seq_lo, seq_hi, seq_step, (jnp.int32(0), jnp.int32(0)))
