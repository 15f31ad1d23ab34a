"""gpt-oss (``model_type`` ``gpt_oss``, Hugging Face's ``GptOssForCausalLM``).

Architecture, parameter names included (Transformers 5.24's ``modeling_gpt_oss``):
``model.embed_tokens`` (unscaled); ``num_hidden_layers`` x [``input_layernorm`` (``GptOssRMSNorm``:
the weight times the float32-normalised input, in float32, then cast; Llama casts before the
product), ``self_attn`` (``q_proj``, ``k_proj``, ``v_proj`` with
biases, rotate-half RoPE, paged attention with scale ``head_dim ** -0.5`` and one learned sink
logit per query head ``self_attn.sinks [num_attention_heads]``, ``o_proj`` with bias), residual,
``post_attention_layernorm``, ``mlp`` (the MoE below), residual]; ``model.norm``; ``lm_head``
(untied unless ``tie_word_embeddings``).

RoPE: one for every layer, from ``rope_parameters`` (YaRN by default in gpt-oss configs: its
inverse frequencies, and cos and sin multiplied by ``RopeConfig.attention_scaling()``, here as
q and k multiplied by it after the rotation).

MoE (``mlp``): ``router`` (``weight [E, H]``, ``bias [E]``) gives logits; the ``num_experts_per_tok``
largest are kept and softmaxed among themselves. Experts are stored fused: ``experts.gate_up_proj
[E, H, 2I]`` + ``gate_up_proj_bias [E, 2I]`` (gate and up *interleaved*: gate in the even
columns, up in the odd ones), ``experts.down_proj [E, I, H]`` + ``down_proj_bias [E, H]``
(``x @ W`` layout, not ``nn.Linear``'s). An expert computes ``gate = min(gate, limit)``,
``up = clip(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)`` then the down
projection plus its bias (``alpha = swiglu_alpha`` 1.702, ``limit = swiglu_limit`` 7.0). This
differs too much from ``kvjax.serve.moe.SparseMoE`` (fused biased weights, a clamped SwiGLU,
softmax after top-k) to share it; like it, every token runs through every expert (dense, exact,
static shapes; documented there) and the routing weights zero the unchosen ones, with its
``dense_combine_weights`` and ``combine_experts``.

Layer kinds come from ``layer_types`` (alternating sliding, full by default); sliding layers see
keys in ``(p - sliding_window, p]`` (Transformers' sliding mask, the same as Gemma 3's).

Cache: the hybrid-SWA pools (``pools.swa``, a ``SWAKVPool``) as in ``gemma3``: full layers write
at ``meta.out_loc`` and read ``meta.page_indices``; sliding layers write at
``meta.swa.out_loc`` and read ``meta.swa.page_indices``. With
``disable_hybrid_swa_memory`` every layer uses the one full-size pool ``pools.kv``. The routing
is ``kvjax.attention.attend``.
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
from kvjax.hf import keys
from kvjax.pools import CachePools
from kvjax.serve.attention_block import project_output, project_qkv_heads
from kvjax.serve.causal_lm import CausalLM, DecoderLayer, LayerMixer
from kvjax.serve.layers import BatchMetadata, Float32RMSNorm, apply_rope
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.moe import combine_experts, dense_combine_weights
from kvjax.serve.sliding_windows import SlidingWindows, read_sliding_windows
from kvjax.serve.trace_state import swa_trace_state
from kvjax.spec import ModelSpec

WEIGHT_INIT_STDDEV = 0.02


@dataclasses.dataclass(frozen=True)
class GptOssConfig(SlidingWindows):
    """gpt-oss's hyperparameters beyond ``ModelConfig`` (frozen, hashable).

    The sliding layers and window (``SlidingWindows``); ``num_experts`` / ``top_k``: experts per
    layer and chosen per token; ``swiglu_alpha`` / ``swiglu_limit``: the experts' clamped SwiGLU
    (module docstring).
    """

    num_experts: int
    top_k: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> GptOssConfig:
    """gpt-oss's own hyperparameters from its ``config.json``.

    A ``quantization_config`` (OpenAI's published checkpoints store the experts in MXFP4 as
    ``*_blocks`` / ``*_scales``) is refused by its method: kvjax loads unquantised weights only.
    """
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise ConfigError(
            "quantization_config.quant_method",
            method,
            "kvjax serves gpt-oss from unquantised (bf16/f32) weights; dequantise the checkpoint first",
        )
    windows = read_sliding_windows(spec, "gpt-oss")
    experts = keys.first_integer(raw, ("num_local_experts", "num_experts"), "gpt_oss")
    top_k = keys.integer(raw, "num_experts_per_tok", "gpt_oss")
    if top_k > experts:
        raise ConfigError("num_experts_per_tok", top_k, f"must be at most num_local_experts={experts}")
    return GptOssConfig(
        sliding=windows.sliding,
        sliding_window=windows.sliding_window,
        num_experts=experts,
        top_k=top_k,
        swiglu_alpha=keys.positive_number(raw, "swiglu_alpha", "gpt_oss", 1.702),
        swiglu_limit=keys.positive_number(raw, "swiglu_limit", "gpt_oss", 7.0),
    )


def _fc(config: ModelConfig) -> GptOssConfig:
    return config.family_settings(GptOssConfig)


GptOssRMSNorm = Float32RMSNorm  # the weight times the float32-normalised input, then the cast


class GptOssAttention(LayerMixer):
    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        q, k, v = project_qkv_heads(c, x)
        sinks = self.param("sinks", nn.initializers.normal(WEIGHT_INIT_STDDEV), (c.num_attention_heads,), dt)
        inv_freq = c.rope.inverse_frequencies(c.head_dim)
        scaling = c.rope.attention_scaling()
        q = apply_rope(q, meta.positions, inv_freq)
        k = apply_rope(k, meta.positions, inv_freq)
        if scaling != 1.0:  # YaRN scales cos and sin, i.e. the rotated q and k
            q = q * jnp.asarray(scaling, q.dtype)
            k = k * jnp.asarray(scaling, k.dtype)
        out, pools = attend(
            pools,
            self.layer_id,
            q,
            k,
            v,
            meta,
            sliding_window=_fc(c).window(self.layer_id),
            sm_scale=c.head_dim**-0.5,
            sinks=sinks.astype(jnp.float32),
        )
        return project_output(c, out), pools


class GptOssRouter(nn.Module):
    """``weight [E, H]``, ``bias [E]``: top-k logits, softmaxed among themselves (float32)."""

    num_experts: int
    top_k: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        e = self.num_experts
        weight = self.param("weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), (e, x.shape[-1]), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (e,), self.dtype)
        logits = (x @ weight.T + bias).astype(jnp.float32)
        top, ids = jax.lax.top_k(logits, self.top_k)
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


class GptOssExperts(nn.Module):
    """The fused experts (module docstring); ``(x [T, H], combine [T, E] f32) -> [T, H]``."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        c = self.config
        fc = _fc(c)
        dt = jnp.dtype(c.dtype)
        e, h, i = fc.num_experts, c.hidden_size, c.intermediate_size
        init = nn.initializers.normal(WEIGHT_INIT_STDDEV)
        gate_up = self.param("gate_up_proj", init, (e, h, 2 * i), dt)
        gate_up_bias = self.param("gate_up_proj_bias", nn.initializers.zeros, (e, 2 * i), dt)
        down = self.param("down_proj", init, (e, i, h), dt)
        down_bias = self.param("down_proj_bias", nn.initializers.zeros, (e, h), dt)
        projected = jnp.einsum("th,ehj->tej", x, gate_up) + gate_up_bias[None]  # every expert (documented)
        gate, up = projected[..., ::2], projected[..., 1::2]
        limit = fc.swiglu_limit
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        hidden = (up + 1) * (gate * jax.nn.sigmoid(gate * fc.swiglu_alpha))
        out = jnp.einsum("tei,eih->teh", hidden, down) + down_bias[None]
        return combine_experts(out, combine, x.dtype)


class GptOssMLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        fc = _fc(c)
        weights, ids = GptOssRouter(fc.num_experts, fc.top_k, jnp.dtype(c.dtype), name="router")(x)
        return GptOssExperts(c, name="experts")(x, dense_combine_weights(weights, ids, fc.num_experts))


class GptOssDecoderLayer(DecoderLayer):
    norm = GptOssRMSNorm
    attention = GptOssAttention

    @nn.nowrap
    def mlp(self) -> nn.Module:
        return GptOssMLP(self.config, name="mlp")


class GptOssForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = GptOssDecoderLayer
    final_norm: type[nn.Module] = GptOssRMSNorm


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """One-page full and SWA pools of the model's shape, and the sliding layers' metadata."""
    return swa_trace_state(config, _fc(config).sliding)
