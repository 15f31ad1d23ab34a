"""The verifier: one target forward over each request's ``k + 1`` round tokens, greedy at every
position.

The round's tokens of a request are ``[t, d_1, .., d_k]`` at positions ``L .. L + k`` (``t``: its
last token, ``d``: the draft's proposals). The target extends over them (writing its KV at the
round's slots, as a chunked prefill would) and returns its greedy token after each:
``g_0 .. g_k`` (``kvjax.serve.speculative.acceptance``). The serving model returns logits at
``meta.logits_indices`` only, so the verify metadata lists every token of every live row there
(``[S * (k + 1)]``, row-major; padding rows point at token 0 and are never read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttentionMetadata, MetadataBuilder, MetadataPart
from kvjax.pools import CachePools

__all__ = ["round_tokens", "verify", "verify_metadata"]


def verify_metadata(
    builder: MetadataBuilder,
    kv_len: np.ndarray,
    rows: np.ndarray,
    slots: np.ndarray,
    max_seqs: int,
    parts: Sequence[MetadataPart | None] = (),
    page_table: np.ndarray | None = None,
) -> tuple[int, AttentionMetadata]:
    """``(token bucket, metadata)`` of the verify forward (numpy).

    Args:
        builder: the scheduler's metadata builder.
        kv_len: int ``[n]``: committed KV lengths ``L``.
        rows: int ``[n]``: request-table rows.
        slots: int ``[n, k + 1]``: the slots of positions ``L .. L + k``.
        max_seqs: the step's padded row count ``S``.
        parts: the serving extensions' parts for this batch (a sliding-window cache's
            ``SWAMetadata``), as a prefill chunk of ``k + 1`` tokens per row gets them.
        page_table: the rows' table as ``proposer.draft_metadata`` takes it, or None (built here).
    """
    n, width = slots.shape
    dummy = [np.zeros(width, np.int32)] * n
    flat, meta = builder.build(
        tokens=dummy,
        starts=kv_len,
        slots=slots.reshape(-1),
        rows=rows,
        seq_lens=kv_len + width,
        parts=parts,
        page_table=page_table,
    )
    every = np.zeros(max_seqs * width, np.int32)
    every[: n * width] = np.arange(n * width, dtype=np.int32)  # rows are uniform: row s starts at s * width
    # numpy like every packed field (the jitted call copies it to the device)
    return int(flat.shape[0]), dataclasses.replace(meta, logits_indices=every)  # type: ignore[arg-type]


def round_tokens(first_tokens: jax.Array, proposals: jax.Array, token_width: int) -> jax.Array:
    """The verify forward's flat tokens ``[token_width]``: row ``s``'s ``[t, d_1, .., d_k]`` at
    ``s * (k + 1)`` (``first_tokens [S]``, ``proposals [k, S]``)."""
    rows = jnp.concatenate([first_tokens[:, None], proposals.T], axis=1).reshape(-1).astype(jnp.int32)
    n = min(token_width, rows.shape[0])
    return jnp.zeros((token_width,), jnp.int32).at[:n].set(rows[:n])


def verify(
    module: Any, params: Any, pools: CachePools, tokens: jax.Array, meta: AttentionMetadata, width: int
) -> tuple[CachePools, jax.Array, jax.Array]:
    """The target's forward over the round (traced inside a jitted step): ``(pools, greedy int32
    [S, width], logits float32 [S, width, vocab])``, ``width = k + 1``."""
    logits, pools = module.apply({"params": params}, tokens, pools, meta)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return pools, greedy.reshape(-1, width), logits.reshape(-1, width, logits.shape[-1])
