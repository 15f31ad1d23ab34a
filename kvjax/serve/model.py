"""A tiny deterministic Llama-style transformer (flax) that reads and writes its KV through kvjax's pool.

It exists to exercise the cache the way a real model does: every layer writes the new tokens' K
and V into the paged pool (``MHAKVPool.set_kv_buffer``) and attends over the pages through
ragged paged attention (``pallas_kernels.ragged_paged_attention``), so a prefix served from the
radix cache is read from the very slots an earlier forward wrote.

Architecture: token embedding, ``num_hidden_layers`` x (RMSNorm, GQA attention with RoPE, RMSNorm,
SwiGLU MLP), final RMSNorm, LM head. Weights come from a fixed PRNG seed (no downloads).

A forward takes one flat, ragged batch: ``T`` tokens of up to ``S`` sequences (``BatchMetadata``)
and returns logits for the last token of each sequence only.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.pools import MHAKVPool
from kvjax.spec import ModelSpec
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchMetadata:
    """Where a ragged batch's tokens live. ``T`` tokens (padded), ``S`` sequence rows (padded).

    Fields (all int32 device arrays):
      positions: ``[T]`` position of each token in its sequence (0 for padding).
      out_loc: ``[T]`` KV slot each token's K/V is written to (0, the trash page, for padding).
      kv_lens: ``[S]`` KV length of each sequence including this batch's tokens.
      page_indices: ``[S, pages_per_seq]`` page table (0 = padding).
      cu_q_lens: ``[S + 1]`` token offsets of the sequences in the batch.
      num_seqs: ``[1]`` live sequences.
      logits_indices: ``[S]`` index of each sequence's last token (0 for padded rows).
    """

    positions: jax.Array
    out_loc: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half convention) of ``x``: ``[T, heads, head_dim]`` at ``positions``."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    """GQA self-attention whose K/V go through the paged pool."""

    spec: ModelSpec
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, kv: MHAKVPool, meta: BatchMetadata) -> tuple[jax.Array, MHAKVPool]:
        s = self.spec
        dense = lambda features, name: nn.DenseGeneral(features, use_bias=False, name=name)  # noqa: E731
        q = dense((s.num_attention_heads, s.head_dim), "q_proj")(x)
        k = dense((s.num_kv_heads, s.head_dim), "k_proj")(x)
        v = dense((s.num_kv_heads, s.v_head_dim), "v_proj")(x)
        q = rope(q, meta.positions, s.rope_theta)
        k = rope(k, meta.positions, s.rope_theta)
        kv = kv.set_kv_buffer(self.layer_id, meta.out_loc, k, v)
        out = ragged_paged_attention(
            q.astype(kv.logical_dtype),
            kv.kv_buffer(self.layer_id),
            meta.kv_lens,
            meta.page_indices,
            meta.cu_q_lens,
            meta.num_seqs,
            soft_cap=s.attn_logit_softcapping,
        )
        out = out[..., : s.v_head_dim].astype(x.dtype)
        return nn.DenseGeneral(s.hidden_size, axis=(-2, -1), use_bias=False, name="o_proj")(out), kv


class DecoderLayer(nn.Module):
    spec: ModelSpec
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, kv: MHAKVPool, meta: BatchMetadata) -> tuple[jax.Array, MHAKVPool]:
        s = self.spec
        h, kv = Attention(s, self.layer_id, name="attn")(nn.RMSNorm(name="attn_norm")(x), kv, meta)
        x = x + h
        y = nn.RMSNorm(name="mlp_norm")(x)
        gate = nn.Dense(s.intermediate_size, use_bias=False, name="gate_proj")(y)
        up = nn.Dense(s.intermediate_size, use_bias=False, name="up_proj")(y)
        x = x + nn.Dense(s.hidden_size, use_bias=False, name="down_proj")(nn.silu(gate) * up)
        return x, kv


class TinyTransformer(nn.Module):
    """The whole model: ``(tokens [T], kv pool, metadata) -> (logits [S, vocab] f32, new pool)``."""

    spec: ModelSpec

    @nn.compact
    def __call__(self, tokens: jax.Array, kv: MHAKVPool, meta: BatchMetadata) -> tuple[jax.Array, MHAKVPool]:
        s = self.spec
        x = nn.Embed(s.vocab_size, s.hidden_size, name="embed")(tokens)
        for layer in range(s.num_hidden_layers):
            x, kv = DecoderLayer(s, kv.start_layer + layer, name=f"layer_{layer}")(x, kv, meta)
        x = nn.RMSNorm(name="final_norm")(x[meta.logits_indices])
        logits = nn.Dense(s.vocab_size, use_bias=False, name="lm_head")(x)
        return logits.astype(jnp.float32), kv


@functools.lru_cache(maxsize=8)
def init_params(spec: ModelSpec, *, seed: int = 0) -> dict:
    """The model's weights, drawn from a fixed seed; cached per ``(spec, seed)``.

    Initialising traces one padding token through a one-page pool of the model's shape, so the
    weights do not depend on any cache the model is later used with.
    """
    kv = MHAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=spec.num_hidden_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        dtype=spec.dtype,
    )
    meta = BatchMetadata(
        positions=jnp.zeros((1,), jnp.int32),
        out_loc=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        page_indices=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
        logits_indices=jnp.zeros((1,), jnp.int32),
    )
    return TinyTransformer(spec).init(jax.random.key(seed), jnp.zeros((1,), jnp.int32), kv, meta)["params"]
