"""Qwen3-Next: gated delta net (linear attention with a recurrent state) and gated full attention,
following Hugging Face's ``Qwen3NextForCausalLM`` (Transformers 5), parameter names included.

Layers (``config.layer_types``): ``linear_attention`` layers run a gated delta net (``linear_attn``:
``in_proj_qkvz``, ``in_proj_ba``, a depthwise causal ``conv1d`` with SiLU over q, k and v,
``A_log``, ``dt_bias``, a gated RMSNorm ``norm`` and ``out_proj``) whose conv window and recurrent
matrix live in the cache's recurrent-state pool (``pools.recurrent``); ``full_attention`` layers
(``self_attn``) project q and a sigmoid output gate together (``q_proj`` is ``2 x`` wide), apply
``(1 + w)`` RMSNorms to q and k over the head dim and rotary embeddings to the first
``partial_rotary_factor`` of it, and attend through the paged pool (``pools.kv``). Every RMSNorm
except the gated one scales by ``1 + weight``. MLPs are dense SwiGLU: kvjax serves Qwen3-Next with
``mlp_only_layers`` covering every layer (a config with sparse-MoE layers is refused by name).

Recurrent state per sequence row (``BatchMetadata.extras``, from ``RecurrentStateExtension``):
``state_slots [S]`` (the row's state slot, 0 for padding) and ``has_initial_state [S]`` (0: the
sequence starts here, from zero state; 1: continue from the slot: a chunk continuation, a decode
step, or a checkpoint forked at the match). The step reads the rows' states, runs the tokens of
each sequence through the conv and the delta rule one token at a time (``lax.scan`` over the
batch's tokens: a per-token recurrence, fine on CPU; the chunked form is a kernel's job), and
writes the rows' final states back into their slots.

Math (float32 inside the recurrence): ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
dt_bias)``; q and k are L2-normalised (eps 1e-6), q scaled by ``k_head_dim ** -0.5``, key heads
shared by ``num_v_heads / num_k_heads`` value heads; per token ``S <- S * exp(g)``, ``delta =
(v - S k) * beta``, ``S <- S + delta k^T``, ``out = S q`` with ``S: [v_head_dim, k_head_dim]`` per
value head (the pool's layout). The conv state holds the last ``conv_kernel - 1`` inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.errors import ConfigError
from kvjax.pools import CachePools, MHAKVPool
from kvjax.serve.layers import MLP, WEIGHT_INIT_STDDEV, BatchMetadata, Embedding, Linear, apply_rope, paged_attention
from kvjax.serve.model_config import ModelConfig
from kvjax.spec import ModelSpec

LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    """The family's own hyperparameters (``ModelConfig.family_config``)."""

    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    partial_rotary_factor: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)


def read_config(spec: ModelSpec, raw: Mapping[str, Any]) -> Qwen3NextConfig:
    """Read the gated-delta-net dims, the layer types and the partial rotary factor; refuse
    sparse-MoE layers (``num_experts > 0`` on a layer not in ``mlp_only_layers``)."""
    n = spec.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    types = tuple(str(t) for t in types)
    experts = int(raw.get("num_experts", 0) or 0)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    moe = [i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0]
    if moe:
        raise ConfigError(
            "mlp_only_layers",
            sorted(dense),
            f"layers {moe} are sparse-MoE layers ({experts} experts), which kvjax's Qwen3-Next model does not run "
            "yet; serve a config whose mlp_only_layers covers every layer (dense MLPs)",
        )
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    return Qwen3NextConfig(
        layer_types=types,
        num_k_heads=int(raw["linear_num_key_heads"]),
        num_v_heads=int(raw["linear_num_value_heads"]),
        k_head_dim=int(raw["linear_key_head_dim"]),
        v_head_dim=int(raw["linear_value_head_dim"]),
        conv_kernel=int(raw["linear_conv_kernel_dim"]),
        partial_rotary_factor=factor,
    )


def _family(config: ModelConfig) -> Qwen3NextConfig:
    fc = config.family_config
    if not isinstance(fc, Qwen3NextConfig):
        raise ConfigError(
            "family_config", fc, "a Qwen3-Next ModelConfig needs its Qwen3NextConfig (model_config_from_spec)"
        )
    return fc


def trace_state(config: ModelConfig) -> tuple[CachePools, dict[str, Any]]:
    """The smallest pools of a Qwen3-Next model (one page, one state slot) and a one-row batch's extras."""
    from kvjax.pools.recurrent import RecurrentStatePool

    fc = _family(config)
    pools: dict[str, Any] = {}
    if fc.full_layers:
        pools["kv"] = MHAKVPool.create(
            num_pages=1,
            page_size=1,
            num_layers=len(fc.full_layers),
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=config.dtype,
            layer_ids=fc.full_layers,
        )
    if fc.linear_layers:
        pools["recurrent"] = RecurrentStatePool.create(
            num_slots=1,
            layer_ids=fc.linear_layers,
            conv_state_shapes=((fc.conv_dim, fc.conv_kernel - 1),),
            ssm_state_shape=(fc.num_v_heads, fc.v_head_dim, fc.k_head_dim),
            conv_dtype=config.dtype,
            ssm_dtype="float32",
        )
    extras = {"state_slots": jnp.ones((1,), jnp.int32), "has_initial_state": jnp.zeros((1,), jnp.int32)}
    return CachePools(pools), extras


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32, cast back (weight starts at 0)."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],), x.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * x / rms(x) * silu(gate)`` (the gated delta net's output norm; weight starts at 1)."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), x.dtype)
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return (weight * normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class Qwen3NextAttention(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _family(c)
        dt = jnp.dtype(c.dtype)
        t = x.shape[0]
        hd = c.head_dim
        qg = Linear(c.num_attention_heads * hd * 2, c.qkv_bias, dt, name="q_proj")(x).reshape(t, -1, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, -1)
        k = Linear(c.num_kv_heads * hd, c.qkv_bias, dt, name="k_proj")(x).reshape(t, c.num_kv_heads, hd)
        v = Linear(c.num_kv_heads * hd, c.qkv_bias, dt, name="v_proj")(x).reshape(t, c.num_kv_heads, hd)
        q = OffsetRMSNorm(c.rms_norm_eps, name="q_norm")(q)
        k = OffsetRMSNorm(c.rms_norm_eps, name="k_norm")(k)
        rot = int(hd * fc.partial_rotary_factor)
        inv_freq = c.rope.inverse_frequencies(rot)
        q = jnp.concatenate([apply_rope(q[..., :rot], meta.positions, inv_freq), q[..., rot:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :rot], meta.positions, inv_freq), k[..., rot:]], axis=-1)
        out, kv = paged_attention(q, k, v, pools.kv, self.layer_id, meta)
        out = out.reshape(t, -1) * jax.nn.sigmoid(gate)
        out = Linear(c.hidden_size, c.o_bias, dt, name="o_proj")(out)
        return out, pools.replace(kv=kv)


class DepthwiseConvWeight(nn.Module):
    """The depthwise causal conv's ``weight: [channels, 1, kernel]`` (Hugging Face's ``nn.Conv1d``)."""

    shape: tuple[int, ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), self.shape, self.dtype)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


class Qwen3NextGatedDeltaNet(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _family(c)
        dt = jnp.dtype(c.dtype)
        t = x.shape[0]
        hk, hv, dk, dv, kernel = fc.num_k_heads, fc.num_v_heads, fc.k_head_dim, fc.v_head_dim, fc.conv_kernel
        per = hv // hk
        qkvz = Linear(2 * hk * dk + 2 * hv * dv, False, dt, name="in_proj_qkvz")(x).reshape(t, hk, -1)
        ba = Linear(2 * hv, False, dt, name="in_proj_ba")(x).reshape(t, hk, 2 * per)
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v = qkvz[..., 2 * dk : 2 * dk + per * dv].reshape(t, hv * dv)
        z = qkvz[..., 2 * dk + per * dv :].reshape(t, hv, dv)
        b, a = ba[..., :per].reshape(t, hv), ba[..., per:].reshape(t, hv)
        mixed = jnp.concatenate([q.reshape(t, hk * dk), k.reshape(t, hk * dk), v], axis=-1)  # [T, conv_dim]
        conv_w = DepthwiseConvWeight((fc.conv_dim, 1, kernel), dt, name="conv1d")()[:, 0, :]  # [conv_dim, K]
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), dt)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), dt)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))

        state = pools.recurrent
        slots = meta.extras["state_slots"]
        keep = meta.extras["has_initial_state"].astype(bool)
        (conv0,), ssm0 = state.get_states(self.layer_id, slots)  # [S, conv_dim, K-1], [S, Hv, Dv, Dk]
        conv0 = jnp.where(keep[:, None, None], conv0.astype(jnp.float32), 0.0)
        ssm0 = jnp.where(keep[:, None, None, None], ssm0.astype(jnp.float32), 0.0)
        # The sequence row of each token; padding tokens (past the last sequence) change nothing.
        pos = jnp.arange(t, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(meta.cu_q_lens[1:], pos, side="right"), 0, slots.shape[0] - 1)
        live = pos < meta.cu_q_lens[meta.num_seqs[0]]
        w32 = conv_w.astype(jnp.float32)
        scale = dk**-0.5

        def token(carry: tuple[jax.Array, jax.Array], inp: tuple[jax.Array, ...]) -> tuple[tuple, jax.Array]:
            conv, ssm = carry
            x_t, g_t, beta_t, s, ok = inp
            window = jnp.concatenate([conv[s], x_t.astype(jnp.float32)[:, None]], axis=-1)  # [conv_dim, K]
            y = jax.nn.silu(jnp.sum(window * w32, axis=-1)).astype(dt).astype(jnp.float32)
            q_t = _l2norm(jnp.repeat(y[: hk * dk].reshape(hk, dk), per, axis=0)) * scale
            k_t = _l2norm(jnp.repeat(y[hk * dk : 2 * hk * dk].reshape(hk, dk), per, axis=0))
            v_t = y[2 * hk * dk :].reshape(hv, dv)
            st = ssm[s] * jnp.exp(g_t)[:, None, None]  # [Hv, Dv, Dk]
            delta = (v_t - jnp.einsum("hvk,hk->hv", st, k_t)) * beta_t[:, None]
            st = st + delta[:, :, None] * k_t[:, None, :]
            out = jnp.einsum("hvk,hk->hv", st, q_t)
            conv = jnp.where(ok, conv.at[s].set(window[:, 1:]), conv)
            ssm = jnp.where(ok, ssm.at[s].set(st), ssm)
            return (conv, ssm), out

        (conv1, ssm1), core = jax.lax.scan(token, (conv0, ssm0), (mixed, g, beta, seq, live))
        core = GatedRMSNorm(c.rms_norm_eps, name="norm")(core.astype(dt), z)
        out = Linear(c.hidden_size, False, dt, name="out_proj")(core.reshape(t, hv * dv))
        state = state.set_states(self.layer_id, slots, (conv1,), ssm1)
        return out, pools.replace(recurrent=state)


class Qwen3NextDecoderLayer(nn.Module):
    config: ModelConfig
    layer_id: int

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        h = OffsetRMSNorm(c.rms_norm_eps, name="input_layernorm")(x)
        if _family(c).layer_types[self.layer_id] == LINEAR:
            h, pools = Qwen3NextGatedDeltaNet(c, self.layer_id, name="linear_attn")(h, pools, meta)
        else:
            h, pools = Qwen3NextAttention(c, self.layer_id, name="self_attn")(h, pools, meta)
        x = x + h
        h = OffsetRMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(x)
        return x + MLP(c, name="mlp")(h), pools


class Qwen3NextModel(nn.Module):
    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, jnp.dtype(c.dtype))
        self.layers = [Qwen3NextDecoderLayer(c, i, name=f"layers_{i}") for i in range(c.num_hidden_layers)]
        self.norm = OffsetRMSNorm(c.rms_norm_eps)

    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, pools = layer(x, pools, meta)
        return self.norm(x[meta.logits_indices]), pools

    def lm_head_tied(self, x: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(x)


class Qwen3NextForCausalLM(nn.Module):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.model = Qwen3NextModel(c)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, jnp.dtype(c.dtype))

    def __call__(self, tokens: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        x, pools = self.model(tokens, pools, meta)
        logits = self.model.lm_head_tied(x) if self.config.tie_word_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32), pools


__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM", "read_config", "trace_state"]
