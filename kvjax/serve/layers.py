"""The pieces every served family shares: linear layers and embeddings in Hugging Face's weight
layout, the RMSNorm variants (Llama's, the float32-product one, the ``1 + weight`` one), rotary
embeddings and the SwiGLU MLP. Attention through kvjax's pools is ``kvjax.attention.attend``.

Weights keep Hugging Face's layout and names (a linear layer's ``weight`` is ``[out, in]``), so a
checkpoint tensor ``model.layers.3.mlp.up_proj.weight`` is the parameter at path
``("model", "layers_3", "mlp", "up_proj", "weight")`` with no transpose (``kvjax.serve.checkpoint``).

Numerics follow the reference implementations: RMSNorm in float32 then cast back, RoPE angles
in float32, attention softmax in float32 (inside ``kvjax.attention``), logits in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttentionMetadata
from kvjax.serve.model_config import ModelConfig

WEIGHT_INIT_STDDEV = 0.02  # random weights (presets without a checkpoint), as Transformers' initializer_range


BatchMetadata = AttentionMetadata
"""The former name of ``kvjax.attention.AttentionMetadata`` (an alias, kept for imports)."""


def _dtype(config: ModelConfig) -> jnp.dtype:
    return jnp.dtype(config.dtype)


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight: [features, in]`` (Hugging Face's ``nn.Linear``)."""

    features: int
    use_bias: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param(
            "weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), (self.features, x.shape[-1]), self.dtype
        )
        y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class Embedding(nn.Module):
    """Token embedding ``weight: [vocab, hidden]``; ``attend`` is the tied LM head."""

    vocab_size: int
    hidden_size: int
    dtype: jnp.dtype

    def setup(self) -> None:
        self.weight = self.param(
            "weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), (self.vocab_size, self.hidden_size), self.dtype
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight, tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jax.lax.dot_general(x, self.weight, (((x.ndim - 1,), (1,)), ((), ())))


def rms_normalize(x32: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis; ``x32`` float32, the result float32."""
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis: normalised in float32, cast back
    to x's dtype, then multiplied by the weight (Llama's order; weight starts at 1)."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return weight * rms_normalize(x.astype(jnp.float32), self.eps).astype(x.dtype)


class Float32RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` with the product taken in float32 before the cast back
    to x's dtype (gpt-oss and Nemotron-H; weight starts at 1). ``dtype``: the weight's, x's when None."""

    eps: float
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype or x.dtype)
        return (weight.astype(jnp.float32) * rms_normalize(x.astype(jnp.float32), self.eps)).astype(x.dtype)


class OffsetRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in float32, cast back to x's dtype (Gemma 3 and
    Qwen3-Next; weight starts at 0). ``dtype``: the weight's, x's when None."""

    eps: float
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],), self.dtype or x.dtype)
        normed = rms_normalize(x.astype(jnp.float32), self.eps)
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x: [T, heads, head_dim]`` at ``positions: [T]`` (rotate-half convention).

    ``inv_freq``: ``[head_dim // 2]`` float32 (``RopeConfig.inverse_frequencies``). Angles and
    their cos/sin are float32, cast to x's dtype before the rotation, as in the reference.
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """Gated MLP: ``down_proj(activation(gate_proj(x)) * up_proj(x))``; SwiGLU by default (``silu``),
    GeGLU with ``activation=gelu_tanh`` (Gemma 3). Biases from ``config.mlp_bias``."""

    config: ModelConfig
    activation: Callable[[jax.Array], jax.Array] = nn.silu

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dt = _dtype(c)
        gate = Linear(c.intermediate_size, c.mlp_bias, dt, name="gate_proj")(x)
        up = Linear(c.intermediate_size, c.mlp_bias, dt, name="up_proj")(x)
        return Linear(c.hidden_size, c.mlp_bias, dt, name="down_proj")(self.activation(gate) * up)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (Transformers' ``gelu_pytorch_tanh``)."""
    return jax.nn.gelu(x, approximate=True)
