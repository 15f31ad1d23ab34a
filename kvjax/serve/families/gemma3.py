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

from kvjax.attention import KindMetadata, attend
from kvjax.errors import ConfigError
from kvjax.hf import keys
from kvjax.pools import CachePools
from kvjax.serve.attention_block import project_output, project_qkv_heads
from kvjax.serve.causal_lm import CausalLM, DecoderLayer, LayerMixer
from kvjax.serve.layers import MLP, BatchMetadata, OffsetRMSNorm, apply_rope, gelu_tanh
from kvjax.serve.model_config import ModelConfig, RopeConfig, read_rope
from kvjax.serve.sliding_windows import SlidingWindows, read_sliding_windows
from kvjax.serve.trace_state import swa_trace_state
from kvjax.spec import ModelSpec

_TYPE = "gemma3_text"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(SlidingWindows):
    """Gemma 3's hyperparameters beyond ``ModelConfig`` (frozen, hashable).

    The sliding layers and window (``SlidingWindows``); ``rope_full`` / ``rope_local``: RoPE of the
    full / sliding layers; ``query_pre_attn_scalar``: the attention scale is its inverse square
    root; soft caps: None when unset.
    """

    rope_full: RopeConfig
    rope_local: RopeConfig
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> Gemma3Config:
    """Gemma 3's own hyperparameters from its ``config.json`` (either RoPE layout)."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ConfigError("hidden_activation", act, f"kvjax's Gemma 3 MLP is GeGLU with {GELU_TANH[0]}")
    windows = read_sliding_windows(spec, "Gemma 3")
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
    return Gemma3Config(
        sliding=windows.sliding,
        sliding_window=windows.sliding_window,
        rope_full=rope_full,
        rope_local=rope_local,
        query_pre_attn_scalar=keys.positive_number(raw, "query_pre_attn_scalar", _TYPE, float(spec.head_dim)),
        final_logit_softcapping=keys.positive_number(raw, "final_logit_softcapping", _TYPE, None),
        attn_logit_softcapping=keys.positive_number(raw, "attn_logit_softcapping", _TYPE, None),
    )


def _max_pos(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"max_position_embeddings": raw["max_position_embeddings"]} if "max_position_embeddings" in raw else {}


def _fc(config: ModelConfig) -> Gemma3Config:
    return config.family_settings(Gemma3Config)


GemmaRMSNorm = OffsetRMSNorm  # ``x / rms(x) * (1 + weight)`` in float32 (weights start at 0)
_rope = apply_rope


class Gemma3Attention(LayerMixer):
    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _fc(c)
        q, k, v = project_qkv_heads(c, x)  # in the model's dtype, which the norms' weights take
        q = GemmaRMSNorm(c.rms_norm_eps, name="q_norm")(q)
        k = GemmaRMSNorm(c.rms_norm_eps, name="k_norm")(k)
        window = fc.window(self.layer_id)
        inv_freq = (fc.rope_full if window is None else fc.rope_local).inverse_frequencies(c.head_dim)
        q = _rope(q, meta.positions, inv_freq)
        k = _rope(k, meta.positions, inv_freq)
        scale, cap = fc.query_pre_attn_scalar**-0.5, fc.attn_logit_softcapping
        out, pools = attend(pools, self.layer_id, q, k, v, meta, sliding_window=window, sm_scale=scale, soft_cap=cap)
        return project_output(c, out), pools


class Gemma3DecoderLayer(DecoderLayer):
    """Four Gemma RMSNorms per layer: around the attention and around the MLP."""

    norm = GemmaRMSNorm
    sandwich_norms = True
    attention = Gemma3Attention

    @nn.nowrap
    def mlp(self) -> nn.Module:
        return MLP(self.config, gelu_tanh, name="mlp")


class Gemma3ForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = Gemma3DecoderLayer
    final_norm: type[nn.Module] = GemmaRMSNorm
    scale_embedding: bool = True

    @nn.nowrap
    def logit_softcap(self) -> float | None:
        return _fc(self.config).final_logit_softcapping


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """One-page full and SWA pools of the model's shape, and the sliding layers' metadata."""
    return swa_trace_state(config, _fc(config).sliding)
