"""Qwen3-Next: gated delta net (linear attention with a recurrent state) and gated full attention,
following Hugging Face's ``Qwen3NextForCausalLM`` (Transformers 5), parameter names included.

Layers (``config.layer_types``): ``linear_attention`` layers run a gated delta net (``linear_attn``:
``in_proj_qkvz``, ``in_proj_ba``, a depthwise causal ``conv1d`` with SiLU over q, k and v,
``A_log``, ``dt_bias``, a gated RMSNorm ``norm`` and ``out_proj``) whose conv window and recurrent
matrix live in the cache's recurrent-state pool (``pools.recurrent``); ``full_attention`` layers
(``self_attn``) project q and a sigmoid output gate together (``q_proj`` is ``2 x`` wide), apply
``(1 + w)`` RMSNorms to q and k over the head dim and rotary embeddings to the first
``partial_rotary_factor`` of it, and attend through the paged pool (``pools.kv``). Every RMSNorm
except the gated one scales by ``1 + weight``. MLPs: a layer in ``mlp_only_layers`` (or every layer
when ``num_experts`` is 0) is a dense SwiGLU; the others (every ``decoder_sparse_step``-th) are the
sparse MoE of ``kvjax.serve.moe`` (softmax router, greedy top ``num_experts_per_tok``,
``norm_topk_prob``, a ``shared_expert`` gated by ``sigmoid(shared_expert_gate(x))``).

Recurrent state per sequence row (``meta.state``, from ``RecurrentStateExtension``):
``state_slots [S]`` (the row's state slot, 0 for padding) and ``has_initial_state [S]`` (0: the
sequence starts here, from zero state; 1: continue from the slot: a chunk continuation, a decode
step, or a checkpoint forked at the match); with the extra buffer also ``track_slots [S]`` and
``track_at [S]``: the state after the row's ``track_at``-th token of this step (its last page
boundary) is written to its ping-pong slot ``track_slots`` too (0 / 0: nothing tracked).
The step reads the rows' states, runs the tokens of
each sequence through the conv and the delta rule one token at a time (``lax.scan`` over the
batch's tokens: a per-token recurrence, fine on CPU; the chunked form is a kernel's job), and
writes the rows' final states back into their slots.

Math (float32 inside the recurrence): ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
dt_bias)``; q and k are L2-normalised (eps 1e-6), q scaled by ``k_head_dim ** -0.5``, key heads
shared by ``num_v_heads / num_k_heads`` value heads; per token ``S <- S * exp(g)``, ``delta =
(v - S k) * beta``, ``S <- S + delta k^T``, ``out = S q`` with ``S: [v_head_dim, k_head_dim]`` per
value head (the pool's layout). The conv state holds the last ``conv_kernel - 1`` inputs.

Tensor parallelism (a recurrent pool sharded over ``"tp"``): the gated delta net is head-parallel,
as SGLang runs it. Each rank holds whole key heads with their value heads: its rows of
``in_proj_qkvz`` / ``in_proj_ba`` (laid out per key head by Transformers), its conv channels (its
q, k and v channels, re-laid out rank-major at load by ``kvjax.serve.param_sharding``), its value
heads' ``A_log`` / ``dt_bias`` and ``out_proj`` input columns; ``norm``'s ``[v_head_dim]`` weight is
replicated. The mixer (``_local_mixer``) runs per rank inside ``shard_map`` over the rank's state
shard and ends in one all-reduce of ``out_proj``'s partial sums
(``kvjax.attention.recurrent_step.recurrent_mixer_over_heads``). tp must divide
``linear_num_key_heads``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax.attention import KindMetadata, attend, recurrent_step
from kvjax.attention.recurrent_step import recurrent_mixer_over_heads, state_mesh_axis, state_ranks
from kvjax.errors import ConfigError
from kvjax.pools import CachePools
from kvjax.serve.attention_block import project_output
from kvjax.serve.causal_lm import CausalLM, DecoderLayer, LayerMixer
from kvjax.serve.layers import (
    MLP,
    BatchMetadata,
    Linear,
    OffsetRMSNorm,
    apply_rope,
    rms_normalize,
)
from kvjax.serve.model_config import ModelConfig
from kvjax.serve.moe import MoEConfig, SparseMoE
from kvjax.serve.param_sharding import param_spec
from kvjax.serve.recurrent_layers import Weight, conv_silu, decay_parameters, project
from kvjax.serve.trace_state import recurrent_trace_state
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
    moe: MoEConfig | None = None
    moe_layers: tuple[int, ...] = ()

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
    """Read the gated-delta-net dims, the layer types, the partial rotary factor and the sparse-MoE
    layers (``num_experts > 0``: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``)."""
    n = spec.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    types = tuple(str(t) for t in types)
    experts = int(raw.get("num_experts", 0) or 0)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    moe_layers = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    moe = None
    if moe_layers:
        try:
            moe = MoEConfig(
                hidden_size=spec.hidden_size,
                num_experts=experts,
                top_k=int(raw.get("num_experts_per_tok", 1)),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                scoring="softmax",
                topk_method="greedy",
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                shared_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0) or 0),
                shared_expert_gated=True,
                shared_name="shared_expert",
            )
        except (KeyError, ValueError) as e:
            raise ConfigError("num_experts", experts, f"the sparse-MoE settings do not fit: {e}") from None
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
        moe=moe,
        moe_layers=moe_layers,
    )


def _family(config: ModelConfig) -> Qwen3NextConfig:
    return config.family_settings(Qwen3NextConfig)


def trace_state(config: ModelConfig) -> tuple[CachePools, KindMetadata | None]:
    """The smallest pools of a Qwen3-Next model (one page, one state slot) and a one-row batch's metadata part."""
    fc = _family(config)
    return recurrent_trace_state(
        config,
        attention_layers=fc.full_layers,
        recurrent_layers=fc.linear_layers,
        conv_dim=fc.conv_dim,
        conv_kernel=fc.conv_kernel,
        ssm_state_shape=(fc.num_v_heads, fc.v_head_dim, fc.k_head_dim),
    )


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * x / rms(x) * silu(gate)`` over the last axis (the gated delta net's output norm,
    per value head: ``weight [v_head_dim]``, shared by the heads), in ``x``'s dtype."""
    normed = rms_normalize(x.astype(jnp.float32), eps).astype(x.dtype)
    return (weight * normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class Qwen3NextAttention(LayerMixer):
    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        dt = jnp.dtype(c.dtype)
        t = x.shape[0]
        hd = c.head_dim
        qg = Linear(c.num_attention_heads * hd * 2, c.qkv_bias, dt, name="q_proj")(x).reshape(t, -1, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, -1)
        k = Linear(c.num_kv_heads * hd, c.qkv_bias, dt, name="k_proj")(x).reshape(t, c.num_kv_heads, hd)
        v = Linear(c.num_kv_heads * hd, c.qkv_bias, dt, name="v_proj")(x).reshape(t, c.num_kv_heads, hd)
        q = OffsetRMSNorm(c.rms_norm_eps, name="q_norm")(q)
        k = OffsetRMSNorm(c.rms_norm_eps, name="k_norm")(k)
        rot = int(hd * _family(c).partial_rotary_factor)
        inv_freq = c.rope.inverse_frequencies(rot)
        q = jnp.concatenate([apply_rope(q[..., :rot], meta.positions, inv_freq), q[..., rot:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :rot], meta.positions, inv_freq), k[..., rot:]], axis=-1)
        out, pools = attend(pools, self.layer_id, q, k, v, meta)
        return project_output(c, out.reshape(t, -1) * jax.nn.sigmoid(gate)), pools


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


class Qwen3NextGatedDeltaNet(LayerMixer):
    """The gated delta net, head-parallel over the recurrent state's mesh (module docstring):
    its weights are declared here, in Transformers' names and shapes, and applied per rank by
    ``_local_mixer`` inside ``recurrent_mixer_over_heads`` (the whole mixer at one rank)."""

    @nn.compact
    def __call__(self, x: jax.Array, pools: CachePools, meta: BatchMetadata) -> tuple[jax.Array, CachePools]:
        c = self.config
        fc = _family(c)
        dt = jnp.dtype(c.dtype)
        hk, hv, dk, dv = fc.num_k_heads, fc.num_v_heads, fc.k_head_dim, fc.v_head_dim
        hidden = x.shape[-1]
        weights = {
            "in_proj_qkvz": Weight((2 * hk * dk + 2 * hv * dv, hidden), dt, name="in_proj_qkvz")(),
            "in_proj_ba": Weight((2 * hv, hidden), dt, name="in_proj_ba")(),
            "conv1d": Weight((fc.conv_dim, 1, fc.conv_kernel), dt, name="conv1d")(),
            "norm": Weight((dv,), dt, ones=True, name="norm")(),
            "out_proj": Weight((c.hidden_size, hv * dv), dt, name="out_proj")(),
        }
        weights["dt_bias"], weights["A_log"] = decay_parameters(self, hv, dt)
        ranks = state_ranks(pools)
        if hk % ranks:
            raise ConfigError(
                "tp_size",
                ranks,
                f"the gated delta net's {hk} key heads do not split over {ranks} ranks (each rank runs whole key "
                "heads with their value heads); use a tp size that divides linear_num_key_heads",
            )
        axis = state_mesh_axis(pools)  # ("tp", "dcp") under DCP: the weights' own split
        specs = {
            name: param_spec(f"linear_attn/{name}" + ("" if name in _BARE else "/weight"), w.shape, c, ranks, axis=axis)
            for name, w in weights.items()
        }
        mixer = functools.partial(_local_mixer, fc=fc, layer_id=self.layer_id, eps=c.rms_norm_eps, dtype=dt)
        return recurrent_mixer_over_heads(pools, mixer, x, weights, specs, meta)


_BARE = ("A_log", "dt_bias")  # parameters of the mixer itself (no ``/weight``)


def _local_mixer(
    pools: CachePools,
    x: jax.Array,
    w: dict[str, jax.Array],
    meta: BatchMetadata,
    *,
    fc: Qwen3NextConfig,
    layer_id: int,
    eps: float,
    dtype: jnp.dtype,
) -> tuple[jax.Array, CachePools]:
    """The gated delta net on one rank's heads (all of them at one rank): ``w`` holds the rank's
    slices (its key heads' rows of ``in_proj_qkvz``/``in_proj_ba``, their conv channels in the
    rank's ``[q, k, v]`` order, their value heads' ``A_log``/``dt_bias`` and ``out_proj`` columns),
    ``pools.recurrent`` the rank's state shard. Returns the rank's partial ``out_proj`` sum."""
    dk, dv = fc.k_head_dim, fc.v_head_dim
    per = fc.num_v_heads // fc.num_k_heads
    hv = w["A_log"].shape[0]  # this rank's value heads
    hk = hv // per  # and key heads
    t = x.shape[0]
    qkvz = project(x, w["in_proj_qkvz"]).reshape(t, hk, -1)
    ba = project(x, w["in_proj_ba"]).reshape(t, hk, 2 * per)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v = qkvz[..., 2 * dk : 2 * dk + per * dv].reshape(t, hv * dv)
    z = qkvz[..., 2 * dk + per * dv :].reshape(t, hv, dv)
    b, a = ba[..., :per].reshape(t, hv), ba[..., per:].reshape(t, hv)
    mixed = jnp.concatenate([q.reshape(t, hk * dk), k.reshape(t, hk * dk), v], axis=-1)  # [T, local conv_dim]
    w32 = w["conv1d"][:, 0, :].astype(jnp.float32)  # [local conv_dim, K]
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(w["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + w["dt_bias"].astype(jnp.float32)
    )
    scale = dk**-0.5

    def update(window: jax.Array, ssm: jax.Array, g_t: jax.Array, beta_t: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = conv_silu(window, w32, None, dtype)
        q_t = _l2norm(jnp.repeat(y[: hk * dk].reshape(hk, dk), per, axis=0)) * scale
        k_t = _l2norm(jnp.repeat(y[hk * dk : 2 * hk * dk].reshape(hk, dk), per, axis=0))
        v_t = y[2 * hk * dk :].reshape(hv, dv)
        st = ssm * jnp.exp(g_t)[:, None, None]  # [Hv, Dv, Dk]
        delta = (v_t - jnp.einsum("hvk,hk->hv", st, k_t)) * beta_t[:, None]
        st = st + delta[:, :, None] * k_t[:, None, :]
        return st, jnp.einsum("hvk,hk->hv", st, q_t)

    core, pools = recurrent_step(pools, layer_id, mixed, (g, beta), update, meta)
    core = gated_rms_norm(core.astype(dtype), z, w["norm"], eps)
    return project(core.reshape(t, hv * dv), w["out_proj"]), pools


class Qwen3NextDecoderLayer(DecoderLayer):
    """A gated delta net or gated attention, then a dense or sparse-MoE MLP; ``(1 + w)`` RMSNorms.

    A layer id past the stack (``>= num_hidden_layers``) is the MTP layer
    (``kvjax.serve.speculative.qwen3_next_mtp``): gated full attention, and the sparse MoE whenever
    the model has experts (SGLang builds every Qwen3-Next layer sparse, the MTP layer included)."""

    norm = OffsetRMSNorm

    @nn.nowrap
    def _is_mtp(self) -> bool:
        return self.layer_id >= len(_family(self.config).layer_types)

    @nn.nowrap
    def mixer(self) -> nn.Module:
        c = self.config
        if not self._is_mtp() and _family(c).layer_types[self.layer_id] == LINEAR:
            return Qwen3NextGatedDeltaNet(c, self.layer_id, name="linear_attn")
        return Qwen3NextAttention(c, self.layer_id, name="self_attn")

    @nn.nowrap
    def mlp(self) -> nn.Module:
        c = self.config
        fc = _family(c)
        if fc.moe is not None and (self.layer_id in fc.moe_layers or self._is_mtp()):
            return SparseMoE(fc.moe, jnp.dtype(c.dtype), name="mlp")
        return MLP(c, name="mlp")


class Qwen3NextForCausalLM(CausalLM):
    """``(tokens [T], pools, metadata) -> (logits [S, vocab] float32, new pools)``."""

    decoder_layer: type[nn.Module] = Qwen3NextDecoderLayer
    final_norm: type[nn.Module] = OffsetRMSNorm


__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM", "read_config", "trace_state"]
