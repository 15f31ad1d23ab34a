"""DeepSeek-V2: multi-head latent attention (MLA) over kvjax's latent pool, and sparse-MoE layers.

Architecture (Hugging Face's ``DeepseekV2ForCausalLM`` in Transformers 5, parameter names included):
``model.embed_tokens``; ``num_hidden_layers`` x [``input_layernorm``, ``self_attn``, residual,
``post_attention_layernorm``, ``mlp``, residual]; ``model.norm``; ``lm_head``.

Attention (per layer, ``H`` heads):

* queries: ``q_proj`` (``q_lora_rank`` null), or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``;
  ``[T, H, qk_nope_head_dim + qk_rope_head_dim]`` split into ``q_nope`` and ``q_pe``.
* latent: ``kv_a_proj_with_mqa`` gives ``[kv_lora_rank + qk_rope_head_dim]`` per token; the first
  part through ``kv_a_layernorm`` is the compressed KV ``c_kv``, the second is ``k_pe``. ``q_pe`` and
  ``k_pe`` are rotated by RoPE over ``qk_rope_head_dim`` in DeepSeek's interleaved convention
  (pairs ``(x[2i], x[2i+1])``, as Transformers' complex ``apply_rotary_emb``). ``(c_kv, k_pe)`` is
  what the cache stores (``MLAKVPool.set_mla_kv_buffer``).
* absorbed attention: ``kv_b_proj.weight`` ``[H * (nope + v), kv_lora_rank]`` holds per head
  ``W_UK [nope, rank]`` and ``W_UV [v, rank]``. The query's nope part is absorbed,
  ``ql_nope = q_nope @ W_UK``, so ``q . k = ql_nope . c_kv + q_pe . k_pe`` is computed against the
  latent rows directly (``pallas_kernels.mla_ragged_paged_attention``, scale
  ``(nope + rope) ** -0.5``, the pool's fp8 scale honoured); the latent output is up-projected,
  ``o @ W_UV^T``, then ``o_proj``. This is the same function as Transformers' expanded K/V (only
  the summation order differs); kvjax only builds the absorbed form: the expanded one would
  re-project every cached latent row each step.
* The two low-rank RMSNorms use eps 1e-6 (Transformers' default for them), the others
  ``rms_norm_eps``.

MLP: layers ``< first_k_dense_replace`` a dense SwiGLU MLP of ``intermediate_size``; the others
``kvjax.serve.moe.SparseMoE`` (softmax scores, ``topk_method`` greedy or group_limited_greedy,
``routed_scaling_factor``, ``n_shared_experts * moe_intermediate_size`` shared experts always
added). Transformers 5.24's DeepSeek-V2 router ignores ``norm_topk_prob``, and so does kvjax here
(DeepSeek's released V2 configs set it false anyway). ``moe_layer_freq`` is ignored as in
Transformers.

Refused by name (``ConfigError``): RoPE types other than the default (YaRN's mscale is not built),
an activation other than SiLU (``model_config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import KindMetadata, attend
from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.layers import MLP, BatchMetadata, Embedding, Linear, RMSNorm
from kvjax.serve.model_config import ModelConfig, read_rope
from kvjax.serve.moe import MoEConfig, SparseMoE, Weight
from kvjax.spec import ModelSpec

LOW_RANK_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config:
    """DeepSeek-V2's own hyperparameters (``ModelConfig.family_config``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    first_k_dense_replace: int
    moe: MoEConfig | None

    @property
    def sm_scale(self) -> float:
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)


def _int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, value, f"'{key}' in config.json must be an integer")
    return value


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> DeepseekV2Config:
    """The family's hyperparameters from ``config.json`` (see the module docstring for refusals)."""
    rope = read_rope(raw)
    if rope.rope_type != "default":
        raise ConfigError("rope_scaling.rope_type", rope.rope_type, "kvjax's DeepSeek-V2 serves the default RoPE only")
    q_lora = raw.get("q_lora_rank")
    moe = None
    experts = raw.get("n_routed_experts")
    if experts:
        shared = raw.get("n_shared_experts") or 0
        moe = MoEConfig(
            hidden_size=spec.hidden_size,
            num_experts=_int(raw, "n_routed_experts"),
            top_k=_int(raw, "num_experts_per_tok"),
            moe_intermediate_size=_int(raw, "moe_intermediate_size"),
            topk_method=str(raw.get("topk_method", "greedy")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            n_group=_int(raw, "n_group", 1) if raw.get("n_group") is not None else 1,
            topk_group=_int(raw, "topk_group", 1) if raw.get("topk_group") is not None else 1,
            shared_intermediate_size=int(shared) * _int(raw, "moe_intermediate_size"),
        )
    return DeepseekV2Config(
        q_lora_rank=None if q_lora is None else _int(raw, "q_lora_rank"),
        kv_lora_rank=_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
        v_head_dim=_int(raw, "v_head_dim"),
        attention_bias=bool(raw.get("attention_bias", False)),
        first_k_dense_replace=_int(raw, "first_k_dense_replace", 0),
        moe=moe,
    )


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """A one-page latent pool of the model's shape, and no metadata part (for tracing the weights)."""
    from kvjax.pools import MLAKVPool

    f: DeepseekV2Config = config.family_config
    kv = MLAKVPool.create(
        num_pages=1,
        page_size=1,
        num_layers=config.num_hidden_layers,
        kv_lora_rank=f.kv_lora_rank,
        qk_rope_head_dim=f.qk_rope_head_dim,
        dtype=config.dtype,
    )
    return CachePools(kv=kv), None


def apply_rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x: [T, heads, d]`` at ``positions: [T]``, pairs ``(x[2i], x[2i+1])`` by angle
    ``position * inv_freq[i]``, in float32 (Transformers' complex-multiply RoPE for DeepSeek-V2)."""
    angles = positions.astype(jnp.float32)[:, None, None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class DeepseekV2Attention(nn.Module):
    """MLA in the absorbed form over the latent pool ``pools.kv`` (module docstring)."""

    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        f: DeepseekV2Config = c.family_config
        dt = jnp.dtype(c.dtype)
        t, heads = x.shape[0], c.num_attention_heads
        nope, rope, rank, vdim = f.qk_nope_head_dim, f.qk_rope_head_dim, f.kv_lora_rank, f.v_head_dim
        if f.q_lora_rank is None:
            q = Linear(heads * (nope + rope), False, dt, name="q_proj")(x)
        else:
            q = Linear(f.q_lora_rank, f.attention_bias, dt, name="q_a_proj")(x)
            q = RMSNorm(LOW_RANK_NORM_EPS, dt, name="q_a_layernorm")(q)
            q = Linear(heads * (nope + rope), False, dt, name="q_b_proj")(q)
        q = q.reshape(t, heads, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        latent = Linear(rank + rope, f.attention_bias, dt, name="kv_a_proj_with_mqa")(x)
        c_kv = RMSNorm(LOW_RANK_NORM_EPS, dt, name="kv_a_layernorm")(latent[:, :rank])
        inv_freq = c.rope.inverse_frequencies(rope)
        q_pe = apply_rope_interleaved(q_pe, meta.positions, inv_freq)
        k_pe = apply_rope_interleaved(latent[:, None, rank:], meta.positions, inv_freq)[:, 0]

        kv_b = Weight((heads * (nope + vdim), rank), dt, name="kv_b_proj")().reshape(heads, nope + vdim, rank)
        ql_nope = jnp.einsum("thn,hnr->thr", q_nope, kv_b[:, :nope])  # absorbed W_UK
        latent_out, pools = attend(pools, self.layer_id, (ql_nope, q_pe), c_kv, k_pe, meta, sm_scale=f.sm_scale)
        out = jnp.einsum("thr,hvr->thv", latent_out, kv_b[:, nope:])  # W_UV
        out = Linear(c.hidden_size, f.attention_bias, dt, name="o_proj")(out.reshape(t, heads * vdim))
        return out, pools


class DeepseekV2DecoderLayer(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        f: DeepseekV2Config = c.family_config
        dt = jnp.dtype(c.dtype)
        h = RMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x)
        h, pools = DeepseekV2Attention(c, self.layer_id, name="self_attn")(h, pools, meta)
        x = x + h
        h = RMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        if f.moe is None or self.layer_id < f.first_k_dense_replace:
            h = MLP(c, name="mlp")(h)
        else:
            h = SparseMoE(f.moe, dt, name="mlp")(h)
        return x + h, pools


class DeepseekV2Model(nn.Module):
    """The decoder stack (``model.*``); returns the final-normed hidden states of each sequence's last token."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        dt = jnp.dtype(c.dtype)
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dt)
        self.layers = [DeepseekV2DecoderLayer(c, i, name=f"layers_{i}") for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, dt)

    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, pools = layer(x, pools, meta)
        return self.norm(x[meta.logits_indices]), pools

    def lm_head_tied(self, x: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(x)


class DeepseekV2ForCausalLM(nn.Module):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.model = DeepseekV2Model(c)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, jnp.dtype(c.dtype))

    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        x, pools = self.model(tokens, pools, meta)
        logits = self.model.lm_head_tied(x) if self.config.tie_word_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32), pools
