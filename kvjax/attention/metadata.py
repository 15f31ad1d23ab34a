"""`AttentionMetadata`: where one ragged batch's tokens live in the cache, as typed fields.

A batch is ``T`` tokens (padded to a bucket) of up to ``S`` sequence rows (padded to the step's
fixed row count). Every field is an int32 array: numpy on the host (``MetadataBuilder`` packs
them there), device arrays inside a jitted step (the jitted call copies them). The metadata is a
pytree, so it passes through ``jax.jit`` as an argument; the kind-specific parts are ``None``
when the cache has no such kind (``None`` is an empty subtree: a step compiled for an MHA model
carries nothing for them).

Parts, one per kind of pool beyond full attention:

* ``SWAMetadata`` (field ``swa``): a hybrid sliding-window pool's own slots and page table for
  the sliding layers (the full layers use the common ``out_loc`` / ``page_indices``).
* ``StateMetadata`` (field ``state``): the recurrent-state slots of the sequence rows.

Each part class names its field in ``AttentionMetadata`` (``FIELD``), so a producer (a serving
extension's ``step_metadata`` hook) returns a part and the builder places it without a branch on
the kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

__all__ = ["AttentionMetadata", "KindMetadata", "SWAMetadata", "StateMetadata", "trace_metadata"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SWAMetadata:
    """The sliding layers' inputs of a hybrid sliding-window pool (``pools.swa``).

    Attributes:
        out_loc: int32 ``[T]``: the SWA-pool slot each new token's K/V is written to (0, the
            trash page, for padding tokens).
        page_indices: int32 ``[S, pages_per_seq]``: each row's page table in the SWA pool. Pages
            whose SWA slots were freed (out of the window) and padding rows are 0; the attention
            kernel never reads them (they lie outside every query's window).
    """

    FIELD: ClassVar[str] = "swa"

    out_loc: jax.Array
    page_indices: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateMetadata:
    """The recurrent-state inputs of the sequence rows (``pools.recurrent``).

    Attributes:
        state_slots: int32 ``[S]``: each row's state slot (0, the padding slot, for padding rows).
        has_initial_state: int32 ``[S]``: 1 where the row continues the state in its slot (a
            chunk continuation, a decode step, a checkpoint forked at the match), 0 where its
            sequence starts in this step from zero state.
        track_slots: int32 ``[S]``: where the state after the row's ``track_at``-th token of this
            step is also written (a ping-pong slot of the extra buffer), 0 when nothing is tracked.
        track_at: int32 ``[S]``: that token's 1-based index within the row's tokens of this step;
            0 when nothing is tracked (the row then writes its zero track state to slot 0).
    """

    FIELD: ClassVar[str] = "state"

    state_slots: jax.Array
    has_initial_state: jax.Array
    track_slots: jax.Array
    track_at: jax.Array


KindMetadata = SWAMetadata | StateMetadata
"""A kind-specific part of ``AttentionMetadata`` (placed at its class's ``FIELD``)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a ragged batch's tokens live: ``T`` tokens (padded), ``S`` sequence rows (padded).

    Invariants: sequence ``s`` owns tokens ``cu_q_lens[s]:cu_q_lens[s + 1]``, which sit at
    positions ``kv_lens[s] - q_len(s) ... kv_lens[s] - 1`` of its sequence; rows
    ``num_seqs[0]:`` are padding (``kv_lens`` 0, page table 0, ``cu_q_lens`` constant); tokens
    past ``cu_q_lens[num_seqs[0]]`` are padding (position 0, slot 0: the trash page).

    Attributes:
        positions: int32 ``[T]``: position of each token in its sequence (0 for padding).
        out_loc: int32 ``[T]``: the full-attention KV slot each token's K/V is written to (0 for
            padding). A slot is ``page * page_size + offset``.
        kv_lens: int32 ``[S]``: KV length of each row including this batch's tokens (0 for padding).
        page_indices: int32 ``[S, pages_per_seq]``: each row's page table in the full-attention
            pool (page ids; 0 beyond the row's pages and in padding rows).
        cu_q_lens: int32 ``[S + 1]``: token offsets of the rows in the batch.
        num_seqs: int32 ``[1]``: live rows.
        logits_indices: int32 ``[S]``: index of each row's last token (0 for padding rows).
        swa: the sliding layers' slots and page table of a hybrid sliding-window pool, or None.
        state: the rows' recurrent-state slots, or None.
    """

    positions: jax.Array
    out_loc: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    swa: SWAMetadata | None = None
    state: StateMetadata | None = None

    def with_parts(self, *parts: KindMetadata | None) -> AttentionMetadata:
        """A copy with each kind part placed at its field (``None`` parts are skipped)."""
        changes: dict[str, Any] = {part.FIELD: part for part in parts if part is not None}
        return dataclasses.replace(self, **changes) if changes else self

    def as_device_arrays(self) -> AttentionMetadata:
        """The metadata with every leaf a ``jax.Array`` (a no-op inside a jitted step, where they are
        already; outside one, numpy leaves from the host builder are copied to the device)."""
        return jax.tree.map(jnp.asarray, self)

    def require_swa(self) -> SWAMetadata:
        """The SWA part (``ValueError`` naming what produces it when absent)."""
        if self.swa is None:
            raise ValueError(
                "a sliding layer of a hybrid SWA pool needs AttentionMetadata.swa (its own slots and page "
                "table); build the metadata with an SWAMetadata part (the SWA serving extension's step_metadata)"
            )
        return self.swa

    def require_state(self) -> StateMetadata:
        """The recurrent-state part (``ValueError`` naming what produces it when absent)."""
        if self.state is None:
            raise ValueError(
                "a recurrent layer needs AttentionMetadata.state (the rows' state slots); build the metadata "
                "with a StateMetadata part (the recurrent-state serving extension's step_metadata)"
            )
        return self.state


def trace_metadata(*parts: KindMetadata | None) -> AttentionMetadata:
    """The metadata of one padding token in one row over one page (for tracing a model's weights),
    with the given kind parts."""
    meta = AttentionMetadata(
        positions=jnp.zeros((1,), jnp.int32),
        out_loc=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        page_indices=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
    )
    return meta.with_parts(*parts)
