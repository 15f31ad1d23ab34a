"""Llama (2 and 3), and the families that differ from it only by configuration: Mistral and
Qwen2/2.5 (q/k/v biases, ``ModelConfig.qkv_bias``), with or without a sliding window.

Architecture (Hugging Face's ``LlamaForCausalLM``, parameter names included): ``model.embed_tokens``;
``num_hidden_layers`` x [``input_layernorm``, ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj``,
RoPE, paged attention, ``o_proj``), residual, ``post_attention_layernorm``, ``mlp``, residual];
``model.norm``; ``lm_head`` (or the embedding, tied).

A forward takes one flat ragged batch (``T`` tokens of up to ``S`` sequences, ``BatchMetadata``)
and the cache's pools (``CachePools``; these families use ``pools.kv``, an ``MHAKVPool``), and
returns float32 logits for the last token of each sequence row, and the updated pools.

Sliding windows (``LlamaWindows``, a ``SlidingWindows`` read from the spec's layer kinds): Mistral with a
``sliding_window`` slides on every layer (a *pure* sliding-window model: the plan's one pool is the
SWA pool, served through ``PureSWARadixCache``), Qwen2 with ``use_sliding_window`` on the layers
from ``max_window_layers`` (a hybrid). Their layers then go through
``kvjax.attention.attend`` (``pools.swa``, or ``pools.kv`` with
``disable_hybrid_swa_memory``); a sliding layer sees keys in ``(p - sliding_window, p]``, as
Transformers' sliding mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax

from kvjax.attention import KindMetadata, attend
from kvjax.pools import CachePools
from kvjax.serve.attention_block import project_output, project_qkv_heads
from kvjax.serve.causal_lm import CausalLM, DecoderLayer, LayerMixer
from kvjax.serve.layers import BatchMetadata, apply_rope
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.sliding_windows import SlidingWindows, sliding_windows
from kvjax.serve.trace_state import mha_trace_state, swa_trace_state
from kvjax.spec import ModelSpec

#: The family config of a Llama-like checkpoint with sliding layers.
LlamaWindows = SlidingWindows


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> LlamaWindows | None:
    """The family config of ``llama`` / ``mistral`` / ``qwen2``: the sliding layers, or None when
    every layer is full attention."""
    return sliding_windows(spec)


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """The smallest pools of the checkpoint's kinds: MHA, or full + SWA with sliding layers."""
    windows = config.family_config
    if isinstance(windows, LlamaWindows):
        return swa_trace_state(config, windows.sliding)
    return mha_trace_state(config)


class LlamaAttention(LayerMixer):
    """GQA self-attention whose K/V go through the paged pool. ``normalize_qk`` is the hook that
    families with q/k norms override (identity here)."""

    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        return q, k

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        q, k, v = project_qkv_heads(c, x)
        q, k = self.normalize_qk(q, k)
        inv_freq = c.rope.inverse_frequencies(c.head_dim)
        q = apply_rope(q, meta.positions, inv_freq)
        k = apply_rope(k, meta.positions, inv_freq)
        windows = c.family_config
        if isinstance(windows, LlamaWindows):
            window = windows.window(self.layer_id)
            out, pools = attend(pools, self.layer_id, q, k, v, meta, sm_scale=c.head_dim**-0.5, sliding_window=window)
        else:
            out, pools = attend(pools, self.layer_id, q, k, v, meta)
        return project_output(c, out), pools


class LlamaDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer; ``attention`` is the hook families with another attention override."""

    attention: ClassVar[type[nn.Module]] = LlamaAttention


class LlamaForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
