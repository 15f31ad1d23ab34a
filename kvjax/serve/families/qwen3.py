"""Qwen3: Llama's architecture plus an RMSNorm over the head dim of q and of k (``q_norm``,
``k_norm``, one weight of ``head_dim`` each, shared by the heads), applied before RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.serve.families.llama import LlamaAttention, LlamaForCausalLM
from kvjax.serve.layers import RMSNorm


class Qwen3Attention(LlamaAttention):
    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        return RMSNorm(c.rms_norm_eps, dt, name="q_norm")(q), RMSNorm(c.rms_norm_eps, dt, name="k_norm")(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention: type[LlamaAttention] = Qwen3Attention
