"""The metadata builder: page tables as the request table says (page sizes 1 and 16), padding rows
and tokens zero, the SWA pool's translated slots and pages, kind parts placed by type."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np
import pytest

from kvjax.attention import (
    AttentionMetadata,
    MetadataBuilder,
    PageTables,
    StateMetadata,
    SWAMetadata,
    build_attention_metadata,
    swa_metadata,
    token_bucket,
    trace_metadata,
)
from kvjax.req_pool import ReqToTokenPool

MAX_SEQS = 4
CONTEXT = 64


def _table_with_requests(page_size: int, lens: list[int]) -> tuple[ReqToTokenPool, np.ndarray]:
    """A request table whose rows hold ``lens`` tokens each, every request on its own pages
    (page ids from 1, in a shuffled order so a wrong column shows)."""
    pool = ReqToTokenPool(8, CONTEXT)
    rows = np.asarray(pool.alloc(len(lens)), np.int64)
    rng = np.random.default_rng(page_size)
    pages = rng.permutation(np.arange(1, 1 + sum(-(-n // page_size) for n in lens)))
    used = 0
    for row, n in zip(rows.tolist(), lens, strict=True):
        k = -(-n // page_size)
        own = pages[used : used + k]
        used += k
        slots = (own[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)[:n]
        pool.write(row, 0, slots.astype(np.int32))
    return pool, rows


def _expected_table(pool: ReqToTokenPool, rows: np.ndarray, lens: np.ndarray, page_size: int) -> np.ndarray:
    """The page table as the request table's own host helper computes it, padded to MAX_SEQS rows."""
    width = -(-CONTEXT // page_size)
    table = np.zeros((MAX_SEQS, width), np.int32)
    table[: len(rows)] = pool.page_table_numpy(rows, lens, page_size, width)
    return table


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_tables_match_the_request_table(page_size):
    lens = [5, 33, 17]
    pool, rows = _table_with_requests(page_size, lens)
    seq_lens = np.asarray(lens)
    builder = MetadataBuilder(pool, page_size, MAX_SEQS)
    assert builder.pages_per_seq == -(-CONTEXT // page_size)
    starts = seq_lens - np.array([5, 1, 3])  # a prefill of 5, a decode, a chunk of 3
    slots = np.concatenate([pool.req_to_token[r, s:e] for r, s, e in zip(rows, starts, seq_lens, strict=True)])
    tokens = [np.arange(int(e - s), dtype=np.int32) + 1 for s, e in zip(starts, seq_lens, strict=True)]
    flat, meta = builder.build(tokens=tokens, starts=starts, slots=slots, rows=rows, seq_lens=seq_lens)

    np.testing.assert_array_equal(meta.page_indices, _expected_table(pool, rows, seq_lens, page_size))
    assert meta.page_indices.dtype == np.int32 and not meta.page_indices[len(lens) :].any()
    total = int((seq_lens - starts).sum())
    assert flat.shape == (token_bucket(total),) and not flat[total:].any()
    np.testing.assert_array_equal(meta.out_loc[:total], slots)
    assert not meta.out_loc[total:].any() and not meta.positions[total:].any()
    np.testing.assert_array_equal(
        meta.positions[:total], np.concatenate([np.arange(s, e) for s, e in zip(starts, seq_lens, strict=True)])
    )
    np.testing.assert_array_equal(meta.kv_lens, [*lens, 0])
    np.testing.assert_array_equal(meta.cu_q_lens, [0, 5, 6, 9, 9])
    np.testing.assert_array_equal(meta.logits_indices, [4, 5, 8, 0])
    np.testing.assert_array_equal(meta.num_seqs, [3])
    assert meta.swa is None and meta.state is None


def test_decode_batch_packs_one_token_per_row():
    pool, rows = _table_with_requests(16, [9, 20])
    seq_lens = np.array([9, 20])
    slots = pool.req_to_token[rows, seq_lens - 1]
    flat, meta = MetadataBuilder(pool, 16, MAX_SEQS).build(
        tokens=np.array([7, 8]), starts=seq_lens - 1, slots=slots, rows=rows, seq_lens=seq_lens
    )
    np.testing.assert_array_equal(flat[:2], [7, 8])
    np.testing.assert_array_equal(meta.positions[:2], [8, 19])
    np.testing.assert_array_equal(meta.logits_indices, [0, 1, 0, 0])


@pytest.mark.parametrize("page_size", [1, 16])
def test_swa_translation_gives_the_swa_pools_slots_and_pages(page_size):
    lens = [20, 7]
    pool, rows = _table_with_requests(page_size, lens)
    seq_lens = np.asarray(lens)
    num_slots = int(pool.req_to_token.max()) + page_size
    # A full->SWA mapping: page p -> page p + 3 (offset kept); slots below 2 pages out of the window (0).
    mapping = np.arange(num_slots, dtype=np.int32) + 3 * page_size
    mapping[: 2 * page_size] = 0
    slots = np.concatenate([pool.req_to_token[r, e - 1 : e] for r, e in zip(rows, seq_lens, strict=True)])
    part = swa_metadata(
        PageTables(pool, page_size),
        rows=rows,
        seq_lens=seq_lens,
        slots=slots,
        max_seqs=MAX_SEQS,
        translate=lambda s: mapping[s],
    )
    assert isinstance(part, SWAMetadata)
    np.testing.assert_array_equal(part.out_loc[:2], mapping[slots])
    assert part.out_loc.shape == (token_bucket(2),) and not part.out_loc[2:].any()
    full = _expected_table(pool, rows, seq_lens, page_size)
    live = full > 0
    want = np.where(live, mapping[full * page_size] // page_size, 0)
    np.testing.assert_array_equal(part.page_indices, want)
    assert not part.page_indices[len(lens) :].any()


def test_kind_parts_are_placed_by_type():
    pool, rows = _table_with_requests(1, [3])
    zeros = np.zeros(MAX_SEQS, np.int32)
    state = StateMetadata(state_slots=zeros + 1, has_initial_state=zeros, track_slots=zeros, track_at=zeros)
    swa = SWAMetadata(out_loc=np.zeros(8, np.int32), page_indices=np.zeros((MAX_SEQS, CONTEXT), np.int32))
    builder = MetadataBuilder(pool, 1, MAX_SEQS)
    args = dict(tokens=[np.arange(3)], starts=np.array([0]), slots=pool.req_to_token[rows[0], :3], rows=rows)
    _, meta = builder.build(**args, seq_lens=np.array([3]), parts=[None, state, swa])
    assert meta.state is state and meta.swa is swa
    with pytest.raises(ValueError, match="two StateMetadata parts"):
        builder.build(**args, seq_lens=np.array([3]), parts=[state, state])


def test_bad_batches_are_refused_by_name():
    pool, rows = _table_with_requests(1, [1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="5 sequences in one batch; the step is compiled for at most 4"):
        MetadataBuilder(pool, 1, MAX_SEQS).build(
            tokens=np.ones(5, np.int32), starts=np.zeros(5), slots=np.ones(5), rows=rows, seq_lens=np.ones(5)
        )
    with pytest.raises(ValueError, match="page_size"):
        PageTables(pool, 0)
    meta = AttentionMetadata(*(np.zeros(1, np.int32) for _ in range(7)))
    with pytest.raises(ValueError, match="AttentionMetadata.swa"):
        meta.require_swa()
    with pytest.raises(ValueError, match="AttentionMetadata.state"):
        meta.require_state()


def test_a_kept_page_table_is_used_as_it_is_and_a_wrong_one_refused():
    """A caller that kept the rows' table (a decode step in which no request starts a page) hands
    it in: the metadata reads that very array. One of another shape or dtype is refused by name."""
    pool, rows = _table_with_requests(16, [5, 9])
    builder = MetadataBuilder(pool, 16, MAX_SEQS)
    lens = np.array([5, 9])
    batch = dict(tokens=np.ones(2, np.int32), starts=lens - 1, slots=np.array([4, 8]), rows=rows, seq_lens=lens)
    _, built = builder.build(**batch)
    kept = np.asarray(built.page_indices)
    _, meta = builder.build(**batch, page_table=kept)
    assert meta.page_indices is kept
    np.testing.assert_array_equal(kept, _expected_table(pool, rows, lens, 16))
    for wrong in (kept[:2], kept.astype(np.int64)):
        with pytest.raises(ValueError, match=r"a kept table is int32 \[4, 4\].*pass None to build it"):
            builder.build(**batch, page_table=wrong)


def test_build_attention_metadata_pads_an_unpadded_table():
    _, meta = build_attention_metadata(
        tokens=[np.arange(2)], starts=[0], slots=np.array([5, 6]), page_table=np.array([[5, 6]]), max_seqs=3
    )
    np.testing.assert_array_equal(meta.page_indices, [[5, 6], [0, 0], [0, 0]])


@pytest.mark.parametrize("n_seqs", [0, 1, 3, MAX_SEQS])
def test_a_decode_batch_packs_as_one_token_sequences_do(n_seqs):
    """The decode form (one flat token array) takes its own path: it packs exactly what the same
    batch as one-token sequences packs, field by field, dtypes included."""
    rng = np.random.default_rng(n_seqs)
    tokens = rng.integers(0, 100, n_seqs)
    starts = rng.integers(0, 40, n_seqs)
    slots = rng.integers(16, 500, n_seqs).astype(np.int32)
    table = rng.integers(0, 9, (n_seqs, 4)).astype(np.int32)
    common = dict(starts=starts, slots=slots, page_table=table, max_seqs=MAX_SEQS)
    flat, meta = build_attention_metadata(tokens=tokens, **common)
    ref_flat, ref = build_attention_metadata(tokens=[t[None] for t in tokens], **common)
    np.testing.assert_array_equal(flat, ref_flat)
    for field in dataclasses.fields(AttentionMetadata):
        got, want = getattr(meta, field.name), getattr(ref, field.name)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype == np.int32, field.name
            np.testing.assert_array_equal(got, want, err_msg=field.name)
    np.testing.assert_array_equal(meta.cu_q_lens, np.minimum(np.arange(MAX_SEQS + 1), n_seqs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Marks:
    """The metadata part of a kind registered outside kvjax."""

    FIELD: ClassVar[str] = "marks"
    rows: np.ndarray


def test_parts_of_other_kinds_land_in_extra_and_are_read_by_name() -> None:
    part = Marks(rows=np.arange(4, dtype=np.int32))
    meta = trace_metadata(part)
    assert meta.swa is None and meta.state is None and meta.part("marks") is part
    leaves = jax.tree_util.tree_leaves(meta)
    assert any(leaf is part.rows for leaf in leaves)  # the part travels through jit as a pytree
    with pytest.raises(KeyError, match=r"no part 'other' \(parts present: \['marks'\]\)"):
        meta.part("other")
    with pytest.raises(ValueError, match="two Marks parts for AttentionMetadata field 'marks'"):
        trace_metadata(part, part)
    with pytest.raises(ValueError, match="give its class a FIELD"):
        trace_metadata(object())  # type: ignore[arg-type]
