"""`MetadataBuilder`: a batch's ``AttentionMetadata`` from what the tree, allocator and request table
return, with fixed shapes, on the host.

Inputs per sequence (in batch order): its new tokens, the KV length before them (``starts``:
the prefix the tree matched plus what earlier steps computed), the KV slots the allocator gave
the new tokens (``slots``, concatenated), its request-table row and its KV length after them.
The page tables come from the request table (``PageTables``); kind-specific parts (an SWA page
table, recurrent-state slots) come from their producers and are placed by type.

Shapes are fixed per step so the jitted step compiles a handful of times: tokens are padded to a
power-of-two bucket (``token_bucket``), rows to ``max_seqs``, page tables to ``pages_per_seq``
columns. The arrays stay numpy: the jitted call copies them to the device inside its C++
dispatch (a few microseconds each, about 40 us for the nine arrays of a decode step on CPU),
far less than one ``jnp.asarray`` per array (measured ~1 ms per step for seven arrays on a
loaded 2-core CPU). Packing is vectorised: no Python loop over the sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.attention.metadata import AttentionMetadata, MetadataPart, SWAMetadata, place_parts
from kvjax.attention.page_table import PageTables, SlotTranslation
from kvjax.errors import InvalidSlotError

__all__ = ["MIN_TOKEN_BUCKET", "MetadataBuilder", "build_attention_metadata", "swa_metadata", "token_bucket"]

MIN_TOKEN_BUCKET = 8


def token_bucket(n: int) -> int:
    """Padded token count of ``n`` tokens: the next power of two, at least ``MIN_TOKEN_BUCKET``."""
    return max(MIN_TOKEN_BUCKET, 1 << max(0, n - 1).bit_length())


def build_attention_metadata(
    *,
    tokens: Sequence[np.ndarray] | np.ndarray,
    starts: Sequence[int] | np.ndarray,
    slots: np.ndarray,
    page_table: np.ndarray,
    max_seqs: int,
    parts: Sequence[MetadataPart | None] = (),
) -> tuple[np.ndarray, AttentionMetadata]:
    """Step inputs for sequences whose new tokens are ``tokens[i]`` at positions ``starts[i]...``.

    Args:
        tokens: one int array per sequence, or (a decode batch) one flat int array with one
            token per sequence.
        starts: int ``[n]``: each sequence's KV length before its new tokens.
        slots: int ``[total new tokens]``: the new tokens' KV slots, concatenated in sequence order.
        page_table: int32 ``[n, pages_per_seq]`` or ``[max_seqs, pages_per_seq]`` (rows ``n:``
            zero) page ids, 0-padded.
        max_seqs: the step's padded row count.
        parts: kind-specific metadata (already padded to the step's shapes), placed at their
            fields; None entries are skipped.

    Returns:
        ``(tokens [T] int32, metadata)``, numpy arrays, ``T = token_bucket(total new tokens)``.

    Raises:
        ValueError: more sequences than ``max_seqs``, or two parts for the same field.
    """
    n_seqs = len(tokens)
    if n_seqs > max_seqs:
        raise ValueError(f"{n_seqs} sequences in one batch; the step is compiled for at most {max_seqs}")
    starts_arr = np.asarray(starts, np.int32)
    decode = isinstance(tokens, np.ndarray)  # one token per sequence, at its start
    if decode:
        total = n_seqs
    else:
        q_lens = np.fromiter((len(t) for t in tokens), np.int32, n_seqs)
        total = int(q_lens.sum())
    size = token_bucket(total)
    flat = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    out_loc = np.zeros(size, np.int32)  # padding writes to slot 0: the trash page
    out_loc[:total] = slots
    kv_lens = np.zeros(max_seqs, np.int32)
    logits_idx = np.zeros(max_seqs, np.int32)
    if decode:
        # Row s owns token s: cu_q_lens is 0..n then n, and each row's last token is itself.
        # (The step's hot path: fewer numpy calls than the general case below.)
        cu = np.minimum(np.arange(max_seqs + 1, dtype=np.int32), n_seqs)
        flat[:total] = tokens
        positions[:total] = starts_arr
        kv_lens[:n_seqs] = starts_arr + 1
        logits_idx[:n_seqs] = cu[:n_seqs]
    else:
        cu = np.zeros(max_seqs + 1, np.int32)
        np.cumsum(q_lens, out=cu[1 : n_seqs + 1])
        cu[n_seqs + 1 :] = total
        if total:
            flat[:total] = np.concatenate(tokens)
            # position of token i of sequence s = starts[s] + (i - cu[s])
            seq_of = np.repeat(np.arange(n_seqs), q_lens)
            positions[:total] = np.arange(total, dtype=np.int32) - cu[seq_of] + starts_arr[seq_of]
        kv_lens[:n_seqs] = starts_arr + q_lens
        logits_idx[:n_seqs] = cu[1 : n_seqs + 1] - 1
    if page_table.shape[0] == max_seqs and page_table.dtype == np.int32:
        table = page_table
    else:
        table = np.zeros((max_seqs, page_table.shape[1]), np.int32)
        table[:n_seqs] = page_table
    fields, extra = place_parts(parts) if parts else ({}, {})
    # numpy leaves on the host (the field types are what the jitted step sees: device arrays)
    make_meta: Any = AttentionMetadata
    meta: AttentionMetadata = make_meta(
        positions=positions,
        out_loc=out_loc,
        kv_lens=kv_lens,
        page_indices=table,
        cu_q_lens=cu,
        num_seqs=np.array([n_seqs], np.int32),
        logits_indices=logits_idx,
        extra=extra,
        **fields,
    )
    return flat, meta


class MetadataBuilder:
    """Builds each step's ``AttentionMetadata`` for one request table and one step shape.

    Args:
        req_to_token_pool: the request table the batch's rows index (``req_to_token``,
            ``max_context_len``).
        page_size: tokens per page of the full-attention pool.
        max_seqs: the step's padded row count.
        num_slots: the full-attention pool's slot count (``(pages + 1) * page_size``, the trash
            page included), or None. When given, :meth:`build` validates on the host what a
            jitted step cannot report (``InvalidSlotError`` naming the value, nothing built): the
            batch's slots lie in ``[page_size, num_slots)`` (the allocator's, never the trash
            page), the rows exist, and each row of the request table holds its sequence's new
            slots at ``[start, seq_len)`` (the table the page table is read from). The scheduler
            leaves it None; :meth:`for_cache` sets it.

    Attributes:
        page_tables: the request table's ``PageTables`` (also used for other pools' tables,
            through a slot translation: ``swa_metadata``).
    """

    def __init__(self, req_to_token_pool: Any, page_size: int, max_seqs: int, *, num_slots: int | None = None) -> None:
        self.page_tables = PageTables(req_to_token_pool, page_size)
        self.max_seqs = int(max_seqs)
        self.num_slots = None if num_slots is None else int(num_slots)

    @classmethod
    def for_cache(cls, cache: Any, max_seqs: int) -> MetadataBuilder:
        """A validating builder over a built ``KVCache``'s request table and allocator."""
        alloc = cache.token_to_kv_pool_allocator
        page_size = int(alloc.page_size)
        full_slots = int(getattr(alloc, "size_full", alloc.size))  # a hybrid allocator's full side
        return cls(cache.req_to_token_pool, page_size, max_seqs, num_slots=full_slots + page_size)

    @property
    def pages_per_seq(self) -> int:
        """Columns of every page table."""
        return self.page_tables.pages_per_seq

    def build(
        self,
        *,
        tokens: Sequence[np.ndarray] | np.ndarray,
        starts: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        parts: Sequence[MetadataPart | None] = (),
        page_table: np.ndarray | None = None,
    ) -> tuple[np.ndarray, AttentionMetadata]:
        """The batch's ``(tokens [T], metadata)`` (see ``build_attention_metadata``).

        Args:
            tokens: new tokens per sequence (or one per sequence, flat, for a decode batch).
            starts: int ``[n]``: KV length before the new tokens.
            slots: int ``[total new tokens]``: their KV slots, concatenated.
            rows: int ``[n]``: the sequences' request-table rows (already holding ``slots``).
            seq_lens: int ``[n]``: KV length after the new tokens.
            parts: kind-specific parts from their producers.
            page_table: int32 ``[max_seqs, pages_per_seq]``: the rows' table at ``seq_lens``, when
                the caller kept it from a step whose rows held the same pages (a decode step in
                which no request starts a page); used as it is, never written. None: built here.
        """
        if len(rows) > self.max_seqs:
            raise ValueError(f"{len(rows)} sequences in one batch; the step is compiled for at most {self.max_seqs}")
        if self.num_slots is not None:
            self._validate(starts, slots, rows, seq_lens)
        if page_table is not None:
            if page_table.shape != (self.max_seqs, self.pages_per_seq) or page_table.dtype != np.int32:
                raise ValueError(
                    f"page_table has shape {page_table.shape} and dtype {page_table.dtype}; a kept table is int32 "
                    f"[{self.max_seqs}, {self.pages_per_seq}] (max_seqs, pages_per_seq): pass None to build it"
                )
            table = page_table
        else:
            table = self.page_tables.build(rows, seq_lens, self.max_seqs)
        return build_attention_metadata(
            tokens=tokens, starts=starts, slots=slots, page_table=table, max_seqs=self.max_seqs, parts=parts
        )

    def _validate(self, starts: np.ndarray, slots: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray) -> None:
        """The host checks of ``num_slots`` (class docstring); raises ``InvalidSlotError``."""
        assert self.num_slots is not None
        starts, seq_lens = np.asarray(starts, np.int64), np.asarray(seq_lens, np.int64)
        rows, slots = np.asarray(rows, np.int64), np.asarray(slots)
        if slots.dtype.kind not in "iu":
            raise InvalidSlotError(f"slots must be integer slot ids, got dtype {slots.dtype}")
        new = seq_lens - starts
        if (new < 0).any() or slots.size != int(new.sum()):
            raise InvalidSlotError(
                f"{slots.size} slots for {new.tolist()} new tokens (seq_lens - starts): give one slot per new token"
            )
        page_size = self.page_tables.page_size
        outside = (slots < page_size) | (slots >= self.num_slots)
        if outside.any():
            raise InvalidSlotError(
                f"slot ids {slots[outside][:8].tolist()} are outside [{page_size}, {self.num_slots}) (page 0 is "
                "the trash page): pass slots the cache's allocator handed out"
            )
        table = self.page_tables.rows.req_to_token
        bad_rows = (rows < 0) | (rows >= table.shape[0])
        if bad_rows.any():
            raise InvalidSlotError(f"rows {rows[bad_rows].tolist()} are not rows of the request table")
        offsets = np.concatenate([[0], np.cumsum(new)])
        for i, (row, start, end) in enumerate(zip(rows.tolist(), starts.tolist(), seq_lens.tolist(), strict=True)):
            if not np.array_equal(table[row, start:end], slots[offsets[i] : offsets[i + 1]]):
                raise InvalidSlotError(
                    f"request-table row {row} does not hold sequence {i}'s slots at [{start}, {end}): write them "
                    "first (req_to_token_pool.write(row, start, slots)); the page table is read from the row"
                )


def swa_metadata(
    page_tables: PageTables,
    *,
    rows: np.ndarray,
    seq_lens: np.ndarray,
    slots: np.ndarray,
    max_seqs: int,
    translate: SlotTranslation,
) -> SWAMetadata:
    """The ``SWAMetadata`` of a batch: the new tokens' slots and the rows' page tables, translated
    into the sliding-window pool (``translate``: request-table slots -> SWA slots; 0 where the
    window has passed). ``slots``: the new tokens' request-table slots, concatenated."""
    total = int(slots.shape[0])
    out_loc = np.zeros(token_bucket(total), np.int32)
    out_loc[:total] = translate(slots)
    make_part: Any = SWAMetadata  # numpy leaves on the host (device arrays inside the step)
    part: SWAMetadata = make_part(out_loc=out_loc, page_indices=page_tables.build(rows, seq_lens, max_seqs, translate))
    return part
