"""Qwen3: Llama's architecture plus an RMSNorm over the head dim of q and of k (``q_norm``,
``k_norm``, one weight of ``head_dim`` each, shared by the heads), applied before RoPE."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.serve.causal_lm import CausalLM
from kvjax.serve.families.llama import LlamaAttention, LlamaDecoderLayer
from kvjax.serve.layers import RMSNorm


class Qwen3Attention(LlamaAttention):
    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        return RMSNorm(c.rms_norm_eps, dt, name="q_norm")(q), RMSNorm(c.rms_norm_eps, dt, name="k_norm")(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention = Qwen3Attention


class Qwen3ForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = Qwen3DecoderLayer
