"""Gemma 3 (text; ``model_type`` ``gemma3_text``, Hugging Face's ``Gemma3ForCausalLM``).

Architecture, parameter names included: ``model.embed_tokens`` (scaled by ``sqrt(hidden_size)``,
the scale cast to the weights' dtype); ``num_hidden_layers`` x [``input_layernorm``, ``self_attn``
(``q_proj``, ``k_proj``, ``v_proj``, ``q_norm`` / ``k_norm`` over the head dim, RoPE, paged
attention with scale ``query_pre_attn_scalar ** -0.5``, ``o_proj``), ``post_attention_layernorm``,
residual, ``pre_feedforward_layernorm``, ``mlp`` (GeGLU with tanh-approximated GELU),
``post_feedforward_layernorm``, residual]; ``model.norm``; the LM head tied to the embedding
(unless ``tie_word_embeddings`` is false); ``final_logit_softcapping`` / ``attn_logit_softcapping``
when set (Gemma 3 leaves both unset). Gemma's RMSNorm multiplies by ``1 + weight`` in float32.

Layer kinds come from ``layer_types`` (or ``sliding_window_pattern``): sliding layers use the
local RoPE base (``rope_parameters["sliding_attention"]``, or ``rope_local_base_freq``; 10,000)
and see keys in ``(p - sliding_window, p]`` (Transformers' sliding mask); full layers use
``rope_parameters["full_attention"]`` (or ``rope_theta`` and ``rope_scaling``; 1,000,000).

Cache: the hybrid-SWA pools (``pools.swa``, a ``SWAKVPool``). Full layers write at
``meta.out_loc`` and read ``meta.page_indices``; sliding layers write at
``meta.swa.out_loc`` and read ``meta.swa.page_indices`` (the SWA pool's slots
and pages, translated by the scheduler's ``SWAServing``). With ``disable_hybrid_swa_memory`` every
layer uses the one full-size pool ``pools.kv`` (sliding layers with their window), as SGLang
serves Gemma 3. The routing is ``kvjax.attention.attend`` (shared with ``gpt_oss``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import KindMetadata, attend
from kvjax.errors import ConfigError
from kvjax.layer_kinds import LayerKind
from kvjax.pools import CachePools
from kvjax.serve.layers import BatchMetadata, Embedding, Linear
from kvjax.serve.model_config import ModelConfig, RopeConfig, read_rope
from kvjax.serve.trace_state import swa_trace_state
from kvjax.spec import ModelSpec

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3's hyperparameters beyond ``ModelConfig`` (frozen, hashable).

    ``sliding``: per layer, whether it is a sliding-window layer; ``sliding_window``: ``W`` tokens;
    ``rope_full`` / ``rope_local``: RoPE of the full / sliding layers; ``query_pre_attn_scalar``:
    the attention scale is its inverse square root; soft caps: None when unset.
    """

    sliding: tuple[bool, ...]
    sliding_window: int
    rope_full: RopeConfig
    rope_local: RopeConfig
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None


def _optional_number(raw: Mapping[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(key, value, f"'{key}' in config.json must be a positive number or null")
    return float(value)


def read_gemma3_config(spec: ModelSpec, raw: Mapping[str, Any]) -> Gemma3Config:
    """Gemma 3's own hyperparameters from its ``config.json`` (either RoPE layout)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ConfigError("hidden_activation", act, f"kvjax's Gemma 3 MLP is GeGLU with {GELU_TANH[0]}")
    if spec.sliding_window is None or spec.sliding_window <= 0:
        raise ConfigError("sliding_window", spec.sliding_window, "Gemma 3 needs a positive sliding_window")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention", True, "kvjax serves Gemma 3 causally only")
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        full_src = {"rope_parameters": params.get("full_attention") or {}, **_max_pos(raw)}
        local_src = {"rope_parameters": params.get("sliding_attention") or {}, **_max_pos(raw)}
        rope_full = read_rope(full_src) if params.get("full_attention") else RopeConfig(theta=1_000_000.0)
        rope_local = read_rope(local_src) if params.get("sliding_attention") else RopeConfig(theta=10_000.0)
    else:
        full = {k: raw[k] for k in ("rope_theta", "rope_scaling", "max_position_embeddings") if k in raw}
        full.setdefault("rope_theta", 1_000_000.0)
        rope_full = read_rope(full)
        rope_local = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10_000.0)))
    scalar = raw.get("query_pre_attn_scalar", spec.head_dim)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ConfigError("query_pre_attn_scalar", scalar, "must be a positive number")
    return Gemma3Config(
        sliding=tuple(kind == LayerKind.SLIDING for kind in spec.layer_kinds),
        sliding_window=int(spec.sliding_window),
        rope_full=rope_full,
        rope_local=rope_local,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=_optional_number(raw, "final_logit_softcapping"),
        attn_logit_softcapping=_optional_number(raw, "attn_logit_softcapping"),
    )


def _max_pos(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"max_position_embeddings": raw["max_position_embeddings"]} if "max_position_embeddings" in raw else {}


def _fc(config: ModelConfig) -> Gemma3Config:
    fc = config.family_config
    assert isinstance(fc, Gemma3Config), "Gemma 3 needs its family_config (read_gemma3_config)"
    return fc


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in float32, cast back (weights start at 0)."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, inv_freq: Any) -> jax.Array:
    """Rotate-half RoPE with float32 angles (as ``kvjax.serve.layers.apply_rope``)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


class Gemma3Attention(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _fc(c)
        dt = jnp.dtype(c.dtype)
        t = x.shape[0]
        q = Linear(c.num_attention_heads * c.head_dim, c.qkv_bias, dt, name="q_proj")(x)
        k = Linear(c.num_kv_heads * c.head_dim, c.qkv_bias, dt, name="k_proj")(x)
        v = Linear(c.num_kv_heads * c.head_dim, c.qkv_bias, dt, name="v_proj")(x)
        q = GemmaRMSNorm(c.rms_norm_eps, dt, name="q_norm")(q.reshape(t, c.num_attention_heads, c.head_dim))
        k = GemmaRMSNorm(c.rms_norm_eps, dt, name="k_norm")(k.reshape(t, c.num_kv_heads, c.head_dim))
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        sliding = fc.sliding[self.layer_id]
        inv_freq = (fc.rope_local if sliding else fc.rope_full).inverse_frequencies(c.head_dim)
        q = _rope(q, meta.positions, inv_freq)
        k = _rope(k, meta.positions, inv_freq)
        out, pools = attend(
            pools,
            self.layer_id,
            q,
            k,
            v,
            meta,
            sliding_window=fc.sliding_window if sliding else None,
            sm_scale=fc.query_pre_attn_scalar**-0.5,
            soft_cap=fc.attn_logit_softcapping,
        )
        return Linear(c.hidden_size, c.o_bias, dt, name="o_proj")(out.reshape(t, -1)), pools


class Gemma3MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = jnp.dtype(c.dtype)
        gate = Linear(c.intermediate_size, False, dt, name="gate_proj")(x)
        up = Linear(c.intermediate_size, False, dt, name="up_proj")(x)
        return Linear(c.hidden_size, False, dt, name="down_proj")(jax.nn.gelu(gate, approximate=True) * up)


class Gemma3DecoderLayer(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        h = GemmaRMSNorm(c.rms_norm_eps, dt, name="input_layernorm")(x)
        h, pools = Gemma3Attention(c, self.layer_id, name="self_attn")(h, pools, meta)
        x = x + GemmaRMSNorm(c.rms_norm_eps, dt, name="post_attention_layernorm")(h)
        h = GemmaRMSNorm(c.rms_norm_eps, dt, name="pre_feedforward_layernorm")(x)
        h = Gemma3MLP(c, name="mlp")(h)
        return x + GemmaRMSNorm(c.rms_norm_eps, dt, name="post_feedforward_layernorm")(h), pools


class Gemma3Model(nn.Module):
    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        dt = jnp.dtype(c.dtype)
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dt)
        self.layers = [Gemma3DecoderLayer(c, i, name=f"layers_{i}") for i in range(c.num_hidden_layers)]
        self.norm = GemmaRMSNorm(c.rms_norm_eps, dt)

    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        x = self.embed_tokens(tokens)
        x = x * jnp.asarray(c.hidden_size**0.5, jnp.float32).astype(x.dtype)
        for layer in self.layers:
            x, pools = layer(x, pools, meta)
        return self.norm(x[meta.logits_indices]), pools

    def lm_head_tied(self, x: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(x)


class Gemma3ForCausalLM(nn.Module):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.model = Gemma3Model(c)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, jnp.dtype(c.dtype))

    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        x, pools = self.model(tokens, pools, meta)
        logits = self.model.lm_head_tied(x) if self.config.tie_word_embeddings else self.lm_head(x)
        logits = logits.astype(jnp.float32)
        cap = _fc(self.config).final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits, pools


def gemma3_trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """One-page full and SWA pools of the model's shape, and the sliding layers' metadata."""
    return swa_trace_state(config, _fc(config).sliding)
