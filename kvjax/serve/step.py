"""The jitted serving step: one forward of a ragged batch with the pools donated, greedy sampling.

``make_step(model)`` returns ``step(pools, params, tokens, meta) -> (pools, next_tokens)``; with
``with_logits=True`` it returns ``(pools, next_tokens, logits)`` (``[S, vocab]`` float32). The
pools are donated, so every KV write happens in place; the host reads back ``next_tokens`` (one
int32 per sequence row) and, only when asked, the logits.

Future tokens (overlap scheduling): ``step(pools, params, tokens, meta, prev_tokens, token_src)``
takes input ids that an earlier step sampled and the host has not read yet. ``prev_tokens`` is
that step's ``next_tokens`` (a device array, ``[S]``), ``token_src`` int32 ``[T]`` (the token
bucket): where ``token_src[i] >= 0`` the input id of token ``i`` is ``prev_tokens[token_src[i]]``,
gathered on the device; where it is ``-1``, ``tokens[i]`` (from the host).

``pack_batch`` turns host-side per-sequence facts into fixed-shape inputs: tokens padded to a
power-of-two bucket (so the step compiles a handful of times), sequence rows padded to a fixed
``max_seqs``, the page table padded to a fixed width. They stay numpy arrays: the jitted call
copies them to the device inside its C++ dispatch (a few microseconds each, about 40 us for the
nine arrays of a decode step on CPU), which costs far less than one ``jnp.asarray`` per array
(measured ~1 ms per step for seven arrays on a loaded 2-core CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.pools import CachePools
from kvjax.serve.layers import BatchMetadata
from kvjax.serve.model import as_model_config, build_model
from kvjax.serve.model_config import ModelConfig
from kvjax.spec import ModelSpec

MIN_TOKEN_BUCKET = 8

StepFn = Callable[..., tuple[Any, ...]]


def make_step(model: ModelSpec | ModelConfig, *, with_logits: bool = False) -> StepFn:
    """The model's forward plus greedy sampling, jitted with the pools donated.

    Cached per model config, so schedulers of the same model share compiled code.
    """
    return _make_step(as_model_config(model), with_logits)


@functools.cache
def _make_step(config: ModelConfig, with_logits: bool) -> StepFn:
    return make_module_step(build_model(config), with_logits=with_logits)


def make_module_step(module: Any, *, with_logits: bool = False) -> StepFn:
    """``make_step`` for a model of the caller's own: ``module`` is a flax module (any object with
    ``apply({"params": params}, tokens, pools, meta) -> (logits [S, vocab], new_pools)``: int32
    ``tokens [T]``, the cache's ``CachePools`` and the batch's ``BatchMetadata``; it returns every
    pool, updated). Not cached: keep the returned step to reuse its compiled code."""

    def step(
        pools: CachePools,
        params: dict,
        tokens: jax.Array,
        meta: BatchMetadata,
        prev_tokens: jax.Array | None = None,
        token_src: jax.Array | None = None,
    ) -> tuple[Any, ...]:
        if token_src is not None and prev_tokens is not None:
            tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)
        logits, new_pools = module.apply({"params": params}, tokens, pools, meta)
        next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (new_pools, next_tokens, logits) if with_logits else (new_pools, next_tokens)

    return jax.jit(step, donate_argnums=0)


def token_bucket(n: int) -> int:
    """Padded token count: the next power of two, at least ``MIN_TOKEN_BUCKET``."""
    return max(MIN_TOKEN_BUCKET, 1 << max(0, n - 1).bit_length())


def pack_batch(
    *,
    tokens: Sequence[np.ndarray] | np.ndarray,
    starts: Sequence[int] | np.ndarray,
    slots: np.ndarray,
    page_table: np.ndarray,
    max_seqs: int,
    extras: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, BatchMetadata]:
    """Step inputs for sequences whose new tokens are ``tokens[i]`` at positions ``starts[i]...``.

    ``tokens``: one array per sequence, or (a decode batch) one flat int array with one token per
    sequence. ``slots`` are the KV slots of all new tokens, concatenated in sequence order;
    ``page_table`` is ``[len(tokens), pages_per_seq]`` (page ids, 0-padded). ``extras``: per-kind
    inputs passed through as ``BatchMetadata.extras`` (already padded to fixed shapes by their
    producer). Returns ``(tokens [T], metadata)`` as numpy arrays.
    """
    n_seqs = len(tokens)
    if n_seqs > max_seqs:
        raise ValueError(f"{n_seqs} sequences in one batch; the step is compiled for at most {max_seqs}")
    if isinstance(tokens, np.ndarray):
        q_lens = np.ones(n_seqs, np.int32)
        tokens = [tokens.astype(np.int32, copy=False)]
    else:
        q_lens = np.fromiter((len(t) for t in tokens), np.int32, n_seqs)
    starts_arr = np.asarray(starts, np.int32)
    total = int(q_lens.sum())
    size = token_bucket(total)
    flat = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    out_loc = np.zeros(size, np.int32)  # padding writes to slot 0: the trash page
    cu = np.zeros(max_seqs + 1, np.int32)
    np.cumsum(q_lens, out=cu[1 : n_seqs + 1])
    cu[n_seqs + 1 :] = total
    if total:
        flat[:total] = np.concatenate(tokens)
        if total == n_seqs:  # a decode batch: one token per sequence, at its start
            positions[:total] = starts_arr
        else:
            # position of token i of sequence s = starts[s] + (i - cu[s])
            seq_of = np.repeat(np.arange(n_seqs), q_lens)
            positions[:total] = np.arange(total, dtype=np.int32) - cu[seq_of] + starts_arr[seq_of]
        out_loc[:total] = slots
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[:n_seqs] = starts_arr + q_lens
    table = np.zeros((max_seqs, page_table.shape[1]), np.int32)
    table[:n_seqs] = page_table
    logits_idx = np.zeros(max_seqs, np.int32)
    logits_idx[:n_seqs] = cu[1 : n_seqs + 1] - 1
    # numpy leaves on the host (the field types are what the jitted step sees: device arrays)
    make_meta: Any = BatchMetadata
    meta: BatchMetadata = make_meta(
        positions=positions,
        out_loc=out_loc,
        kv_lens=kv_lens,
        page_indices=table,
        cu_q_lens=cu,
        num_seqs=np.array([n_seqs], np.int32),
        logits_indices=logits_idx,
        extras=dict(extras or {}),
    )
    return flat, meta
