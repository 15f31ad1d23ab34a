"""Overlap scheduling of speculative rounds (SGLang's spec v2 overlap, kvjax's way): round
``N + 1`` is launched before the host reads round ``N``'s result.

What round ``N + 1`` needs from round ``N`` stays on the device. The host builds round ``N + 1``'s
inputs at each request's *host-known* committed length ``L`` (the start of round ``N``, the last
length the host settled) and gives the step, per request, the row of round ``N``'s output that
continues it (``src``; ``-1``: the request was not in round ``N``, its first token is the host's).
``chain_round_inputs`` (jitted, run right before the round) then computes on the device, from
round ``N``'s proposals and greedy tokens:

* the request's accepted count ``a`` (``acceptance.accepted_lengths``' rule) and its first token,
  round ``N``'s last kept token ``g_a``;
* its offset ``delta = a + 1``: the round starts at ``L + delta``. ``room`` (the host's, one less
  than the tokens the request may still generate) bounds it: a request with ``a + 1 > room`` is
  finished by round ``N`` at ``max_new_tokens`` (a continuing request always has ``a + 1 <=
  room``); its row stays at offset 0 and writes nothing but the trash page (slot 0, where padding
  writes), so it neither reaches past its last round's positions nor overwrites the KV round
  ``N`` committed;

and shifts the round's metadata by it: every live token's position and its row's KV length move
by ``delta``, and the slot a token writes (``out_loc``) is read from the row's page table at the
new position (``page * page_size + offset``). The page table given to the step covers each row's
*allocated* pages: the host keeps every running request allocated up to its host-known length
plus ``2 (k + 1)`` (SGLang's double reserve, ``allocation_sizing.get_alloc_reserve_per_decode``),
capped at its last round's positions, so whatever round ``N`` accepted, round ``N + 1``'s slots
are in the row (``DraftDecoding`` keeps the allocation; ``rollback`` frees only what the round in
flight cannot use).

A hybrid sliding-window pool's own inputs (``SWAMetadata``) move with them: its slots are read
from the row's SWA page table at the new positions (a full slot's page and its SWA page are paired
page for page, offsets kept: ``SWATokenToKVPoolAllocator``), the table built, as the full one, over
the allocated pages. Window freeing before the round frees by the host-known length, which lags
the true one: nothing a query of the round can see is freed.

Invariant: a row with ``src < 0`` is unchanged (offset 0), so a round with no round before it is
exactly the non-overlapped round. Recurrent state is not chained (its rollback replays the kept
tokens on the host's count; ``DraftDecoding`` resolves before those rounds).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.attention import AttentionMetadata

__all__ = ["chain_round_inputs", "device_accepted", "no_previous_round", "shift_metadata"]


def device_accepted(proposals: jax.Array, greedy: jax.Array) -> jax.Array:
    """``acceptance.accepted_lengths`` on the device: int32 ``[B]`` accepted draft tokens per row
    (``proposals [B, k]``, ``greedy [B, k + 1]``; the longest agreeing prefix)."""
    agree = proposals == greedy[:, :-1]
    k = proposals.shape[1]
    return jnp.where(agree.all(axis=1), k, jnp.argmin(agree, axis=1)).astype(jnp.int32)


def shift_metadata(
    meta: AttentionMetadata, delta: jax.Array, page_size: int, trash: jax.Array | None = None
) -> AttentionMetadata:
    """``meta`` with row ``s``'s tokens moved ``delta[s]`` positions on (traced).

    ``delta``: int32 ``[S]`` (0 for padding rows). Each live token's position, its row's KV length
    and its slot (from the row's page table at the new position) move; padding is untouched.
    ``trash``: bool ``[S]``, rows whose tokens write slot 0 (the trash page) instead. Requires the
    page tables (the base one and a sliding-window pool's, ``meta.swa``) to cover the new positions
    and no other kind parts (``state``, ``extra``).
    """
    if meta.state is not None or meta.extra:
        raise ValueError("a chained round's metadata has recurrent or other kind parts; those rounds are not chained")
    t = meta.positions.shape[0]
    rows = meta.page_indices.shape[0]
    index = jnp.arange(t, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(meta.cu_q_lens[1:], index, side="right"), rows - 1)
    live = index < meta.cu_q_lens[meta.num_seqs[0]]
    moved = live & (delta[row] != 0)
    positions = jnp.where(moved, meta.positions + delta[row], meta.positions)
    trashed = None if trash is None else live & trash[row]

    def moved_slots(page_indices: jax.Array, out_loc: jax.Array) -> jax.Array:
        """``out_loc`` with each moved token's slot read from ``page_indices`` at its new position."""
        slots = page_indices[row, positions // page_size] * page_size + positions % page_size
        new = jnp.where(moved, slots, out_loc)
        if trashed is not None:
            new = jnp.where(trashed, 0, new)
        return new.astype(out_loc.dtype)

    swa = meta.swa
    if swa is not None:
        swa = dataclasses.replace(swa, out_loc=moved_slots(swa.page_indices, swa.out_loc))
    live_rows = jnp.arange(rows, dtype=jnp.int32) < meta.num_seqs[0]
    kv_lens = jnp.where(live_rows, meta.kv_lens + delta, meta.kv_lens).astype(meta.kv_lens.dtype)
    return dataclasses.replace(
        meta,
        positions=positions.astype(meta.positions.dtype),
        out_loc=moved_slots(meta.page_indices, meta.out_loc),
        kv_lens=kv_lens,
        swa=swa,
    )


@functools.partial(jax.jit, static_argnames=("page_size",))
def chain_round_inputs(
    prev_proposals: jax.Array,
    prev_greedy: jax.Array,
    src: jax.Array,
    host_first: jax.Array,
    room: jax.Array,
    draft_metas: AttentionMetadata,
    verify_meta: AttentionMetadata,
    *,
    page_size: int,
) -> tuple[jax.Array, AttentionMetadata, AttentionMetadata]:
    """The round's ``(first_tokens [S], draft_metas, verify_meta)`` continued from the round
    before on the device (module docstring).

    Args:
        prev_proposals: int32 ``[B, k]``: the previous round's proposals (its output, on the device).
        prev_greedy: int32 ``[B', k + 1]``: the previous round's greedy tokens.
        src: int32 ``[S]``: each row's row in the previous round's output, or -1.
        host_first: int32 ``[S]``: the first token of rows with ``src < 0`` (the host's last output id).
        room: int32 ``[S]``: the largest offset of a continued row that goes on (module docstring).
        draft_metas: ``proposer.draft_metadata``'s ``k + 1`` stacked steps, built at the host-known lengths.
        verify_meta: ``verifier.verify_metadata``'s, likewise.
        page_size: the pools' page size.
    """
    m = min(prev_proposals.shape[0], prev_greedy.shape[0])
    accepted = device_accepted(prev_proposals[:m], prev_greedy[:m])
    has = src >= 0
    at = jnp.clip(src, 0, m - 1)
    a = accepted[at]
    finished = has & (a + 1 > room)  # round N ends it at max_new_tokens: its row writes the trash page
    delta = jnp.where(has & ~finished, a + 1, 0).astype(jnp.int32)
    first = jnp.where(has, prev_greedy[at, a], host_first).astype(jnp.int32)
    draft_metas = jax.vmap(lambda meta: shift_metadata(meta, delta, page_size, finished))(draft_metas)
    return first, draft_metas, shift_metadata(verify_meta, delta, page_size, finished)


def no_previous_round(max_seqs: int, k: int) -> tuple[Any, Any]:
    """Zero ``(proposals [max_seqs, k], greedy [max_seqs, k + 1])`` for a round with none before it."""
    return jnp.zeros((max_seqs, k), jnp.int32), jnp.zeros((max_seqs, k + 1), jnp.int32)
