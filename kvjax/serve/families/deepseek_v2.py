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

DeepSeek-V3 (``DeepseekV3ForCausalLM``, ``model_type`` ``deepseek_v3``) is served by the same model:
its attention and checkpoint names are V2's, and Transformers rotates its RoPE pairs the same way
when ``rope_interleave`` is true (the released configs; false is refused). Its router differs and is
read from the model type, as Transformers hard-codes it (V3's ``config.json`` names no
``topk_method``): sigmoid scores, ``noaux_tc`` (choice scores with ``gate.e_score_correction_bias``,
groups scored by their two best), weights normalised when ``norm_topk_prob`` (default true) and
scaled by ``routed_scaling_factor``. Its MTP layer (``num_nextn_predict_layers``) drafts as V2's does
(``kvjax.serve.speculative.nextn``).

Refused by name (``ConfigError``): RoPE types other than the default (YaRN's mscale is not built),
an activation other than SiLU (``model_config``), DeepSeek-V3 with ``rope_interleave`` false.
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
from kvjax.hf import keys
from kvjax.pools import CachePools
from kvjax.serve.causal_lm import CausalLM, DecoderLayer, LayerMixer
from kvjax.serve.layers import MLP, BatchMetadata, Linear, RMSNorm
from kvjax.serve.model_config import ModelConfig, read_rope
from kvjax.serve.moe import MoEConfig, SparseMoE, Weight
from kvjax.spec import ModelSpec

LOW_RANK_NORM_EPS = 1e-6
_TYPE = "deepseek_v2"


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


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> DeepseekV2Config:
    """The family's hyperparameters from ``config.json`` (see the module docstring for refusals)."""
    rope = read_rope(raw)
    if rope.rope_type != "default":
        raise ConfigError("rope_scaling.rope_type", rope.rope_type, "kvjax's DeepSeek-V2 serves the default RoPE only")
    q_lora = raw.get("q_lora_rank")
    v3 = raw.get("model_type") == "deepseek_v3"
    if v3 and not raw.get("rope_interleave", True):
        raise ConfigError(
            "rope_interleave", False, "kvjax's DeepSeek-V3 rotates interleaved RoPE pairs only (the released configs)"
        )
    router: dict[str, Any] = {"topk_method": str(raw.get("topk_method", "greedy"))}
    if v3:  # Transformers' DeepseekV3TopkRouter: sigmoid, noaux_tc, normalised unless said
        router = {
            "topk_method": "noaux_tc",
            "scoring": "sigmoid",
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        }
    moe = None
    experts = raw.get("n_routed_experts")
    if experts:
        shared = raw.get("n_shared_experts") or 0
        moe = MoEConfig(
            hidden_size=spec.hidden_size,
            num_experts=keys.integer(raw, "n_routed_experts", _TYPE),
            top_k=keys.integer(raw, "num_experts_per_tok", _TYPE),
            moe_intermediate_size=keys.integer(raw, "moe_intermediate_size", _TYPE),
            **router,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            n_group=keys.integer(raw, "n_group", _TYPE, 1),
            topk_group=keys.integer(raw, "topk_group", _TYPE, 1),
            shared_intermediate_size=int(shared) * keys.integer(raw, "moe_intermediate_size", _TYPE),
        )
    return DeepseekV2Config(
        q_lora_rank=None if q_lora is None else keys.integer(raw, "q_lora_rank", _TYPE),
        kv_lora_rank=keys.integer(raw, "kv_lora_rank", _TYPE),
        qk_nope_head_dim=keys.integer(raw, "qk_nope_head_dim", _TYPE),
        qk_rope_head_dim=keys.integer(raw, "qk_rope_head_dim", _TYPE),
        v_head_dim=keys.integer(raw, "v_head_dim", _TYPE),
        attention_bias=bool(raw.get("attention_bias", False)),
        first_k_dense_replace=keys.integer(raw, "first_k_dense_replace", _TYPE, 0, minimum=0),
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


class DeepseekV2Attention(LayerMixer):
    """MLA in the absorbed form over the latent pool ``pools.kv`` (module docstring)."""

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


class DeepseekV2DecoderLayer(DecoderLayer):
    """MLA, then a dense MLP before ``first_k_dense_replace`` and the sparse MoE from there."""

    @nn.nowrap
    def mixer(self) -> nn.Module:
        return DeepseekV2Attention(self.config, self.layer_id, name="self_attn")

    @nn.nowrap
    def mlp(self) -> nn.Module:
        c = self.config
        f: DeepseekV2Config = c.family_config
        if f.moe is None or self.layer_id < f.first_k_dense_replace:
            return MLP(c, name="mlp")
        return SparseMoE(f.moe, jnp.dtype(c.dtype), name="mlp")


class DeepseekV2ForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = DeepseekV2DecoderLayer
