"""The jitted serving step: one forward of a ragged batch with the pools donated, greedy sampling.

``make_step(spec)`` returns ``step(pools, params, tokens, meta) -> (pools, next_tokens)``. The pools
are donated, so every KV write happens in place; the only value the host reads back is
``next_tokens`` (one int32 per sequence row).

``pack_batch`` turns host-side per-sequence facts into fixed-shape device inputs: tokens padded
to a power-of-two bucket (so the step compiles a handful of times), sequence rows padded to a fixed
``max_seqs``, the page table padded to a fixed width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.pools import CachePools
from kvjax.serve.model import BatchMetadata, TinyTransformer
from kvjax.spec import ModelSpec

MIN_TOKEN_BUCKET = 8

StepFn = Callable[[CachePools, dict, jax.Array, BatchMetadata], tuple[CachePools, jax.Array]]


@functools.cache
def make_step(spec: ModelSpec) -> StepFn:
    """The model's forward plus greedy sampling, jitted with the pools donated.

    Cached per spec, so schedulers of the same model share compiled code.
    """
    model = TinyTransformer(spec)

    def step(pools: CachePools, params: dict, tokens: jax.Array, meta: BatchMetadata) -> tuple[CachePools, jax.Array]:
        logits, kv = model.apply({"params": params}, tokens, pools.kv, meta)
        return pools.replace(kv=kv), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.jit(step, donate_argnums=0)


def token_bucket(n: int) -> int:
    """Padded token count: the next power of two, at least ``MIN_TOKEN_BUCKET``."""
    return max(MIN_TOKEN_BUCKET, 1 << max(0, n - 1).bit_length())


def pack_batch(
    *,
    tokens: Sequence[np.ndarray],
    starts: Sequence[int],
    slots: np.ndarray,
    page_table: np.ndarray,
    max_seqs: int,
) -> tuple[jax.Array, BatchMetadata]:
    """Device inputs for sequences whose new tokens are ``tokens[i]`` at positions ``starts[i]...``.

    ``slots`` are the KV slots of all new tokens, concatenated in sequence order; ``page_table`` is
    ``[len(tokens), pages_per_seq]`` (page ids, 0-padded). Returns ``(tokens [T], metadata)``.
    """
    n_seqs = len(tokens)
    if n_seqs > max_seqs:
        raise ValueError(f"{n_seqs} sequences in one batch; the step is compiled for at most {max_seqs}")
    q_lens = np.array([len(t) for t in tokens], np.int32)
    total = int(q_lens.sum())
    size = token_bucket(total)
    flat = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    out_loc = np.zeros(size, np.int32)  # padding writes to slot 0: the trash page
    if total:
        flat[:total] = np.concatenate(tokens)
        positions[:total] = np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, q_lens)])
        out_loc[:total] = slots
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : n_seqs + 1] = np.cumsum(q_lens)
    cu[n_seqs + 1 :] = total
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[:n_seqs] = np.asarray(starts, np.int32) + q_lens
    table = np.zeros((max_seqs, page_table.shape[1]), np.int32)
    table[:n_seqs] = page_table
    logits_idx = np.zeros(max_seqs, np.int32)
    logits_idx[:n_seqs] = cu[1 : n_seqs + 1] - 1
    meta = BatchMetadata(
        positions=jnp.asarray(positions),
        out_loc=jnp.asarray(out_loc),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([n_seqs], jnp.int32),
        logits_indices=jnp.asarray(logits_idx),
    )
    return jnp.asarray(flat), meta
