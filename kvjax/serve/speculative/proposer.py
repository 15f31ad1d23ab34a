"""The proposer: the draft model decodes ``k + 1`` steps on its own pool, proposing ``k`` tokens.

Step ``j`` (``0 .. k``) of a request whose committed KV length is ``L`` feeds the token at
position ``L + j`` (its last token for ``j = 0``, then the draft's own previous proposal) and
writes its draft KV at that position's slot; it proposes ``d_{j+1}``. The last step's proposal is
dropped: it runs so that the draft writes every position the target's verification writes
(``L .. L + k``), so after acceptance the draft's KV is valid wherever the target's is (the draft
never lags: nothing to catch up at the next round, and the tree can cache and share any committed
prefix for both models).

Host side, ``draft_metadata`` packs the ``k + 1`` decode steps' ``AttentionMetadata`` (the slots
of every position are allocated before the round, so each step's page table is the row's); device
side, ``propose`` runs them in one ``lax.scan`` inside the round's jitted step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttentionMetadata, MetadataBuilder
from kvjax.pools import CachePools
from kvjax.serve.speculative.draft_view import draft_view, with_draft

__all__ = ["draft_metadata", "place_row_tokens", "propose"]


def draft_metadata(
    builder: MetadataBuilder,
    kv_len: np.ndarray,
    rows: np.ndarray,
    slots: np.ndarray,
    steps: int,
    page_table: np.ndarray | None = None,
) -> AttentionMetadata:
    """The ``steps`` decode steps' metadata, stacked on a leading axis (numpy; the steps' token
    bucket is ``positions.shape[1]``).

    Args:
        builder: the scheduler's metadata builder (its request table holds every slot already).
        kv_len: int ``[n]``: committed KV lengths ``L`` before the round.
        rows: int ``[n]``: request-table rows.
        slots: int ``[n, steps]``: the slots of positions ``L .. L + steps - 1``.
        steps: ``k + 1``.
        page_table: int32 ``[max_seqs, pages_per_seq]``: the rows' table for every step, or None
            (each step's built at its length). Overlap (``overlap``): the table of the rows'
            allocated pages, so the device can move the round past the host-known lengths.
    """
    metas = []
    zeros = np.zeros(len(kv_len), np.int32)
    for j in range(steps):
        _, meta = builder.build(
            tokens=zeros,
            starts=kv_len + j,
            slots=slots[:, j],
            rows=rows,
            seq_lens=kv_len + j + 1,
            page_table=page_table,
        )
        metas.append(meta)
    return jax.tree.map(lambda *leaves: np.stack(leaves), *metas)


def place_row_tokens(row_tokens: jax.Array, width: int) -> jax.Array:
    """A decode batch's flat tokens ``[width]`` (token ``i`` is row ``i``'s) from one per row."""
    n = min(width, row_tokens.shape[0])
    return jnp.zeros((width,), jnp.int32).at[:n].set(row_tokens[:n].astype(jnp.int32))


def propose(
    module: Any,
    params: Any,
    pools: CachePools,
    first_tokens: jax.Array,
    metas: AttentionMetadata,
    token_width: int,
) -> tuple[CachePools, jax.Array]:
    """Run the draft's decode steps (traced inside a jitted step).

    Args:
        module: the draft's flax module; ``params`` its weights.
        pools: the cache's pools (the draft writes ``"kv_draft"`` only).
        first_tokens: int32 ``[S]``: each row's last token (position ``L``).
        metas: ``draft_metadata``'s stacked metadata (``k + 1`` steps).
        token_width: the steps' token bucket (the flat token count of one step).

    Returns:
        ``(pools, proposals)``: int32 ``[k + 1, S]``: row ``j`` is every request's ``d_{j+1}``.
    """

    def step(carry: tuple[Any, jax.Array], meta: AttentionMetadata) -> tuple[tuple[Any, jax.Array], jax.Array]:
        draft_pool, tokens = carry
        logits, new = module.apply({"params": params}, tokens, CachePools(kv=draft_pool), meta)
        proposed = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (new["kv"], place_row_tokens(proposed, token_width)), proposed

    start = (draft_view(pools)["kv"], place_row_tokens(first_tokens, token_width))
    (draft_pool, _), proposals = jax.lax.scan(step, start, metas)
    return with_draft(pools, draft_pool), proposals
